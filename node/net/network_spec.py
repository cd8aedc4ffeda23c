"""The [network] section of a run's config as a :class:`NetworkSpec`: the named link
presets and profiles, which clients get which, scripted events, drop-outs, traces and the
time of day; :meth:`NetworkSpec.build` makes the broker's :class:`~.links.Network`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..schema import did_you_mean, did_you_mean_key
from ..streams import uniform
from .availability import Availability, parse_ids
from .links import Network
from .population import Population, population_from_config
from .profiles import DOWN, TRANSPORTS, UP, LinkConfigError, LinkProfile, parse_bandwidth
from .time_of_day import TimeOfDay, time_of_day_from_config

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
            key = sorted(unknown)[0]
            raise LinkConfigError(f"unknown key network.{key}{did_you_mean_key('network', key, NETWORK_KEYS)}; "
                                  f"[network] has {', '.join(NETWORK_KEYS)}")
        seed = section.get("seed", run_seed)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise LinkConfigError(f"network.seed = {seed!r} must be an integer in [0, 2**63)")
        if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) or not time_scale > 0:
            raise LinkConfigError(f"run.time_scale = {time_scale!r} must be a number > 0")
        transport = section.get("transport", "tcp")
        if transport not in TRANSPORTS:
            raise LinkConfigError(f"network.transport = {transport!r}{did_you_mean(transport, TRANSPORTS)} "
                                  f"must be one of {', '.join(TRANSPORTS)} "
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
                raise LinkConfigError(f"{where} = {name!r} is not a profile{did_you_mean(name, profiles)}; "
                                      f"profiles are {', '.join(profiles)}")
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
        key = sorted(set(section) - allowed)[0]
        raise LinkConfigError(f"unknown key network.dropout.{key}{did_you_mean_key('network.dropout', key, allowed)}; "
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

