"""Which TCP the model follows, and what a link brings when the config leaves it out.

The model is Linux's TCP (:data:`LINUX`). Where TCP implementations differ in a way the
model can follow either, the choice is a field of :class:`Stack`; :data:`NS3_337` is
ns-3 3.37's TCP, so bench/transport_fidelity.py can show which of the model's
differences from ns-3 come from these choices. :data:`STACK` is the one followed now.
The code reads it as ``presets.STACK`` at each use (never ``from .presets import
STACK``), so that setting it here, or as ``tcp.STACK`` (the package forwards it here),
takes effect at once.

Also here: the receiver's delayed ACKs and the default drop-tail buffer, which the
window (window.py), the recovery (recovery.py) and the bottleneck (bottleneck.py,
shared.py) all assume.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..profiles import LinkProfile


@dataclass(frozen=True)
class Stack:
    """The choices in which TCP implementations differ and the model can follow either.
    LINUX is the model (what fedemu emulates); NS3_337 is ns-3 3.37's TCP, for the
    benchmark to show which of its differences from ns-3 come from these choices."""

    reno_friendly: bool  # CUBIC's Reno-friendly region (RFC 9438 4.3; ns-3 from 3.41)
    hystart: bool  # CUBIC's hybrid slow start
    hystart_train: float  # the ACK train ends slow start past this share of the min RTT
    hystart_delay: tuple[float, float, float]  # RTT rise: clamp(min RTT / a, b s, c s)
    backoff_until_sample: bool  # a backed-off RTO holds until an RTT sample of new data
    # The receiver ACKs the first data segment alone, then every second one, so the
    # last of an even first window is ACKed only with the next, unless the delayed-ACK
    # timer fires first (ns-3); Linux's receiver quick-ACKs a connection's first
    # segments (and after idle).
    first_ack_alone: bool
    # CUBIC's slow start adds all an ACK acknowledged even past ssthresh (ns-3's
    # TcpCubic; its TcpLinuxReno and Linux stop at ssthresh, the rest counted in
    # congestion avoidance).
    slow_start_overshoots: bool
    # The retransmission timeout's floor: Linux floors the variance term (RTO = srtt +
    # max(4 rttvar, rto_min): its rttvar never falls below tcp_rto_min), RFC 6298 and
    # ns-3 the sum (max(rto_min, srtt + 4 rttvar)), 70 ms shorter on `lte`.
    rto_floors_variance: bool


LINUX = Stack(reno_friendly=True, hystart=True, hystart_train=0.5, hystart_delay=(8, 0.004, 0.016),
              backoff_until_sample=False, first_ack_alone=False, slow_start_overshoots=False,
              rto_floors_variance=True)
NS3_337 = Stack(reno_friendly=False, hystart=True, hystart_train=1.0, hystart_delay=(1, 0.004, 1.0),
                backoff_until_sample=True, first_ack_alone=True, slow_start_overshoots=True,
                rto_floors_variance=False)
STACK = LINUX

DELAYED_ACK_SEGMENTS = 2  # RFC 1122/5681: an ACK for every second full segment
DELAYED_ACK_TIMEOUT_S = 0.04  # Linux's minimum delayed-ACK timer (TCP_ATO_MIN)
BUFFER_PACKETS = 1000  # tc-netem's default queue limit, Linux's default txqueuelen
FULL_SEGMENT = 1448 + 52  # a default segment on the wire (the shared links' default buffer)


def default_buffer(profile: LinkProfile, reverse: LinkProfile) -> float:
    """A link's drop-tail buffer when ``buffer_bytes`` is left out: tc-netem's default
    queue limit (1,000 packets; Linux's default txqueuelen too), or one bandwidth-delay
    product of the connection's base round trip where that is larger (the rule of thumb
    that lets one flow keep its link busy through a window reduction, Villamizar &
    Song 1994)."""
    if profile.buffer_bytes is not None:
        return float(profile.buffer_bytes)
    segment = profile.mss_bytes + profile.header_bytes
    rtt = (profile.latency_ms + reverse.latency_ms) / 1000.0
    return max(profile.bandwidth * rtt, BUFFER_PACKETS * segment)
