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

Every random decision is a pure function of (run seed, the decision's purpose, link,
direction, message counter on that link), so the same seed gives the same decisions
whatever the thread or process interleaving. A purpose is a name (``"loss"``,
``"jitter/1"``, ``"group network.dropout.leave[0]"``), so two decisions can only share
draws by sharing a name: independent by construction. Times here are emulated seconds; the broker divides
them by ``time_scale`` to get wall-clock delays.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any

from ..streams import uniform
from .population import LinkTrace, Population, population_from_config
from .time_of_day import HourlyRate, TimeOfDay, time_of_day_from_config
from .traces import RateTrace, StepSeries

UP, DOWN = 0, 1
DIRECTIONS = {"up": UP, "down": DOWN}

JITTER_DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")
TRANSPORTS = ("tcp", "message")
CONGESTION_CONTROLS = ("cubic", "reno")

# Random streams, by purpose: independent draws for independent decisions on the same message.
_STREAM_LOSS, _STREAM_GE = "loss", "gilbert-elliott"
_STREAM_JITTER = tuple(f"jitter/{i}" for i in range(8))  # a jitter sample takes up to 8 uniforms

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
    # How messages cross the link (node/net/tcp.py for "tcp"). Under "tcp", `loss` and the
    # Gilbert-Elliott keys are per packet, not per message.
    transport: str = "tcp"
    # TCP (transport = "tcp" only; docs/network.md, "TCP"):
    mss_bytes: int = 1448  # payload per segment: a 1500-byte MTU less 52 header bytes
    header_bytes: int = 52  # per segment on the wire: IPv4 20 + TCP 20 + timestamp option 12
    init_cwnd_segments: int = 10  # RFC 6928, Linux's default
    congestion: str = "cubic"  # "cubic" (RFC 9438, Linux's default) or "reno" (RFC 5681)
    # Drop-tail buffer at the link, bytes; None: 1,000 packets (tc-netem's default limit),
    # or one bandwidth-delay product where larger (node/net/tcp.py, default_buffer).
    buffer_bytes: int | None = None
    rto_min_s: float = 0.2  # Linux's TCP_RTO_MIN (RFC 6298's 1 s is a SHOULD)
    # A connection whose retransmissions went unanswered this long fails, as Linux gives up
    # after tcp_retries2 = 15 back-offs from a 200 ms RTO: 924.6 s.
    connection_timeout_s: float = 924.6

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
        need(self.transport in TRANSPORTS, "transport", f"one of {', '.join(TRANSPORTS)}")
        need(self.congestion in CONGESTION_CONTROLS, "congestion", f"one of {', '.join(CONGESTION_CONTROLS)}")
        for key, low in (("mss_bytes", 1), ("header_bytes", 0), ("init_cwnd_segments", 1)):
            value = getattr(self, key)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= low, key,
                 f"an integer >= {low}")
        need(self.buffer_bytes is None or (isinstance(self.buffer_bytes, int) and not isinstance(self.buffer_bytes, bool)
                                           and self.buffer_bytes > 0),
             "buffer_bytes", "an integer > 0 (bytes), or left out for one bandwidth-delay product")
        for key in ("rto_min_s", "connection_timeout_s"):
            value = getattr(self, key)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                 and value > 0, key, "a number > 0 (seconds)")
        if self.transport == "tcp":
            # A TCP connection is a byte stream: it neither reorders messages nor drops one
            # because a queue is full (its drop-tail buffer drops packets, which it resends).
            if self.reorder:
                raise LinkConfigError(f"{where}.reorder = true: a TCP connection delivers its messages in "
                                      "order; reorder needs transport = 'message'")
            for key in ("queue_messages", "queue_bytes"):
                if getattr(self, key):
                    raise LinkConfigError(
                        f"{where}.{key} = {getattr(self, key)!r}: under transport = 'tcp' no message is dropped "
                        "for a full queue; the link's drop-tail buffer is buffer_bytes (packets it drops are "
                        "resent). Use buffer_bytes, or transport = 'message' for a message queue limit")
        else:
            for key in _TCP_KEYS:
                if getattr(self, key) != _DEFAULTS[key]:
                    raise LinkConfigError(f"{where}.{key} = {getattr(self, key)!r} applies to transport = 'tcp', "
                                          f"and this link's transport is {self.transport!r}")

    @property
    def ideal(self) -> bool:
        """Whether this link can neither delay nor drop a message, whatever its transport."""
        return (self.latency_ms == 0 and self.jitter_ms == 0 and math.isinf(self.bandwidth)
                and self.overhead_bytes == 0 and self.loss == 0 and self.ge_p == 0
                and self.queue_messages == 0 and self.queue_bytes == 0)


