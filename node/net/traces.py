"""Conditions that change over emulated time: a value per time step, and a link's rate.

Two small, pure objects, with no sockets, no config and no clock of their own:

* :class:`StepSeries`: a value that holds from each of its times until the next
  (piecewise constant), optionally repeating with a period: a client's availability
  (1 online, 0 offline), a link's latency or loss probability over time.
* :class:`RateTrace`: a link's rate in bytes per second over time, a StepSeries with
  the one operation a transport needs, :meth:`RateTrace.finish`: given bytes and the
  time they start, when the last of them has been served. :meth:`RateTrace.served`
  integrates the rate over an interval (a flow-level transport that shares the rate
  with its own window asks how much could cross in a step).

Every series starts at t = 0: its first value holds from 0 (a trace's first row is the
state at the start of the run). A series with a period repeats it for ever (Mahimahi's
traces loop, FedScale's availability repeats every ``finish_time``); one without
keeps its last value for ever.

A Mahimahi trace (Netravali et al., USENIX ATC 2015; mahimahi's ``mm-link``) has one
line per delivery opportunity of one 1500-byte packet, in milliseconds from the
start, non-decreasing, and repeats once its last line is reached (the last
timestamp is the period). :meth:`RateTrace.from_mahimahi` makes each millisecond a
step whose rate serves that millisecond's opportunities: an opportunity at ms t
serves its 1,500 bytes during the millisecond before t, so the trace's bytes by any
whole millisecond are exactly mahimahi's.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

import numpy as np

MAHIMAHI_PACKET_BYTES = 1500  # mm-link: each line is one MTU-sized delivery opportunity


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file or entry and the fault."""


class StepSeries:
    """A value over emulated time: ``values[i]`` holds from ``times[i]`` until
    ``times[i + 1]`` (the last until ``period``, then it all repeats; without a period
    the last value holds for ever). ``times[0]`` must be 0."""

    def __init__(self, times: Sequence[float], values: Sequence[float], period: float | None = None,
                 where: str = "trace") -> None:
        times = np.asarray(times, dtype=np.float64)
        values = np.asarray(values, dtype=np.float64)
        if times.ndim != 1 or times.shape != values.shape or not len(times):
            raise TraceError(f"{where}: needs as many times as values, at least one")
        if times[0] != 0.0:
            raise TraceError(f"{where}: its first step must start at t = 0, not {times[0]:g}")
        if not np.all(np.isfinite(times)) or np.any(np.diff(times) <= 0):
            raise TraceError(f"{where}: times must be finite and strictly increasing")
        if not np.all(np.isfinite(values)):
            raise TraceError(f"{where}: every value must be a finite number")
        if period is not None and not (math.isfinite(period) and period > times[-1]):
            raise TraceError(f"{where}: period {period!r} must be finite and after its last step "
                             f"(t = {times[-1]:g} s)")
        # Merge steps that do not change the value: next_change() then never reports a
        # change that is none.
        keep = np.concatenate(([True], values[1:] != values[:-1]))
        self.times, self.values, self.period = times[keep], values[keep], period
        self.where = where
        self._times_list = self.times.tolist()  # bisect on a list is several times faster than on an array

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where}: {len(self.times)} steps, period {self.period})"

    def _step(self, t: float) -> tuple[int, float]:
        """(the step holding at t, the time its period began: 0 without a period)."""
        base = 0.0
        if self.period is not None:
            base = math.floor(t / self.period) * self.period
            t -= base
        return max(bisect.bisect_right(self._times_list, t) - 1, 0), base

    def value_at(self, t: float) -> float:
        return float(self.values[self._step(t)[0]])

    def next_change(self, t: float) -> float:
        """The first time after ``t`` at which the value changes (math.inf: never)."""
        if len(self.times) == 1:
            return math.inf
        i, base = self._step(t)
        if i + 1 < len(self.times):
            return base + float(self.times[i + 1])
        if self.period is None:
            return math.inf
        # The last step ends at the period, where the first begins again: a change only if
        # their values differ, else the first step's end is the next one.
        if self.values[-1] != self.values[0]:
            return base + self.period
        return base + self.period + float(self.times[1])


