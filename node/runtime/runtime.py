"""Erlang-style processes inside a node, talking to other nodes through the broker.

A :class:`Node` is one OS process hosting many processes (process.py), connected to
the broker by one socket that its own I/O thread serves.

Semantics (as Erlang's): ``send`` never blocks; delivery between one pair of
processes is FIFO; ``monitor`` delivers exactly one :class:`Down` per monitor, with
reason ``normal``, ``crash: <error>``, ``noproc`` (no such process) or
``noconnection`` (its node was lost).

A node's jobs each have a module; :class:`Node` is made of them:

* transport.py: the socket, the I/O thread and the send path;
* node_control.py: what each control op from the broker or a peer does;
* table.py: the process table: spawning, names, exits and monitors;
* timekeeping.py: the run's clock, timers, and virtual time's busy/idle books;
* holding.py: messages held until due (where link emulation ends) and the estimate
  of the broker's clock, as objects the node owns.

The first four are mixins rather than objects because they share the node's state
(its lock, clock, outbox and tables) at nearly every step. This module ties them
together: the node's lifecycle and its requests to the broker. What callers import
from here (Node, Process, Down, ...) is still importable from here.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .. import wire
from .holding import BrokerClock, HeldMessages
from .node_control import NodeControl
# The process API is re-exported (see __all__): callers import it from here.
from .process import (TIMEOUT, Behaviour, BehaviourProcess, Down, Message, NodeError, Process, Stalled,
                      ThreadProcess)
from ..control import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S
from ..security import RunKeys
from .table import ProcessTable
from .timekeeping import Timekeeping
from .transport import Transport
from ..wire import BROKER_NODE, BROKER_PID, USER, Pid

log = logging.getLogger("fedemu.node")

_PR_SET_NAME = 15  # prctl(2)
# A node process that ends itself because its own machinery failed (see Node._fail) exits
# with this code (sysexits' EX_SOFTWARE), after one line on stderr that names the failure.
FAILED_EXIT = 70
# call_broker: how many times its timeout an answer is awaited while the broker is alive.
BUSY_BROKER_FACTOR = 12


def _start_pool_thread(name: str, increment: int) -> None:
    """A pool thread's start: the OS learns its name (``top -H``, ``/proc/*/task/*/comm``
    and bench/scale.py tell training apart from the node's I/O by it), and it runs
    ``increment`` nicer than the node's own threads."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15])
    except (OSError, AttributeError):
        pass  # not Linux: the name is cosmetic
    if increment:
        _renice_this_thread(increment)


