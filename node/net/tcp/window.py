"""The congestion window: how much a sender may have in flight, grown and cut.

* slow start by bytes acknowledged (RFC 3465 with no limit, as Linux), ended early by
  CUBIC's HyStart (Ha & Rhee 2011, with Linux's thresholds) when the ACK train or the
  round trip shows the pipe is full;
* congestion avoidance by CUBIC (RFC 9438, with Linux's Reno-friendly region and fast
  convergence) or Reno (RFC 5681);
* the reduction after a congestion event (ssthresh, CUBIC's W_max);
* the restart after the connection sat idle longer than its RTO (RFC 7661 as Linux's
  tcp_slow_start_after_idle = 1 does it).

Pure functions of one :class:`~.state.Flow`: recovery.py reads the ACKs and calls them;
where Linux and ns-3 differ, ``presets.STACK`` says which way to go.
"""
from __future__ import annotations

import math

from ..profiles import LinkProfile
from . import presets
from .presets import DELAYED_ACK_SEGMENTS
from .state import OPEN, Flow, Round

# Congestion control constants, as Linux (net/ipv4/tcp_cubic.c) and RFC 9438 give them.
CUBIC_C = 0.4
CUBIC_BETA = 0.7  # Linux: 717/1024
RENO_BETA = 0.5
CUBIC_RENO_ALPHA = 3 * (1 - CUBIC_BETA) / (1 + CUBIC_BETA)  # RFC 9438, Reno-friendly region
CUBIC_CNT_CLAMP = 20  # Linux: with no loss seen yet, grow at least 5% per RTT
HYSTART_LOW_WINDOW = 16  # segments
HYSTART_MIN_SAMPLES = 8  # ACKs of a round before the delay test
HYSTART_ACK_DELTA_S = 0.002  # ACKs further apart break the ACK train


def restart_window(flow: Flow, t: float, profile: LinkProfile) -> None:
    """Linux's tcp_cwnd_restart: the window halves per RTO idle, down to
    min(initial window, cwnd); ssthresh keeps 3/4 of the old window."""
    restart = min(float(profile.init_cwnd_segments), flow.cwnd)
    flow.ssthresh = max(flow.ssthresh, 0.75 * flow.cwnd)
    idle = t - flow.lsnd - flow.rto
    while idle > 0 and flow.cwnd > restart:
        flow.cwnd = math.floor(flow.cwnd / 2)
        idle -= flow.rto
    flow.cwnd = max(flow.cwnd, restart)
    if flow.epoch is not None:  # CUBIC: idle time does not count as growth time
        flow.epoch = min(flow.epoch + (t - flow.lsnd), t)


def grow(flow: Flow, acked: int, rnd: Round, t: float, sample: float) -> None:
    """``acked`` segments newly acknowledged in the open phase: slow start up to
    ssthresh, the rest in congestion avoidance."""
    if not rnd.cwnd_limited:
        # Linux's tcp_is_cwnd_limited: an application-limited window grows only in
        # slow start, and only up to twice what was out.
        if flow.cwnd < flow.ssthresh:
            flow.cwnd += max(0.0, min(acked, 2 * rnd.n - flow.cwnd, flow.ssthresh - flow.cwnd))
        return
    if flow.cwnd < flow.ssthresh:
        acked = slow_start(flow, acked, rnd, t, sample)
    if acked > 0:
        avoid(flow, acked, t)


def slow_start(flow: Flow, acked: int, rnd: Round, t: float, sample: float) -> int:
    """cwnd grows by what was acked (ABC), up to ssthresh or HyStart's exit;
    returns what is left over for congestion avoidance."""
    if flow.cc == "cubic" and presets.STACK.hystart and not flow.found and flow.phase == OPEN:
        hystart(flow, acked, rnd, sample)
    if presets.STACK.slow_start_overshoots and flow.cc == "cubic":
        grow = acked
    else:
        grow = min(acked, max(0.0, flow.ssthresh - flow.cwnd))
    flow.cwnd += grow
    flow.ss_grown += grow
    return int(acked - grow)


def hystart(flow: Flow, acked: int, rnd: Round, sample: float) -> None:
    """HyStart (Ha & Rhee 2011, Linux's thresholds) over this round's ACK train:
    slow start ends where the train outlasts half the minimum RTT (the pipe is
    full) or the round's RTT rose clearly above the minimum (a queue builds), with
    ssthresh the window at that ACK."""
    delay_min = flow.delay_min
    start = max(0.0, HYSTART_LOW_WINDOW - flow.cwnd)  # tested from cwnd = the low window on
    if not math.isfinite(delay_min) or start >= acked:
        return
    exit_at = math.inf  # segments acked in this round when HyStart fires
    # Strictly: a real link adds its framing (Ethernet, PPP) to the IP bytes counted here,
    # so ACKs of two full segments at exactly 12 Mbit/s come more than 2 ms apart.
    if 0 < rnd.rate < math.inf and DELAYED_ACK_SEGMENTS * flow.segment_wire / rnd.rate < HYSTART_ACK_DELTA_S:
        train = presets.STACK.hystart_train * delay_min * rnd.rate / flow.segment_wire  # segments acked by then
        if train < acked:
            exit_at = max(start, train)
    samples = DELAYED_ACK_SEGMENTS * HYSTART_MIN_SAMPLES
    if acked >= samples:
        share, low, high = presets.STACK.hystart_delay
        threshold = delay_min + min(max(delay_min / share, low), high)
        if sample > threshold:
            exit_at = min(exit_at, max(start, samples))
    if exit_at < math.inf:
        flow.found = True
        flow.ssthresh = min(flow.ssthresh, flow.cwnd + exit_at)


def avoid(flow: Flow, acked: int, t: float) -> None:
    """Congestion avoidance for ``acked`` segments acknowledged at t."""
    cwnd = flow.cwnd
    if flow.cc == "reno":
        flow.cwnd = cwnd + acked / cwnd
        return
    if flow.epoch is None:
        flow.epoch = t
        flow.w_est = cwnd
        if flow.w_max <= cwnd:
            flow.k, flow.origin = 0.0, cwnd
        else:
            flow.k = ((flow.w_max - cwnd) / CUBIC_C) ** (1 / 3)
            flow.origin = flow.w_max
    elapsed = t + (flow.delay_min if math.isfinite(flow.delay_min) else 0.0) - flow.epoch
    target = flow.origin + CUBIC_C * (elapsed - flow.k) ** 3
    cnt = cwnd / (target - cwnd) if target > cwnd else 100 * cwnd
    if flow.w_max == 0 and cnt > CUBIC_CNT_CLAMP:
        cnt = CUBIC_CNT_CLAMP
    # Reno-friendly region (RFC 9438 4.3): W_est grows alpha per window acked.
    flow.w_est += CUBIC_RENO_ALPHA * acked / cwnd
    if presets.STACK.reno_friendly and flow.w_est > cwnd:
        cnt = min(cnt, cwnd / (flow.w_est - cwnd))
    cnt = max(cnt, 2.0)  # at most 1.5x per round trip
    flow.cwnd = cwnd + acked / cnt


def reduce(flow: Flow) -> None:
    """ssthresh after a congestion event (and CUBIC's W_max)."""
    cwnd = flow.cwnd
    if flow.cc == "reno":
        flow.ssthresh = max(cwnd * RENO_BETA, 2.0)
        return
    flow.epoch = None
    if cwnd < flow.w_max:  # fast convergence
        flow.w_max = cwnd * (1 + CUBIC_BETA) / 2
    else:
        flow.w_max = cwnd
    flow.ssthresh = max(cwnd * CUBIC_BETA, 2.0)
