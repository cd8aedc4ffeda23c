"""A link's settings (:class:`LinkProfile`: latency, jitter, bandwidth, loss, queue limits
and the TCP transport's knobs), their units and checks, and the jitter distributions as
tc-netem defines them."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from ..schema import did_you_mean_key

UP, DOWN = 0, 1
DIRECTIONS = {"up": UP, "down": DOWN}

JITTER_DISTRIBUTIONS = ("uniform", "normal", "pareto", "paretonormal")
TRANSPORTS = ("tcp", "message")
CONGESTION_CONTROLS = ("cubic", "reno")


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
                raise LinkConfigError(f"unknown key {where}.{key}{did_you_mean_key(where, key, known)}; "
                                      f"link keys are {', '.join(sorted(known))}")
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


