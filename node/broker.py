"""The broker: one ZeroMQ ROUTER every node connects to; it plays the network.

Every message between nodes passes here. The broker unpacks only the small header
frame, so its cost per message does not grow with the payload. It keeps

* the nodes it has heard from, and declares a node lost (``node_down``) when it stays
  silent longer than the heartbeat timeout;
* the global name registry (``server``, ``client/17``), and which processes own an
  emulated link (a client's link id), so it can account bytes per link and direction:
  a message from a link owner travels *up* its link, one to a link owner travels *down*;
* counters per link and direction, and of every dropped message by reason.

Link emulation: for a message that crosses a client's link the broker decides at once
whether it is lost and when the model says it arrives, starting the model's clock at
the sender's send time (stamped in the header, in the broker's clock). It forwards
the message immediately with a :class:`~fedemu.node.wire.Hold` in the header; the
receiving node keeps it until it is due. So the time the bytes take to cross loopback
or the LAN overlaps the emulated delay instead of adding to it, and a busy broker
loop no longer delivers late. A client that goes offline while messages to or from
it are held gets an ``offline`` notice to every node; they drop what is held for it
and report back, so the loss is counted here like any other. The client's own node
also hears when its device goes offline and comes back (``availability``), so its
training stops as a real device's would; no other node does.

With :class:`~fedemu.node.security.RunKeys`, the ROUTER is a CURVE server that admits
only the run's nodes; every refused connection is logged and counted (``refused``).

A malformed frame, an unknown destination or an oversize message is logged with the
reason and dropped; the broker keeps serving everyone else.
"""
from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgpack
import zmq

from . import control, wire
from .control import QUIET_OPS, WORK_OPS
from .links import DOWN, UP, LinkConfigError, Network, NetworkSpec, parse_ids
from .security import Admission, RunKeys
from .vclock import VirtualScheduler, sender_of
from .wire import BROKER_NODE, BROKER_PID, CTL, USER, VERSION, Pid, WireError

log = logging.getLogger("fedemu.broker")

# Plain ints: OR-ing or passing zmq's Flag enums costs microseconds per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)

_unpackb = msgpack.unpackb

# How far back a sender's send stamp may start a message's emulated clock. A stamp is
# normally a fraction of a millisecond old; a much older one means a starved sender
# or a bad clock estimate, and must not let a message skip most of its delay.
MAX_SEND_AGE_S = 1.0

CLOCKS = ("wall", "virtual")


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
    name: str
    identity: bytes
    last_seen: float


