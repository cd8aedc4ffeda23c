"""Moving messages between a node's processes and the broker: the send path, the I/O
thread that alone touches the socket, and handing what it decodes to the mailboxes.

The node owns one DEALER socket to the broker, served by a dedicated I/O thread that
also sends heartbeats, so socket I/O and liveness never wait behind a process that
trains for minutes. Senders queue encoded frames and wake the thread through a pipe;
the thread decodes every message once, checked by :func:`wire.decode` (and a control
message by :func:`control.check`), and hands deliveries over in groups.

Apart from the node (runtime.py) because this is the part that knows the socket and
runs the I/O thread's loop; what a control message means is node_control.py's, when a
held message is due is holding.py's.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any

import zmq

from .. import control, wire
from ..control import RELAYED_OPS, WORK_OPS
from .process import Message, Process
from ..security import PROTOCOL_ERRORS, pending_monitor_events
from ..wire import BROKER_NODE, BROKER_PID, CTL, MANY, USER, Hold, Pid, WireError

log = logging.getLogger("fedemu.node")

# The welcome's round trip includes the TCP connect (and CURVE handshake): a few quick
# heartbeats right after it give a good clock offset before the first message.
QUICK_SYNC_BEATS, QUICK_SYNC_INTERVAL = 5, 0.01
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

# Messages the I/O thread decodes before handing them over: small enough that the first
# of a burst is not held back long (a 1 KB message decodes in ~20 µs: bench/wire_codec.py).
_HANDOVER_GROUP = 16


def _relayed(frames: list) -> bool:
    """Whether a message this node could not decode was a user or control message the
    broker relayed from a node: in virtual time the broker counted it as a delivery
    (it relays only messages whose header it checked; its own messages decode)."""
    try:
        header = wire.unpack_header(bytes(frames[0]))
    except (WireError, IndexError):
        return False
    return header.kind in (USER, CTL) and header.src.node != BROKER_NODE


class Transport:
    """Node's socket, I/O thread and send path (a mixin of :class:`~fedemu.node.runtime.Node`)."""

    def _init_transport(self) -> None:
        self._outbox: collections.deque[list] = collections.deque()
        self._ctx = zmq.Context()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._io_thread: threading.Thread | None = None
        self.dropped: collections.Counter[str] = collections.Counter()
        self._refused: str | None = None  # why the broker refused the handshake
        # Deliveries the I/O thread has decoded but not yet handed over, per process: a
        # burst is handed over in groups, so a receiving thread wakes (and takes the GIL
        # from the I/O thread) once per group, not once per message.
        self._to_hand_over: dict[Process, list[Message]] = {}
        self._to_hand_over_count = 0
        # Virtual time: bodies of messages to many, by the broker's stash id: [sender,
        # fanout, releases still to come].
        self._stashes: dict[int, list] = {}

    def _connect(self) -> None:
        """Open the socket to the broker and start the I/O thread."""
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
        # The send time, in the broker's clock: where an emulated link's clock starts (wall clock runs only).
        offset = self._broker_clock.offset
        wall_link = offset is not None and kind == USER and not self.clock.virtual
        sent = time.monotonic() + offset if wall_link else None  # wall
        self._outbox.append(wire.encode(kind, src, dst, body, sent))
        self._report_due = True
        self._wake()

    def _send_many(self, src: Pid, dsts: list[Pid], body: Any) -> None:
        """``body`` to each of ``dsts``: one message per node they live on, so a model
        sent to a thousand clients crosses the broker once per worker node; the broker
        still charges each receiver's link as if it had been sent alone."""
        groups: dict[str, list[int]] = {}
        for dst in dsts:
            if not isinstance(dst, Pid):
                raise TypeError(f"send_many needs pids, not {dst!r}")
            groups.setdefault(dst.node, []).append(dst.id)
        for node, ids in groups.items():
            if len(ids) == 1 or (node == self.name and (src.id == 0 or not self.clock.virtual)):
                for i in ids:  # what stays local (see _send), or a message like any other
                    self._send(USER, src, Pid(node, i), body)
                continue
            if self.closed.is_set():
                self.dropped["node-closed"] += len(ids)
                continue
            offset = self._broker_clock.offset
            sent = time.monotonic() + offset if offset is not None and not self.clock.virtual else None  # wall
            self._outbox.append(wire.encode_many(src, node, ids, body, sent))
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
        last_heard = time.monotonic()  # wall
        next_beat = time.monotonic()  # wall
        try:
            while not self.closed.is_set():
                now = time.monotonic()  # wall
                if now >= next_beat:
                    if self._welcomed.is_set():
                        # Frames waiting unread mean this thread was busy, not the broker silent.
                        if now - last_heard > self.heartbeat_timeout and not sock.get(zmq.EVENTS) & zmq.POLLIN:
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
                        time.sleep(wait)  # wall: the last fraction of a ms before a held message is due
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
                            frame = recv(wire.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        frames = [frame]
                        while frame.more:  # a multipart message arrives whole: the rest is here
                            frame = recv(0, copy=False)
                            frames.append(frame)
                        last_heard = time.monotonic()  # wall
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
        except Exception as exc:
            try:
                log.exception("I/O thread of %s failed", self.name)
                self.failure = f"its I/O thread failed: {type(exc).__name__}: {exc}"
                self._lose_broker(self.failure)
            except BaseException as again:  # not even that (no memory): nothing would close the node
                self._fail("after its I/O thread failed", again)
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
            send(frame, wire.SNDMORE if i < last else 0, copy=len(frame) < zmq.COPY_THRESHOLD)

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
        try:
            threading.Thread(target=self.close, args=(f"noconnection: {reason}",), daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: the node could not even close
            self._fail(f"closing after it lost the broker ({reason})", exc)

    def _on_frames(self, frames: list) -> None:
        try:
            header, body = wire.decode(frames, self.max_message_bytes)
        except WireError as exc:
            self._drop("oversize" if isinstance(exc, wire.OversizeError) else "malformed", str(exc))
            if self.clock.virtual and _relayed(frames):
                self._count_work(in_batch=True)  # dropped, but taken in: the broker counted it
            return
        if header.kind == MANY:
            try:
                self._on_many(header, body)
            except WireError as exc:
                self._drop("malformed", f"message to many from {header.src}: {exc}")
        elif header.kind == USER:
            try:
                self._on_user(header, body)
            finally:  # delivered or dropped, a delivery of the instant (virtual time's books)
                if self.clock.virtual:
                    self._count_work(in_batch=True)
        else:
            self._hand_over()  # what came before a control message (a DOWN) is delivered before it
            relayed = header.src.node != BROKER_NODE
            op = body.get("op") if isinstance(body, dict) else None
            try:
                control.check(body, control.NODE, from_broker=not relayed)
                self._control(header, body)
            except control.ControlError as exc:
                self._drop("spoofed" if isinstance(exc, control.NotEntitled) else "malformed",
                           f"{exc} (from {header.src})")
            except Exception as exc:  # whatever a peer sends, the I/O thread lives on
                self._drop("malformed", f"control message {body!r}: {type(exc).__name__}: {exc}")
            finally:
                # Virtual time's books: the broker counted every control message it relayed
                # from a node (a delivery of the instant) and its own work ops, whatever
                # became of them here.
                if self.clock.virtual and (relayed or op in WORK_OPS):
                    self._count_work(in_batch=relayed or op in RELAYED_OPS)

    def _on_user(self, header: wire.Header, body: Any) -> None:
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

    def _on_many(self, header: wire.Header, fanout: wire.Fanout) -> None:
        """A message to many from the broker. In wall time, each recipient's copy with
        its hold (``holds``: [id, hold, link, direction], link -1 when no emulated link
        delays it). In virtual time the body comes first (``stash``, with how many
        ``release`` notes will refer to it) and each recipient's note comes at its
        instant, as a delivery of that instant."""
        note = fanout.recipients
        if not isinstance(note, dict):
            raise WireError(f"recipients record {note!r} is not a map")
        if "holds" in note:
            at, to = note.get("at"), note["holds"]
            if type(at) is not float or type(to) is not list:
                raise WireError("a fan-out needs a time and a list of recipients")
            for entry in to:
                if not (type(entry) is list and len(entry) == 4 and type(entry[0]) is int
                        and type(entry[1]) is float and type(entry[2]) is int and entry[3] in (-1, 0, 1)):
                    raise WireError(f"bad recipient {entry!r}")
                dst, hold, link, direction = entry
                timing = Hold(hold, at, link, direction) if link >= 0 else None
                body = fanout.body()
                if type(timing) is Hold or self._held.pairs:
                    self._held.arrive(header.src, dst, body, timing)
                else:
                    self._io_deliver(header.src, dst, body)
        elif "stash" in note:
            sid, count = note["stash"], note.get("count")
            if type(sid) is not int or type(count) is not int or count < 1 or not fanout.frames:
                raise WireError("a stash needs an id, a count and a body")
            self._stashes[sid] = [header.src, fanout, count]
        elif "release" in note:
            try:
                sid, dst = note["release"], note.get("to")
                stash = self._stashes.get(sid)
                if stash is None or type(dst) is not int:
                    raise WireError(f"release of unknown stash {sid!r} (or no recipient)")
                stash[2] -= 1
                if stash[2] == 0:
                    del self._stashes[sid]
                if not note.get("void"):  # void: lost on the way (its link went offline)
                    self._io_deliver(stash[0], dst, stash[1].body())
            finally:  # a delivery of the instant, whatever became of it: the broker counted it
                self._count_work(in_batch=True)
        else:
            raise WireError(f"recipients record with keys {sorted(note)!r}")

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

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] <= 20 or self.dropped[reason] % 1000 == 0:
            log.warning("node %s dropped a message (%s): %s", self.name, reason, detail)
