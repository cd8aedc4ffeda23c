"""Erlang-style processes inside a node, talking to other nodes through the broker.

A :class:`Node` is one OS process. It owns one DEALER socket to the broker, served by
a dedicated I/O thread that also sends heartbeats, so socket I/O and liveness never
wait behind a process that trains for minutes.

Two kinds of processes live in a node, both with a pid, a mailbox and monitors:
thread processes and behaviour processes (see process.py).

Semantics (as Erlang's): ``send`` never blocks; delivery between one pair of
processes is FIFO; ``monitor`` delivers exactly one :class:`Down` per monitor, with
reason ``normal``, ``crash: <error>``, ``noproc`` (no such process) or
``noconnection`` (its node was lost).

Link emulation ends here: a message that crossed an emulated link arrives with a
:class:`~fedemu.node.wire.Hold` from the broker, and the I/O thread keeps it in a small
heap until it is due, then puts it in the mailbox. Times on the wire are in the
broker's clock; the node estimates its offset to it from the heartbeats' round trips
(the sample with the shortest round trip of the last few), so nodes on other
machines need no synchronized clocks.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import zmq

from . import wire
from . import control
from .broker import _NOBLOCK, _SNDMORE, BROKER_NODE, BROKER_PID
from .control import RELAYED_OPS, WORK_OPS
from .holding import BrokerClock, HeldMessages
from .process import (TIMEOUT, Behaviour, BehaviourProcess, Down, LinkChange, Message, NodeError, Process, Stalled,
                      ThreadProcess)
from .security import PROTOCOL_ERRORS, RunKeys, pending_monitor_events
from .table import ProcessTable
from .timekeeping import Timekeeping
from .wire import CTL, USER, Hold, Pid, WireError

log = logging.getLogger("fedemu.node")

# The welcome's round trip includes the TCP connect (and CURVE handshake): a few quick
# heartbeats right after it give a good clock offset before the first message.
QUICK_SYNC_BEATS, QUICK_SYNC_INTERVAL = 5, 0.01
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

# Messages the I/O thread decodes before handing them over: small enough that the first
# of a burst is not held back long (a 1 KB message decodes in ~20 µs: bench/wire_codec.py).
_HANDOVER_GROUP = 16


def _renice_this_thread(increment: int) -> None:
    """Lower this thread's priority by ``increment`` (relative, as nice(1))."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError as exc:  # not allowed (or not Linux): run at the node's priority
        log.warning("could not lower the pool threads' priority by %d: %s", increment, exc)