@dataclass
class BrokerStats:
    links: dict[int, LinkCounters] = field(default_factory=dict)
    other_bytes: int = 0
    other_msgs: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # connections refused by authentication

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
            "refused": self.refused,
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
        keys: RunKeys | None = None,
        clock: str = "wall",
    ) -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock = {clock!r}: use {' or '.join(CLOCKS)}")
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self.stats = BrokerStats()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Fail loudly on an unroutable identity instead of zmq's silent drop.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        # pyzmq's Python-level send() wraps the C one for DRAFT-socket arguments this
        # broker never uses, at about a microsecond per frame: call the C one.
        self._send_frame = zmq.backend.Socket.send.__get__(self._sock)
        # Before the bind: with no ZAP handler bound, libzmq lets every CURVE client in.
        self._admission = Admission(self._ctx, self._sock, keys, self.stats) if keys is not None else None
        self.endpoint = self._bind(bind)
        self._nodes: dict[str, _NodeInfo] = {}
        self._by_identity: dict[bytes, _NodeInfo] = {}
        self._names: dict[str, Pid] = {}
        self._link_of: dict[tuple[str, int], int] = {}
        self._running = False
        self.spec = network
        self.network = network.build() if network is not None else Network()
        self.time_scale = network.time_scale if network is not None else 1.0
        self._emulating = not self.network.ideal
        self._t0 = time.monotonic()
        self._now = self._t0  # set once per burst in _drain
        # Per link, when the last message forwarded across it is due (broker clock):
        # while that is ahead, receiving nodes may hold messages of that link.
        self._flight_until: dict[int, float] = {}
        # Clients' devices: the processes owning each link, the links whose owners were
        # told they are offline, and when to look again: a heap of (emulated time, link)
        # with the one time that counts per link.
        self._owners: dict[int, set[Pid]] = {}
        self._devices_offline: set[int] = set()
        self._device_checks: list[tuple[float, int]] = []
        self._device_check_at: dict[int, float] = {}
        # Virtual time: the broker owns the clock and holds every message until due.
        self.scheduler = VirtualScheduler(self) if clock == "virtual" else None
        self._wake_deadline = math.inf  # the scheduler's next look, in wall time
        if self.scheduler is not None:
            self.time_scale = 1.0  # nothing waits on the wall clock

    def emulated_now(self) -> float:
        """Emulated seconds since the run's clock started: wall seconds x time_scale
        since the broker started, or the virtual clock's instant."""
        if self.scheduler is not None:
            return self.scheduler.now
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
        for extra in self._admission.sockets if self._admission else ():
            poller.register(extra, zmq.POLLIN)
        next_check = time.monotonic() + self.heartbeat_interval
        log.info("broker listening on %s%s", self.endpoint, " (CURVE: run keys required)" if self._admission else "")
        try:
            while self._running:
                wake = min(next_check, self._wake_deadline)
                self._wake_deadline = math.inf
                wall_devices = self._device_checks and self.scheduler is None
                if wall_devices:
                    wake = min(wake, self._t0 + self._device_checks[0][0] / self.time_scale)
                for sock, _ in poller.poll(max(0.0, wake - time.monotonic()) * 1000):
                    if sock is self._sock:
                        self._drain()
                    else:
                        self._admission.handle(sock)
                if self.scheduler is not None:
                    self.scheduler.step()
                elif wall_devices:
                    self._due_device_checks()
                now = time.monotonic()
                if now >= next_check:
                    self._check_nodes(now)
                    self._scripted_events(round_=None)
                    next_check = now + self.heartbeat_interval
        finally:
            if self._admission is not None:
                self._admission.close()
            self._sock.close(linger=0)
            self._ctx.term()
            log.info("broker stopped; %s", self.stats.as_dict())

    def stop(self) -> None:
        self._running = False

    def _drain(self) -> None:
        # Read everything queued before polling again: one poll per burst. Frame by
        # frame with int flags: recv_multipart's per-frame flag handling costs more
        # than the rest of the relay.
        recv = self._sock.recv
        on_message = self._on_message
        self._now = time.monotonic()  # "last seen" for every message of this burst
        for _ in range(10_000):
            try:
                identity = recv(_NOBLOCK)  # small bytes; a ROUTER always puts it first
            except zmq.Again:
                return
            frames = []
            frame = None
            more = True
            while more:  # a multipart message arrives whole: the rest is here
                frame = recv(0, copy=False)
                frames.append(frame)
                more = frame.more
            try:
                on_message(identity, frames)
            except WireError as exc:
                self._drop("malformed", f"from {identity!r}: {exc}")
            except Exception as exc:  # a bug; still, no input may stop the broker
                log.exception("error handling a message from %r", identity)
                self._drop("malformed", f"from {identity!r}: {type(exc).__name__}: {exc}")

    def _on_message(self, identity: bytes, frames: list) -> None:
        """One message from ``identity``: ``frames`` = [header, body, arrays...]."""
        info = self._by_identity.get(identity)
        if info is not None and len(frames) >= 2:
            # The fast path: a well-formed user message from a known node (nearly all
            # traffic), checked by wire.user_fields; anything else takes the slow path,
            # which names the fault. (Frame.bytes, cached by the frame, unpacks twice as
            # fast as a fresh Frame.buffer memoryview.)
            size = 0
            for f in frames:
                size += len(f)
            if size <= self.max_message_bytes:
                fields = wire.user_fields(frames[0].bytes, info.name)
                if fields is not None:
                    src_node, src_id, dst_node, dst = fields[2:6]
                    info.last_seen = self._now
                    if self.scheduler is not None:
                        self.scheduler.heard(info.name)
                        self._route_user(fields, frames, size, Pid(src_node, src_id))
                        return
                    if dst_node:
                        target = self._nodes.get(dst_node)
                        dst_pid = (dst_node, dst)  # a Pid is a tuple: same hash, same key
                    else:
                        dst_pid = self._names.get(dst)
                        target = self._nodes.get(dst_pid[0]) if dst_pid is not None else None
                    if target is not None and not (self._emulating and self._link_of):
                        if self._link_of:
                            self._account((src_node, src_id), dst_pid, size)
                        else:
                            self.stats.other_bytes += size
                            self.stats.other_msgs += 1
                        self._send(target.identity, frames, target.name)
                    else:
                        self._route_user(fields, frames, size, Pid(src_node, src_id))
                    return
        self._on_other(identity, info, frames)

    def _on_other(self, identity: bytes, info: _NodeInfo | None, frames: list) -> None:
        """Everything but the fast path: control traffic, emulated links, and faults."""
        if len(frames) < 2:
            raise WireError(f"{len(frames)} frame(s); a message needs a header and a body")
        size = sum(len(f) for f in frames)
        if size > self.max_message_bytes:
            self._drop("oversize", f"{size} bytes from {identity!r} exceed {self.max_message_bytes}")
            return
        header = wire.unpack_header(frames[0].buffer)  # the full checks, naming the fault
        if header.src.node.encode() != identity:
            self._drop("spoofed", f"header names node {header.src.node!r} but socket is {identity!r}")
            return
        if info is None:
            if header.kind == CTL and header.dst_node == BROKER_NODE:
                self._control(identity, header, frames, known=False)
            else:
                self._drop("unknown-node", f"message from {header.src.node!r} before hello")
                self._send_ctl(identity, header.src, {"op": "unknown_node"})
            return
        info.last_seen = time.monotonic()
        if header.kind == CTL:
            if header.dst_node == BROKER_NODE:
                self._control(identity, header, frames, known=True)
            else:
                if self.scheduler is not None:
                    self.scheduler.heard(info.name)
                self._route_ctl(header, frames)
            return
        if self.scheduler is not None:
            self.scheduler.heard(info.name)
        # A user message whose timing field is not a send time: route it, unstamped.
        self._route_user([VERSION, USER, header.src.node, header.src.id, header.dst_node, header.dst],
                         frames, size, header.src)

    def _route_user(self, fields: list, frames: list, size: int, src: Pid) -> None:
        if self.scheduler is not None:  # takes effect at quiescence, in its place
            self.scheduler.accept(src, "user", (fields, frames, size))
            return
        destination = self._destination(fields)
        if destination is None:
            return
        dst_pid, target = destination
        crossing = self._account(src, dst_pid, size) if self._link_of else self._other(size)
        if crossing is not None and self._emulating:
            self._emulate(crossing, size, target, fields, frames)
            return
        self._send(target.identity, frames, target.name)

    def _destination(self, fields: list) -> tuple[Pid, _NodeInfo] | None:
        """A user message's receiver and its node, or None (dropped, with the reason)."""
        dst_node, dst = fields[4], fields[5]
        if dst_node:
            dst_pid = Pid(dst_node, dst)
        else:
            dst_pid = self._names.get(dst)
            if dst_pid is None:
                self._drop("unknown-destination", f"no process registered as {dst!r}")
                return None
        target = self._nodes.get(dst_pid.node)
        if target is None:
            self._drop("unknown-destination", f"node {dst_pid.node!r} is not connected")
            return None
        return dst_pid, target

    def _route_ctl(self, header: wire.Header, msg: list) -> None:
        """Runtime control between nodes (monitor, demonitor, down): relayed as is (in
        virtual time, held and delivered at its instant like a message)."""
        if self.scheduler is not None:
            body = wire.unpack_body(msg[1].buffer, msg[2:])
            watcher = body.get("watcher") if isinstance(body, dict) else None
            receiver = watcher if isinstance(watcher, Pid) else (header.dst_node, header.dst)
            self.scheduler.accept(sender_of(header.src, body), "ctl", (header, msg, receiver))
            return
        self._relay_ctl(header, msg)

    def _relay_ctl(self, header: wire.Header, msg: list, hold=None) -> None:
        if header.dst_node:
            dst_node = header.dst_node
        else:
            pid = self._names.get(header.dst)
            dst_node = pid.node if pid is not None else None
        target = self._nodes.get(dst_node) if dst_node is not None else None
        if target is None:
            self._drop("unknown-destination", f"node {dst_node or header.dst!r} is not connected")
            # A monitor or down for a lost node must still resolve: tell the sender.
            sender = self._nodes.get(header.src.node)
            if sender is not None and dst_node is not None:
                self._send_ctl(sender.identity, header.src, {"op": "node_down", "node": dst_node})
            return
        if hold is not None:
            hold(target.name, msg)
            return
        self._send(target.identity, msg, target.name)

    def _send(self, identity: bytes, msg: list, node: str) -> None:
        """Send ``msg`` (header, body, arrays...) to the node with ``identity``."""
        send = self._send_frame
        try:
            send(identity, _SNDMORE)
            if len(msg) == 2:  # most messages: header and body
                send(msg[0], _SNDMORE)
                send(msg[1])
                return
            last = len(msg) - 1
            for i in range(last):
                send(msg[i], _SNDMORE)  # received frames go zero-copy; small bytes are copied
            send(msg[last])
        except zmq.ZMQError as exc:  # the peer vanished between heartbeats
            self._drop("unreachable", f"node {node!r}: {exc}")

    def _other(self, size: int) -> None:
        self.stats.other_bytes += size
        self.stats.other_msgs += 1
        return None

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
        return self._other(size)

    def _emulate(self, crossing: tuple[int, int], size: int, target: _NodeInfo, fields: list, frames: list) -> None:
        link, direction = crossing
        now = time.monotonic()
        # The model's clock starts when the sender sent (its stamp, in this clock),
        # so the bytes' trip here is part of the emulated delay, not added to it.
        sent = fields[6] if len(fields) == 7 else None
        entry = now if sent is None else min(now, max(sent, now - MAX_SEND_AGE_S))
        arrival = self._arrival(link, direction, size, (entry - self._t0) * self.time_scale)
        if arrival is None:
            return
        due = self._t0 + arrival / self.time_scale
        if due > self._flight_until.get(link, 0.0):
            self._flight_until[link] = due
        header = msgpack.packb([*fields[:6], [due - now, now, link, direction]])
        self._send(target.identity, [header, *frames[1:]], target.name)

    def _arrival(self, link: int, direction: int, size: int, entry: float) -> float | None:
        """When a message entering ``link`` at emulated time ``entry`` arrives, by the
        link model, or None if it is lost (counted)."""
        verdict = self.network.transmit(link, direction, size, entry)
        if verdict.dropped is not None:
            self._lost(link, direction, verdict.dropped)
            return None
        c = self._counters(link)
        if direction == UP:
            c.up_transfer_s += verdict.transfer_s
        else:
            c.down_transfer_s += verdict.transfer_s
        # Offline when it would arrive (a scheduled drop-out): lost in flight. Offline
        # changes made later (set_links, a new round) reach held messages by notice.
        if self.network.is_offline(link, verdict.arrival):
            self._lost(link, direction, "offline")
            return None
        return verdict.arrival

    def _notify_offline(self) -> None:
        """After a change that can take clients offline: every node drops what it holds
        for the clients now offline (in flight when they went), and reports back. In
        virtual time the broker holds it all, and drops it here."""
        if self.scheduler is not None:
            emulated = self.scheduler.now
            self.scheduler.drop_held(lambda link: self.network.is_offline(link, emulated),
                                     lambda link, direction: self._lost(link, direction, "offline"))
            return
        now = time.monotonic()
        for link in [k for k, until in self._flight_until.items() if until <= now]:
            del self._flight_until[link]  # nothing of it is held anywhere any more
        emulated = (now - self._t0) * self.time_scale
        links = [k for k in self._flight_until if self.network.is_offline(k, emulated)]
        if not links:
            return
        for link in links:
            del self._flight_until[link]
        for info in self._nodes.values():
            self._send_ctl(info.identity, Pid(info.name, 0), {"op": "offline", "links": links, "at": now})

    def _held_dropped(self, counts: Any) -> None:
        """A node's report of held messages it dropped on an ``offline`` notice."""
        if not isinstance(counts, list):
            raise WireError("held_dropped needs a list of [link, direction, count]")
        for entry in counts:
            if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)
                    and entry[1] in (UP, DOWN) and 0 < entry[2] <= 1_000_000):
                raise WireError(f"bad held_dropped entry {entry!r}")
            link, direction, count = entry
            for _ in range(count):
                self._lost(link, direction, "offline")

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
        try:
            op = control.check(body, control.BROKER)
        except control.ControlError as exc:
            raise WireError(str(exc)) from None
        src = header.src
        if op == "hello":
            if known:
                log.warning("node %s said hello again; keeping its registrations", src.node)
            info = self._nodes[src.node] = _NodeInfo(src.node, identity, time.monotonic())
            self._by_identity[identity] = info
            if self.scheduler is not None and not known:
                self.scheduler.join(src.node)
            log.info("node %s joined", src.node)
            self._send_ctl(identity, src, {
                "op": "welcome",
                "heartbeat_interval": self.heartbeat_interval,
                "heartbeat_timeout": self.heartbeat_timeout,
                # Echo and this clock: the node's first estimate of its clock offset.
                "t": body.get("t"), "now": time.monotonic(),
                "clock": "virtual" if self.scheduler is not None else "wall", "time_scale": float(self.time_scale),
            })
            return
        if not known:
            self._drop("unknown-node", f"{op!r} from {src.node!r} before hello")
            self._send_ctl(identity, src, {"op": "unknown_node"})
            return
        if self.scheduler is not None and op not in QUIET_OPS:
            self.scheduler.heard(src.node)
        if op == "idle":
            if self.scheduler is None:
                raise WireError("idle reports are for virtual time; this broker runs on wall time")
            self.scheduler.report(src.node, body.get("seen"), body.get("next"))
        elif op == "busy":
            pass  # a node busy with work the broker did not hand it (heard() above took note)
        elif op == "clock_start":
            if self.scheduler is not None and not self.scheduler.started:
                self.scheduler.started = True
                log.info("virtual clock started by %s", src)
        elif op == "hb":
            # The node times the round trip: its send time echoed, and this clock.
            self._send_ctl(identity, src, {"op": "hb", "t": body.get("t"), "now": time.monotonic()})
        elif op == "register":
            self._register(identity, src, body.get("entries"))
        elif op == "unregister":
            names = body.get("names")
            if not isinstance(names, list):
                raise WireError("unregister needs a list of names")
            pid = body.get("pid")
            pid = pid if isinstance(pid, Pid) and pid.node == src.node else None
            self._unregister(src.node, names, pid)
        elif op == "whereis":
            name = body.get("name")
            if not isinstance(name, str):
                raise WireError(f"whereis needs a name, not {name!r}")
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
            round_ = body.get("round")
            if type(round_) is not int:
                raise WireError(f"round {round_!r} is not an integer")
            by = body.get("by")
            if self.scheduler is not None:
                self.scheduler.accept(by if isinstance(by, Pid) and by.node == src.node else src, "round", round_)
            else:
                self._apply_round(round_)
        elif op == "set_links":
            error = self._check_set_links(body)
            if error is None:
                if self.scheduler is not None:
                    self.scheduler.accept(src, "set_links", body)
                else:
                    self._apply_set_links(body)
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": error})
        elif op == "held_dropped":
            self._held_dropped(body.get("counts"))
        elif op == "shutdown":
            log.info("shutdown requested by %s", src)
            for info in self._nodes.values():
                self._send_ctl(info.identity, Pid(info.name, 0), {"op": "shutdown"})
            self._running = False
        elif op == "bye":
            self._forget(src.node, reason=None)

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

    def _disown(self, pid: Pid) -> None:
        link = self._link_of.pop(pid, None)
        owners = self._owners.get(link)
        if owners is not None:
            owners.discard(pid)
            if not owners:
                del self._owners[link]

    # --- changing the network while it runs ----------------------------------------------

    def _apply_round(self, round_: int) -> None:
        self.network.round = round_
        self._scripted_events(round_=round_)
        if self.network.availability is not None:
            self._notify_offline()  # the new round's drop-outs
            if self.network.availability.per_round > 0:
                self._check_devices(list(self._owners))

    def _check_set_links(self, body: dict) -> str | None:
        """None if a set_links request is valid, else the error that names what is wrong."""
        try:
            if self.spec is None:
                raise LinkConfigError("this broker runs without a network spec")
            parse_ids(body.get("clients", []), "clients", self.spec.num_clients)
            profile = body.get("profile")
            if profile is not None and profile not in self.spec.profiles:
                raise LinkConfigError(f"profile {profile!r} is unknown; profiles are {', '.join(self.spec.profiles)}")
        except LinkConfigError as exc:
            return str(exc)
        return None

    def _apply_set_links(self, body: dict) -> None:
        self._set_links(body)
        if body.get("offline") is True:
            self._notify_offline()
        if isinstance(body.get("offline"), bool):
            self._check_devices(list(self._owners))

    def _set_links(self, body: dict) -> None:
        """Give a group of clients a named profile, or force them offline/online (the
        request was checked by _check_set_links)."""
        clients = parse_ids(body.get("clients", []), "clients", self.spec.num_clients)
        profile = body.get("profile")
        if profile is not None:
            self.spec.apply(self.network, profile, clients)
            log.info("clients %s now on profile %s", _ids_text(clients), profile)
        if body.get("offline") is True:
            self.network.offline |= clients
        elif body.get("offline") is False:
            self.network.offline -= clients
        self._emulating = not self.network.ideal

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

    # --- clients' devices: telling a client's own node when it goes offline and back ---

    def _check_devices(self, links: Iterable[int]) -> None:
        """Tell the owners of these links (on their nodes) when whether they are offline
        has changed, and schedule a look at the next time-based switch. Only the client's
        own node hears of it: a device knows it is offline; the server learns of it as a
        real one would (no answer)."""
        availability = self.network.availability
        if availability is None and not self.network.offline and not self._devices_offline:
            return
        timed = availability is not None and availability.timed
        now = self.emulated_now()
        changed = []
        for link in links:
            if link not in self._owners:
                continue  # no client owns it (yet): looked at when one registers
            offline = self.network.is_offline(link, now)
            if offline != (link in self._devices_offline):
                if offline:
                    self._devices_offline.add(link)
                else:
                    self._devices_offline.discard(link)
                changed.extend((pid, offline) for pid in self._owners[link])
            if timed:
                at = availability.next_change(link, now)
                if at < math.inf and self._device_check_at.get(link) != at:
                    self._device_check_at[link] = at
                    heapq.heappush(self._device_checks, (at, link))
        self._tell_devices(changed)

    def _due_device_checks(self) -> None:
        now = self.emulated_now()
        due = []
        while self._device_checks and self._device_checks[0][0] <= now:
            at, link = heapq.heappop(self._device_checks)
            if self._device_check_at.get(link) == at:  # else superseded by a later push
                del self._device_check_at[link]
                due.append(link)
        if due:
            self._check_devices(due)

    def _tell_devices(self, changed: list[tuple[Pid, bool]]) -> None:
        by_node: dict[str, dict[str, list[int]]] = {}
        for pid, offline in changed:
            lists = by_node.setdefault(pid[0], {"offline": [], "online": []})
            lists["offline" if offline else "online"].append(pid[1])
        for node, lists in by_node.items():
            info = self._nodes.get(node)
            if info is None:
                continue
            if self.scheduler is not None:  # at the instant it happens, with the node's next advance
                self.scheduler.notify(node, {"op": "availability", **lists})
            else:
                self._send_ctl(info.identity, Pid(node, 0), {"op": "availability", **lists})

    # --- liveness -------------------------------------------------------------------

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

    # --- helpers ----------------------------------------------------------------------

    def _send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None:
        node = identity.decode(errors="replace")
        if self.scheduler is not None and body.get("op") in WORK_OPS:
            self.scheduler.counted(node)
        self._send(identity, wire.encode(CTL, BROKER_PID, dst, body), node)

    # --- virtual time (the scheduler's calls) -----------------------------------------

    def _send_work(self, node: str, frames: list) -> None:
        """A delivery of the current instant to ``node`` (counted in its books)."""
        info = self._nodes.get(node)
        if info is not None:
            self.scheduler.counted(node)
            self._send(info.identity, frames, node)

    def _send_work_ctl(self, node: str, body: dict) -> None:
        info = self._nodes.get(node)
        if info is not None:
            self._send_ctl(info.identity, Pid(node, 0), body)

    def _virtual_input(self, sender: Pid, sequence: int, kind: str, payload) -> None:
        """One thing a process sent during the instant, taken in its place in the order."""
        if kind == "user":
            self._transmit_virtual(sender, sequence, *payload)
        elif kind == "ctl":
            header, frames, receiver = payload
            self._relay_ctl(header, frames, hold=lambda node, msg: self.scheduler.hold(
                self.scheduler.now, sender, sequence, receiver, node, msg))
        elif kind == "round":
            self._apply_round(payload)
        elif kind == "set_links":
            self._apply_set_links(payload)
        elif kind == "disown":
            self._disown(payload)

    def _transmit_virtual(self, src: Pid, sequence: int, fields: list, frames: list, size: int) -> None:
        """A message sent at the current instant: through its link's model (if it
        crosses one) to its due time, then held until then."""
        destination = self._destination(fields)
        if destination is None:
            return
        dst_pid, target = destination
        now = self.scheduler.now
        crossing = self._account(src, dst_pid, size) if self._link_of else self._other(size)
        if crossing is None or not self._emulating:
            self.scheduler.hold(now, src, sequence, dst_pid, target.name, frames)
            return
        link, direction = crossing
        arrival = self._arrival(link, direction, size, now)
        if arrival is not None:
            self.scheduler.hold(arrival, src, sequence, dst_pid, target.name, frames, link, direction)

    def _clock_moved(self) -> None:
        """The virtual clock moved on: time-based availability changes and scripted
        events due by now take effect."""
        self._due_device_checks()
        self._scripted_events(round_=None)

    def _wake_at(self, wall: float) -> None:
        """Have the serve loop look again (step the scheduler) by ``wall`` (monotonic)."""
        self._wake_deadline = min(self._wake_deadline, wall)

    def _next_scheduled_change(self) -> float:
        """When the network next changes by itself (availability, a scripted event)."""
        checks = self._device_checks
        while checks and self._device_check_at.get(checks[0][1]) != checks[0][0]:
            heapq.heappop(checks)  # superseded by a later look at that link
        soonest = checks[0][0] if checks else math.inf
        if self.spec is not None:
            for event in self.spec.events:
                if event.at_s is not None and not event.done:
                    soonest = min(soonest, event.at_s)
        return soonest

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

