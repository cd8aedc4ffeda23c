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

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import wire
from .wire import CTL, USER, Pid, WireError

log = logging.getLogger("fedemu.broker")

BROKER_NODE = "$broker"
BROKER_PID = Pid(BROKER_NODE, 0)


@dataclass
class LinkCounters:
    up_bytes: int = 0
    up_msgs: int = 0
    down_bytes: int = 0
    down_msgs: int = 0


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
        up_bytes = sum(c.up_bytes for c in self.links.values())
        down_bytes = sum(c.down_bytes for c in self.links.values())
        return {
            "bytes_up": up_bytes,
            "bytes_down": down_bytes,
            "msgs_up": sum(c.up_msgs for c in self.links.values()),
            "msgs_down": sum(c.down_msgs for c in self.links.values()),
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
                timeout_ms = max(0.0, next_check - time.monotonic()) * 1000
                if poller.poll(timeout_ms):
                    self._drain()
                now = time.monotonic()
                if now >= next_check:
                    self._check_nodes(now)
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
            self._account(header.src, dst, size)
        try:
            self._sock.send_multipart([target.identity, *msg], copy=False)
        except zmq.ZMQError as exc:  # the peer vanished between heartbeats
            self._drop("unreachable", f"node {dst.node!r}: {exc}")

    def _account(self, src: Pid, dst: Pid, size: int) -> None:
        src_link = self._link_of.get(src)
        dst_link = self._link_of.get(dst)
        if src_link is not None:
            c = self._counters(src_link)
            c.up_bytes += size
            c.up_msgs += 1
        if dst_link is not None:
            c = self._counters(dst_link)
            c.down_bytes += size
            c.down_msgs += 1
        if src_link is None and dst_link is None:
            self.stats.other_bytes += size
            self.stats.other_msgs += 1

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
            if body.get("per_link"):
                value["links"] = {k: vars(c) for k, c in self.stats.links.items()}
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": value})
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

