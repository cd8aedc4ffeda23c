"""A round at the bottleneck: its segments queued, served, delivered and ACKed.

A round's segments join the flow's queue at its bottleneck as chunks whose ends are
the moments that matter: a message's last byte, the end of its retransmissions, and
the pair of segments whose ACK clocks the next round. On a client's own link the queue
is served alone at a known rate, so every chunk's departure is known when it joins; on
a shared link, shared.py serves it. A chunk served crosses the rest of the path
(latency, jitter, store and forward); a message is done when its every segment
arrived, in order; the clocking pair's ACK starts the next round.

Also here, the drop-tail buffer of a client's own link (:meth:`_private_overflow`):
what the flow's window holds beyond the pipe waits in the queue and lengthens the
round trip; what exceeds the buffer is dropped.

:class:`BottleneckQueues` is the part of :class:`~.scheduler.TcpTransport` that does
this; bench/transport_launch.py overrides :meth:`_queue_round` to record losses.
"""
from __future__ import annotations

import math

from ..profiles import LinkProfile, jitter_sample
from .losses import count_between
from .presets import DELAYED_ACK_SEGMENTS, default_buffer
from .shared import queued_weight
from .state import Arrival, Flow, Plan, Round


class BottleneckQueues:
    """Queueing, service and delivery of rounds (see the module's docstring)."""

    def _private_overflow(self, plan: Plan, t: float) -> int:
        """The flow's own link is its bottleneck: its queue now plus what piles on."""
        flow, profile = plan.flow, plan.profile
        if math.isinf(profile.bandwidth):
            return 0
        buffer = default_buffer(profile, self.profile(flow.link, 1 - flow.direction))
        # The flow's queue at its bottleneck: what waits to be served, less what of the
        # last round is released only as ACKs come (it replaces what leaves), and never
        # more than the buffer holds.
        clocked = max(0.0, flow.clocked_bytes - profile.bandwidth * (t - flow.released_at))
        queue = min(buffer, max(0.0, self._backlog(flow, t) - clocked))
        peak = queue + plan.pile * flow.segment_wire
        if peak <= buffer:
            return 0
        return min(plan.fast, math.ceil((peak - buffer) / flow.segment_wire))

    def _queue_round(self, flow: Flow, rnd: Round, t: float, profile: LinkProfile, dropped: set[int],
                     rtx_at: float) -> None:
        """The round's segments join the flow's queue at its bottleneck as chunks whose
        ends are the moments that matter: a message's last byte, the end of its
        retransmissions, and the pair of segments whose ACK clocks the next round."""
        reverse = self.profile(flow.link, 1 - flow.direction)
        jitter = jitter_sample(profile, lambda i: self._draw(flow, f"tcp/jitter/{i}")) if profile.jitter_ms else 0.0
        forward = max(0.0, (profile.latency_ms + jitter) / 1000.0)
        shared = self.shared[flow.direction]
        if shared is not None and math.isfinite(profile.bandwidth) and math.isfinite(shared.bandwidth):
            # A segment also crosses the link that is not the bottleneck, store and forward.
            forward += flow.segment_wire / max(profile.bandwidth, shared.bandwidth)
        flow.back = reverse.latency_ms / 1000.0 + profile.header_bytes / reverse.bandwidth
        positions = rnd.lost_positions  # sorted
        drop_positions = sorted(dropped)
        mark_at = min(DELAYED_ACK_SEGMENTS, rnd.n) - 1
        rtx, first_new, before, new = rnd.segments
        chunks: list = []
        msgs = flow.msgs

        def new_data(seg: int, end: int, pos: int, release: float) -> int:
            """Chunks for new segments [seg, end) at round position pos, one per message."""
            mi = 0
            while seg < end:
                while msgs[mi].seg0 + msgs[mi].nseg <= seg:
                    mi += 1
                m = msgs[mi]
                last = m.seg0 + m.nseg
                stop = min(end, last)
                if pos <= mark_at < pos + (stop - seg):
                    stop = seg + (mark_at - pos) + 1
                count = stop - seg
                short = m.mss - m.last_payload if stop == last else 0  # its last segment is short
                wire = count * (m.mss + m.header) - short
                m.wire += wire
                m.sent += count
                served = wire
                if drop_positions:  # dropped at the buffer: never served by the bottleneck
                    n_drop = count_between(drop_positions, pos, pos + count)
                    served -= n_drop * (m.mss + m.header)
                    if n_drop and short and (pos + count - 1) in dropped:
                        served += short
                delivered = count - count_between(positions, pos, pos + count) if positions else count
                chunks.append([served, m, delivered, forward, rnd if pos + count - 1 == mark_at else None, release])
                pos += count
                seg = stop
            return pos

        pos = new_data(first_new, first_new + before, 0, t)
        # Retransmissions, one chunk per message (the ACK mark may split one).
        lost = set(positions)
        run: list = []
        mi = 0
        for seg in rtx:
            while msgs[mi].seg0 + msgs[mi].nseg <= seg:
                mi += 1
            m = msgs[mi]
            if run and run[1] is not m:
                chunks.append(run)
                run = []
            if not run:
                run = [0.0, m, 0, forward, None, rtx_at]
            wire = m.segment_wire(seg)
            m.wire += wire
            m.retx += wire
            if pos not in dropped:
                run[0] += wire
            if pos not in lost:
                run[2] += 1
            if pos == mark_at:
                run[4] = rnd
                chunks.append(run)
                run = []
            pos += 1
        if run:
            chunks.append(run)
        new_data(first_new + before, first_new + before + new, pos, rtx_at)
        self._enqueue(flow, t, chunks, profile)

    def _enqueue(self, flow: Flow, t: float, chunks: list, profile: LinkProfile) -> None:
        shared = self.shared[flow.direction]
        if shared is None:
            # The flow's own link serves it alone at a known rate: every chunk's
            # departure is known now (a rate that changes applies from the next round).
            rate = profile.bandwidth
            end = max(t, flow.q_end)
            for chunk in chunks:
                end = max(end, chunk[5])  # retransmissions go when the loss is found
                if rate < math.inf:
                    end += chunk[0] / rate
                self._chunk_done(flow, chunk, end)
            flow.q_end = end
            flow.rate = rate
            return
        total = sum(c[0] for c in chunks)
        was_empty = not flow.q
        flow.q.extend(chunks)
        self._touch(shared)
        self._advance_shared(shared, t)
        if was_empty:
            self._join(shared, flow, profile.bandwidth, flow.q[0][0], total)
            self._refill(shared, t)
        else:
            flow.end_target += total
            if flow.group[1] != queued_weight(flow, self._backlog(flow, t)):
                self._regroup(shared, flow, flow.group[0], t)  # its share is what it has queued now

    def _chunk_done(self, flow: Flow, chunk: list, t: float) -> None:
        """A chunk's last byte left the bottleneck at t."""
        msg, delivered, forward, mark = chunk[1], chunk[2], chunk[3], chunk[4]
        if delivered:
            when = max(t + forward, flow.last_delivery)
            flow.last_delivery = when
            msg.pending -= delivered
            if when > msg.latest:
                msg.latest = when
            if msg.pending == 0:
                self._complete(flow)
        if mark is not None and mark is flow.round:
            # The ACK of the round's first segments comes back: the next round.
            flow.t_round = t + forward + flow.back
            self._schedule(flow)
        if not flow.q:
            flow.ack_end = max(flow.ack_end, t + forward + flow.back)

    def _complete(self, flow: Flow) -> None:
        """Messages at the head of the stream whose every segment arrived are done."""
        msgs = flow.msgs
        while msgs and msgs[0].pending == 0:
            m = msgs.pop(0)
            arrival = Arrival(m.token, flow.link, flow.direction, m.entry, m.latest, m.size, m.wire, m.retx)
            self._push_done(m.latest, flow, m.order, arrival)
            if msgs and msgs[0].latest < m.latest:
                msgs[0].latest = m.latest

    def _backlog(self, flow: Flow, t: float) -> float:
        """Bytes of the flow still queued at its bottleneck at t."""
        if flow.group is not None:
            shared = self.shared[flow.direction]
            return max(0.0, flow.end_target - shared.groups[flow.group].v) if flow.q else 0.0
        if math.isinf(flow.rate) or flow.q_end <= t:
            return 0.0
        return (flow.q_end - t) * flow.rate

    def _rate(self, flow: Flow, profile: LinkProfile) -> float:
        shared = self.shared[flow.direction]
        if shared is None:
            return profile.bandwidth
        return min(profile.bandwidth, shared.fair)
