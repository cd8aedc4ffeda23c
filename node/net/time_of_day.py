"""Conditions that follow the time of day, without a trace: who is online, and how fast
links are, by each client's local hour.

``[network.time_of_day]`` gives a day's profile (24 values, one per local hour) and
each client group's time zone; emulated t = 0 is ``start_utc_h`` o'clock UTC.

* ``online``: the fraction of clients online at each local hour, linear between the
  hours. Each client draws one uniform u per local day (stream
  ``time_of_day.online``, by client and day) and is online while u < the profile: a
  client with a small u is online most of the day, one with a large u only around the
  peak, and the fraction online at any moment is the profile's in expectation. With a
  profile that rises and falls once a day, each client has one session a day, which
  starts and ends at different times for different clients.
* ``bandwidth``: a factor on every link's bandwidth at each local hour, times
  exp(sigma Z) with Z standard normal per client, direction and hour (stream
  ``time_of_day.bandwidth/i``): a link's rate is constant within an hour and steps at
  the hour. A client with a rate trace follows its trace instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..streams import uniform

DAY_S, HOUR_S = 86400.0, 3600.0
TIME_OF_DAY_KEYS = ("start_utc_h", "zones", "online", "bandwidth", "bandwidth_sigma")
_STREAM_ONLINE = "time_of_day.online"
_STREAM_BANDWIDTH = ("time_of_day.bandwidth/0", "time_of_day.bandwidth/1")
_SCAN_DAYS = 8  # a profile whose crossing is not within a week never changes


@dataclass
class TimeOfDay:
    seed: int
    start_utc_h: float = 0.0
    offsets_h: dict[int, float] = field(default_factory=dict)  # client -> UTC offset (others: 0)
    online: tuple[float, ...] | None = None  # fraction online at each local hour 0..23
    bandwidth: tuple[float, ...] | None = None  # bandwidth factor at each local hour
    bandwidth_sigma: float = 0.0

    def _shift_s(self, client: int) -> float:
        """Local seconds since the client's midnight of day 0, minus emulated seconds."""
        return (self.start_utc_h + self.offsets_h.get(client, 0.0)) * HOUR_S

    # --- availability -----------------------------------------------------------------------

    def _hour(self, client: int, local: float) -> tuple[float, float, bool, float]:
        """The local hour holding ``local``: (its start, its end, whether the profile
        rises through it, the switch time x). The profile runs linearly from this hour's
        value to the next's; the client is online for local times >= x when it rises, < x
        when it falls (x clamped to the hour: no switch within it). Half-open, so at a
        switch time the state is already the new one."""
        hour = math.floor(local / HOUR_S)
        day, h = divmod(hour, 24)
        a, b = hour * HOUR_S, (hour + 1) * HOUR_S
        p0, p1 = self.online[h], self.online[(h + 1) % 24]
        u = uniform(self.seed, _STREAM_ONLINE, client, 0, day)
        if p1 == p0:
            return a, b, True, a if u < p0 else b
        x = a + (u - p0) / (p1 - p0) * (b - a)
        return a, b, p1 > p0, min(max(x, a), b)

    def _online_local(self, client: int, local: float) -> bool:
        _, _, rising, x = self._hour(client, local)
        return local >= x if rising else local < x

    def online_at(self, client: int, t: float) -> bool:
        return True if self.online is None else self._online_local(client, t + self._shift_s(client))

    def next_online_change(self, client: int, t: float) -> float:
        """The first emulated time after t at which the client's diurnal state changes
        (math.inf: none within a week, so none ever)."""
        if self.online is None:
            return math.inf
        shift = self._shift_s(client)
        local = t + shift
        state = self._online_local(client, local)
        for _ in range(24 * _SCAN_DAYS):
            a, b, _, x = self._hour(client, local)
            if a < x < b and x > local:  # the one switch within this hour, still ahead
                return _after(x - shift)
            local = b
            if self._online_local(client, b) != state:  # a new hour (and maybe day) begins switched
                return _after(b - shift)
        return math.inf

    # --- bandwidth ----------------------------------------------------------------------

    def _factor(self, client: int, direction: int, hour: int) -> float:
        """The factor on a link's bandwidth during the client's local ``hour`` (counted
        from its midnight of day 0)."""
        factor = self.bandwidth[hour % 24]
        if self.bandwidth_sigma > 0:
            u1 = uniform(self.seed, _STREAM_BANDWIDTH[0], client, direction, hour)
            u2 = uniform(self.seed, _STREAM_BANDWIDTH[1], client, direction, hour)
            z = math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)
            factor *= math.exp(self.bandwidth_sigma * z)
        return factor

    def bandwidth_factor(self, client: int, direction: int, t: float) -> float:
        return self._factor(client, direction, math.floor((t + self._shift_s(client)) / HOUR_S))

    def rate(self, client: int, direction: int, bandwidth: float) -> HourlyRate:
        """The link's rate over time: ``bandwidth`` scaled by the client's hour."""
        return HourlyRate(self, client, direction, bandwidth)


