"""The emulated network: each client's uplink and downlink, and when a message arrives.

Pure bookkeeping, no sockets: the broker asks :meth:`Network.transmit` for every
message that crosses a client's link and gets back the (emulated) arrival time, or the
reason it was dropped. The model, per link and direction:

* **serialization** on a FIFO: a message of S bytes entering at t starts at
  max(t, link busy until), occupies the link (S + overhead) / bandwidth seconds;
* then **propagation**: latency + jitter, jitter drawn from a distribution as
  tc-netem defines them (uniform, normal, pareto, paretonormal) and clipped so the
  delay is never negative;
* **FIFO** per link (so per sender/receiver pair) even with jitter, unless ``reorder``;
* **loss**: a Bernoulli drop probability, or Gilbert-Elliott bursts;
* a **queue limit** in messages and bytes (a tail drop when full);
* optional **shared bottlenecks** on the server side: every download first crosses
  the server's uplink, every upload the server's downlink, each one FIFO shared by all
  clients.

Every random decision is a pure function of (run seed, link, direction, stream,
message counter on that link), so the same seed gives the same decisions whatever the
thread or process interleaving. Times here are emulated seconds; the broker divides
them by ``time_scale`` to get wall-clock delays.
"""
from __future__ import annotations

import collections
import hashlib
import math
import re
import struct
from dataclasses import dataclass, field, fields, replace
from typing import Any

UP, DOWN = 0, 1
DIRECTIONS = {"up": UP, "down": DOWN}

JITTER_DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")

# Random streams: independent draws for independent decisions on the same message.
_STREAM_JITTER, _STREAM_LOSS, _STREAM_GE = 1, 2, 3

# Pareto with shape 3 has mean 1.5 and standard deviation sqrt(3)/2: netem's pareto
# table is such a heavy right tail, scaled to the configured jitter.
_PARETO_ALPHA = 3.0
_PARETO_MEAN = _PARETO_ALPHA / (_PARETO_ALPHA - 1)
_PARETO_STD = math.sqrt(_PARETO_ALPHA / ((_PARETO_ALPHA - 1) ** 2 * (_PARETO_ALPHA - 2)))


class LinkConfigError(ValueError):
    """A link setting that is not allowed; the message names the key and the range."""


_UNITS = {  # bytes per second
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3,
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8,
}


def parse_bandwidth(value: Any, key: str = "bandwidth") -> float:
    """Bytes per second from a number (bytes/s) or a string with a unit: "10Mbit",
    "1.5 MB/s", "100kbit", "unlimited". Bit units (bit, kbit, Mbps) are bits per second;
    B, kB, MB, KiB are bytes per second."""
    if isinstance(value, bool):
        raise LinkConfigError(f"{key} = {value!r} must be bytes/s or a string like '10Mbit'")
    if isinstance(value, (int, float)):
        rate = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text in ("unlimited", "inf", "infinity"):
            return math.inf
        match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]+)(/s)?", text)
        if not match or match.group(2) not in _UNITS:
            raise LinkConfigError(
                f"{key} = {value!r}: use bytes/s or a number with a unit "
                f"({', '.join(sorted(set(_UNITS)))}), e.g. '10Mbit' or '1.5MB/s'")
        rate = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise LinkConfigError(f"{key} = {value!r} must be bytes/s or a string like '10Mbit'")
    if not rate > 0:
        raise LinkConfigError(f"{key} = {value!r} must be > 0 (or 'unlimited')")
    return rate


