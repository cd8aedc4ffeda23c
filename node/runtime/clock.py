"""Emulated time as a node sees it: one interface, two clocks.

Everything a run's logic waits on goes through a node's clock: ``send_after`` delays,
``receive`` timeouts, round deadlines, retries, a slow device's held reply. Times here
are *emulated* seconds.

* :class:`WallClock`: emulated time is the host's monotonic clock times ``time_scale``;
  a delay of d emulated seconds takes d / time_scale wall seconds. Results depend on
  how fast the host runs the code.
* :class:`VirtualClock`: the broker owns the time (see ``vclock``). A node knows the
  instant the broker last announced; its timers are a heap that fires only when the
  broker advances the clock to them, never by the passing of wall time. While a
  process computes, emulated time stands still.

Failure detection (heartbeats) and ``wall_timeout`` waits always use wall time.
"""
from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Any, Callable


class TimerRef:
    """A pending send_after or receive timeout; ``cancel()`` stops it if it has not
    fired (Erlang's cancel_timer)."""

    __slots__ = ("due", "seq", "args", "cancelled", "fired", "owner", "offline_count", "_lock")

    def __init__(self, due: float, seq: int, args: tuple, owner: Any, lock: threading.Condition | threading.Lock) -> None:
        self.due, self.seq, self.args, self.cancelled, self.fired = due, seq, args, False, False
        # Skipped if the owner's link has gone offline by then (send_after's unless_offline).
        self.owner = owner
        self.offline_count = owner.offline_count if owner is not None else 0
        self._lock = lock

    def __lt__(self, other: TimerRef) -> bool:
        return (self.due, self.seq) < (other.due, other.seq)

    def cancel(self) -> bool:
        """Stop the send; True if it had not been made (and now never will be)."""
        with self._lock:
            self.cancelled = True
            if not self.fired:
                self.args = ()  # what it would have sent can go now
            return not self.fired

    def take_args(self) -> tuple:
        """What to send, once fired; the reference keeps none of it (a client keeps its
        last reply's timer: 1,000 of them must not keep 1,000 models alive)."""
        args, self.args = self.args, ()
        return args

    def decide(self) -> bool:
        """Called under the lock when due: whether it fires (not cancelled, and its
        owner's device has not gone offline since it was set)."""
        self.fired = not self.cancelled and (self.owner is None or self.owner.offline_count == self.offline_count)
        return self.fired


class WallClock:
    """Emulated time = (the host's monotonic clock - ``origin``) x ``time_scale``: the
    broker's emulated time once its welcome set ``origin`` (the local monotonic instant
    of the run's emulated zero), so what nodes stamp with it (a client's computation,
    the server's deadlines) lines up with the broker's books (transfers, drop-outs)."""

    virtual = False

    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale
        self.origin = 0.0

    def now(self) -> float:
        return (time.monotonic() - self.origin) * self.time_scale

    def wall_seconds(self, emulated: float) -> float:
        return emulated / self.time_scale


class WallTimers:
    """A node's send_after timers on one thread and a heap: a run keeps thousands of
    timers pending (retries, straggler holds), far too many for a thread each."""

    def __init__(self, fire: Callable[..., None], name: str, clock: WallClock, log) -> None:
        self._fire = fire
        self._name = name
        self._clock = clock
        self._log = log
        self._heap: list[TimerRef] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, delay: float, args: tuple, owner: Any = None) -> TimerRef:
        ref = TimerRef(time.monotonic() + self._clock.wall_seconds(delay), next(self._seq), args, owner, self._cond)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-timers", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, ref)
            if self._heap[0] is ref:
                self._cond.notify()
        return ref

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0].due > time.monotonic()):
                    self._cond.wait(self._heap[0].due - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                ref = heapq.heappop(self._heap)
                # Decided under the lock, so cancel() knows for sure whether it was sent.
                fired = ref.decide()
            if fired:
                try:
                    self._fire(*ref.take_args())
                except Exception:  # one failed send must not stop every later timer
                    self._log.exception("node %s: a timed send failed", self._name)


class VirtualClock:
    """The broker's instant as this node last heard it, and this node's timers, which
    fire only when the broker advances the clock to them. Timers that are due at the
    same instant fire in the order they were set (due, then sequence)."""

    virtual = True
    time_scale = 1.0

    def __init__(self) -> None:
        self._now = 0.0
        self._heap: list[TimerRef] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._now

    def add(self, delay: float, args: tuple, owner: Any = None) -> TimerRef:
        with self._lock:
            return self._push(self._now + max(delay, 0.0), args, owner)

    def add_at(self, when: float, args: tuple, owner: Any = None) -> TimerRef:
        """A timer due at the instant ``when`` itself (not now + a delay, which need not
        round to the same float): what an earlier ``add`` would have set."""
        with self._lock:
            return self._push(max(when, self._now), args, owner)

    def _push(self, due: float, args: tuple, owner: Any) -> TimerRef:
        ref = TimerRef(due, next(self._seq), args, owner, self._lock)
        heapq.heappush(self._heap, ref)
        return ref

    def advance(self, now: float) -> None:
        # Never back: a node that missed an instant (it had nothing due) catches up.
        if now > self._now:
            self._now = now

    def earliest(self) -> float | None:
        """When the next live timer is due (cancelled ones are dropped on the way)."""
        with self._lock:
            heap = self._heap
            while heap and heap[0].cancelled:
                heapq.heappop(heap)
            return heap[0].due if heap else None

    def due(self) -> list[TimerRef]:
        """Pop every timer due by now that fires, in order (decided under the lock)."""
        fired = []
        with self._lock:
            heap = self._heap
            while heap and heap[0].due <= self._now:
                ref = heapq.heappop(heap)
                if ref.decide():
                    fired.append(ref)
        return fired

    def close(self) -> None:
        with self._lock:
            self._heap.clear()