@dataclass(frozen=True)
class HourlyRate:
    """A link's rate that steps at each local hour: the same operations as
    traces.RateTrace (finish, served, value_at, next_change), so a transport takes
    either."""

    tod: TimeOfDay
    client: int
    direction: int
    bandwidth: float

    def _hour(self, t: float) -> tuple[int, float]:
        """(the client's local hour at t, when it ends in emulated time)."""
        hour = math.floor((t + self.tod._shift_s(self.client)) / HOUR_S)
        return hour, self._end(hour)

    def _end(self, hour: int) -> float:
        """When local ``hour`` ends, in emulated time (computed afresh, not summed: no drift)."""
        return (hour + 1) * HOUR_S - self.tod._shift_s(self.client)

    def _rate(self, hour: int) -> float:
        return self.bandwidth * self.tod._factor(self.client, self.direction, hour)

    def value_at(self, t: float) -> float:
        return self._rate(self._hour(t)[0])

    def next_change(self, t: float) -> float:
        return self._hour(t)[1]

    def served(self, start: float, end: float) -> float:
        hour, hour_end = self._hour(start)
        t, total = start, 0.0
        while t < end:
            stop = min(end, hour_end)
            total += self._rate(hour) * (stop - t)
            t, hour = stop, hour + 1
            hour_end = self._end(hour)
        return total

    def finish(self, start: float, size: float) -> float:
        """When ``size`` bytes starting at ``start`` have crossed the link."""
        hour, hour_end = self._hour(start)
        t, left = start, float(size)
        while True:
            rate = self._rate(hour)
            if left <= rate * (hour_end - t):
                return t + left / rate
            left -= rate * (hour_end - t)
            t, hour = hour_end, hour + 1
            hour_end = self._end(hour)


def _after(t: float) -> float:
    """A switch time moved up to 2 microseconds later, onto a grid: a clock that stops
    there reads the new state, whatever the float rounding of local time."""
    return math.ceil(t * 1e6 + 1.0) / 1e6


def time_of_day_from_config(section: Any, num_clients: int, seed: int, parse_ids, error) -> TimeOfDay | None:
    """``[network.time_of_day]`` checked; ``parse_ids`` and ``error`` are links.py's."""
    if not isinstance(section, dict):
        raise error("network.time_of_day must be a table")
    unknown = set(section) - set(TIME_OF_DAY_KEYS)
    if unknown:
        raise error(f"unknown key network.time_of_day.{sorted(unknown)[0]}; [network.time_of_day] has "
                    f"{', '.join(TIME_OF_DAY_KEYS)}")
    if not section:
        return None
    where = "network.time_of_day"

    def number(value: Any, key: str, rule: str, ok) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise error(f"{where}.{key} = {value!r} must be {rule}")
        return float(value)

    def profile(key: str, rule: str, ok) -> tuple[float, ...] | None:
        values = section.get(key)
        if values is None:
            return None
        if not isinstance(values, list) or len(values) != 24:
            raise error(f"{where}.{key} must list 24 values, one per local hour (0 to 23)")
        return tuple(number(v, f"{key}[{h}]", rule, ok) for h, v in enumerate(values))

    offsets: dict[int, float] = {}
    zones = section.get("zones", [])
    if not isinstance(zones, list):
        raise error(f"{where}.zones must be a list of {{ clients = '0-49', utc_offset_h = 1 }}")
    for i, zone in enumerate(zones):
        if not isinstance(zone, dict) or set(zone) != {"clients", "utc_offset_h"}:
            raise error(f"{where}.zones[{i}] needs clients (ids like '0-49') and utc_offset_h")
        offset = number(zone["utc_offset_h"], f"zones[{i}].utc_offset_h", "in [-24, 24] hours",
                        lambda v: -24 <= v <= 24)
        for k in parse_ids(zone["clients"], f"{where}.zones[{i}].clients", num_clients):
            offsets[k] = offset
    tod = TimeOfDay(seed=seed,
                    start_utc_h=number(section.get("start_utc_h", 0.0), "start_utc_h", "in [0, 24)",
                                       lambda v: 0 <= v < 24),
                    offsets_h=offsets,
                    online=profile("online", "a fraction in [0, 1]", lambda v: 0 <= v <= 1),
                    bandwidth=profile("bandwidth", "a factor > 0", lambda v: v > 0),
                    bandwidth_sigma=number(section.get("bandwidth_sigma", 0.0), "bandwidth_sigma", ">= 0",
                                           lambda v: v >= 0))
    if tod.online is None and tod.bandwidth is None:
        raise error(f"{where} needs online (24 fractions) or bandwidth (24 factors), or both")
    if tod.bandwidth_sigma and tod.bandwidth is None:
        raise error(f"{where}.bandwidth_sigma needs a bandwidth profile")
    return tod
