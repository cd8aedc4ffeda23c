"""The broker: one ZeroMQ ROUTER every node connects to; it plays the network.

Every message between nodes passes here. The broker unpacks only the small header
frame, so its cost per message does not grow with the payload. It is one socket and
its serve loop (this module) holding collaborators, each with one job:

* ``members`` (membership.py): the nodes and their liveness, the global names, the
  links' owners;
* ``links`` (net/emulator.py): the link emulator: every client link's state, how each
  message crosses its link, the network's own changes, and the books;
* ``time`` (timebase.py): the run's clock, wall or virtual, which decides when what
  processes send takes effect and when what is due is delivered;
* ``router`` (routing.py): where each message goes (the fast path, names, relayed
  control, the slow path that names what is wrong);
* ``changes`` (network_changes.py): the network changing as the run goes, and the
  devices told when they go offline;
* ``control`` (control_ops.py): what each control op addressed to the broker does.

With :class:`~fedemu.node.security.RunKeys` the ROUTER is a CURVE server that admits
only the run's nodes (security.Admission); with a ``token`` a node joins only if its
hello carries it (control_ops.py); every refused connection or hello is logged and
counted (``refused``). With ``controllers``, the ops that steer the run
(control.CONTROLLER_OPS) are taken only from those nodes. A malformed frame, an unknown
destination or an oversize message is logged with the reason and dropped; the broker
keeps serving everyone else.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import zmq

from .. import wire
from ..control import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S
from ..net.emulator import LinkEmulator
from ..net.network_spec import NetworkSpec
from ..security import Admission, RunKeys
from ..wire import CTL, Pid, WireError
from .control_ops import BrokerControl
from .membership import Membership
from .network_changes import NetworkChanges
from .routing import Router
from .timebase import VirtualTimebase, WallTimebase

log = logging.getLogger("fedemu.broker")

_NOBLOCK, _SNDMORE = wire.NOBLOCK, wire.SNDMORE

CLOCKS = ("wall", "virtual")


@dataclass
class BrokerStats:
    """The broker's own books; the links' are the link emulator's (``as_dict`` joins them)."""

    dropped: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # connections refused by authentication
    fanout_msgs: int = 0  # messages to many, each relayed once to its node
    fanout_receivers: int = 0  # the receivers those reached (each also counted on its link)

    def as_dict(self, links: LinkEmulator) -> dict[str, Any]:
        return {
            **links.books(),
            "dropped": {**self.dropped, **links.lost_by_reason},
            "refused": self.refused,
            "fanout_msgs": self.fanout_msgs,
            "fanout_receivers": self.fanout_receivers,
        }


class Broker:
    def __init__(
        self,
        bind: str,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
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
        self.token = token  # a hello must carry it (None: any hello joins)
        self.controllers = frozenset(controllers) if controllers is not None else None  # None: any node
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
        self._running = False
        self.loop_now = time.monotonic()  # wall: set once per burst, "last seen" for its messages
        self.links = LinkEmulator(network)
        self.time = (VirtualTimebase(self) if clock == "virtual"
                     else WallTimebase(self, network.time_scale if network is not None else 1.0))
        self.members = Membership(self)
        self.changes = NetworkChanges(self)
        self.router = Router(self)
        self.control = BrokerControl(self)

    def emulated_now(self) -> float:
        """Emulated seconds since the run's clock started."""
        return self.time.now()

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
                wake = min(next_check, self.time.wake())
                for sock, _ in poller.poll(max(0.0, wake - time.monotonic()) * 1000):  # wall
                    if sock is self._sock:
                        self._drain()
                    else:
                        self._admission.handle(sock)
                self.time.step()
                now = time.monotonic()  # wall: heartbeat bookkeeping
                if now >= next_check:
                    self.members.check_nodes(now)
                    self._beat(now)
                    self.links.scripted_events(None, self.time.now())
                    next_check = now + self.heartbeat_interval
        finally:
            if self._admission is not None:
                self._admission.close()
            self._sock.close(linger=0)
            self._ctx.term()
            log.info("broker stopped; %s", self.stats.as_dict(self.links))

    def stop(self) -> None:
        self._running = False

    def _beat(self, now: float) -> None:
        """A heartbeat to every node, unasked: a node's own heartbeat may wait behind
        gigabytes of its uploads in the same stream (5,000 asynchronous clients uploading
        at once), and its answer with it; this one tells the node the broker is alive."""
        for info in list(self.members.nodes.values()):
            self.send_ctl(info.identity, Pid(info.name, 0), {"op": "hb", "now": now})

    def _drain(self) -> None:
        # Read everything queued before polling again: one poll per burst. Frame by
        # frame with int flags: recv_multipart's per-frame flag handling costs more
        # than the rest of the relay. A burst that takes longer than half a heartbeat
        # interval is left for the next turn of the loop, so heartbeats still go out.
        recv = self._sock.recv
        on_message = self.router.on_message
        self.loop_now = time.monotonic()  # wall: "last seen" for every message of this burst
        give_way = self.loop_now + self.heartbeat_interval / 2
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
                self.drop("malformed", f"from {identity!r}: {exc}")
            except Exception as exc:  # a bug; still, no input may stop the broker
                log.exception("error handling a message from %r", identity)
                self.drop("malformed", f"from {identity!r}: {type(exc).__name__}: {exc}")

    # --- what processes sent, taking effect -------------------------------------------

    def apply(self, sender: Pid, sequence: int, kind: str, payload: Any) -> None:
        """Something a process sent, taking effect now (the timebase says when): a user
        message or a message to many through their links, relayed control, the server's
        round, a change of links, or the link of a process that ended let go."""
        if kind == "user":
            self.router.transmit(sender, sequence, *payload)
        elif kind == "many":
            self.router.transmit_many(sender, sequence, *payload)
        elif kind == "ctl":
            self.router.relay_ctl(sender, sequence, *payload)
        elif kind == "round":
            self.changes.start_round(payload)
        elif kind == "set_links":
            self.changes.set_links(payload)
        elif kind == "disown":
            self.members.disown(payload)
        else:
            raise ValueError(f"unknown input kind {kind!r}")

    # --- sending ---------------------------------------------------------------------

    def send(self, identity: bytes, msg: list, node: str) -> None:
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
            self.drop("unreachable", f"node {node!r}: {exc}")

    def send_to(self, node: str, msg: list) -> None:
        """Send ``msg`` to the node named ``node``; nothing if it has left the run."""
        info = self.members.nodes.get(node)
        if info is not None:
            self.send(info.identity, msg, node)

    def send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None:
        node = identity.decode(errors="replace")
        self.time.counted(node, body)
        self.send(identity, wire.encode(CTL, wire.BROKER_PID, dst, body), node)

    def drop(self, reason: str, detail: str) -> None:
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        count = self.stats.dropped[reason]
        # Log the first few of each kind in full, then every 1000th: a flood must not
        # turn into a log flood.
        if count <= 20 or count % 1000 == 0:
            log.warning("dropped message (%s, #%d): %s", reason, count, detail)


__all__ = ["Broker", "BrokerStats", "CLOCKS"]
