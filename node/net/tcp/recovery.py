"""Loss recovery: what a round's ACKs tell the sender, and what it does about a loss.

* the RTT estimator and the retransmission timer (RFC 6298's estimator; Linux's floor,
  srtt + max(4 rttvar, ``rto_min_s``), or RFC 6298's as the stack says; doubled per
  expiry up to :data:`RTO_MAX_S`);
* SACK-based fast retransmit once three segments after a hole arrived (limited
  transmit, RFC 3042, lends two), one window reduction per episode, then proportional
  rate reduction (RFC 6937: :func:`enter_recovery` sets it up, connection.py's round
  plan spends its budget);
* the timeout: everything unacknowledged is lost, the window restarts from one
  segment. A lost retransmission, too, waits for the timer (as with RFC 6675).

Pure functions of one :class:`~.state.Flow`; the window's own arithmetic is window.py's.
What the connection does around them (a connection that times out for good, the round
of retransmissions) is connection.py's.
"""
from __future__ import annotations

import math

from ..profiles import LinkProfile
from . import presets, window
from .presets import DELAYED_ACK_SEGMENTS, DELAYED_ACK_TIMEOUT_S
from .state import LOSS, OPEN, RECOVERY, Flow, Round

DUPTHRESH = 3  # RFC 5681
LIMITED_TRANSMIT = 2  # RFC 3042
RTO_MAX_S = 120.0  # Linux's TCP_RTO_MAX


def rtt_sample(flow: Flow, sample: float, acks: int, profile: LinkProfile) -> None:
    """Fold one round's sample in as ``acks`` per-ACK samples of the same value
    (with timestamps every ACK is a sample), in closed form."""
    if flow.srtt is None:
        flow.srtt, flow.rttvar = sample, sample / 2
        acks -= 1
    if acks > 0:
        d = abs(flow.srtt - sample)
        a, b = 0.875 ** acks, 0.75 ** acks
        flow.rttvar = b * flow.rttvar + 2.0 * d * (a - b)
        flow.srtt = sample + (flow.srtt - sample) * a
    if presets.STACK.rto_floors_variance:
        rto = flow.srtt + max(4 * flow.rttvar, profile.rto_min_s)
    else:
        rto = max(profile.rto_min_s, flow.srtt + 4 * flow.rttvar)
    flow.rto = min(rto, RTO_MAX_S)