class Node(ProcessTable, Timekeeping):
    """One OS process hosting many processes, connected to the broker."""

    def __init__(
        self,
        name: str,
        broker: str,
        *,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 5.0,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        pool_size: int = 1,
        keys: RunKeys | None = None,
        pool_nice: int = 0,
    ) -> None:
        if not name or name.startswith("$") or "/" in name:
            raise ValueError(f"bad node name {name!r}")
        self.name = name
        self.broker = broker
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self._init_table()
        self._refs = itertools.count(1)  # of monitors and of calls to the broker
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._state = threading.RLock()
        self._outbox: collections.deque[list] = collections.deque()
        # pool_nice > 0 runs the behaviours (clients' training) that much nicer than the
        # I/O thread, so on busy cores messages still leave and are released on time
        # (Linux nice is per thread; lowering it needs no privilege).
        self._pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix=f"{name}-pool",
                                        initializer=_renice_this_thread if pool_nice else None,
                                        initargs=(pool_nice,) if pool_nice else ())
        self._ctx = zmq.Context()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._welcomed = threading.Event()
        self.closed = threading.Event()
        self.close_reason: str | None = None
        self.broker_lost: str | None = None  # why this node lost the broker, once it has
        self._io_thread: threading.Thread | None = None
        self.on_close: list[Callable[[str], None]] = []
        self.dropped: collections.Counter[str] = collections.Counter()
        self.keys = keys
        self._refused: str | None = None  # why the broker refused the handshake
        self._broker_clock = BrokerClock()
        self._held = HeldMessages(self._io_deliver, self._broker_clock)
        self._init_timekeeping()
        # Deliveries the I/O thread has decoded but not yet handed over, per process: a
        # burst is handed over in groups, so a receiving thread wakes (and takes the GIL
        # from the I/O thread) once per group, not once per message.
        self._to_hand_over: dict[Process, list[Message]] = {}
        self._to_hand_over_count = 0

    # --- lifecycle --------------------------------------------------------------------

    def start(self, connect_timeout: float = 30.0) -> Node:
        """Connect to the broker and wait for its welcome."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 2000)
        if self.keys is not None:
            self.keys.make_client(sock)
        # Until the welcome, watch the handshake: a refusal is then an error that says
        # so, not a silent wait for the connect timeout.
        self._handshake_monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        sock.connect(self.broker)
        self._sock = sock
        self._send_frame = zmq.backend.Socket.send.__get__(sock)  # the C send: no per-frame enum handling
        self._io_thread = threading.Thread(target=self._io_loop, name=f"{self.name}-io", daemon=True)
        self._io_thread.start()
        deadline = time.monotonic() + connect_timeout
        next_hello = 0.0
        while not self._welcomed.wait(0.05):
            if self._refused is not None:
                self.close("refused by the broker")
                raise NodeError(f"the broker at {self.broker} refused node {self.name}: {self._refused}")
            if self.closed.is_set():
                raise NodeError(f"node {self.name} closed while connecting: {self.close_reason}")
            now = time.monotonic()
            if now > deadline:
                self.close("no broker")
                raise NodeError(f"no broker answered at {self.broker} within {connect_timeout:.0f}s")
            if now >= next_hello:  # the first may precede the connect
                self._send_ctl(BROKER_PID, {"op": "hello", "t": time.monotonic()})
                next_hello = now + 0.5
        return self

    def close(self, reason: str = "closed") -> None:
        """Stop the node: its processes' watchers elsewhere see ``noconnection``."""
        with self._state:
            if self.closed.is_set():
                return
            self.close_reason = reason
            self.closed.set()
        log.info("node %s closing: %s", self.name, reason)
        self._wake()
        if self._io_thread and self._io_thread is not threading.current_thread():
            self._io_thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._timers.close()
        if self.clock.virtual:
            self.clock.close()
        for callback in self.on_close:
            callback(reason)

    def wait(self, timeout: float | None = None) -> bool:
        return self.closed.wait(timeout)

    def whereis(self, name: str, timeout: float = 5.0) -> Pid | None:
        """The pid registered under ``name`` anywhere, or None."""
        local = self._names.get(name)
        if local is not None:
            return local.pid
        return self.call_broker({"op": "whereis", "name": name}, timeout)

    def broker_stats(self, per_link: bool = False, timeout: float = 5.0) -> dict:
        """The broker's traffic counters (bytes and messages per direction, drops)."""
        return self.call_broker({"op": "stats", "per_link": per_link}, timeout)

    def announce_round(self, round_: int, by: Pid | None = None) -> None:
        """Tell the broker's network which round starts (per-round drop-outs and
        round-scripted link changes key on it). Nothing comes back. ``by``: the process
        announcing it, whose messages around it keep their order in virtual time."""
        self._send_ctl(BROKER_PID, {"op": "round", "round": round_, "by": by})

    def start_clock(self) -> None:
        """Start the run's emulated time (virtual time: until now the clock stood at 0
        while real processes started up; wall time: nothing to do)."""
        if self.clock.virtual:
            self._send_ctl(BROKER_PID, {"op": "clock_start"})

    def set_links(self, clients: str | list[int], profile: str | None = None, offline: bool | None = None,
                  timeout: float = 5.0) -> None:
        """Change the emulated network now: give ``clients`` a named profile and/or
        force them offline (True) or back online (False). Raises with the broker's
        reason if the request is invalid."""
        error = self.call_broker({"op": "set_links", "clients": clients, "profile": profile, "offline": offline}, timeout)
        if error:
            raise NodeError(f"set_links refused: {error}")

    def call_broker(self, body: dict, timeout: float) -> Any:
        ref = next(self._refs)
        done = threading.Event()
        slot: list = []
        self._replies[ref] = (done, slot)
        self._send_ctl(BROKER_PID, {**body, "ref": ref})
        if not done.wait(timeout):
            self._replies.pop(ref, None)
            raise NodeError(f"broker did not answer {body['op']!r} within {timeout}s")
        return slot[0]

    def send(self, dst: Pid | str, body: Any) -> None:
        """Send from the node itself (pid id 0): for code outside any process, such as
        a signal handler asking the server to stop."""
        self._send(USER, Pid(self.name, 0), dst, body)

    def shutdown_all(self) -> None:
        """Ask the broker to stop every node of the run, and itself."""
        self._send_ctl(BROKER_PID, {"op": "shutdown"})

    # --- sending ----------------------------------------------------------------------------

    def _send(self, kind: int, src: Pid, dst: Pid | str, body: Any) -> None:
        if isinstance(dst, str):
            local = self._names.get(dst)
            if local is not None:
                dst = local.pid
        # In virtual time only a process's messages to itself stay in the node: between
        # two processes, even on one node, the broker orders what happens at an instant.
        # The node's own word (a signal handler's Stop) is a real-time event: it stays too.
        if isinstance(dst, Pid) and dst.node == self.name and (dst == src or src.id == 0 or not self.clock.virtual):
            # Local delivery still goes through the codec: a receiver never shares
            # mutable state with the sender, wherever it lives.
            frames = wire.encode(kind, src, dst, body)
            header, payload = wire.decode([bytes(f) for f in frames], self.max_message_bytes)
            self._deliver_local(src, dst.id, payload)
            return
        if self.closed.is_set():
            self.dropped["node-closed"] += 1
            return
        # The send time, in the broker's clock: where an emulated link's clock starts.
        offset = self._broker_clock.offset
        sent = time.monotonic() + offset if offset is not None and kind == USER and not self.clock.virtual else None
        self._outbox.append(wire.encode(kind, src, dst, body, sent))
        self._report_due = True
        self._wake()

    def _send_ctl(self, dst: Pid, body: dict) -> None:
        if self.closed.is_set() and body.get("op") != "bye":
            return
        self._outbox.append(wire.encode(CTL, Pid(self.name, 0), dst, body))
        if body.get("op") != "hb":  # the broker reads anything else as this node being busy
            self._report_due = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # pipe full: the I/O thread is awake anyway
            pass
        except OSError:
            pass

    def _pool_submit(self, fn: Callable[[], None]) -> None:
        try:
            self._pool.submit(fn)
        except RuntimeError:  # pool shut down: the node is closing
            pass

    # --- the I/O thread ----------------------------------------------------------------

    def _io_loop(self) -> None:
        sock = self._sock
        recv = sock.recv
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._handshake_monitor, zmq.POLLIN)
        watching = True
        quick_sync = QUICK_SYNC_BEATS
        held = self._held.heap
        last_heard = time.monotonic()
        next_beat = time.monotonic()
        try:
            while not self.closed.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    if self._welcomed.is_set():
                        if now - last_heard > self.heartbeat_timeout:
                            self._lose_broker(f"broker silent for {now - last_heard:.1f}s")
                            break
                        self._send_ctl(BROKER_PID, {"op": "hb", "t": now})
                    if quick_sync and self._welcomed.is_set():
                        quick_sync -= 1
                        next_beat = now + QUICK_SYNC_INTERVAL
                    else:
                        next_beat = now + self.heartbeat_interval
                wait = next_beat - now
                if held and held[0][2] - now < wait:
                    wait = held[0][2] - now
                if wait >= 0.001:
                    events = poller.poll(int(wait * 1000))  # whole ms: may wake early, never late
                else:
                    if wait > 0:
                        time.sleep(wait)  # the last fraction of a ms before a held message is due
                    events = poller.poll(0)
                ready = dict(events)
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                while self._outbox:
                    self._ship(self._outbox.popleft())
                if sock in ready:
                    for _ in range(10_000):
                        # Frame by frame with int flags, as the broker reads: recv_multipart's
                        # per-frame option and flag handling cost more than decoding.
                        try:
                            frame = recv(_NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        frames = [frame]
                        while frame.more:  # a multipart message arrives whole: the rest is here
                            frame = recv(0, copy=False)
                            frames.append(frame)
                        last_heard = time.monotonic()
                        self._on_frames(frames)
                        if held and held[0][2] <= last_heard:
                            self._held.release_due()  # a long burst must not make held messages late
                        if self._to_hand_over_count >= _HANDOVER_GROUP:
                            self._hand_over()
                if held:
                    self._held.release_due()
                self._hand_over()
                if self.clock.virtual:
                    while self._outbox:  # what fired timers sent, before saying we are idle
                        self._ship(self._outbox.popleft())
                    self._report_if_idle()
                if watching and (self._handshake_monitor in ready or self._welcomed.is_set()):
                    watching = self._watch_handshake(poller)
        except Exception:
            log.exception("I/O thread of %s failed", self.name)
            self._lose_broker("I/O thread failed")
        finally:
            if self._welcomed.is_set():
                try:
                    # What was sent before close() still goes out (the loop may have seen
                    # `closed` before its last flush), then the goodbye.
                    while self._outbox:
                        self._ship(self._outbox.popleft())
                    sock.send_multipart(wire.encode(CTL, Pid(self.name, 0), BROKER_PID, {"op": "bye"}))
                except zmq.ZMQError:
                    pass
            if watching:
                sock.disable_monitor()
                self._handshake_monitor.close(linger=0)
            sock.close(linger=500)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _ship(self, frames: list) -> None:
        """Send one message's frames (I/O thread only), frame by frame with int flags as
        the broker does: small frames are copied, cheaper than tracking them; arrays go
        zero-copy (the sender must not change an array it sent)."""
        send = self._send_frame
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            send(frame, _SNDMORE if i < last else 0, copy=len(frame) < zmq.COPY_THRESHOLD)

    def _watch_handshake(self, poller: zmq.Poller) -> bool:
        """Note a refused handshake for :meth:`start`; once welcomed, stop watching.
        Returns whether to keep watching."""
        for kind, value in pending_monitor_events(self._handshake_monitor):
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                detail = f"ZAP status {value}"
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                detail = PROTOCOL_ERRORS.get(value, f"protocol error {value}")
            elif self._refused is None:  # no detail: often the broker closing on us
                detail = zmq.strerror(value) if value else "no detail"
            else:
                continue  # keep the more telling reason already noted
            # Which side lacks what is a guess from this side's keys; the detail says what zmq saw.
            self._refused = (f"the handshake failed ({detail}): "
                             + ("this node has no run keys; the broker requires them" if self.keys is None
                                else "this node's keys are not the run's, or the broker runs without keys"))
        if not self._welcomed.is_set():
            return True
        poller.unregister(self._handshake_monitor)
        self._sock.disable_monitor()
        self._handshake_monitor.close(linger=0)
        return False

    def _lose_broker(self, reason: str) -> None:
        log.error("node %s lost the broker: %s", self.name, reason)
        self.broker_lost = reason  # set before the DOWNs: a watcher can tell them from its peers' faults
        self._hand_over()  # what arrived before the loss is delivered before the DOWNs
        self._fire_noconnection(None)
        threading.Thread(target=self.close, args=(f"noconnection: {reason}",), daemon=True).start()

    def _on_frames(self, frames: list) -> None:
        try:
            header, body = wire.decode(frames, self.max_message_bytes)
        except WireError as exc:
            self._drop("malformed", str(exc))
            return
        if header.kind == USER:
            dst = header.dst
            if isinstance(dst, str):
                proc = self._names.get(dst)
                if proc is None:
                    self._drop("unknown-destination", f"no local process named {dst!r}")
                    return
                dst = proc.pid.id
            if type(header.timing) is Hold or self._held.pairs:
                self._held.arrive(header.src, dst, body, header.timing)
            else:
                self._io_deliver(header.src, dst, body)
            if self.clock.virtual:
                self._count_work(in_batch=True)
        else:
            self._hand_over()  # what came before a control message (a DOWN) is delivered before it
            try:
                control.check(body, control.NODE, from_broker=header.src.node == BROKER_NODE)
            except control.ControlError as exc:
                self._drop("spoofed" if "from the broker only" in str(exc) else "malformed",
                           f"{exc} (from {header.src})")
                return
            try:
                self._control(header, body)
            except Exception as exc:  # whatever a peer sends, the I/O thread lives on
                self._drop("malformed", f"control message {body!r}: {type(exc).__name__}: {exc}")
            if self.clock.virtual and body["op"] in WORK_OPS:
                self._count_work(in_batch=body["op"] in RELAYED_OPS)

    def _drop_offline(self, links: Any, at: Any) -> None:
        """The broker's notice that ``links`` went offline at ``at``: drop what is held
        for them, and report it back for the books."""
        counts = self._held.drop_offline(links, at)
        if not counts:
            return
        log.info("node %s dropped %d held message(s) of clients gone offline", self.name, sum(counts.values()))
        self._send_ctl(BROKER_PID, {"op": "held_dropped",
                                    "counts": [[link, d, n] for (link, d), n in sorted(counts.items())]})

    def _link_changes(self, offline: Any, online: Any) -> None:
        """The broker's word that the links of these local processes went offline or
        came back: their flags change at once (a running handler sees them), and a
        behaviour hears of it in mailbox order."""
        for ids, state in ((offline, True), (online, False)):
            if not (isinstance(ids, list) and all(type(i) is int for i in ids)):
                raise ValueError("availability needs lists of local process ids")
            for i in ids:
                proc = self._procs.get(i)
                if proc is None or proc.offline == state:
                    continue
                proc.offline = state
                if state:
                    proc.offline_count += 1
                if isinstance(proc, BehaviourProcess):
                    proc._deliver(Message(BROKER_PID, LinkChange(state)))

    def _deliver_local(self, sender: Pid, dst_id: int, body: Any) -> None:
        proc = self._procs.get(dst_id)
        if proc is None or not proc.alive:
            self.dropped["dead-destination"] += 1  # Erlang: a send to a dead pid is a no-op
            return
        proc._deliver(Message(sender, body))

    def _io_deliver(self, sender: Pid, dst_id: int, body: Any) -> None:
        """The I/O thread's delivery: queued for :meth:`_hand_over`, in order."""
        proc = self._procs.get(dst_id)
        if proc is None or not proc.alive:
            self.dropped["dead-destination"] += 1
            return
        msgs = self._to_hand_over.get(proc)
        if msgs is None:
            self._to_hand_over[proc] = [Message(sender, body)]
        else:
            msgs.append(Message(sender, body))
        self._to_hand_over_count += 1

    def _hand_over(self) -> None:
        if self._to_hand_over_count:
            groups, self._to_hand_over, self._to_hand_over_count = self._to_hand_over, {}, 0
            for proc, msgs in groups.items():
                proc._deliver_many(msgs)

    def _control(self, header: wire.Header, body: dict) -> None:
        op = body["op"]
        if op == "hb":
            self._broker_clock.sample(body)
            return
        if op == "welcome":
            self._broker_clock.sample(body)
            self._set_clock(body.get("clock", "wall"), body.get("time_scale", 1.0))
            self._welcomed.set()
        elif op == "advance":
            # Virtual time: the clock is at `now`; the broker's notices for this instant
            # apply first, `count` deliveries of it follow, then this node's timers due
            # by now fire (one message, so nothing runs at the new instant before it is set).
            now, count, notices = body.get("now"), body.get("count"), body.get("notices", [])
            if type(now) is not float or type(count) is not int or count < 0 or not isinstance(notices, list):
                raise ValueError("advance needs a time, a count and a list of notices")
            self.clock.advance(now)
            for notice in notices:
                if not isinstance(notice, dict) or notice.get("op") not in ("availability", "offline", "node_down"):
                    raise ValueError(f"advance carries an unknown notice {notice!r}")
                self._control(header, notice)
            self._start_batch(count)
        elif op == "stalled":
            if self.clock.virtual:
                self.clock.advance(float(body.get("now", 0.0)))
            for proc in self.processes():
                if isinstance(proc, ThreadProcess):
                    proc._offer(Message(BROKER_PID, Stalled(float(body.get("now", 0.0)))))
        elif op == "reply":
            waiter = self._replies.pop(body["ref"], None)
            if waiter is not None:
                waiter[1].append(body["value"])
                waiter[0].set()
        elif op == "monitor":
            self._remote_monitor(header.src.node, body["watcher"], body["target"], body["ref"])
        elif op == "demonitor":
            self._remote_demonitor(body["target"], body["ref"])
        elif op == "down":
            self._remote_down(body["down"])
        elif op == "offline":
            self._drop_offline(body.get("links"), body.get("at"))
        elif op == "availability":
            self._link_changes(body.get("offline"), body.get("online"))
        elif op == "node_down":
            log.warning("node %s reports node %s down", self.name, body["node"])
            self._fire_noconnection(body["node"])
        elif op == "register_failed":
            log.error("registering %r failed: held by %s", body["name"], body["holder"])
        elif op == "shutdown":
            threading.Thread(target=self.close, args=("shutdown",), daemon=True).start()
        elif op == "unknown_node":
            # The broker declared this node lost: everyone has seen our processes as
            # DOWN, so living on would break the semantics the others rely on.
            self._lose_broker("the broker no longer knows this node")

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] <= 20 or self.dropped[reason] % 1000 == 0:
            log.warning("node %s dropped a message (%s): %s", self.name, reason, detail)


__all__ = [
    "Behaviour", "BehaviourProcess", "Down", "Message", "Node", "NodeError", "Pid",
    "Process", "Stalled", "ThreadProcess", "TIMEOUT", "BROKER_NODE",
]