IDEAL = LinkProfile()
_DEFAULTS = {f.name: f.default for f in fields(LinkProfile)}
_TCP_KEYS = ("mss_bytes", "header_bytes", "init_cwnd_segments", "congestion", "buffer_bytes", "rto_min_s",
             "connection_timeout_s")


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
        self.offline: set[int] = set()  # forced offline (the API), besides availability
        self.availability: Availability | None = None
        # Conditions over time: a client's link following its trace (rate, latency,
        # loss), or every link's bandwidth scaled by the client's time of day.
        self.link_traces: dict[int, LinkTrace] = {}
        self.time_of_day: TimeOfDay | None = None
        self.round = 0  # the round the server announced last (for per-round drop-outs)
        # The server's side: downloads leave through its uplink, uploads enter its downlink.
        self.server_links = {
            DOWN: Bottleneck(server_up_bandwidth) if math.isfinite(server_up_bandwidth) else None,
            UP: Bottleneck(server_down_bandwidth) if math.isfinite(server_down_bandwidth) else None,
        }

    def set_profile(self, link: int, direction: int, profile: LinkProfile) -> None:
        self.profiles[(link, direction)] = profile

    def profile(self, link: int, direction: int) -> LinkProfile:
        return self.profiles.get((link, direction), self.default[direction])

    def profile_at(self, link: int, direction: int, now: float) -> LinkProfile:
        """The link's profile for a message entering at ``now``: its trace's latency and
        loss at that time, where it has them, replace the profile's (its rate: ``rate``)."""
        profile = self.profile(link, direction)
        trace = self.link_traces.get(link)
        if trace is None or (trace.latency_ms is None and trace.loss is None):
            return profile
        return dataclasses.replace(
            profile, **({"latency_ms": trace.latency_ms.value_at(now)} if trace.latency_ms is not None else {}),
            **({"loss": trace.loss.value_at(now), "ge_p": 0.0} if trace.loss is not None else {}))

    @property
    def ideal(self) -> bool:
        """True when no message could be delayed or dropped: the broker skips the model."""
        return (not self.offline and self.availability is None and not self.link_traces
                and (self.time_of_day is None or self.time_of_day.bandwidth is None)
                and all(p.ideal for p in self.default.values())
                and all(p.ideal for p in self.profiles.values())
                and all(b is None for b in self.server_links.values()))

    def is_offline(self, link: int, now: float) -> bool:
        if link in self.offline:
            return True
        return self.availability is not None and self.availability.offline(link, now, self.round)

    def transmit(self, link: int, direction: int, size: int, now: float) -> Verdict:
        """Admit a message of ``size`` bytes entering ``link`` at emulated time ``now``."""
        key = (link, direction)
        profile = self.profile_at(link, direction, now)
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = LinkState()
        counter = state.counter
        state.counter += 1
        if self.is_offline(link, now):
            return Verdict(None, "offline")

        def draw(purpose: str) -> float:
            return uniform(self.seed, purpose, link, direction, counter)

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
        tx_end = self.serialized(link, direction, profile.bandwidth, start, wire_size)
        if tx_end == math.inf:  # the link's trace serves nothing from some time on
            return Verdict(None, "outage")
        state.busy_until = tx_end
        state.in_flight.append((tx_end, wire_size))
        state.queued_bytes += wire_size
        delay = (profile.latency_ms + jitter_sample(profile, lambda i: draw(_STREAM_JITTER[i]))) / 1000.0
        arrival = tx_end + max(delay, 0.0)
        if direction == UP and shared is not None:  # then enters the server through its downlink
            arrival = shared.serialize(arrival, wire_size)
        if not profile.reorder:
            arrival = max(arrival, state.last_arrival)
        state.last_arrival = max(state.last_arrival, arrival)
        return Verdict(arrival, None, arrival - now)

    def rate(self, link: int, direction: int, bandwidth: float) -> RateTrace | HourlyRate | None:
        """The link's rate over emulated time where it changes: its trace's, else
        ``bandwidth`` (the profile's) scaled by the client's hour if the network has a
        bandwidth profile; None: a constant ``bandwidth``. A transport asks this for its
        access link (both kinds answer finish, served, value_at, next_change)."""
        trace = self.link_traces.get(link)
        rate = None if trace is None else (trace.up if direction == UP else trace.down)
        if rate is not None:
            return rate
        if self.time_of_day is not None and self.time_of_day.bandwidth is not None and math.isfinite(bandwidth):
            return self.time_of_day.rate(link, direction, bandwidth)
        return None

    def serialized(self, link: int, direction: int, bandwidth: float, start: float, size: int) -> float:
        """When ``size`` bytes that start on the link at ``start`` have all left it."""
        rate = self.rate(link, direction, bandwidth)
        return start + size / bandwidth if rate is None else rate.finish(start, size)

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