def feedback(flow: Flow, rnd: Round, t: float, profile: LinkProfile) -> None:
    """What the ACKs of ``rnd`` tell the sender: RTT, what arrived, what was lost."""
    n, lost = rnd.n, rnd.lost
    delivered = n - len(lost)
    flow.clock = delivered  # the ACKs that clock the next round
    flow.ss_grown = 0.0  # of which, ACKs that grew the window in slow start
    sample = t - rnd.release
    if rnd.new and delivered:  # Karn: a round of retransmissions only gives no sample
        rtt_sample(flow, sample, max(1, delivered // DELAYED_ACK_SEGMENTS), profile)
        flow.delay_min = min(flow.delay_min, sample)
    had_holes = bool(flow.undetected or flow.stuck or flow.lost)
    acked_to = first_hole(flow, rnd.segments[0][0] if rnd.segments[0] else math.inf)
    first_lost = rnd.lost_positions[0] if lost else n
    if lost:
        rtx = rnd.segments[0]
        if rtx:
            retransmitted = set(rtx)
            flow.stuck = sorted(flow.stuck + [seg for seg in lost if seg in retransmitted])
            fresh = [seg for seg in lost if seg not in retransmitted]
        else:
            fresh = lost
        if fresh and not flow.undetected:
            # Duplicate ACKs: what arrived after the first fresh hole of this round.
            first = rnd.lost_positions[lost.index(fresh[0])]
            flow.dupacks = (n - first - 1) - (len(lost) - lost.index(fresh[0]) - 1)
        elif flow.undetected:
            flow.dupacks += delivered
        flow.undetected = sorted(flow.undetected + fresh) if flow.undetected else fresh
    elif flow.undetected:
        flow.dupacks += delivered
    # The cumulative ACK advanced: the timer's back-off ends (with timestamps, the
    # ACK of a retransmission is an RTT sample too, RFC 7323 and Linux).
    if delivered and (rnd.segments[0] or (first_lost > 0 and not had_holes)):
        if not presets.STACK.backoff_until_sample or (rnd.new and first_lost > 0):
            flow.backoff = 1.0
        flow.stall_since = None
    if flow.stuck:
        if flow.t_rto is None:
            flow.t_rto = t + flow.rto * flow.backoff
    elif not flow.undetected and not flow.lost:
        flow.t_rto = None
    acked = 0 if had_holes else first_lost  # cumulatively acknowledged, before any hole
    if presets.STACK.first_ack_alone and flow.rounds == 1 and not lost and n % 2 == 0 and acked \
            and sample < DELAYED_ACK_TIMEOUT_S:
        acked -= 1  # the first window's last segment is ACKed with the next window
        flow.clock -= 1
    if flow.phase == RECOVERY:
        flow.prr_delivered += delivered
        flow.prr_last = delivered
        if flow.undetected and flow.dupacks >= DUPTHRESH:
            # SACK shows holes in what recovery sent: resent in the same episode.
            flow.lost = sorted(flow.lost + flow.undetected)
            flow.undetected, flow.dupacks = [], 0
        if not flow.stuck and not (flow.lost and flow.lost[0] < flow.recover) \
                and not (flow.undetected and flow.undetected[0] < flow.recover):
            # RFC 6937: the window ends at ssthresh. Holes past the recovery point
            # that SACK showed during the episode are resent in it, not counted as
            # another congestion event (as ns-3's recovery does).
            flow.phase = OPEN
            flow.cwnd = max(flow.ssthresh, 1.0)
        acked = 0
    elif flow.phase == LOSS:
        # After a timeout the cumulative ACK jumps over what SACK had seen arrive:
        # the window grows by that advance.
        advance = first_hole(flow, math.inf) - acked_to
        if advance > 0:
            window.slow_start(flow, advance, rnd, t, sample)
        if not flow.lost and not flow.stuck:
            flow.phase = OPEN
        acked = 0
    if flow.phase == OPEN:
        if acked:  # these ACKs come before the duplicates
            window.grow(flow, acked, rnd, t, sample)
        if flow.undetected and flow.dupacks >= DUPTHRESH:
            enter_recovery(flow, rnd, acked, delivered - acked if acked else delivered)


def first_hole(flow: Flow, also: float) -> float:
    """The first segment not yet delivered (what the cumulative ACK stops at)."""
    first = min(also, flow.next_seg)
    for holes in (flow.lost, flow.stuck, flow.undetected):
        if holes and holes[0] < first:
            first = holes[0]
    return first


def enter_recovery(flow: Flow, rnd: Round, acked: int, after: int) -> None:
    """Fast retransmit: three segments arrived past a hole (SACK shows them all);
    the window is reduced once for the episode. Before the third duplicate ACK,
    the ACKs of this round up to the hole slid the window (and limited transmit
    sent two more): those go out first, then the retransmissions."""
    outstanding = rnd.n - acked
    flow.pre_sends = max(0, int(flow.cwnd) - outstanding) + LIMITED_TRANSMIT
    # The ACKs of the round come one after another: the third duplicate, which
    # starts the recovery, comes after those up to the hole and three more.
    flow.detect_delay = (acked + DUPTHRESH) * flow.segment_wire / rnd.rate if 0 < rnd.rate < math.inf else 0.0
    flow.pre_clock = acked
    flow.phase = RECOVERY
    window.reduce(flow)
    flow.lost = sorted(flow.lost + flow.undetected)
    flow.undetected = []
    flow.dupacks = 0
    # The episode covers everything sent by the time of detection (RFC 6675's
    # RecoveryPoint = HighData), the sends that slid the window included.
    flow.recover = flow.next_seg + min(flow.pre_sends, flow.end_seg - flow.next_seg)
    # PRR: the flight at detection, and what of it has been delivered since.
    flow.recover_fs = max(1, outstanding + flow.pre_sends)
    flow.prr_delivered = flow.prr_last = after
    flow.prr_out = 0


def timeout(flow: Flow) -> None:
    """The retransmission timer expired and the connection lives on: everything
    unacknowledged is taken as lost, the window restarts from one segment, the timer
    backs off (RFC 6298). The caller then sends the round of retransmissions."""
    rnd, flow.round = flow.round, None
    flow.t_round, flow.waking = None, False
    if rnd is not None:  # what that round lost is lost; what it delivered is SACKed
        flow.lost = flow.lost + rnd.lost
    if flow.phase != LOSS:
        window.reduce(flow)
    flow.phase = LOSS
    flow.lost = sorted(set(flow.lost + flow.undetected + flow.stuck))
    flow.undetected, flow.stuck, flow.dupacks = [], [], 0
    flow.cwnd = 1.0
    # CUBIC forgets its history on a timeout (Linux's bictcp_reset and hystart reset).
    flow.w_max, flow.epoch, flow.delay_min, flow.found = 0.0, None, math.inf, False
    flow.backoff = min(flow.backoff * 2, RTO_MAX_S / flow.rto)
    flow.clock = 0
