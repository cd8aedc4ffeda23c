"""Who is in the run, as the broker knows it: the nodes and their liveness, the global
name registry (``server``, ``client/17``), and which processes own an emulated link
(a client's link id).

The broker declares a node lost (``node_down`` to every other node) when it stays
silent longer than the heartbeat timeout; its names and links go with it.

Apart from routing (routing.py) because these tables change only on control messages
and liveness checks, while routing only reads them; every change to them is here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..wire import Pid, WireError

log = logging.getLogger("fedemu.broker")


@dataclass
class NodeInfo:
    name: str
    identity: bytes
    last_seen: float


class Registry:
    """Broker's nodes, names and link owners (a mixin of :class:`~fedemu.node.broker.Broker`)."""

    def _init_registry(self) -> None:
        self._nodes: dict[str, NodeInfo] = {}
        self._by_identity: dict[bytes, NodeInfo] = {}
        self._names: dict[str, Pid] = {}
        self._link_of: dict[tuple[str, int], int] = {}
        # Clients' devices: the processes owning each link.
        self._owners: dict[int, set[Pid]] = {}

    def _join(self, identity: bytes, node: str, known: bool) -> None:
        """A node's hello: it is in the run from now (again, if ``known``)."""
        if known:
            log.warning("node %s said hello again; keeping its registrations", node)
        info = self._nodes[node] = NodeInfo(node, identity, time.monotonic())  # wall
        self._by_identity[identity] = info
        if self.scheduler is not None and not known:
            self.scheduler.join(node)
        log.info("node %s joined", node)

    def _register(self, identity: bytes, src: Pid, entries: Any) -> None:
        if not isinstance(entries, list):
            raise WireError("register needs a list of entries")
        owned = []
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise WireError(f"bad register entry {entry!r}")
            name, pid, link = entry
            if not isinstance(name, str) or not isinstance(pid, Pid) or pid.node != src.node:
                raise WireError(f"bad register entry {entry!r}")
            holder = self._names.get(name)
            if holder is not None and holder != pid:
                log.warning("name %r already registered by %s; refused for %s", name, holder, pid)
                self._send_ctl(identity, src, {"op": "register_failed", "name": name, "holder": holder})
                continue
            self._names[name] = pid
            if isinstance(link, int):
                self._link_of[pid] = link
                self._owners.setdefault(link, set()).add(pid)
                owned.append((pid, link))
        # A new owner of a link already offline (a restarted client) is told at once.
        self._tell_devices([(pid, True) for pid, link in owned if link in self._devices_offline])
        self._check_devices({link for _, link in owned})

    def _unregister(self, node: str, names: list, pid: Pid | None) -> None:
        """Names of an ended process: only while they still name it. In virtual time its
        link stays its own until the messages it sent before it ended are taken in."""
        for name in names:
            holder = self._names.get(name)
            if isinstance(name, str) and holder is not None and holder[0] == node and (pid is None or holder == pid):
                self._names.pop(name)
                if self.scheduler is not None:
                    self.scheduler.accept(holder, "disown", holder)
                else:
                    self._disown(holder)

    def _disown(self, pid: Pid) -> None:
        link = self._link_of.pop(pid, None)
        owners = self._owners.get(link)
        if owners is not None:
            owners.discard(pid)
            if not owners:
                del self._owners[link]

    def _check_nodes(self, now: float) -> None:
        for name, info in list(self._nodes.items()):
            if now - info.last_seen > self.heartbeat_timeout:
                self._forget(name, reason=f"silent for {now - info.last_seen:.1f}s")

    def _forget(self, node: str, reason: str | None) -> None:
        info = self._nodes.pop(node, None)
        if info is None:
            return
        self._by_identity.pop(info.identity, None)
        if self.scheduler is not None:
            self.scheduler.leave(node)
        if reason:
            log.warning("node %s lost (%s)", node, reason)
        else:
            log.info("node %s left", node)
        for name, pid in list(self._names.items()):
            if pid.node == node:
                del self._names[name]
        for pid in [p for p in self._link_of if p[0] == node]:
            self._disown(pid)
        for info in self._nodes.values():
            self._send_ctl(info.identity, Pid(info.name, 0), {"op": "node_down", "node": node})