# --- availability: when clients are offline ---------------------------------------------

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


# --- the network section of a run's config --------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    # latency_ms is one way: half the round-trip time the sources give.
    "ideal": {},
    "lan": {"latency_ms": 0.25, "bandwidth": "1Gbit"},  # a nominal switched gigabit LAN
    # WebPageTest's connectivity presets "Cable" and "LTE".
    "cable": {"latency_ms": 14, "up": {"bandwidth": "1Mbit"}, "down": {"bandwidth": "5Mbit"}},
    "lte": {"latency_ms": 35, "bandwidth": "12Mbit"},
    # Lighthouse's mobile throttling ("Slow 4G", formerly "Fast 3G"; WebPageTest's
    # "Mobile 3G - Fast"): 150 ms RTT, 1.6 Mbps down, 750 kbps up.
    "3g": {"latency_ms": 75, "up": {"bandwidth": "750kbit"}, "down": {"bandwidth": "1.6Mbit"}},
    # Ookla's Speedtest Global Index, September 2020, global averages (as reported at
    # my-financial-wealth.com/2020/10/25/the-global-mobile-and-broadband-internet-speed-ranking):
    # mobile 35.96 Mbps down, 11.22 Mbps up, 40 ms latency; fixed broadband 85.73 down,
    # 45.74 up, 21 ms. Speedtest's latency is a round trip: half of it each way.
    "mobile-2020": {"latency_ms": 20, "up": {"bandwidth": "11.22Mbit"}, "down": {"bandwidth": "35.96Mbit"}},
    "broadband-2020": {"latency_ms": 10.5, "up": {"bandwidth": "45.74Mbit"}, "down": {"bandwidth": "85.73Mbit"}},
    # Ookla Speedtest Intelligence, the world's median 5G connection in 2023 (reported
    # February 2024): 207 Mbit/s down, 20 Mbit/s up, 44 ms multi-server latency (RTT).
    "5g": {"latency_ms": 22, "up": {"bandwidth": "20Mbit"}, "down": {"bandwidth": "200Mbit"}},
    # A long-haul WAN between sites (cross-silo FL): 78 ms RTT, as WonderProxy's pings
    # New York-Fremont (77.5 ms) and New York-Paris (78.3 ms) ("Miles per Millisecond",
    # 2011), over a nominal gigabit site uplink.
    "wan": {"latency_ms": 39, "bandwidth": "1Gbit"},
}

NETWORK_KEYS = ("seed", "transport", "default_profile", "server_up_bandwidth", "server_down_bandwidth",
                "server_buffer_bytes", "profiles", "assign", "events", "dropout", "traces", "devices", "time_of_day")


