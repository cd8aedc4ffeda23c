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

Here: the model (:class:`Network`, a link's :class:`LinkState`). A link's settings are
profiles.py's, when clients are offline availability.py's, and the [network] section of a
run's config network_spec.py's.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field

from ..streams import uniform
from .availability import Availability
from .population import LinkTrace
from .profiles import DOWN, IDEAL, UP, LinkProfile, jitter_sample
from .time_of_day import HourlyRate, TimeOfDay
from .traces import RateTrace

# Random streams, by purpose: independent draws for independent decisions on the same message.
_STREAM_LOSS, _STREAM_GE = "loss", "gilbert-elliott"
_STREAM_JITTER = tuple(f"jitter/{i}" for i in range(8))  # a jitter sample takes up to 8 uniforms


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




# Names that lived here before issue 51 split this file: still importable, with a warning.
_MOVED_TO = {"network_spec": ("NetworkSpec", "ScriptedEvent", "PRESETS", "NETWORK_KEYS", "profile_pair"),
             "availability": ("parse_ids",),
             "profiles": ("CONGESTION_CONTROLS", "DIRECTIONS", "JITTER_DISTRIBUTIONS", "TRANSPORTS",
                          "LinkConfigError", "parse_bandwidth")}


def __getattr__(name: str):
    for module, names in _MOVED_TO.items():
        if name in names:
            # lazy: only an old import path gets here
            import importlib
            import warnings

            warnings.warn(f"fedemu.node.net.links.{name} has moved to fedemu.node.net.{module}; import it from "
                          "there (the old path will go in a later release)", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(f"{__package__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
