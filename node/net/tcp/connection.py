"""A client's connection, one direction's sender: opening, rounds, timeouts and failure.

The model steps each sender once per round trip, not per packet, so 1,000 concurrent
flows stay cheap. A round is a window of segments released by the previous round's
ACKs (or, with none due, by data arriving at an idle connection): the ACKs are read
(recovery.py, which grows or cuts the window, window.py), the next round is planned
(retransmissions first, then new data, as the window or PRR allows), the buffer drops
what it cannot hold of what piles up (bottleneck.py, shared.py), the link loses its
share (losses.py), and the round joins the queue at the bottleneck (bottleneck.py).
Rounds released at the same instant into a shared link are released together: they
share its buffer.

A connection opens on its first data (the handshake's round trip is the first RTT
sample), restarts its window after idle, and fails with its messages when the client
goes offline or its retransmissions go unanswered for ``connection_timeout_s``; the
next data opens a new one.

:class:`Connections` is the part of :class:`~.scheduler.TcpTransport` that does this.
Every random draw comes from :meth:`_draw`: a named stream (node/streams.py) of (seed,
purpose, link, direction, the flow's draw counter).
"""
from __future__ import annotations

import math
import random

from ...streams import uniform
from ..profiles import DOWN, UP, LinkProfile
from . import recovery, window
from .losses import overflow_positions, random_losses, segment_at
from .recovery import LIMITED_TRANSMIT
from .state import OPEN, RECOVERY, Failure, Flow, Plan, Round

_NONE: frozenset = frozenset()


