"""The broker: one ZeroMQ ROUTER every node connects to; it plays the network.

Every message between nodes passes here. The broker unpacks only the small header
frame, so its cost per message does not grow with the payload. Its jobs each have a
module; :class:`Broker` is made of them:

* routing.py: where each message goes (the fast path, names, relayed control);
* emulation.py: link emulation's decisions (a message's link, its arrival or loss)
  and the counters per link and direction, and of every dropped message by reason;
* registry.py: the nodes and their liveness, the global names, the links' owners;
* network_changes.py: the network changing as the run goes (rounds' drop-outs,
  ``set_links``, scripted events) and clients' devices told when they go offline;
* broker_control.py: what each control op addressed to the broker does;
* broker_vtime.py: what the virtual-time scheduler (vclock.py) calls back.

They are mixins rather than objects because they share the broker's tables (nodes,
names, links, the network) at nearly every step. This module keeps the socket: the
serve loop, reading bursts, sending frames. With :class:`~fedemu.node.security.RunKeys`
the ROUTER is a CURVE server that admits only the run's nodes (security.Admission);
with a ``token`` a node joins only if its hello carries it (broker_control.py); every
refused connection or hello is logged and counted (``refused``). With ``controllers``,
the ops that steer the run (control.CONTROLLER_OPS) are taken only from those nodes.

A malformed frame, an unknown destination or an oversize message is logged with the
reason and dropped; the broker keeps serving everyone else.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Iterable

import zmq

from . import wire
from .broker_control import BrokerControl
from .broker_vtime import VirtualTimeCalls
from .control import WORK_OPS
from .emulation import BrokerStats, LinkCounters, LinkEmulation
from .links import NetworkSpec
from .network_changes import NetworkChanges
from .registry import Registry
from .routing import Routing
from .security import Admission, RunKeys
from .vclock import VirtualScheduler
from .wire import BROKER_NODE, BROKER_PID, CTL, Pid, WireError

log = logging.getLogger("fedemu.broker")

# Plain ints: OR-ing or passing zmq's Flag enums costs microseconds per frame.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)

CLOCKS = ("wall", "virtual")


class Broker(Routing, LinkEmulation, Registry, NetworkChanges, BrokerControl, VirtualTimeCalls):
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
        token: str | None = None,
        controllers: Iterable[str] | None = None,
    ) -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock = {clock!r}: use {' or '.join(CLOCKS)}")
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self._token = token  # a hello must carry it (None: any hello joins)
        self._controllers = frozenset(controllers) if controllers is not None else None  # None: any node
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
        self._init_registry()
        self._running = False
        self._init_emulation(network)
        self.time_scale = network.time_scale if network is not None else 1.0
        self._t0 = time.monotonic()  # wall: the wall clock's origin
        self._now = self._t0  # set once per burst in _drain
        self._init_devices()
        # Virtual time: the broker owns the clock and holds every message until due.
        self.scheduler = VirtualScheduler(self) if clock == "virtual" else None
        self._stash_ids = 0  # virtual time: bodies of messages to many, held by their nodes
        self._wake_deadline = math.inf  # the scheduler's next look, in wall time
        if self.scheduler is not None:
            self.time_scale = 1.0  # nothing waits on the wall clock

    def emulated_now(self) -> float:
        """Emulated seconds since the run's clock started: wall seconds x time_scale
        since the broker started, or the virtual clock's instant."""
        if self.scheduler is not None:
            return self.scheduler.now
        return (time.monotonic() - self._t0) * self.time_scale  # wall: the wall clock's emulated time

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
        next_check = time.monotonic() + self.heartbeat_interval  # wall: heartbeats are host time
        log.info("broker listening on %s%s", self.endpoint, " (CURVE: run keys required)" if self._admission else "")
        try:
            while self._running:
                wake = min(next_check, self._wake_deadline)
                self._wake_deadline = math.inf
                wall_devices = self._device_checks and self.scheduler is None
                if wall_devices:
                    wake = min(wake, self._t0 + self._device_checks[0][0] / self.time_scale)
                for sock, _ in poller.poll(max(0.0, wake - time.monotonic()) * 1000):  # wall
                    if sock is self._sock:
                        self._drain()
                    else:
                        self._admission.handle(sock)
                if self.scheduler is not None:
                    self.scheduler.step()
                elif wall_devices:
                    self._due_device_checks()
                now = time.monotonic()  # wall: heartbeat bookkeeping
                if now >= next_check:
                    self._check_nodes(now)
                    self._beat(now)
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

    def _beat(self, now: float) -> None:
        """A heartbeat to every node, unasked: a node's own heartbeat may wait behind
        gigabytes of its uploads in the same stream (5,000 asynchronous clients uploading
        at once), and its answer with it; this one tells the node the broker is alive."""
        for info in list(self._nodes.values()):
            self._send_ctl(info.identity, Pid(info.name, 0), {"op": "hb", "now": now})

    def _drain(self) -> None:
        # Read everything queued before polling again: one poll per burst. Frame by
        # frame with int flags: recv_multipart's per-frame flag handling costs more
        # than the rest of the relay. A burst that takes longer than half a heartbeat
        # interval is left for the next turn of the loop, so heartbeats still go out.
        recv = self._sock.recv
        on_message = self._on_message
        self._now = time.monotonic()  # wall: "last seen" for every message of this burst
        give_way = self._now + self.heartbeat_interval / 2
        for count in range(10_000):
            if count % 64 == 63 and time.monotonic() > give_way:  # wall
                return
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

    # --- helpers ----------------------------------------------------------------------

    def _send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None:
        node = identity.decode(errors="replace")
        if self.scheduler is not None and body.get("op") in WORK_OPS:
            self.scheduler.counted(node)
        self._send(identity, wire.encode(CTL, BROKER_PID, dst, body), node)

    def _drop(self, reason: str, detail: str) -> None:
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        count = self.stats.dropped[reason]
        # Log the first few of each kind in full, then every 1000th: a flood must not
        # turn into a log flood.
        if count <= 20 or count % 1000 == 0:
            log.warning("dropped message (%s, #%d): %s", reason, count, detail)


__all__ = ["BROKER_NODE", "BROKER_PID", "Broker", "BrokerStats", "CLOCKS", "LinkCounters"]