@dataclass(frozen=True)
class LinkProfile:
    """One direction of one link. Times in milliseconds, sizes in bytes."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    jitter_distribution: str = "uniform"
    bandwidth: float = math.inf  # bytes/s
    overhead_bytes: int = 0  # added to every message's size on the link (headers)
    loss: float = 0.0  # Bernoulli drop probability (ignored when ge_p > 0)
    ge_p: float = 0.0  # Gilbert-Elliott: P(good -> bad) per message; 0 disables
    ge_r: float = 1.0  # P(bad -> good)
    ge_loss_bad: float = 1.0  # drop probability in the bad state (1 - h)
    ge_loss_good: float = 0.0  # drop probability in the good state (1 - k)
    queue_messages: int = 0  # 0: unlimited
    queue_bytes: int = 0  # 0: unlimited
    reorder: bool = False

    @classmethod
    def from_dict(cls, values: dict, where: str = "link") -> LinkProfile:
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise LinkConfigError(f"unknown key {where}.{key}; link keys are {', '.join(sorted(known))}")
            kwargs[key] = parse_bandwidth(value, f"{where}.{key}") if key == "bandwidth" else value
        profile = cls(**kwargs)
        profile.validate(where)
        return profile

    def validate(self, where: str = "link") -> None:
        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                raise LinkConfigError(f"{where}.{key} = {getattr(self, key)!r} must be {rule}")

        for key in ("latency_ms", "jitter_ms"):
            value = getattr(self, key)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                 and value >= 0, key, "a number >= 0 (milliseconds)")
        need(self.jitter_distribution in JITTER_DISTRIBUTIONS, "jitter_distribution",
             f"one of {', '.join(JITTER_DISTRIBUTIONS)}")
        need(self.bandwidth > 0, "bandwidth", "> 0 bytes/s")
        for key in ("loss", "ge_p", "ge_r", "ge_loss_bad", "ge_loss_good"):
            value = getattr(self, key)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1,
                 key, "a probability in [0, 1]")
        for key in ("overhead_bytes", "queue_messages", "queue_bytes"):
            value = getattr(self, key)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 0, key, "an integer >= 0")
        need(isinstance(self.reorder, bool), "reorder", "true or false")

    @property
    def ideal(self) -> bool:
        return self == IDEAL


IDEAL = LinkProfile()


def uniform(seed: int, link: int, direction: int, stream: int, counter: int) -> float:
    """A uniform draw in [0, 1) that depends only on its arguments (counter-based RNG)."""
    digest = hashlib.blake2b(struct.pack("<qqqqq", seed, link, direction, stream, counter), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))


def _standard_normal(u1: float, u2: float) -> float:
    return math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)


def _standard_pareto(u: float) -> float:
    """Pareto(shape 3, scale 1) shifted and scaled to mean 0, standard deviation 1."""
    return ((1.0 - u) ** (-1.0 / _PARETO_ALPHA) - _PARETO_MEAN) / _PARETO_STD


def jitter_sample(profile: LinkProfile, draw) -> float:
    """A jitter in ms; ``draw(i)`` gives the i-th uniform of this message."""
    sigma = profile.jitter_ms
    if sigma == 0:
        return 0.0
    dist = profile.jitter_distribution
    if dist == "uniform":  # netem: uniform in [-jitter, +jitter]
        return sigma * (2.0 * draw(0) - 1.0)
    if dist == "normal":
        return sigma * _standard_normal(draw(0), draw(1))
    if dist == "pareto":
        return sigma * _standard_pareto(draw(0))
    # paretonormal, as netem's table: a quarter normal, three quarters pareto
    return sigma * (0.25 * _standard_normal(draw(0), draw(1)) + 0.75 * _standard_pareto(draw(2)))


@dataclass
class LinkState:
    """What one direction of one link remembers between messages."""

    busy_until: float = 0.0
    last_arrival: float = 0.0
    counter: int = 0
    ge_bad: bool = False
    in_flight: collections.deque = field(default_factory=collections.deque)  # (tx end, size)
    queued_bytes: int = 0


@dataclass
class Verdict:
    """What happened to one message: its arrival time, or why it was dropped."""

    arrival: float | None  # emulated seconds; None when dropped
    dropped: str | None = None  # "loss", "queue", "offline"
    transfer_s: float = 0.0  # arrival - entry


@dataclass
class Bottleneck:
    """A FIFO shared by all clients (the server's uplink or downlink)."""

    bandwidth: float
    busy_until: float = 0.0

    def serialize(self, t: float, size: int) -> float:
        start = max(t, self.busy_until)
        self.busy_until = start + size / self.bandwidth
        return self.busy_until


class Network:
    """Per-client links in both directions, their profiles, and the random decisions."""

    def __init__(self, seed: int = 0, default: LinkProfile = IDEAL,
                 server_up_bandwidth: float = math.inf, server_down_bandwidth: float = math.inf):
        self.seed = seed
        self.default = {UP: default, DOWN: default}
        self.profiles: dict[tuple[int, int], LinkProfile] = {}
        self.states: dict[tuple[int, int], LinkState] = {}
        self.offline: set[int] = set()
        # The server's side: downloads leave through its uplink, uploads enter its downlink.
        self.server_links = {
            DOWN: Bottleneck(server_up_bandwidth) if math.isfinite(server_up_bandwidth) else None,
            UP: Bottleneck(server_down_bandwidth) if math.isfinite(server_down_bandwidth) else None,
        }

    def set_profile(self, link: int, direction: int, profile: LinkProfile) -> None:
        self.profiles[(link, direction)] = profile

    def profile(self, link: int, direction: int) -> LinkProfile:
        return self.profiles.get((link, direction), self.default[direction])

    @property
    def ideal(self) -> bool:
        """True when no message could be delayed or dropped: the broker skips the model."""
        return (not self.offline and all(p.ideal for p in self.default.values())
                and all(p.ideal for p in self.profiles.values())
                and all(b is None for b in self.server_links.values()))

    def transmit(self, link: int, direction: int, size: int, now: float) -> Verdict:
        """Admit a message of ``size`` bytes entering ``link`` at emulated time ``now``."""
        key = (link, direction)
        profile = self.profile(link, direction)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = LinkState()
        counter = state.counter
        state.counter += 1
        if link in self.offline:
            return Verdict(None, "offline")

        def draw(stream: int, i: int = 0) -> float:
            return uniform(self.seed, link, direction, stream * 8 + i, counter)

        if self._lost(profile, state, draw):
            return Verdict(None, "loss")
        wire_size = size + profile.overhead_bytes
        # Queue: messages that entered the link and have not finished serializing.
        while state.in_flight and state.in_flight[0][0] <= now:
            state.queued_bytes -= state.in_flight.popleft()[1]
        if ((profile.queue_messages and len(state.in_flight) >= profile.queue_messages)
                or (profile.queue_bytes and state.queued_bytes + wire_size > profile.queue_bytes)):
            return Verdict(None, "queue")
        entry = now
        shared = self.server_links[direction]
        if direction == DOWN and shared is not None:  # leaves the server through its uplink first
            entry = shared.serialize(entry, wire_size)
        start = max(entry, state.busy_until)
        tx_end = start + wire_size / profile.bandwidth
        state.busy_until = tx_end
        state.in_flight.append((tx_end, wire_size))
        state.queued_bytes += wire_size
        delay = (profile.latency_ms + jitter_sample(profile, lambda i: draw(_STREAM_JITTER, i))) / 1000.0
        arrival = tx_end + max(delay, 0.0)
        if direction == UP and shared is not None:  # then enters the server through its downlink
            arrival = shared.serialize(arrival, wire_size)
        if not profile.reorder:
            arrival = max(arrival, state.last_arrival)
        state.last_arrival = max(state.last_arrival, arrival)
        return Verdict(arrival, None, arrival - now)

    @staticmethod
    def _lost(profile: LinkProfile, state: LinkState, draw) -> bool:
        if profile.ge_p > 0:
            # Gilbert-Elliott: move between the good and bad states, then drop with the
            # new state's loss probability.
            u = draw(_STREAM_GE)
            state.ge_bad = (u >= profile.ge_r) if state.ge_bad else (u < profile.ge_p)
            p = profile.ge_loss_bad if state.ge_bad else profile.ge_loss_good
            return draw(_STREAM_LOSS) < p
        return profile.loss > 0 and draw(_STREAM_LOSS) < profile.loss

    def clear_link(self, link: int) -> None:
        """Forget what is queued on a client's links (it went offline)."""
        for direction in (UP, DOWN):
            state = self.states.get((link, direction))
            if state is not None:
                state.in_flight.clear()
                state.queued_bytes = 0


def with_overrides(profile: LinkProfile, **changes: Any) -> LinkProfile:
    updated = replace(profile, **changes)
    updated.validate()
    return updated