def profile_pair(name: str, values: dict, where: str, transport: str = "tcp") -> tuple[LinkProfile, LinkProfile]:
    """(up, down) from a profile table: shared keys, then optional `up`/`down` tables;
    ``transport``: the network's, for a profile that names none."""
    if not isinstance(values, dict):
        raise LinkConfigError(f"{where} must be a table of link keys")
    shared = {"transport": transport, **{k: v for k, v in values.items() if k not in ("up", "down")}}
    pair = []
    for direction in ("up", "down"):
        extra = values.get(direction, {})
        if not isinstance(extra, dict):
            raise LinkConfigError(f"{where}.{direction} must be a table of link keys")
        pair.append(LinkProfile.from_dict({**shared, **extra}, f"{where}.{direction}" if extra else where))
    return pair[0], pair[1]


@dataclass
class ScriptedEvent:
    """At round r or emulated time t, give ``clients`` the named profile."""

    profile: str
    clients: frozenset[int] | None
    at_round: int | None = None
    at_s: float | None = None
    done: bool = False


@dataclass
class NetworkSpec:
    """A validated network section: what the broker needs to emulate every link."""

    num_clients: int
    seed: int = 0
    time_scale: float = 1.0
    default_profile: str = "ideal"
    server_up_bandwidth: float = math.inf
    server_down_bandwidth: float = math.inf
    profiles: dict[str, tuple[LinkProfile, LinkProfile]] = field(default_factory=dict)
    # (profile, clients) in config order; clients is a host's name (a str) for an entry
    # given by ``machine``, until resolve_machines() knows which clients that host runs.
    assign: list[tuple[str, frozenset[int] | str]] = field(default_factory=list)
    events: list[ScriptedEvent] = field(default_factory=list)
    availability: Availability | None = None
    population: Population | None = None  # traces mapped to clients, device classes
    time_of_day: TimeOfDay | None = None
    server_buffer_bytes: int | None = None  # the server's shared links' drop-tail buffers (tcp); None: the model's
    raw: dict = field(default_factory=dict)  # the section as given, to hand to the broker

    @classmethod
    def from_config(cls, section: dict, num_clients: int, run_seed: int, time_scale: float = 1.0) -> NetworkSpec:
        unknown = set(section) - set(NETWORK_KEYS)
        if unknown:
            raise LinkConfigError(f"unknown key network.{sorted(unknown)[0]}; [network] has {', '.join(NETWORK_KEYS)}")
        seed = section.get("seed", run_seed)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise LinkConfigError(f"network.seed = {seed!r} must be an integer in [0, 2**63)")
        if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not time_scale > 0:
            raise LinkConfigError(f"run.time_scale = {time_scale!r} must be a number > 0")
        transport = section.get("transport", "tcp")
        if transport not in TRANSPORTS:
            raise LinkConfigError(f"network.transport = {transport!r} must be one of {', '.join(TRANSPORTS)} "
                                  "(how every profile's messages cross their links, unless the profile says)")
        buffer = section.get("server_buffer_bytes")
        if buffer is not None and (isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer < 2**40):
            raise LinkConfigError(f"network.server_buffer_bytes = {buffer!r} must be an integer in (0, 2**40) "
                                  "(bytes: the drop-tail buffer of each of the server's shared links, under tcp)")
        profiles = {name: profile_pair(name, values, f"network.profiles.{name}", transport)
                    for name, values in PRESETS.items()}
        user_profiles = section.get("profiles", {})
        if not isinstance(user_profiles, dict):
            raise LinkConfigError("network.profiles must be a table of named profiles")
        for name, values in user_profiles.items():
            profiles[name] = profile_pair(name, values, f"network.profiles.{name}", transport)

        def known(name: Any, where: str) -> str:
            if name not in profiles:
                raise LinkConfigError(f"{where} = {name!r} is not a profile; profiles are {', '.join(profiles)}")
            return name

        default = known(section.get("default_profile", "ideal"), "network.default_profile")
        assign = []
        for i, entry in enumerate(section.get("assign", [])):
            where = f"network.assign[{i}]"
            if not isinstance(entry, dict) or set(entry) - {"profile", "clients", "fraction", "machine"}:
                raise LinkConfigError(f"{where} must have profile and clients (ids), fraction or machine")
            name = known(entry.get("profile"), f"{where}.profile")
            if "machine" in entry:
                machine = entry["machine"]
                if len(entry) != 2 or not isinstance(machine, str) or not machine:
                    raise LinkConfigError(f"{where}: machine = {machine!r} must name one host of --machines "
                                          "(as given there), with no clients or fraction beside it")
                assign.append((name, machine))
                continue
            assign.append((name, _group(entry, where, num_clients, seed, required=True)))
        events = []
        for i, entry in enumerate(section.get("events", [])):
            where = f"network.events[{i}]"
            if not isinstance(entry, dict) or set(entry) - {"profile", "clients", "fraction", "at_round", "at_s"}:
                raise LinkConfigError(f"{where} has keys profile, clients or fraction, at_round or at_s")
            if ("at_round" in entry) == ("at_s" in entry):
                raise LinkConfigError(f"{where} needs exactly one of at_round and at_s")
            events.append(ScriptedEvent(known(entry.get("profile"), f"{where}.profile"),
                                        _group(entry, where, num_clients, seed),
                                        entry.get("at_round"), entry.get("at_s")))
        population = population_from_config(section, num_clients, seed,
                                            lambda entry, where: _group(entry, where, num_clients, seed), LinkConfigError)
        time_of_day = time_of_day_from_config(section.get("time_of_day", {}), num_clients, seed, parse_ids,
                                              LinkConfigError)
        availability = _availability(section.get("dropout", {}), num_clients, seed)
        traced = population.online()
        if traced or (time_of_day is not None and time_of_day.online is not None):
            availability = availability or Availability(seed=seed)
            availability.traced = traced
            availability.diurnal = time_of_day if time_of_day is not None and time_of_day.online is not None else None
        return cls(
            num_clients=num_clients, seed=seed, time_scale=float(time_scale), default_profile=default,
            server_up_bandwidth=parse_bandwidth(section.get("server_up_bandwidth", "unlimited"), "network.server_up_bandwidth"),
            server_down_bandwidth=parse_bandwidth(section.get("server_down_bandwidth", "unlimited"), "network.server_down_bandwidth"),
            profiles=profiles, assign=assign, events=events, availability=availability, population=population,
            time_of_day=time_of_day, server_buffer_bytes=buffer, raw=section,
        )

    @property
    def server_buffers(self) -> dict[int, float] | None:
        """The server's shared links' buffers for the TCP model (None: its default)."""
        if self.server_buffer_bytes is None:
            return None
        return {UP: float(self.server_buffer_bytes), DOWN: float(self.server_buffer_bytes)}

    @property
    def can_drop(self) -> bool:
        """Whether this network can lose a message or take a client offline."""
        used = {self.default_profile, *(name for name, _ in self.assign), *(e.profile for e in self.events)}
        # Under tcp a lost packet is sent again, never the message: only drop-outs lose one.
        lossy = any(p.transport == "message" and (p.loss > 0 or p.ge_p > 0 or p.queue_messages or p.queue_bytes)
                    for name in used for p in self.profiles[name])
        traced = self.population is not None and any(t.loss is not None or t.up is not None or t.down is not None
                                                      for t in self.population.links().values())  # loss, outages
        return lossy or traced or self.availability is not None

    @property
    def machines(self) -> list[str]:
        """Hosts named by ``machine`` entries of network.assign."""
        return [clients for _, clients in self.assign if isinstance(clients, str)]

    def resolve_machines(self, clients_of: dict[str, range]) -> list[tuple[str, frozenset[int]]]:
        """network.assign with every ``machine`` entry replaced by the clients that host
        runs, in config order (a later entry wins, as in build())."""
        resolved = []
        for i, (name, clients) in enumerate(self.assign):
            if isinstance(clients, str):
                if clients not in clients_of:
                    raise LinkConfigError(f"network.assign[{i}].machine = {clients!r} is not a host of this run; "
                                          f"the hosts are {', '.join(clients_of) or 'none (a local run)'}")
                clients = frozenset(clients_of[clients])
            resolved.append((name, clients))
        return resolved

    def build(self) -> Network:
        up, down = self.profiles[self.default_profile]
        network = Network(self.seed, server_up_bandwidth=self.server_up_bandwidth,
                          server_down_bandwidth=self.server_down_bandwidth)
        network.default = {UP: up, DOWN: down}
        for name, clients in self.assign:
            if not isinstance(clients, str):  # a host's clients arrive with set_links once placed
                self.apply(network, name, clients)
        network.availability = self.availability
        if self.population is not None:
            network.link_traces = self.population.links()
        network.time_of_day = self.time_of_day
        return network

    def apply(self, network: Network, profile: str, clients: frozenset[int] | None) -> None:
        up, down = self.profiles[profile]
        for k in (range(self.num_clients) if clients is None else clients):
            network.set_profile(k, UP, up)
            network.set_profile(k, DOWN, down)