class RateTrace(StepSeries):
    """A link's rate in bytes/s over emulated time (0: an outage). ``finish`` is the
    operation a transport needs: when ``size`` bytes starting at ``start`` have all
    been served at the rate as it changes."""

    def __init__(self, times: Sequence[float], rates: Sequence[float], period: float | None = None,
                 where: str = "rate trace") -> None:
        super().__init__(times, rates, period, where)
        if np.any(self.values < 0):
            raise TraceError(f"{where}: a rate must be >= 0 bytes/s")
        # Bytes served from t = 0 to the start of each step (and, last, to the period).
        ends = np.append(self.times[1:], period if period is not None else math.inf)
        widths = ends - self.times
        served = self.values * np.where(self.values > 0, widths, 0.0)  # a dead last step serves 0, not nan
        self._cumulative = np.concatenate(([0.0], np.cumsum(served)))
        self._period_bytes = float(self._cumulative[-1]) if period is not None else math.inf
        if period is None and self.values[-1] == 0:
            self._period_bytes = float(self._cumulative[-2])  # a link that ends dead serves no more
        self._cumulative_list = self._cumulative.tolist()

    @classmethod
    def constant(cls, rate: float) -> RateTrace:
        return cls([0.0], [rate], where=f"constant {rate:g} B/s")

    def served_by(self, t: float) -> float:
        """Bytes the link could have served from t = 0 to ``t``."""
        i, base = self._step(t)
        within = self._cumulative_list[i] + float(self.values[i]) * (t - base - float(self.times[i]))
        return within if self.period is None else base / self.period * self._period_bytes + within

    def served(self, start: float, end: float) -> float:
        """Bytes the link can serve between ``start`` and ``end``."""
        return self.served_by(end) - self.served_by(start) if end > start else 0.0

    def finish(self, start: float, size: float) -> float:
        """When ``size`` bytes that start at ``start`` have been served (math.inf: never:
        the rate stays 0 from some time on)."""
        if size <= 0:
            return start
        target = self.served_by(start) + size
        if self.period is None:
            if target > self._period_bytes:
                return math.inf
            base, within = 0.0, target
        else:
            if self._period_bytes <= 0:
                return math.inf
            # The period in which the target is reached: a target that is an exact multiple
            # of a period's bytes is reached inside the period before.
            n = math.ceil(target / self._period_bytes) - 1
            base, within = n * self.period, target - n * self._period_bytes
        # The step in which the served bytes reach ``within``: the first whose cumulative
        # end is >= within, skipping steps of rate 0 (they serve nothing).
        i = bisect.bisect_left(self._cumulative_list, within) - 1
        i = min(max(i, 0), len(self.times) - 1)
        while self.values[i] == 0 and i + 1 < len(self.times):
            i += 1
        rate = float(self.values[i])
        return base + float(self.times[i]) + (within - self._cumulative_list[i]) / rate

    @classmethod
    def from_mahimahi(cls, lines: Iterable[str], where: str = "mahimahi trace",
                      packet_bytes: int = MAHIMAHI_PACKET_BYTES, window_ms: int = 1) -> RateTrace:
        """A Mahimahi packet-delivery trace (one timestamp in ms per line, repeating
        after the last) as steps of ``window_ms`` each: the rate that serves that window's
        opportunities, averaged over it (the last window may be shorter; equal
        consecutive windows merge). 1 ms, the emulator's, keeps every millisecond's bytes
        exact; a wider window (``fedemu traces convert --window-ms``) gives a rate, not
        1,500-byte bursts."""
        if not (isinstance(window_ms, int) and window_ms >= 1):
            raise TraceError(f"{where}: the averaging window must be a whole number of ms >= 1, not {window_ms!r}")
        stamps: list[int] = []
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not text:
                continue
            try:
                stamp = int(text)
            except ValueError:
                raise TraceError(f"{where}, line {number}: {text[:40]!r} is not a whole number of "
                                 "milliseconds (a Mahimahi trace has one per line)") from None
            if stamp < 0 or (stamps and stamp < stamps[-1]):
                raise TraceError(f"{where}, line {number}: {stamp} ms: timestamps must be >= 0 and "
                                 "non-decreasing")
            stamps.append(stamp)
        if not stamps:
            raise TraceError(f"{where}: no delivery opportunities (a Mahimahi trace has one ms timestamp "
                             "per line)")
        period_ms = max(stamps[-1], 1)
        # An opportunity at ms t serves its packet in the millisecond [t - 1, t); one at 0,
        # in the first millisecond.
        slots = np.bincount(np.maximum(np.asarray(stamps), 1) - 1, minlength=period_ms)
        starts = np.arange(0, period_ms, window_ms)
        widths_ms = np.minimum(starts + window_ms, period_ms) - starts
        rates = np.add.reduceat(slots, starts) * packet_bytes * 1000.0 / widths_ms  # bytes/s within each window
        return cls(starts / 1000.0, rates, period=period_ms / 1000.0, where=where)
