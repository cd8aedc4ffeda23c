"""Emulated time on a node: the run's clock and its timers, and in virtual time the
books that tell the broker when this node is idle.

The run's clock is wall time until the broker's welcome says otherwise. In virtual time
the broker moves the clock only when every node is quiescent, so the node counts its
runnable work (``_busy_up``/``_busy_down``: a thread process from its birth until it
blocks in a receive, a behaviour process from a delivery until its mailbox is empty),
counts the work messages it has taken in, and its I/O thread reports ``idle`` when
nothing is runnable, waiting to go out or still to arrive in the current batch. The
timers due at an advance fire after its batch of deliveries.

Apart from the node (runtime.py) because these books are one job that the I/O loop,
the process table and the processes all feed: kept together, what counts a process
busy and what reads the count can be checked against each other.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from .. import wire
from .clock import TimerRef, VirtualClock, WallClock, WallTimers
from .process import ThreadProcess
from ..wire import BROKER_PID, CTL, Pid

if TYPE_CHECKING:
    from .process import Process

log = logging.getLogger("fedemu.node")


class Timekeeping:
    """Node's part that keeps time (a mixin of :class:`~fedemu.node.runtime.Node`)."""

    def _init_timekeeping(self) -> None:
        # The run's clock: wall until the broker's welcome says otherwise (virtual time).
        self.clock: WallClock | VirtualClock = WallClock()
        self._timers = WallTimers(self._send, self.name, self.clock, log)
        # Virtual time's books (see _report_if_idle): processes runnable or computing now;
        # work messages received from the broker; whether the broker must hear from us
        # again; messages of the current instant's batch still to come before the timers.
        self._busy = 0
        self._busy_lock = threading.Lock()
        self._seen = 0
        self._report_due = True
        self._batch_left = 0

    def _set_clock(self, kind: Any, time_scale: Any, origin: float | None = None) -> None:
        """The run's clock, as the broker's welcome says (before any process exists);
        ``origin``: on the wall clock, the local monotonic instant of emulated zero."""
        if kind == "virtual":
            self.clock = VirtualClock()
            self._report_due = True
        elif kind == "wall" and type(time_scale) is float and time_scale > 0:
            self.clock.time_scale = time_scale
            if origin is not None:
                self.clock.origin = origin
        else:
            raise ValueError(f"unknown clock {kind!r} (time scale {time_scale!r})")

    def _add_timer(self, delay: float, args: tuple, owner: Process | None) -> TimerRef:
        if self.clock.virtual:
            return self.clock.add(delay, args, owner)
        return self._timers.add(delay, args, owner)

    def _busy_up(self) -> None:
        if self.clock.virtual:
            with self._busy_lock:
                self._busy += 1
                woke = self._busy == 1
            if woke and threading.current_thread() is not self._io_thread:
                # Work the broker did not hand us (a spawn from outside any process, a
                # wall-time timeout): tell it, or it could take us for idle a while longer.
                self._send_ctl(BROKER_PID, {"op": "busy"})

    def _busy_down(self) -> None:
        if self.clock.virtual:
            with self._busy_lock:
                self._busy -= 1
                idle = self._busy == 0
            if idle:
                self._wake()  # the I/O thread tells the broker

    def _fire_timers(self) -> None:
        """Virtual time (I/O thread), after an advance's batch was handed over: every
        timer now due, in order. A send goes out (or into a local mailbox); a receive's
        timeout wakes its process."""
        self._hand_over()
        for ref in self.clock.due():
            args = ref.take_args()
            if isinstance(args[0], ThreadProcess):
                args[0]._timer_fired(args[1])
                continue
            try:
                self._send(*args)
            except Exception:  # one failed send must not stop the later timers
                log.exception("node %s: a timed send failed", self.name)

    def _start_batch(self, count: int) -> None:
        """(I/O thread) An advance announced ``count`` deliveries of its instant: the
        timers due by then fire after the last of them (at once if none)."""
        self._batch_left = count
        if not count:
            self._fire_timers()

    def _count_work(self, in_batch: bool) -> None:
        """(I/O thread) A work message from the broker arrived (virtual time's books);
        ``in_batch``: a delivery of the current instant, after which due timers fire."""
        self._seen += 1
        self._report_due = True
        if in_batch and self._batch_left:
            self._batch_left -= 1
            if not self._batch_left:
                self._fire_timers()

    def _report_if_idle(self) -> None:
        """Virtual time (I/O thread): when no process of this node is runnable, no
        message is waiting to go out or to be handed over, and the current batch has
        arrived, tell the broker, with the work messages seen so far (so it knows none
        is still on its way here) and the earliest timer. Sent again whenever the
        broker may have a stale picture: after work arrived or anything went out."""
        if not self._report_due:
            return
        self._report_due = False  # cleared before looking: a send racing this sets it again
        if self._busy or self._outbox or self._to_hand_over_count or self._batch_left or not self._welcomed.is_set():
            self._report_due = True
            return
        frames = wire.encode(CTL, Pid(self.name, 0), BROKER_PID,
                             {"op": "idle", "seen": self._seen, "next": self.clock.earliest()})
        self._ship(frames)
