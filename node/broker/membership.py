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
from typing import TYPE_CHECKING, Any, Protocol

from ..wire import Pid, WireError

if TYPE_CHECKING:
    from .network_changes import NetworkChanges
    from .timebase import Timebase

log = logging.getLogger("fedemu.broker")


class MembershipHost(Protocol):
    """What Membership uses of the broker that holds it: passed in, so this module
    depends on these, not on the Broker."""

    changes: NetworkChanges
    heartbeat_timeout: float
    time: Timebase

    def send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None: ...


@dataclass
class NodeInfo:
    name: str
    identity: bytes
    last_seen: float


class Membership:
    """The broker's nodes, names and link owners."""

    def __init__(self, broker: MembershipHost) -> None:
        self._broker = broker
        self.nodes: dict[str, NodeInfo] = {}
        self.by_identity: dict[bytes, NodeInfo] = {}
        self.names: dict[str, Pid] = {}
        self.link_of: dict[tuple[str, int], int] = {}
        # Clients' devices: the processes owning each link.
        self.owners: dict[int, set[Pid]] = {}

    def join(self, identity: bytes, node: str, known: bool) -> None:
        """A node's hello: it is in the run from now (again, if ``known``)."""
        if known:
            log.warning("node %s said hello again; keeping its registrations", node)
        info = self.nodes[node] = NodeInfo(node, identity, time.monotonic())  # wall
        self.by_identity[identity] = info
        if not known:
            self._broker.time.join(node)
        log.info("node %s joined", node)

    def register(self, identity: bytes, src: Pid, entries: Any) -> None:
        if not isinstance(entries, list):
            raise WireError("register needs a list of entries")
        owned = []
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 3):
                raise WireError(f"bad register entry {entry!r}")
            name, pid, link = entry
            if not isinstance(name, str) or not isinstance(pid, Pid) or pid.node != src.node:
                raise WireError(f"bad register entry {entry!r}")
            holder = self.names.get(name)
            if holder is not None and holder != pid:
                log.warning("name %r already registered by %s; refused for %s", name, holder, pid)
                self._broker.send_ctl(identity, src, {"op": "register_failed", "name": name, "holder": holder})
                continue
            self.names[name] = pid
            if isinstance(link, int):
                self.link_of[pid] = link
                self.owners.setdefault(link, set()).add(pid)
                owned.append((pid, link))
        self._broker.changes.owners_joined(owned)

    def unregister(self, node: str, names: list, pid: Pid | None) -> None:
        """Names of an ended process: only while they still name it. In virtual time its
        link stays its own until the messages it sent before it ended are taken in."""
        for name in names:
            holder = self.names.get(name)
            if isinstance(name, str) and holder is not None and holder[0] == node and (pid is None or holder == pid):
                self.names.pop(name)
                self._broker.time.take(holder, "disown", holder)

    def disown(self, pid: Pid) -> None:
        link = self.link_of.pop(pid, None)
        owners = self.owners.get(link)
        if owners is not None:
            owners.discard(pid)
            if not owners:
                del self.owners[link]

    def check_nodes(self, now: float) -> None:
        for name, info in list(self.nodes.items()):
            if now - info.last_seen > self._broker.heartbeat_timeout:
                self.forget(name, reason=f"silent for {now - info.last_seen:.1f}s")

    def forget(self, node: str, reason: str | None) -> None:
        info = self.nodes.pop(node, None)
        if info is None:
            return
        self.by_identity.pop(info.identity, None)
        self._broker.time.leave(node)
        if reason:
            log.warning("node %s lost (%s)", node, reason)
        else:
            log.info("node %s left", node)
        for name, pid in list(self.names.items()):
            if pid.node == node:
                del self.names[name]
        for pid in [p for p in self.link_of if p[0] == node]:
            self.disown(pid)
        for info in self.nodes.values():
            self._broker.send_ctl(info.identity, Pid(info.name, 0), {"op": "node_down", "node": node})

    def order_of(self, sender: Pid) -> tuple:
        """Where a sender's messages come among those due at one instant: a client's by
        its link (its number, whichever node hosts it), then anyone else's by pid."""
        link = self.link_of.get(sender)
        return (0, link, "", 0) if link is not None else (1, -1, sender.node, sender.id)
