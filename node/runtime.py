"""Erlang-style processes inside a node, talking to other nodes through the broker.

A :class:`Node` is one OS process. It owns one DEALER socket to the broker, served by
a dedicated I/O thread that also sends heartbeats, so socket I/O and liveness never
wait behind a process that trains for minutes.

Two kinds of processes live in a node, both with a pid, a mailbox and monitors:

* **thread processes** (:meth:`Node.spawn`): a function running in its own thread
  that may block in a selective :meth:`ThreadProcess.receive` — for long-lived
  coordinators such as the server;
* **behaviour processes** (:meth:`Node.spawn_behaviour`): an object whose
  :meth:`Behaviour.handle` runs on the node's small worker pool, one message at a
  time — an idle one costs only its state, so a node can host thousands of emulated
  clients without thousands of threads.

Semantics (as Erlang's): ``send`` never blocks; delivery between one pair of
processes is FIFO; ``monitor`` delivers exactly one :class:`Down` per monitor, with
reason ``normal``, ``crash: <error>``, ``noproc`` (no such process) or
``noconnection`` (its node was lost).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import zmq

from . import wire
from .broker import BROKER_NODE, BROKER_PID
from .wire import CTL, USER, Pid, WireError, message

log = logging.getLogger("fedemu.node")


class NodeError(RuntimeError):
    """The node cannot do what was asked (no broker, node closed, ...)."""


class _Timeout:
    def __repr__(self) -> str:
        return "TIMEOUT"

    def __bool__(self) -> bool:
        return False


TIMEOUT = _Timeout()
"""Returned by :meth:`ThreadProcess.receive` when nothing matched in time (falsy)."""


@message
class Down:
    """Sent to a watcher when a monitored process ends, exactly once per monitor."""

    ref: int
    pid: Pid
    reason: str


class Message(NamedTuple):
    sender: Pid
    body: Any


Match = Callable[[Any], bool] | type | tuple | None


def _matcher(match: Match) -> Callable[[Any], bool]:
    if match is None:
        return lambda body: True
    if isinstance(match, (type, tuple)):
        return lambda body: isinstance(body, match)
    return match


class Process:
    """What every process can do. Subclasses decide how messages are consumed."""

    def __init__(self, node: Node, pid: Pid) -> None:
        self.node = node
        self.pid = pid
        self.names: list[str] = []
        self._mailbox: collections.deque[Message] = collections.deque()
        self._lock = threading.Lock()
        self.alive = True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pid}{' ' + self.names[0] if self.names else ''})"

    # --- the process API ----------------------------------------------------------

    def send(self, dst: Pid | str, body: Any) -> None:
        """Send ``body`` to a pid or a registered name. Never blocks; may be lost
        (as in Erlang) if the destination does not exist."""
        self.node._send(USER, self.pid, dst, body)

    def monitor(self, target: Pid) -> int:
        """Watch ``target``; exactly one :class:`Down` with this ref will arrive."""
        return self.node._monitor(self.pid, target)

    def demonitor(self, ref: int) -> None:
        self.node._demonitor(ref)

    def register(self, name: str, link: int | None = None) -> None:
        """Register a global name; ``link`` marks this process as the owner of an
        emulated link (a client), so the broker accounts its traffic per link."""
        self.node.register(name, self.pid, link)

    def whereis(self, name: str, timeout: float = 5.0) -> Pid | None:
        return self.node.whereis(name, timeout)

    def spawn(self, fn: Callable, *args: Any, name: str | None = None) -> Pid:
        return self.node.spawn(fn, *args, name=name)

    def send_after(self, delay: float, dst: Pid | str, body: Any) -> None:
        """Send ``body`` after ``delay`` wall seconds, without blocking this process
        (Erlang's send_after): how a client emulates a slower device."""
        if delay <= 0:
            self.send(dst, body)
            return
        timer = threading.Timer(delay, self.node._send, args=(USER, self.pid, dst, body))
        timer.daemon = True
        timer.start()

    # --- runtime side ---------------------------------------------------------------

    def _deliver(self, msg: Message) -> None:
        raise NotImplementedError


class ThreadProcess(Process):
    def __init__(self, node: Node, pid: Pid) -> None:
        super().__init__(node, pid)
        self._arrived = threading.Condition(self._lock)

    def receive(self, match: Match = None, timeout: float | None = None) -> Message | _Timeout:
        """Selective receive: remove and return the first queued message whose body
        matches (a predicate, a type or a tuple of types); leave the others queued.
        Returns :data:`TIMEOUT` if nothing matches within ``timeout`` seconds."""
        accept = _matcher(match)
        deadline = None if timeout is None else time.monotonic() + timeout
        scanned = 0  # messages already rejected need no second look
        with self._arrived:
            while True:
                box = self._mailbox
                for i in range(scanned, len(box)):
                    if accept(box[i].body):
                        msg = box[i]
                        del box[i]
                        return msg
                scanned = len(box)
                if deadline is None:
                    self._arrived.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return TIMEOUT
                    self._arrived.wait(remaining)

    def _deliver(self, msg: Message) -> None:
        with self._arrived:
            self._mailbox.append(msg)
            self._arrived.notify()


class Behaviour:
    """Callbacks of a behaviour process; ``handle`` runs on the node's worker pool.

    Raise to crash the process (watchers get ``Down`` with the error); call
    ``proc.stop()`` to end it normally.
    """

    def started(self, proc: BehaviourProcess) -> None:
        pass

    def handle(self, proc: BehaviourProcess, msg: Message) -> None:
        raise NotImplementedError

    def stopped(self, proc: BehaviourProcess, reason: str) -> None:
        pass


class BehaviourProcess(Process):
    # Messages handled per pool turn before yielding to other processes.
    _BATCH = 16

    def __init__(self, node: Node, pid: Pid, behaviour: Behaviour) -> None:
        super().__init__(node, pid)
        self.behaviour = behaviour
        self._scheduled = False
        self._stop_reason: str | None = None

    def stop(self, reason: str = "normal") -> None:
        self._stop_reason = reason

    def _deliver(self, msg: Message) -> None:
        with self._lock:
            self._mailbox.append(msg)
            if self._scheduled:
                return
            self._scheduled = True
        self.node._pool_submit(self._run)

    def _run(self) -> None:
        for _ in range(self._BATCH):
            with self._lock:
                if not self._mailbox or not self.alive:
                    self._scheduled = False
                    return
                msg = self._mailbox.popleft()
            try:
                self.behaviour.handle(self, msg)
            except Exception as exc:
                self.node._exit(self, _crash_reason(exc))
                return
            if self._stop_reason is not None:
                self.node._exit(self, self._stop_reason)
                return
        self.node._pool_submit(self._run)  # more queued: requeue behind other processes


def _crash_reason(exc: BaseException) -> str:
    log.error("process crashed:\n%s", "".join(traceback.format_exception(exc)))
    return f"crash: {type(exc).__name__}: {exc}"


class Node:
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
    ) -> None:
        if not name or name.startswith("$") or "/" in name:
            raise ValueError(f"bad node name {name!r}")
        self.name = name
        self.broker = broker
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self._ids = itertools.count(1)  # id 0 is the node itself
        self._refs = itertools.count(1)
        self._procs: dict[int, Process] = {}
        self._names: dict[str, Process] = {}
        self._monitors: dict[int, list[tuple[int, Pid]]] = {}  # local target id -> (ref, watcher)
        self._out_monitors: dict[int, tuple[Pid, Pid]] = {}  # ref -> (watcher, remote target)
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._state = threading.RLock()
        self._outbox: collections.deque[list] = collections.deque()
        self._pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix=f"{name}-pool")
        self._ctx = zmq.Context()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._welcomed = threading.Event()
        self.closed = threading.Event()
        self.close_reason: str | None = None
        self._io_thread: threading.Thread | None = None
        self.on_close: list[Callable[[str], None]] = []
        self.dropped: collections.Counter[str] = collections.Counter()

    # --- lifecycle --------------------------------------------------------------------

    def start(self, connect_timeout: float = 30.0) -> Node:
        """Connect to the broker and wait for its welcome."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.name.encode())
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.broker)
        self._sock = sock
        self._io_thread = threading.Thread(target=self._io_loop, name=f"{self.name}-io", daemon=True)
        self._io_thread.start()
        deadline = time.monotonic() + connect_timeout
        while not self._welcomed.wait(0.5):
            if self.closed.is_set():
                raise NodeError(f"node {self.name} closed while connecting: {self.close_reason}")
            if time.monotonic() > deadline:
                self.close("no broker")
                raise NodeError(f"no broker answered at {self.broker} within {connect_timeout:.0f}s")
            self._send_ctl(BROKER_PID, {"op": "hello"})  # the first may precede the connect
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
        for callback in self.on_close:
            callback(reason)

    def wait(self, timeout: float | None = None) -> bool:
        return self.closed.wait(timeout)

    # --- processes --------------------------------------------------------------------

    def spawn(self, fn: Callable, *args: Any, name: str | None = None, link: int | None = None) -> Pid:
        """Run ``fn(proc, *args)`` in a thread process; it ends when ``fn`` returns
        (reason ``normal``) or raises (reason ``crash: ...``)."""
        proc = ThreadProcess(self, Pid(self.name, next(self._ids)))
        self._add(proc, name, link)

        def run() -> None:
            reason = "normal"
            try:
                fn(proc, *args)
            except Exception as exc:
                reason = _crash_reason(exc)
            self._exit(proc, reason)

        threading.Thread(target=run, name=f"{self.name}-{proc.pid.id}", daemon=True).start()
        return proc.pid

    def spawn_behaviour(self, behaviour: Behaviour, name: str | None = None, link: int | None = None) -> Pid:
        proc = BehaviourProcess(self, Pid(self.name, next(self._ids)), behaviour)
        self._add(proc, name, link)
        try:
            behaviour.started(proc)
        except Exception as exc:
            self._exit(proc, _crash_reason(exc))
        return proc.pid

    def _add(self, proc: Process, name: str | None, link: int | None) -> None:
        self._check_open()
        with self._state:
            self._procs[proc.pid.id] = proc
        if name is not None:
            self.register(name, proc.pid, link)

    def register(self, name: str, pid: Pid, link: int | None = None) -> None:
        self.register_many([(name, pid, link)])

    def register_many(self, entries: list[tuple[str, Pid, int | None]]) -> None:
        """Register global names in one message to the broker (thousands of clients)."""
        with self._state:
            for name, pid, _ in entries:
                proc = self._procs.get(pid.id)
                if proc is None or pid.node != self.name:
                    raise NodeError(f"cannot register {name!r}: {pid} is not a live local process")
                if name in self._names and self._names[name] is not proc:
                    raise NodeError(f"name {name!r} is already registered on {self.name}")
                self._names[name] = proc
                proc.names.append(name)
        self._send_ctl(BROKER_PID, {"op": "register", "entries": [list(e) for e in entries]})

    def whereis(self, name: str, timeout: float = 5.0) -> Pid | None:
        """The pid registered under ``name`` anywhere, or None."""
        local = self._names.get(name)
        if local is not None:
            return local.pid
        return self.call_broker({"op": "whereis", "name": name}, timeout)

    def broker_stats(self, per_link: bool = False, timeout: float = 5.0) -> dict:
        """The broker's traffic counters (bytes and messages per direction, drops)."""
        return self.call_broker({"op": "stats", "per_link": per_link}, timeout)

    def announce_round(self, round_: int) -> None:
        """Tell the broker's network which round starts (per-round drop-outs and
        round-scripted link changes key on it). Nothing comes back."""
        self._send_ctl(BROKER_PID, {"op": "round", "round": round_})

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

    def processes(self) -> list[Process]:
        with self._state:
            return list(self._procs.values())

    def shutdown_all(self) -> None:
        """Ask the broker to stop every node of the run, and itself."""
        self._send_ctl(BROKER_PID, {"op": "shutdown"})

    # --- exits and monitors -------------------------------------------------------------

    def _exit(self, proc: Process, reason: str) -> None:
        with self._state:
            if not proc.alive:
                return
            proc.alive = False
            self._procs.pop(proc.pid.id, None)
            for name in proc.names:
                self._names.pop(name, None)
            watchers = self._monitors.pop(proc.pid.id, [])
        if proc.names and not self.closed.is_set():
            self._send_ctl(BROKER_PID, {"op": "unregister", "names": proc.names})
        if isinstance(proc, BehaviourProcess):
            try:
                proc.behaviour.stopped(proc, reason)
            except Exception:
                log.exception("stopped() of %s raised", proc)
        log.debug("%s exited: %s", proc, reason)
        for ref, watcher in watchers:
            self._send_down(watcher, Down(ref, proc.pid, reason))

    def _send_down(self, watcher: Pid, down: Down) -> None:
        if watcher.node == self.name:
            self._deliver_local(down.pid, watcher.id, down)
        else:
            self._send_ctl(Pid(watcher.node, 0), {"op": "down", "down": down, "watcher": watcher})

    def _monitor(self, watcher: Pid, target: Pid) -> int:
        if not isinstance(target, Pid):
            raise TypeError(f"monitor needs a Pid, not {target!r}; resolve names with whereis()")
        ref = next(self._refs)
        if target.node == self.name:
            with self._state:
                if target.id in self._procs:
                    self._monitors.setdefault(target.id, []).append((ref, watcher))
                    return ref
            self._send_down(watcher, Down(ref, target, "noproc"))
            return ref
        with self._state:
            if self.closed.is_set():
                dead = True
            else:
                dead = False
                self._out_monitors[ref] = (watcher, target)
        if dead:
            self._send_down(watcher, Down(ref, target, "noconnection"))
        else:
            self._send_ctl(Pid(target.node, 0), {"op": "monitor", "ref": ref, "watcher": watcher, "target": target.id})
        return ref

    def _demonitor(self, ref: int) -> None:
        with self._state:
            entry = self._out_monitors.pop(ref, None)
            if entry is None:
                for watchers in self._monitors.values():
                    watchers[:] = [w for w in watchers if w[0] != ref]
                return
        watcher, target = entry
        self._send_ctl(Pid(target.node, 0), {"op": "demonitor", "ref": ref, "target": target.id})

    def _fire_noconnection(self, node: str | None) -> None:
        """Resolve every monitor on processes of ``node`` (None: of every remote node)."""
        with self._state:
            lost = [(ref, w, t) for ref, (w, t) in self._out_monitors.items() if node is None or t.node == node]
            for ref, _, _ in lost:
                del self._out_monitors[ref]
            if node is not None:
                for watchers in self._monitors.values():
                    watchers[:] = [w for w in watchers if w[1].node != node]
        for ref, watcher, target in lost:
            self._deliver_local(target, watcher.id, Down(ref, target, "noconnection"))

    # --- sending ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed.is_set():
            raise NodeError(f"node {self.name} is closed ({self.close_reason})")

    def _send(self, kind: int, src: Pid, dst: Pid | str, body: Any) -> None:
        if isinstance(dst, str):
            local = self._names.get(dst)
            if local is not None:
                dst = local.pid
        frames = wire.encode(kind, src, dst, body)
        if isinstance(dst, Pid) and dst.node == self.name:
            # Local delivery still goes through the codec: a receiver never shares
            # mutable state with the sender, wherever it lives.
            header, payload = wire.decode([bytes(f) for f in frames], self.max_message_bytes)
            self._deliver_local(src, dst.id, payload)
            return
        if self.closed.is_set():
            self.dropped["node-closed"] += 1
            return
        self._outbox.append(frames)
        self._wake()

    def _send_ctl(self, dst: Pid, body: dict) -> None:
        if self.closed.is_set() and body.get("op") != "bye":
            return
        self._outbox.append(wire.encode(CTL, Pid(self.name, 0), dst, body))
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
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
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
                        self._send_ctl(BROKER_PID, {"op": "hb"})
                    next_beat = now + self.heartbeat_interval
                ready = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                while self._outbox:
                    sock.send_multipart(self._outbox.popleft(), copy=False)
                if sock in ready:
                    for _ in range(10_000):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        last_heard = time.monotonic()
                        self._on_frames(frames)
        except Exception:
            log.exception("I/O thread of %s failed", self.name)
            self._lose_broker("I/O thread failed")
        finally:
            if self._welcomed.is_set():
                try:
                    sock.send_multipart(wire.encode(CTL, Pid(self.name, 0), BROKER_PID, {"op": "bye"}))
                except zmq.ZMQError:
                    pass
            sock.close(linger=500)
            self._ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _lose_broker(self, reason: str) -> None:
        log.error("node %s lost the broker: %s", self.name, reason)
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
            self._deliver_local(header.src, dst, body)
        else:
            try:
                self._control(header, body)
            except (KeyError, TypeError, ValueError) as exc:
                self._drop("malformed", f"control message {body!r}: {exc}")

    def _deliver_local(self, sender: Pid, dst_id: int, body: Any) -> None:
        proc = self._procs.get(dst_id)
        if proc is None or not proc.alive:
            self.dropped["dead-destination"] += 1  # Erlang: a send to a dead pid is a no-op
            return
        proc._deliver(Message(sender, body))

    def _control(self, header: wire.Header, body: dict) -> None:
        op = body["op"]
        if op == "hb":
            return
        if op == "welcome":
            self._welcomed.set()
        elif op == "reply":
            waiter = self._replies.pop(body["ref"], None)
            if waiter is not None:
                waiter[1].append(body["value"])
                waiter[0].set()
        elif op == "monitor":
            watcher, target_id = body["watcher"], body["target"]
            with self._state:
                alive = target_id in self._procs
                if alive:
                    self._monitors.setdefault(target_id, []).append((body["ref"], watcher))
            if not alive:
                self._send_down(watcher, Down(body["ref"], Pid(self.name, target_id), "noproc"))
        elif op == "demonitor":
            with self._state:
                watchers = self._monitors.get(body["target"], [])
                watchers[:] = [w for w in watchers if w[0] != body["ref"]]
        elif op == "down":
            down: Down = body["down"]
            with self._state:
                entry = self._out_monitors.pop(down.ref, None)
            if entry is not None:  # absent: already resolved (exactly one Down)
                self._deliver_local(down.pid, entry[0].id, down)
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
        else:
            self._drop("malformed", f"unknown control op {op!r}")

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] <= 20 or self.dropped[reason] % 1000 == 0:
            log.warning("node %s dropped a message (%s): %s", self.name, reason, detail)


__all__ = [
    "Behaviour", "BehaviourProcess", "Down", "Message", "Node", "NodeError", "Pid",
    "Process", "ThreadProcess", "TIMEOUT", "BROKER_NODE",
]