def _group(entry: dict, where: str, num_clients: int, seed: int, required: bool = False):
    if "clients" in entry and "fraction" in entry:
        raise LinkConfigError(f"{where}: give clients or fraction, not both")
    if "clients" in entry:
        return parse_ids(entry["clients"], f"{where}.clients", num_clients)
    if "fraction" in entry:
        fraction = entry["fraction"]
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise LinkConfigError(f"{where}.fraction = {fraction!r} must be in [0, 1]")
        # A seeded choice of round(fraction * K) clients: the same group on every rerun, and
        # its own stream (named by the config path), independent of every other group's.
        order = sorted(range(num_clients), key=lambda k: uniform(seed, f"group {where}", k, 0, 0))
        return frozenset(order[: round(fraction * num_clients)])
    if required:
        raise LinkConfigError(f"{where} needs clients (e.g. '0-49') or fraction")
    return None


def _availability(section: Any, num_clients: int, seed: int) -> Availability | None:
    if not isinstance(section, dict):
        raise LinkConfigError("network.dropout must be a table")
    allowed = {"per_round", "clients", "windows", "leave", "on_off"}
    if set(section) - allowed:
        raise LinkConfigError(f"unknown key network.dropout.{sorted(set(section) - allowed)[0]}; "
                              f"[network.dropout] has {', '.join(sorted(allowed))}")
    if not section:
        return None
    per_round = section.get("per_round", 0.0)
    if isinstance(per_round, bool) or not isinstance(per_round, (int, float)) or not 0 <= per_round <= 1:
        raise LinkConfigError(f"network.dropout.per_round = {per_round!r} must be a probability in [0, 1]")
    avail = Availability(seed=seed, per_round=float(per_round),
                         per_round_clients=_group(section, "network.dropout", num_clients, seed))
    for i, w in enumerate(section.get("windows", [])):
        where = f"network.dropout.windows[{i}]"
        start, end = (w.get("start_s"), w.get("end_s")) if isinstance(w, dict) else (None, None)
        if not isinstance(start, (int, float)) or not isinstance(end, (int, float)) or not 0 <= start < end:
            raise LinkConfigError(f"{where} needs 0 <= start_s < end_s (emulated seconds)")
        avail.windows.append((_group(w, where, num_clients, seed), float(start), float(end)))
    for i, entry in enumerate(section.get("leave", [])):
        where = f"network.dropout.leave[{i}]"
        at = entry.get("at_s") if isinstance(entry, dict) else None
        if not isinstance(at, (int, float)) or at < 0:
            raise LinkConfigError(f"{where} needs at_s >= 0 (emulated seconds)")
        avail.leave.append((_group(entry, where, num_clients, seed), float(at)))
    if "on_off" in section:
        entry = section["on_off"]
        where = "network.dropout.on_off"
        up, down = (entry.get("mean_up_s"), entry.get("mean_down_s")) if isinstance(entry, dict) else (None, None)
        if not all(isinstance(x, (int, float)) and x > 0 for x in (up, down)):
            raise LinkConfigError(f"{where} needs mean_up_s > 0 and mean_down_s > 0 (emulated seconds)")
        avail.on_off = (_group(entry, where, num_clients, seed), float(up), float(down))
    return avail