class Connections:
    """The senders of every client's connection (see the module's docstring)."""

    def _flow(self, link: int, direction: int) -> Flow:
        flow = self.flows.get((link, direction))
        if flow is None:
            flow = self.flows[(link, direction)] = Flow(link, direction)
        return flow

    def _ideal(self, link: int, direction: int, profile: LinkProfile) -> bool:
        if self.shared[direction] is not None or not math.isinf(profile.bandwidth):
            return False
        if profile.latency_ms or profile.jitter_ms or profile.loss or profile.ge_p:
            return False
        reverse = self.profile(link, 1 - direction)
        return not (reverse.latency_ms or reverse.jitter_ms)

    def _wake(self, flow: Flow, t: float, profile: LinkProfile) -> int:
        """Data to send and no round awaiting ACKs: open the connection, or restart its
        window after idle. Returns what is still in flight from before."""
        if not flow.connected:
            flow.connected = True
            flow.cc = profile.congestion
            flow.cwnd = float(profile.init_cwnd_segments)
            flow.segment_wire = profile.mss_bytes + profile.header_bytes
            # The handshake's round trip is the first RTT sample (RFC 6298 2.2).
            rtt = self._base_rtt(flow, profile)
            recovery.rtt_sample(flow, rtt, 1, profile)
            flow.delay_min = rtt
            return 0
        if not (flow.lost or flow.undetected or flow.stuck) and t - flow.lsnd > flow.rto and t >= flow.ack_end:
            window.restart_window(flow, t, profile)
        return self._outstanding(flow, t)

    def _base_rtt(self, flow: Flow, profile: LinkProfile) -> float:
        reverse = self.profile(flow.link, 1 - flow.direction)
        segment = profile.mss_bytes + profile.header_bytes
        rate = self._path_rate(flow, profile)
        return ((profile.latency_ms + reverse.latency_ms) / 1000.0 + segment / rate
                + profile.header_bytes / reverse.bandwidth)

    def _path_rate(self, flow: Flow, profile: LinkProfile) -> float:
        shared = self.shared[flow.direction]
        return profile.bandwidth if shared is None else min(profile.bandwidth, shared.bandwidth)

    def _on_rounds(self, flows: list[Flow], t: float) -> None:
        """Several flows' ACKs arrive at the same instant: each learns, then their next
        rounds are released together."""
        plans = []
        for flow in flows:
            profile = self.profile(flow.link, flow.direction)
            in_flight = 0
            if flow.waking:
                flow.waking = False
                in_flight = self._wake(flow, t, profile)
            rnd, flow.round = flow.round, None
            if rnd is not None:
                recovery.feedback(flow, rnd, t, profile)
            if flow.connected:
                plan = self._plan_round(flow, t, profile, in_flight)
                if plan is not None:
                    plans.append(plan)
        if plans:
            self._release(plans, t)
        for flow in flows:
            # A timer the ACKs armed goes on the heap now: at a shared link the round's
            # chunks (whose service would schedule it) may be served after it is due.
            self._schedule(flow)

    def _on_rto(self, flow: Flow, t: float) -> None:
        """The retransmission timer expired: the connection fails once its
        retransmissions went unanswered for connection_timeout_s; else everything
        unacknowledged is lost (recovery.timeout) and a round of retransmissions goes."""
        profile = self.profile(flow.link, flow.direction)
        if flow.stall_since is None:
            flow.stall_since = t
        elif t - flow.stall_since >= profile.connection_timeout_s:
            self._connection_timeout(flow, t)
            return
        recovery.timeout(flow)
        self._send_round(flow, t, profile)

    def _connection_timeout(self, flow: Flow, t: float) -> None:
        for direction in (UP, DOWN):
            other = self.flows.get((flow.link, direction))
            if other is None:
                continue
            self._touch(other)
            for failure in self._fail_flow(other, t, "timeout"):
                self._push_done(t, other, -1, failure)

    def _fail_flow(self, flow: Flow, t: float, cause: str) -> list[Failure]:
        failures = [Failure(m.token, flow.link, flow.direction, m.entry, t, cause, m.size,
                            min(m.size, m.sent * m.mss), m.wire, m.retx) for m in flow.msgs]
        shared = self.shared[flow.direction]
        if flow.q and flow.group is not None:
            self._touch(shared)
            self._advance_shared(shared, t)
            self._leave(shared, flow)
            self._refill(shared, t)
        self._hold_window(flow, self.profile(flow.link, flow.direction), 0.0)
        flow.msgs = []
        flow.q.clear()
        flow.group = None
        flow.next_seg = flow.end_seg
        flow.t_round = flow.t_rto = None
        flow.waking = flow.connected = False
        flow.reset_connection()
        self._schedule(flow)
        return failures

    def _send_round(self, flow: Flow, t: float, profile: LinkProfile, in_flight: int = 0) -> None:
        """Release the next round of one flow (see _plan_round and _release)."""
        plan = self._plan_round(flow, t, profile, in_flight)
        if plan is not None:
            self._release([plan], t)

    def _plan_round(self, flow: Flow, t: float, profile: LinkProfile, in_flight: int = 0) -> Plan | None:
        """What the next round sends: retransmissions first (after what the window slid
        by before a loss was detected), then new data, as the window (or PRR, in
        recovery) allows. None when it sends nothing."""
        flow.segment_wire = profile.mss_bytes + profile.header_bytes
        available = flow.end_seg - flow.next_seg
        before = 0  # new segments sent ahead of the retransmissions
        clock = flow.clock  # the ACKs releasing this round
        if flow.phase == RECOVERY:
            if flow.pre_sends:
                before = min(flow.pre_sends, available)
                available -= before
                clock = flow.pre_clock
                flow.pre_sends = 0
            # PRR (RFC 6937): send in proportion to what was delivered, toward ssthresh;
            # once the flight fell below ssthresh, the slow-start reduction bound (what
            # was delivered, plus one segment an ACK).
            budget = math.ceil(flow.prr_delivered * flow.ssthresh / flow.recover_fs) - flow.prr_out
            if flow.prr_last < flow.ssthresh:
                budget = max(budget, min(int(flow.ssthresh), math.ceil(1.5 * flow.prr_last)))
            budget = max(budget, 1 if flow.prr_out == 0 else 0)  # the fast retransmit itself
        else:
            budget = int(flow.cwnd) - len(flow.undetected) - len(flow.stuck) - in_flight
            if flow.undetected and flow.phase == OPEN:
                budget += min(LIMITED_TRANSMIT, flow.dupacks)
        budget = max(budget, 0)
        rtx = flow.lost[:budget]
        new = min(budget - len(rtx), available)
        n = before + len(rtx) + new
        if n == 0:
            self._stall(flow, t)
            return None
        if rtx:
            flow.lost = flow.lost[len(rtx):]
        if flow.phase == RECOVERY:
            flow.prr_out += len(rtx) + new
            # PRR's window is what is in flight once it has sent (a timeout in recovery
            # reduces from there).
            flow.cwnd = float(n)
        plan = Plan(flow, profile, (rtx, flow.next_seg, before, new), n)
        plan.rtx_at = t + flow.detect_delay
        flow.detect_delay = 0.0
        plan.cwnd_limited = new < available or n >= int(flow.cwnd)
        plan.slow_start = flow.phase != RECOVERY and flow.cwnd < flow.ssthresh
        # What leaves faster than the ACK clock drains it piles up at the bottleneck: in
        # slow start the window's growth (released at twice the drain rate); with no ACK
        # clock (a first round, after idle or a timeout) the whole burst, as fast as the
        # link before the bottleneck brings it.
        plan.fast = before if before else n
        plan.clocked = clock > 0
        if not plan.clocked:
            plan.pile = plan.fast
        elif flow.phase == RECOVERY and not before:
            plan.pile = 0  # PRR sends no faster than what is delivered
        else:
            # Beyond what the ACKs clock out; in slow start, two segments go out for each
            # ACKed one until the window (or the data) is used, so half of that part piles
            # up even when the data runs out first.
            plan.pile = max(plan.fast - clock, (min(plan.fast, 2 * int(flow.ss_grown)) + 1) // 2)
        flow.next_seg += before + new
        flow.lsnd = t
        return plan

    def _release(self, plans: list[Plan], t: float) -> None:
        """Release rounds planned for the same instant: the bottleneck's buffer drops what
        it cannot hold of what piles up (rounds at a shared link share its buffer's
        overflow in proportion to what they pile on it); what gets through may be lost
        on the link; each round joins its flow's queue at the bottleneck."""
        shared = self.shared[plans[0].flow.direction]
        at_shared = []
        if shared is not None:
            # The fair share once this instant's rounds joined the flows already there.
            members = shared.members + sum(1 for p in plans if not p.flow.rtt_base)
            at_shared = [p for p in plans if shared.bandwidth / members < p.profile.bandwidth]
        if at_shared:
            self._shared_overflow(at_shared)
        for plan in plans:
            if plan not in at_shared:
                plan.drops = self._private_overflow(plan, t)
        for plan in plans:
            self._launch(plan, t)

    def _launch(self, plan: Plan, t: float) -> None:
        """Draw the round's losses and queue it at the bottleneck."""
        flow, profile, n = plan.flow, plan.profile, plan.n
        rtx, first_new, before, new = order = plan.order
        rng = None
        if plan.drops and (not plan.clocked or 2 * plan.drops > plan.fast):
            rng = random.Random(self._draw(flow, "tcp/drop-positions"))
        doubling = plan.slow_start or before > 0 or flow.ss_grown > 0  # released two for one
        dropped = overflow_positions(plan.fast, plan.drops, plan.clocked and doubling, rng)
        lost_positions = random_losses(flow, profile, n, lambda purpose: self._draw(flow, purpose)) if profile.loss or profile.ge_p else []
        forced = self.forced_losses.get((flow.link, flow.direction)) if self.forced_losses else None
        if forced:
            # New segments chosen to be lost once (to compare recovery with a reference).
            chosen = [p for p in range(n) if (p < before or p >= before + len(rtx))
                      and segment_at(order, p) in forced]
            for p in chosen:
                forced.discard(segment_at(order, p))
            lost_positions = sorted(set(lost_positions).union(chosen))
        if dropped:
            lost_positions = sorted(set(lost_positions).union(dropped))
        if self.shared[flow.direction] is not None:
            self._hold_window(flow, profile, (n - len(dropped)) * flow.segment_wire)
            # Its next events' place among others' at the same instant (they interact).
            flow.tiebreak = self._draw(flow, "tcp/order")
        lost = [segment_at(order, p) for p in lost_positions] if lost_positions else []
        rnd = Round(t, n, before + new, order, lost, lost_positions, self._rate(flow, profile), plan.cwnd_limited)
        flow.round = rnd
        flow.last_sent = n
        flow.rounds += 1
        flow.clocked_bytes = max(0, n - len(dropped) - max(0, plan.pile - len(dropped))) * flow.segment_wire
        flow.released_at = t
        self._queue_round(flow, rnd, t, profile, set(dropped) if dropped else _NONE, plan.rtx_at)

    def _stall(self, flow: Flow, t: float) -> None:
        """Nothing the window allows to send: wait for the timer if a hole is left
        that no further ACK will reveal, else the sender is idle until more data."""
        if (flow.undetected or flow.stuck or flow.lost) and flow.t_rto is None:
            flow.t_rto = t + flow.rto * flow.backoff
        flow.clock = 0  # the next round starts without an ACK clock
        self._hold_window(flow, self.profile(flow.link, flow.direction), 0.0)
        self._schedule(flow)

    def _outstanding(self, flow: Flow, t: float) -> int:
        """At a wake-up: segments of the last round not yet acknowledged (the sender
        went quiet while they were out, so no round counted them acked)."""
        if t >= flow.ack_end or not flow.srtt:
            return 0
        return min(flow.last_sent, math.ceil(flow.last_sent * (flow.ack_end - t) / flow.srtt))

    def _draw(self, flow: Flow, purpose: str) -> float:
        counter = flow.draws
        flow.draws += 1
        return uniform(self.seed, purpose, flow.link, flow.direction, counter)
