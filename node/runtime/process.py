"""Processes and their mailboxes: what runs inside a node, and what it sees.

Two kinds of processes live in a node, both with a pid, a mailbox and monitors:

* **thread processes** (:meth:`Node.spawn`): a function running in its own thread
  that may block in a selective :meth:`ThreadProcess.receive` — for long-lived
  coordinators such as the server;
* **behaviour processes** (:meth:`Node.spawn_behaviour`): an object whose
  :meth:`Behaviour.handle` runs on the node's small worker pool, one message at a
  time — an idle one costs only its state, so a node can host thousands of emulated
  clients without thousands of threads.

Apart from the node (runtime.py) because a process's API and how it consumes its
mailbox are one job, and the node's (moving messages, its process table, its clocks)
are others: a process reaches its node only through a handful of calls (``_send``,
``_monitor``, ``_add_timer``, ``_busy_up``/``_busy_down``, ``_exit``, ``_pool_submit``,
``_deliver_local``).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

from .clock import TimerRef
from ..wire import USER, Pid, message

if TYPE_CHECKING:
    from .runtime import Node

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


@message
class Stalled:
    """Virtual time only: the whole run is quiescent and nothing is pending (no message in
    flight or held, no timer, no scheduled change): no process can ever run again unless
    a real fault happens. Offered to every thread process blocked in a receive that
    accepts it: how a run notices a deadlock the moment it happens."""

    now: float


class Message(NamedTuple):
    sender: Pid
    body: Any


class LinkChange(NamedTuple):
    """The broker's word that this process's link went offline or came back: handed
    to :meth:`Behaviour.link_changed`, in mailbox order, never to ``handle``."""

    offline: bool


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
        # The emulated device behind a client's link: whether it is offline now, and how
        # many times it has gone offline (work begun before a change is lost with it).
        self.offline = False
        self.offline_count = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pid}{' ' + self.names[0] if self.names else ''})"

    # --- the process API ----------------------------------------------------------

    def send(self, dst: Pid | str, body: Any) -> None:
        """Send ``body`` to a pid or a registered name. Never blocks; may be lost
        (as in Erlang) if the destination does not exist."""
        self.node._send(USER, self.pid, dst, body)

    def send_many(self, dsts: list[Pid], body: Any) -> None:
        """Send ``body`` to every pid in ``dsts``, as many sends would, but encoded once
        and carried once per node they live on (a model broadcast to a round's clients).
        Each receiver decodes its own copy; arrays in it are read-only and shared."""
        self.node._send_many(self.pid, list(dsts), body)

    def hand(self, dst: Pid, body: Any) -> None:
        """Give ``body`` (any object, as it is: not encoded, not copied) to ``dst``, a
        process of this node, at once: no broker, no link, in either clock. For a node's
        own services, whose state its processes share by design (a client handing its
        local work to its node's trainer); between emulated parties, ``send``. The
        receiver is runnable from now, so in virtual time the node stays busy until it
        has run."""
        if dst.node != self.node.name:
            raise ValueError(f"hand: {dst} is not a process of node {self.node.name}")
        self.node._deliver_local(self.pid, dst.id, body)

    def monitor(self, target: Pid) -> int:
        """Watch ``target``; exactly one :class:`Down` with this ref will arrive."""
        return self.node._monitor(self.pid, [target])[0]

    def monitor_many(self, targets: list[Pid]) -> list[int]:
        """``monitor`` each of ``targets`` (a ref each, in order), with one control message
        per node they live on rather than one each."""
        return self.node._monitor(self.pid, list(targets))

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

    def send_after(self, delay: float, dst: Pid | str, body: Any, *, unless_offline: bool = False
                   ) -> TimerRef | None:
        """Send ``body`` after ``delay`` emulated seconds (the node's clock), without
        blocking this process (Erlang's send_after): how a client emulates a slower
        device. Returns a reference whose ``cancel()`` stops a send not yet made (None if
        sent now). With ``unless_offline`` the send is skipped if this process's link goes
        offline first: the device's work it stands for was lost with the device."""
        if delay <= 0:
            self.send(dst, body)
            return None
        return self.node._add_timer(delay, (USER, self.pid, dst, body), self if unless_offline else None)

    def send_at(self, when: float, dst: Pid | str, body: Any, *, unless_offline: bool = False
                ) -> TimerRef | None:
        """``send_after`` to the emulated instant ``when`` (virtual time only): the send a
        ``send_after(when - t, ...)`` made at an earlier instant t would make, exactly."""
        if not self.node.clock.virtual:
            raise RuntimeError("send_at: only on the virtual clock")
        if when <= self.now():
            self.send(dst, body)
            return None
        return self.node.clock.add_at(when, (USER, self.pid, dst, body), self if unless_offline else None)

    def now(self) -> float:
        """Emulated seconds on the run's clock (wall x time_scale, or the broker's
        virtual time); only differences between two readings mean anything."""
        return self.node.clock.now()

    def has_message(self, match: Match) -> bool:
        """Whether a message whose body matches is waiting in the mailbox, left there
        (Erlang's ``receive ... after 0`` without taking it): how a long computation
        notices it is no longer wanted."""
        accept = _matcher(match)
        with self._lock:
            return any(accept(msg.body) for msg in self._mailbox)

    # --- runtime side ---------------------------------------------------------------

    def _deliver(self, msg: Message) -> None:
        raise NotImplementedError

    def _deliver_many(self, msgs: Iterable[Message]) -> None:
        for msg in msgs:
            self._deliver(msg)


class ThreadProcess(Process):
    def __init__(self, node: Node, pid: Pid) -> None:
        super().__init__(node, pid)
        self._arrived = threading.Condition(self._lock)
        # Virtual time: the matcher of the receive this process is blocked in (None while
        # it runs), why it was woken, and which wait a receive timeout belongs to.
        self._waiting: Callable[[Any], bool] | None = None
        self._woken: str | None = None
        self._wait_id = 0

    def receive(self, match: Match = None, timeout: float | None = None, *,
                wall_timeout: float | None = None) -> Message | _Timeout:
        """Selective receive: remove and return the first queued message whose body
        matches (a predicate, a type or a tuple of types); leave the others queued.
        Returns :data:`TIMEOUT` if nothing matches within ``timeout`` emulated seconds
        (the run's clock), or within ``wall_timeout`` seconds of real time (for waits on
        real processes: start-up, a watchdog), whichever comes first."""
        accept = _matcher(match)
        if self.node.clock.virtual:
            return self._receive_virtual(accept, timeout, wall_timeout)
        # wall: on the wall clock an emulated timeout is host seconds (time_scale applied)
        deadline = None if timeout is None else time.monotonic() + self.node.clock.wall_seconds(timeout)  # wall
        if wall_timeout is not None:
            wall_deadline = time.monotonic() + wall_timeout  # wall
            deadline = wall_deadline if deadline is None else min(deadline, wall_deadline)
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
                    remaining = deadline - time.monotonic()  # wall
                    if remaining <= 0:
                        return TIMEOUT
                    self._arrived.wait(remaining)

    def _receive_virtual(self, accept: Callable[[Any], bool], timeout: float | None,
                         wall_timeout: float | None) -> Message | _Timeout:
        """The same, on virtual time: blocked here, the process counts as idle (the clock
        may move); a matching delivery, its timeout's timer or ``wall_timeout`` wakes it,
        and whoever wakes it counts it busy again at that moment."""
        node = self.node
        wall_deadline = None if wall_timeout is None else time.monotonic() + wall_timeout  # wall
        with self._arrived:
            msg = self._take(accept)
            if msg is not None:
                return msg
            if (timeout is not None and timeout <= 0) or (wall_timeout is not None and wall_timeout <= 0):
                return TIMEOUT
            self._wait_id += 1
            self._waiting, self._woken = accept, None
            timer = node.clock.add(timeout, (self, self._wait_id)) if timeout is not None else None
            node._busy_down()
            while self._woken is None:
                remaining = None if wall_deadline is None else wall_deadline - time.monotonic()  # wall
                if remaining is not None and remaining <= 0:
                    self._waiting, self._woken = None, "wall"
                    node._busy_up()
                    break
                self._arrived.wait(remaining)
            woken = self._woken
            if timer is not None:
                timer.cancel()
            return self._take(accept) if woken == "message" else TIMEOUT

    def _take(self, accept: Callable[[Any], bool]) -> Message | None:
        box = self._mailbox
        for i in range(len(box)):
            if accept(box[i].body):
                msg = box[i]
                del box[i]
                return msg
        return None

    def _wake(self, why: str) -> None:
        """(Under the lock.) Virtual time: make a blocked receive runnable again."""
        self._waiting, self._woken = None, why
        self.node._busy_up()
        self._arrived.notify()

    def _timer_fired(self, wait_id: int) -> None:
        """Virtual time: a receive's timeout is due (the I/O thread, at an advance)."""
        with self._arrived:
            if self._waiting is not None and self._wait_id == wait_id:
                self._wake("timeout")

    def _offer(self, msg: Message) -> None:
        """Deliver ``msg`` only if the blocked receive takes it (a Stalled notice)."""
        with self._arrived:
            if self._waiting is not None and self._waiting(msg.body):
                self._mailbox.append(msg)
                self._wake("message")

    def _deliver(self, msg: Message) -> None:
        self._deliver_many((msg,))

    def _deliver_many(self, msgs: Iterable[Message]) -> None:
        with self._arrived:
            box = self._mailbox
            before = len(box)
            box.extend(msgs)
            waiting = self._waiting
            if waiting is not None:
                for i in range(before, len(box)):
                    if waiting(box[i].body):
                        self._wake("message")
                        return
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

    def drained(self, proc: BehaviourProcess) -> None:
        """Its mailbox has run empty after one or more messages (still runnable: in
        virtual time the node stays busy meanwhile). Work gathered from many messages
        can be done here at once; what arrives meanwhile is handled after it."""

    def link_changed(self, proc: BehaviourProcess, offline: bool) -> None:
        """This process owns an emulated link (a client) whose device went offline
        (``offline``) or came back. Runs in mailbox order, like ``handle``; a handler
        already running sees ``proc.offline_count`` change at once."""

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
        self._drains = type(behaviour).drained is not Behaviour.drained
        self._undrained = False  # handled a message since its last drained()

    def stop(self, reason: str = "normal") -> None:
        self._stop_reason = reason

    def _deliver(self, msg: Message) -> None:
        self._deliver_many((msg,))

    def _deliver_many(self, msgs: Iterable[Message]) -> None:
        with self._lock:
            self._mailbox.extend(msgs)
            if self._scheduled or not self.alive:
                return
            self._scheduled = True
            self.node._busy_up()  # runnable from now until its mailbox is empty (virtual time)
        self.node._pool_submit(self._run)

    def _run(self) -> None:
        try:
            self._run_turn()
        except BaseException as exc:  # the node's part failed (no memory for the DOWN, say), not the behaviour
            self.node._fail(f"running {self.pid}", exc)

    def _run_turn(self) -> None:
        for _ in range(self._BATCH):
            with self._lock:
                if not self.alive or not (self._mailbox or self._undrained):
                    self._unschedule()
                    return
                msg = self._mailbox.popleft() if self._mailbox else None
            try:
                if msg is None:
                    self._undrained = False
                    self.behaviour.drained(self)
                elif type(msg.body) is LinkChange:
                    self.behaviour.link_changed(self, msg.body.offline)
                else:
                    self._undrained = self._drains
                    self.behaviour.handle(self, msg)
            except Exception as exc:
                self.node._exit(self, crash_reason(exc))
                with self._lock:
                    self._unschedule()
                return
            if self._stop_reason is not None:
                self.node._exit(self, self._stop_reason)
                with self._lock:
                    self._unschedule()
                return
        self.node._pool_submit(self._run)  # more queued: requeue behind other processes

    def _unschedule(self) -> None:
        """(Under the lock.) Nothing left to run: idle until the next delivery."""
        if self._scheduled:
            self._scheduled = False
            self.node._busy_down()


def crash_reason(exc: BaseException) -> str:
    log.error("process crashed:\n%s", "".join(traceback.format_exception(exc)))
    return f"crash: {type(exc).__name__}: {exc}"