def _renice_this_thread(increment: int) -> None:
    """Lower this thread's priority by ``increment`` (relative, as nice(1))."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError as exc:  # not allowed (or not Linux): run at the node's priority
        log.warning("could not lower the pool threads' priority by %d: %s", increment, exc)


class Node(Transport, NodeControl, ProcessTable, Timekeeping):
    """One OS process hosting many processes, connected to the broker."""

    def __init__(
        self,
        name: str,
        broker: str,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL_S,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        pool_size: int = 1,
        keys: RunKeys | None = None,
        pool_nice: int = 0,
        token: str | None = None,
        exit_on_failure: bool = False,
    ) -> None:
        if not name or name.startswith("$") or "/" in name:
            raise ValueError(f"bad node name {name!r}")
        self.name = name
        self.broker = broker
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.max_message_bytes = max_message_bytes
        self._init_table()
        self._init_transport()
        self._refs = itertools.count(1)  # of monitors and of calls to the broker
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._state = threading.RLock()  # over the process table and `closed`
        # pool_nice > 0 runs the behaviours (clients' training) that much nicer than the
        # I/O thread, so on busy cores messages still leave and are released on time
        # (Linux nice is per thread; lowering it needs no privilege).
        self._pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix=f"{name}-pool",
                                        initializer=_start_pool_thread, initargs=(f"{name}-pool", pool_nice))
        self._welcomed = threading.Event()
        self.closed = threading.Event()
        self.close_reason: str | None = None
        self.broker_lost: str | None = None  # why this node lost the broker, once it has
        self.failure: str | None = None  # what broke in the node itself (_fail, its I/O thread), if anything
        self.exit_on_failure = exit_on_failure  # a node of a run: its OS process ends with the node (_fail)
        self.on_close: list[Callable[[str], None]] = []
        self.keys = keys
        self.token = token  # the run's token, which the broker may ask of a hello (security.py)
        self._broker_clock = BrokerClock()
        self._held = HeldMessages(self._io_deliver, self._broker_clock)
        self._init_timekeeping()

    # --- lifecycle --------------------------------------------------------------------

    def start(self, connect_timeout: float = 30.0) -> Node:
        """Connect to the broker and wait for its welcome."""
        self._connect()
        deadline = time.monotonic() + connect_timeout  # wall: a real process connecting
        next_hello = 0.0
        while not self._welcomed.wait(0.05):
            if self._refused is not None:
                self.close("refused by the broker")
                raise NodeError(f"the broker at {self.broker} refused node {self.name}: {self._refused}")
            if self.closed.is_set():
                raise NodeError(f"node {self.name} closed while connecting: {self.close_reason}")
            now = time.monotonic()  # wall
            if now > deadline:
                self.close("no broker")
                raise NodeError(f"no broker answered at {self.broker} within {connect_timeout:.0f}s")
            if now >= next_hello:  # the first may precede the connect
                self._send_ctl(BROKER_PID, {"op": "hello", "t": time.monotonic(),  # wall: a first clock-offset sample
                                            **({"token": self.token} if self.token is not None else {})})
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
        for done, _ in list(self._replies.values()):  # a request awaiting the broker waits no more
            done.set()
        self._wake()
        if self._io_thread and self._io_thread is not threading.current_thread():
            self._io_thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._timers.close()
        if self.clock.virtual:
            self.clock.close()
        for callback in self.on_close:
            callback(reason)

    def _fail(self, doing: str, exc: BaseException) -> None:
        """The node's own machinery failed while ``doing`` something (out of memory, no
        thread to be had): a DOWN it could not send, a process it could not schedule. Its
        books cannot be trusted after that (in virtual time a process counted busy for ever
        holds the run's clock still; a lost DOWN leaves its watcher waiting), so the node
        fails stop, as an Erlang node does: the broker finds it silent within the heartbeat
        timeout and every watcher gets ``noconnection``. A node of a run
        (``exit_on_failure``) ends its OS process at once, with FAILED_EXIT and one line on
        stderr naming the failure, which the launcher reports; an embedded node closes."""
        try:
            reason = f"{doing}: {type(exc).__name__}: {exc}"
            self.failure = reason
            log.critical("node %s failed %s", self.name, reason)
        except BaseException:  # out of memory even for the message: the exit code still says it
            reason = doing
        if self.exit_on_failure:
            try:
                os.write(2, f"fedemu: node {self.name} failed {reason}\n".encode(errors="replace"))
            finally:
                os._exit(FAILED_EXIT)
        self.close(f"failed {reason}")

    def wait(self, timeout: float | None = None) -> bool:
        return self.closed.wait(timeout)

    def whereis(self, name: str, timeout: float = 5.0) -> Pid | None:
        """The pid registered under ``name`` anywhere, or None."""
        local = self._names.get(name)
        if local is not None:
            return local.pid
        return self.call_broker({"op": "whereis", "name": name}, timeout)

    def broker_stats(self, per_link: bool = False, timeline: bool = False, timeout: float = 5.0) -> dict:
        """The broker's traffic counters (bytes and messages per direction, drops);
        ``timeline``: also the transfers and device switches since the last such call
        (``transfers``: net.emulator.TRANSFER_FIELDS; ``availability``: [link, t,
        offline]), which the broker then forgets: one process of the run takes them."""
        return self.call_broker({"op": "stats", "per_link": per_link, "timeline": timeline}, timeout)

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
        """The broker's answer to a control request. Past ``timeout`` it is still awaited
        while the broker is alive (heartbeats), up to BUSY_BROKER_FACTOR times as long: the
        request may be queued behind gigabytes this node sent before it (thousands of
        models), which the broker reads first."""
        self._check_open()
        ref = next(self._refs)
        done = threading.Event()
        slot: list = []
        self._replies[ref] = (done, slot)
        self._send_ctl(BROKER_PID, {**body, "ref": ref})
        if not done.wait(timeout):
            patience = timeout * (BUSY_BROKER_FACTOR - 1)
            while self.broker_lost is None and patience > 0 and not done.wait(min(patience, 0.5)):
                patience -= 0.5
            if not done.is_set():
                self._replies.pop(ref, None)
                if self.broker_lost:
                    raise NodeError(f"broker did not answer {body['op']!r}: lost the broker: {self.broker_lost}")
                raise NodeError(f"broker did not answer {body['op']!r} within {timeout * BUSY_BROKER_FACTOR:g}s "
                                "(alive, but busy)")
        if not slot:  # woken by close()
            self._replies.pop(ref, None)
            if self.broker_lost:
                raise NodeError(f"broker did not answer {body['op']!r}: lost the broker: {self.broker_lost}")
            raise NodeError(f"node {self.name} closed ({self.close_reason}) before the broker answered {body['op']!r}")
        return slot[0]

    def send(self, dst: Pid | str, body: Any) -> None:
        """Send from the node itself (pid id 0): for code outside any process, such as
        a signal handler asking the server to stop."""
        self._send(USER, Pid(self.name, 0), dst, body)

    def shutdown_all(self) -> None:
        """Ask the broker to stop every node of the run, and itself."""
        self._send_ctl(BROKER_PID, {"op": "shutdown"})

    def _pool_submit(self, fn: Callable[[], None]) -> None:
        try:
            self._pool.submit(fn)
        except RuntimeError as exc:
            if self.closed.is_set():
                return  # pool shut down: the node is closing
            # No thread for the pool ("can't start new thread"): the process it was for
            # stays counted busy with nobody to run it.
            self._fail("starting its worker pool", exc)


__all__ = [
    "Behaviour", "BehaviourProcess", "Down", "Message", "Node", "NodeError", "Pid",
    "Process", "Stalled", "ThreadProcess", "TIMEOUT", "BROKER_NODE",
]
