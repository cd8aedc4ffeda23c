"""When clients are offline: a drop-out each round, scheduled windows, on/off processes,
traced and diurnal availability; and client id lists such as ``"0-49,60"``."""
from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..streams import uniform
from .profiles import LinkConfigError
from .time_of_day import TimeOfDay
from .traces import StepSeries

_STREAM_ROUND_DROPOUT, _STREAM_ON_OFF = "dropout.per_round", "dropout.on_off"


def parse_ids(spec: Any, where: str = "clients", limit: int | None = None) -> frozenset[int]:
    """Client ids from "0-49,60,70-79", a list of ints, or one int."""
    if isinstance(spec, bool):
        raise LinkConfigError(f"{where} = {spec!r}: give ids like '0-49,60'")
    if isinstance(spec, int):
        ids = {spec}
    elif isinstance(spec, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
        ids = set(spec)
    elif isinstance(spec, str):
        ids = set()
        for part in spec.replace(" ", "").split(","):
            match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if not match:
                raise LinkConfigError(f"{where} = {spec!r}: {part!r} is not an id or a range like 0-49")
            low, high = int(match.group(1)), int(match.group(2) or match.group(1))
            if high < low:
                raise LinkConfigError(f"{where} = {spec!r}: range {part} runs backwards")
            ids.update(range(low, high + 1))
    else:
        raise LinkConfigError(f"{where} = {spec!r}: give ids like '0-49,60' or a list of integers")
    if limit is not None and ids and (min(ids) < 0 or max(ids) >= limit):
        raise LinkConfigError(f"{where} = {spec!r}: ids must be in 0..{limit - 1}")
    return frozenset(ids)


@dataclass
class Availability:
    """When each client is offline; every decision seeded by (seed, client, round or
    step), so reruns agree. A client is offline when any of the rules says so."""

    seed: int
    per_round: float = 0.0  # Bernoulli drop-out, drawn anew each round
    per_round_clients: frozenset[int] | None = None  # None: every client
    windows: list[tuple[frozenset[int] | None, float, float]] = field(default_factory=list)
    leave: list[tuple[frozenset[int] | None, float]] = field(default_factory=list)  # gone for good from t
    on_off: tuple[frozenset[int] | None, float, float] | None = None  # (clients, mean up s, mean down s)
    traced: dict[int, StepSeries] = field(default_factory=dict)  # a client's trace: online 1, offline 0
    diurnal: TimeOfDay | None = None  # online by the client's local hour ([network.time_of_day] online)
    _switches: dict[int, list[float]] = field(default_factory=dict)

    def offline(self, link: int, now: float, round_: int) -> bool:
        def covers(group: frozenset[int] | None) -> bool:
            return group is None or link in group

        if self.per_round > 0 and round_ > 0 and covers(self.per_round_clients):
            if uniform(self.seed, _STREAM_ROUND_DROPOUT, link, 0, round_) < self.per_round:
                return True
        for group, start, end in self.windows:
            if start <= now < end and covers(group):
                return True
        for group, at in self.leave:
            if now >= at and covers(group):
                return True
        trace = self.traced.get(link)
        if trace is not None and trace.value_at(now) == 0:
            return True
        if self.diurnal is not None and not self.diurnal.online_at(link, now):
            return True
        if self.on_off is not None and covers(self.on_off[0]):
            return self._on_off_offline(link, now)
        return False

    @property
    def timed(self) -> bool:
        """Whether any rule changes a client's state with time (not only per round)."""
        return bool(self.windows or self.leave or self.on_off or self.traced or self.diurnal)

    def next_change(self, link: int, now: float) -> float:
        """The first time after ``now`` at which a time-based rule may change whether
        this client is offline (math.inf: none will)."""
        def covers(group: frozenset[int] | None) -> bool:
            return group is None or link in group

        soonest = math.inf
        for group, start, end in self.windows:
            if covers(group):
                soonest = min(soonest, start if start > now else end if end > now else math.inf)
        for group, at in self.leave:
            if covers(group) and at > now:
                soonest = min(soonest, at)
        trace = self.traced.get(link)
        if trace is not None:
            soonest = min(soonest, trace.next_change(now))
        if self.diurnal is not None:
            soonest = min(soonest, self.diurnal.next_online_change(link, now))
        if self.on_off is not None and covers(self.on_off[0]):
            self._on_off_offline(link, now)  # draws switches up to past now
            switches = self._switches[link]
            soonest = min(soonest, switches[bisect.bisect_right(switches, now)])
        return soonest

    def _on_off_offline(self, link: int, now: float) -> bool:
        """Alternating exponential up and down periods, starting up; switch times are
        drawn lazily, in order, from the client's own counter."""
        _, mean_up, mean_down = self.on_off
        switches = self._switches.setdefault(link, [])
        while not switches or switches[-1] <= now:
            i = len(switches)
            mean = mean_up if i % 2 == 0 else mean_down
            u = uniform(self.seed, _STREAM_ON_OFF, link, 0, i)
            switches.append((switches[-1] if switches else 0.0) - mean * math.log(1.0 - u))
        # Before switches[0] the client is up; after an odd number of switches, down.
        passed = sum(1 for t in switches if t <= now)
        return passed % 2 == 1


