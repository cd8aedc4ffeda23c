"""The broker: one ZeroMQ ROUTER every node connects to; it plays the network.

Every message between nodes passes here. The broker unpacks only the small header
frame, so its cost per message does not grow with the payload. It keeps

* the nodes it has heard from, and declares a node lost (``node_down``) when it stays
  silent longer than the heartbeat timeout;
* the global name registry (``server``, ``client/17``), and which processes own an
  emulated link (a client's link id), so it can account bytes per link and direction:
  a message from a link owner travels *up* its link, one to a link owner travels *down*;
* counters per link and direction, and of every dropped message by reason.

A malformed frame, an unknown destination or an oversize message is logged with the
reason and dropped; the broker keeps serving everyone else.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import wire
from .links import DOWN, UP, LinkConfigError, Network, NetworkSpec, parse_ids
from .wire import CTL, USER, Pid, WireError

log = logging.getLogger("fedemu.broker")

BROKER_NODE = "$broker"
BROKER_PID = Pid(BROKER_NODE, 0)


@dataclass
class LinkCounters:
    """Per client link. Bytes and messages count what entered the link (sent), lost
    ones included; ``*_lost`` counts what never arrived (loss, queue, offline)."""

    up_bytes: int = 0
    up_msgs: int = 0
    down_bytes: int = 0
    down_msgs: int = 0
    up_lost: int = 0
    down_lost: int = 0
    up_transfer_s: float = 0.0  # emulated seconds from entry to arrival, summed
    down_transfer_s: float = 0.0


@dataclass
class _NodeInfo:
    identity: bytes
    last_seen: float


@dataclass
class BrokerStats:
    links: dict[int, LinkCounters] = field(default_factory=dict)
    other_bytes: int = 0
    other_msgs: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        links = self.links.values()
        return {
            "bytes_up": sum(c.up_bytes for c in links),
            "bytes_down": sum(c.down_bytes for c in links),
            "msgs_up": sum(c.up_msgs for c in links),
            "msgs_down": sum(c.down_msgs for c in links),
            "lost_up": sum(c.up_lost for c in links),
            "lost_down": sum(c.down_lost for c in links),
            "transfer_s_up": round(sum(c.up_transfer_s for c in links), 6),
            "transfer_s_down": round(sum(c.down_transfer_s for c in links), 6),
            "bytes_other": self.other_bytes,
            "msgs_other": self.other_msgs,
            "dropped": dict(self.dropped),
        }


class Broker:
    def __init__(
        self,
        bind: str,
        *,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        network: NetworkSpec | None = None,
    ) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Fail loudly on an unroutable identity instead of zmq's silent drop.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._bind(bind)
        self._nodes: dict[str, _NodeInfo] = {}
        self._names: dict[str, Pid] = {}
        self._link_of: dict[tuple[str, int], int] = {}
        self.stats = BrokerStats()
        self._running = False
        self.spec = network
        self.network = network.build() if network is not None else Network()
        self.time_scale = network.time_scale if network is not None else 1.0
        self._emulating = not self.network.ideal
        self._t0 = time.monotonic()
        # Messages the network holds back: (wall delivery time, seq, link, direction, identity, frames)
        self._pending: list = []
        self._seq = itertools.count()

    def emulated_now(self) -> float:
        """Emulated seconds since the broker started (wall seconds x time_scale)."""
        return (time.monotonic() - self._t0) * self.time_scale

    def _bind(self, bind: str) -> str:
        if not bind.startswith("tcp://") and not bind.startswith("ipc://"):
            raise ValueError(f"broker address {bind!r} must be tcp://HOST:PORT or ipc://PATH")
        if bind.endswith(":0"):  # an ephemeral port, chosen by the OS
            port = self._sock.bind_to_random_port(bind[: -len(":0")])
            return f"{bind[:-2]}:{port}"
        self._sock.bind(bind)
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- main loop --------------------------------------------------------------

    def serve_forever(self) -> None:
        self._running = True
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_check = time.monotonic() + self.heartbeat_interval
        log.info("broker listening on %s", self.endpoint)
        try:
            while self._running:
                wake = min(next_check, self._pending[0][0]) if self._pending else next_check
                if poller.poll(max(0.0, wake - time.monotonic()) * 1000):
                    self._drain()
                now = time.monotonic()
                if self._pending and self._pending[0][0] <= now:
                    self._deliver_due(now)
                if now >= next_check:
                    self._check_nodes(now)
                    self._scripted_events(round_=None)
                    next_check = now + self.heartbeat_interval
        finally:
            self._sock.close(linger=0)
            self._ctx.term()
            log.info("broker stopped; %s", self.stats.as_dict())

    def stop(self) -> None:
        self._running = False

    def _drain(self) -> None:
        # Read everything queued before polling again: one poll per burst.
        for _ in range(10_000):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._on_message(frames)
            except WireError as exc:
                self._drop("malformed", f"from {bytes(frames[0].bytes)!r}: {exc}")

    def _on_message(self, frames: list) -> None:
        identity = frames[0].bytes
        msg = frames[1:]
        if len(msg) < 2:
            raise WireError(f"{len(msg)} frame(s); a message needs a header and a body")
        size = sum(len(f) for f in msg)
        if size > self.max_message_bytes:
            self._drop("oversize", f"{size} bytes from {identity!r} exceed {self.max_message_bytes}")
            return
        header = wire.unpack_header(msg[0].buffer)
        if header.src.node.encode() != identity:
            self._drop("spoofed", f"header names node {header.src.node!r} but socket is {identity!r}")
            return
        node = self._nodes.get(header.src.node)
        now = time.monotonic()
        if node is None:
            if header.kind == CTL and header.dst_node == BROKER_NODE:
                self._control(identity, header, msg, known=False)
            else:
                self._drop("unknown-node", f"message from {header.src.node!r} before hello")
                self._send_ctl(identity, header.src, {"op": "unknown_node"})
            return
        node.last_seen = now
        if header.kind == CTL and header.dst_node == BROKER_NODE:
            self._control(identity, header, msg, known=True)
            return
        self._route(header, msg, size)

    def _route(self, header: wire.Header, msg: list, size: int) -> None:
        if header.dst_node:
            dst = Pid(header.dst_node, header.dst)
        else:
            dst = self._names.get(header.dst)
            if dst is None:
                self._drop("unknown-destination", f"no process registered as {header.dst!r}")
                return
        target = self._nodes.get(dst.node)
        if target is None:
            self._drop("unknown-destination", f"node {dst.node!r} is not connected")
            if header.kind == CTL:
                # A monitor or down for a lost node must still resolve: tell the sender.
                sender = self._nodes.get(header.src.node)
                if sender is not None:
                    self._send_ctl(sender.identity, header.src, {"op": "node_down", "node": dst.node})
            return
        if header.kind == USER:
            crossing = self._account(header.src, dst, size)
            if crossing is not None and self._emulating:
                self._emulate(crossing, size, target.identity, msg)
                return
        self._send(target.identity, msg, dst.node)

    def _send(self, identity: bytes, msg: list, node: str) -> None:
        try:
            self._sock.send_multipart([identity, *msg], copy=False)
        except zmq.ZMQError as exc:  # the peer vanished between heartbeats
            self._drop("unreachable", f"node {node!r}: {exc}")

    def _account(self, src: Pid, dst: Pid, size: int) -> tuple[int, int] | None:
        """Count a message on the client link it crosses; returns (link, direction).

        A message from a link owner goes up its link; one to a link owner comes down
        its link (client-to-client traffic is counted on both, emulated on the uplink).
        """
        src_link = self._link_of.get(src)
        dst_link = self._link_of.get(dst)
        if dst_link is not None:
            c = self._counters(dst_link)
            c.down_bytes += size
            c.down_msgs += 1
        if src_link is not None:
            c = self._counters(src_link)
            c.up_bytes += size
            c.up_msgs += 1
            return src_link, UP
        if dst_link is not None:
            return dst_link, DOWN
        self.stats.other_bytes += size
        self.stats.other_msgs += 1
        return None

    def _emulate(self, crossing: tuple[int, int], size: int, identity: bytes, msg: list) -> None:
        link, direction = crossing
        verdict = self.network.transmit(link, direction, size, self.emulated_now())
        if verdict.dropped is not None:
            self._lost(link, direction, verdict.dropped)
            return
        c = self._counters(link)
        if direction == UP:
            c.up_transfer_s += verdict.transfer_s
        else:
            c.down_transfer_s += verdict.transfer_s
        due = self._t0 + verdict.arrival / self.time_scale
        heapq.heappush(self._pending, (due, next(self._seq), link, direction, identity, msg))

    def _deliver_due(self, now: float) -> None:
        emulated = (now - self._t0) * self.time_scale
        while self._pending and self._pending[0][0] <= now:
            _, _, link, direction, identity, msg = heapq.heappop(self._pending)
            if self.network.is_offline(link, emulated):  # went offline while in flight
                self._lost(link, direction, "offline")
                continue
            self._send(identity, msg, identity.decode(errors="replace"))

    def _lost(self, link: int, direction: int, reason: str) -> None:
        c = self._counters(link)
        if direction == UP:
            c.up_lost += 1
        else:
            c.down_lost += 1
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        log.debug("link %d %s: message dropped (%s)", link, "up" if direction == UP else "down", reason)

    def _counters(self, link: int) -> LinkCounters:
        c = self.stats.links.get(link)
        if c is None:
            c = self.stats.links[link] = LinkCounters()
        return c

    # --- control traffic addressed to the broker ----------------------------------

    def _control(self, identity: bytes, header: wire.Header, msg: list, known: bool) -> None:
        body = wire.unpack_body(msg[1].buffer, msg[2:])
        if not isinstance(body, dict) or not isinstance(body.get("op"), str):
            raise WireError("control body is not a map with an 'op'")
        op = body["op"]
        src = header.src
        if op == "hello":
            if known:
                log.warning("node %s said hello again; keeping its registrations", src.node)
            self._nodes[src.node] = _NodeInfo(identity, time.monotonic())
            log.info("node %s joined", src.node)
            self._send_ctl(identity, src, {
                "op": "welcome",
                "heartbeat_interval": self.heartbeat_interval,
                "heartbeat_timeout": self.heartbeat_timeout,
            })
            return
        if not known:
            self._drop("unknown-node", f"{op!r} from {src.node!r} before hello")
            self._send_ctl(identity, src, {"op": "unknown_node"})
            return
        if op == "hb":
            self._send_ctl(identity, src, {"op": "hb"})
        elif op == "register":
            self._register(identity, src, body.get("entries"))
        elif op == "unregister":
            for name in body.get("names") or []:
                if isinstance(name, str) and self._names.get(name, (None,))[0] == src.node:
                    pid = self._names.pop(name)
                    self._link_of.pop(pid, None)
        elif op == "whereis":
            name = body.get("name")
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": self._names.get(name)})
        elif op == "stats":
            value = self.stats.as_dict()
            value["emulated_s"] = round(self.emulated_now(), 6)
            if self._emulating:
                now = self.emulated_now()
                value["offline"] = sorted(k for k in set(self._link_of.values()) if self.network.is_offline(k, now))
            if body.get("per_link"):
                value["links"] = {k: vars(c) for k, c in self.stats.links.items()}
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": value})
        elif op == "round":
            # The server's round clock: per-round drop-outs and round-scripted events.
            self.network.round = int(body["round"])
            self._scripted_events(round_=self.network.round)
        elif op == "set_links":
            error = self._set_links(body)
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": error})
        elif op == "shutdown":
            log.info("shutdown requested by %s", src)
            for info in self._nodes.values():
                self._send_ctl(info.identity, Pid(info.identity.decode(), 0), {"op": "shutdown"})
            self._running = False
        elif op == "bye":
            self._forget(src.node, reason=None)
        else:
            raise WireError(f"unknown control op {op!r}")

    def _register(self, identity: bytes, src: Pid, entries: Any) -> None:
        if not isinstance(entries, list):
            raise WireError("register needs a list of entries")
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

    # --- changing the network while it runs ----------------------------------------------

    def _set_links(self, body: dict) -> str | None:
        """Give a group of clients a named profile, or force them offline/online.
        Returns None, or the error that names what was wrong (nothing is changed)."""
        try:
            if self.spec is None:
                raise LinkConfigError("this broker runs without a network spec")
            clients = parse_ids(body.get("clients", []), "clients", self.spec.num_clients)
            profile = body.get("profile")
            if profile is not None and profile not in self.spec.profiles:
                raise LinkConfigError(f"profile {profile!r} is unknown; profiles are {', '.join(self.spec.profiles)}")
        except LinkConfigError as exc:
            return str(exc)
        if profile is not None:
            self.spec.apply(self.network, profile, clients)
            log.info("clients %s now on profile %s", _ids_text(clients), profile)
        if body.get("offline") is True:
            self.network.offline |= clients
        elif body.get("offline") is False:
            self.network.offline -= clients
        self._emulating = not self.network.ideal
        return None

    def _scripted_events(self, round_: int | None) -> None:
        if self.spec is None:
            return
        now = self.emulated_now()
        for event in self.spec.events:
            due = (event.at_round is not None and round_ is not None and round_ >= event.at_round) or \
                  (event.at_s is not None and now >= event.at_s)
            if due and not event.done:
                event.done = True
                self.spec.apply(self.network, event.profile, event.clients)
                self._emulating = not self.network.ideal
                log.info("scripted event: clients %s now on profile %s (round %s, t=%.3fs)",
                         _ids_text(event.clients), event.profile, round_, now)

    # --- liveness -------------------------------------------------------------------

    def _check_nodes(self, now: float) -> None:
        for name, info in list(self._nodes.items()):
            if now - info.last_seen > self.heartbeat_timeout:
                self._forget(name, reason=f"silent for {now - info.last_seen:.1f}s")

    def _forget(self, node: str, reason: str | None) -> None:
        if self._nodes.pop(node, None) is None:
            return
        if reason:
            log.warning("node %s lost (%s)", node, reason)
        else:
            log.info("node %s left", node)
        for name, pid in list(self._names.items()):
            if pid.node == node:
                del self._names[name]
        for pid in [p for p in self._link_of if p[0] == node]:
            del self._link_of[pid]
        for info in self._nodes.values():
            self._send_ctl(info.identity, Pid(info.identity.decode(), 0), {"op": "node_down", "node": node})

    # --- helpers ----------------------------------------------------------------------

    def _send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None:
        frames = wire.encode(CTL, BROKER_PID, dst, body)
        try:
            self._sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as exc:
            self._drop("unreachable", f"control to {identity!r}: {exc}")

    def _drop(self, reason: str, detail: str) -> None:
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        count = self.stats.dropped[reason]
        # Log the first few of each kind in full, then every 1000th: a flood must not
        # turn into a log flood.
        if count <= 20 or count % 1000 == 0:
            log.warning("dropped message (%s, #%d): %s", reason, count, detail)



def _ids_text(ids) -> str:
    if ids is None:
        return "all"
    ids = sorted(ids)
    return f"{ids[0]}..{ids[-1]} ({len(ids)})" if len(ids) > 3 else str(ids)
