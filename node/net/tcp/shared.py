"""The server's shared links: one link every client's flow in a direction crosses.

The server's downlink carries every upload, its uplink every download; where its
bandwidth is finite (``server_bandwidth``), the flows sending share it as a drop-tail
FIFO does: each in proportion to what it has queued there (its segments, counted when
it queues a round), each bounded by its own link's rate; the rates are recomputed
whenever a flow starts or stops sending or queues a round (so one flow's completion
moves when another starts or ends). Flows with equal queues share equally; a flow the
buffer dropped more from queues less and falls behind, so equal flows spread out as a
real queue's do, by the seeded drops (bench/linux_reference.py, docs/results.md).
Flows with the same cap and weight progress together: a :class:`Group` keeps one
virtual clock V (bytes served to each) and a heap of its flows' next chunk ends, so the
next service event is found without touching every flow. The drop-tail buffer holds
what the sending flows' windows put beyond the link's pipe; what this instant's rounds
pile on top of it overflows and is shared among them.

:class:`SharedLinks` is the part of :class:`~.scheduler.TcpTransport` that does this; it
uses the transport's ``flows``, ``shared``, ``seed`` and ``version`` (the counter that
tells a heap entry stale), its undo log (``_touch``, speculation.py), its event heap
(``_schedule_shared``, scheduler.py), ``_base_rtt`` (connection.py) and ``_chunk_done``
(bottleneck.py).
"""
from __future__ import annotations

import heapq
import math
import random

from ...streams import uniform
from ..profiles import LinkProfile
from .state import Flow, Plan

SHARED_LINK = -1  # the link id of a shared link's events (sorts before every client's)


def queued_weight(flow: Flow, queued: float) -> float:
    """A queued flow's weight at a shared link: the segments it has queued there (whole
    ones, so flows with about as much queued share a group)."""
    return float(max(1, math.ceil(queued / flow.segment_wire)))


class Group:
    """Active flows of a shared link with the same cap (their own link's rate) and the
    same weight (the segments they have queued): they progress together, so one virtual
    clock V (bytes served to each) serves them all. A group lives while it has flows."""

    __slots__ = ("key", "cap", "weight", "v", "rate", "n", "heap", "head_valid")

    def __init__(self, key: tuple[float, float]):
        self.key = key
        self.cap, self.weight = key
        self.v, self.rate, self.n = 0.0, self.cap, 0
        self.heap: list = []  # (head target, link, version)
        self.head_valid = False  # heap[0] is known to be a queued flow's current entry


class SharedLink:
    """A link every client's flow in one direction crosses: the server's downlink
    (uploads) or uplink (downloads), shared by the flows sending as a FIFO shares it."""

    def __init__(self, direction: int, bandwidth: float, buffer: float):
        self.direction, self.bandwidth, self.buffer = direction, bandwidth, buffer
        self.t = 0.0
        self.groups: dict[float, Group] = {}
        self.fair = math.inf
        self.t_next: float | None = None
        self.ver = 0
        self.draws = 0  # random draws made (the stream counter)
        # The windows of the flows with data out (for the queue they stand in):
        self.members = 0
        self.sum_window = 0.0  # bytes
        self.sum_rtt = 0.0  # their base round trips, s

    def snapshot(self) -> dict:
        return {"t": self.t, "fair": self.fair, "t_next": self.t_next, "ver": self.ver,
                "members": self.members, "sum_window": self.sum_window, "sum_rtt": self.sum_rtt,
                "draws": self.draws,
                "groups": {key: (g.v, g.rate, g.n) for key, g in self.groups.items()}}

    def restore(self, state: dict) -> None:
        self.t, self.fair, self.t_next, self.ver = state["t"], state["fair"], state["t_next"], state["ver"]
        self.members, self.sum_window, self.sum_rtt = state["members"], state["sum_window"], state["sum_rtt"]
        self.draws = state["draws"]
        groups = {}
        for key, (v, rate, n) in state["groups"].items():
            g = self.groups.get(key) or Group(key)
            g.v, g.rate, g.n, g.heap, g.head_valid = v, rate, n, [], False
            groups[key] = g
        self.groups = groups



class SharedLinks:
    """Service, fair shares and the buffer of the shared links (see the module's docstring)."""

    def _hold_window(self, flow: Flow, profile: LinkProfile, window: float) -> None:
        """Count the flow's window (bytes in flight) at its shared link, or stop counting
        it (window 0)."""
        shared = self.shared[flow.direction]
        if shared is None:
            return
        self._touch(shared)
        if window > 0:
            if not flow.rtt_base:
                flow.rtt_base = self._base_rtt(flow, profile)
                shared.members += 1
                shared.sum_rtt += flow.rtt_base
            shared.sum_window += window - flow.window_bytes
            flow.window_bytes = window
        elif flow.rtt_base:
            shared.members -= 1
            shared.sum_rtt -= flow.rtt_base
            shared.sum_window -= flow.window_bytes
            if shared.members == 0:
                shared.sum_rtt = shared.sum_window = 0.0
            flow.rtt_base = flow.window_bytes = 0.0

    def _shared_overflow(self, plans: list[Plan]) -> None:
        """The shared link's queue: what the flows' windows hold beyond its pipe (each
        flow's fair share times its round trip), plus what this instant's rounds pile
        on; the overflow is shared among them in proportion to what each piles."""
        shared = self.shared[plans[0].flow.direction]
        joining = [p for p in plans if not p.flow.rtt_base]
        members = shared.members + len(joining)
        rtts = shared.sum_rtt + sum(self._base_rtt(p.flow, p.profile) for p in joining)
        queue = max(0.0, shared.sum_window - shared.bandwidth * rtts / members)
        fair = shared.bandwidth / members
        piles = []
        for plan in plans:
            pile = plan.pile * plan.flow.segment_wire
            if not plan.clocked and math.isfinite(plan.profile.bandwidth):
                pile *= max(0.0, 1.0 - fair / plan.profile.bandwidth)  # drained while it arrives
            piles.append(pile)
        total = sum(piles)
        # Only what piles on now can be dropped now (a clocked window replaces what leaves).
        overflow = min(queue + total - shared.buffer, total)
        if overflow <= 0:
            return
        drops = math.ceil(overflow / plans[0].flow.segment_wire)
        if len(plans) == 1:
            plans[0].drops = min(plans[0].fast, drops)
            return
        # Drop-tail drops whichever packet finds the queue full: each drop falls on a
        # flow with a chance in proportion to what it piles on (a seeded draw of the
        # link's own stream), so equal flows lose unequally, as they do.
        counter = shared.draws
        shared.draws += 1
        rng = random.Random(uniform(self.seed, "tcp/shared-drops", SHARED_LINK, shared.direction, counter))
        counts = [0] * len(plans)
        room = [p.fast for p in plans]
        weights = list(piles)
        while drops > 0 and any(weights):
            for i in rng.choices(range(len(plans)), weights=weights, k=drops):
                if counts[i] < room[i]:
                    counts[i] += 1
                    drops -= 1
            weights = [w if c < r else 0.0 for w, c, r in zip(weights, counts, room)]
        for plan, count in zip(plans, counts):
            plan.drops = count

    def _advance_shared(self, shared: SharedLink, t: float) -> None:
        dt = t - shared.t
        if dt > 0:
            for g in shared.groups.values():
                if g.n:
                    g.v += g.rate * dt
            shared.t = t

    def _join(self, shared: SharedLink, flow: Flow, cap: float, head: float, total: float) -> None:
        key = (cap, queued_weight(flow, total))
        g = shared.groups.get(key)
        if g is None:
            g = shared.groups[key] = Group(key)
        flow.group = key
        g.n += 1
        flow.head_target = g.v + head
        flow.end_target = g.v + total
        self.version += 1
        flow.gver = self.version
        heapq.heappush(g.heap, (flow.head_target, flow.link, flow.gver))

    def _leave(self, shared: SharedLink, flow: Flow) -> None:
        g = shared.groups[flow.group]
        g.n -= 1
        g.head_valid = False  # its entry may be the head
        if g.n == 0:  # an empty group is forgotten: a flow that comes later starts one afresh
            del shared.groups[flow.group]
        flow.group = None

    def _regroup(self, shared: SharedLink, flow: Flow, cap: float, t: float) -> None:
        """Move a queued flow to the group of its cap and weight now (its cap changed, or
        what it has queued), keeping what it has left to be served."""
        g = shared.groups[flow.group]
        left_head, left_all = flow.head_target - g.v, flow.end_target - g.v
        self._leave(shared, flow)
        self._join(shared, flow, cap, left_head, left_all)
        self._refill(shared, t)

    def _refill(self, shared: SharedLink, t: float) -> None:
        """Rates as a drop-tail FIFO gives them: each flow's share of the link is its
        share of what is queued there (its weight: segments queued when it last queued a
        round), unless its own link's rate (its cap) is less; the capped get their cap,
        the rest share what is left by weight. Equal queues share equally (max-min);
        unequal ones (one flow lost more than another) finish apart, as a real queue's
        flows do, and what a flow has queued drains as fast as anyone's."""
        active = sorted((g for g in shared.groups.values() if g.n), key=lambda g: g.cap / g.weight)
        remaining, weights = shared.bandwidth, sum(g.n * g.weight for g in active)
        remaining_n = sum(g.n for g in active)
        fair = math.inf
        for i, g in enumerate(active):
            if g.cap * weights <= remaining * g.weight:
                g.rate = g.cap
                remaining -= g.cap * g.n
                weights -= g.n * g.weight
                remaining_n -= g.n
            else:
                per_weight = remaining / weights
                for h in active[i:]:
                    h.rate = h.weight * per_weight
                fair = remaining / remaining_n  # an average flow's share (what a new round expects)
                break
        shared.fair = fair
        self._next_shared(shared, t)

    def _group_head(self, shared: SharedLink, g: Group) -> tuple | None:
        """A group's next chunk to be served (target, link, version), its stale entries
        (a flow since regrouped, re-queued or emptied) dropped; None if it has none."""
        heap = g.heap
        if g.head_valid:  # nothing left or popped since it was checked (a push keeps a valid head)
            return heap[0]
        while heap:
            _, link, ver = heap[0]
            flow = self.flows[(link, shared.direction)]
            if flow.gver == ver and flow.group == g.key and flow.q:
                g.head_valid = True
                return heap[0]
            heapq.heappop(heap)
        return None

    def _next_shared(self, shared: SharedLink, t: float) -> None:
        soonest = math.inf
        for g in shared.groups.values():
            head = self._group_head(shared, g)
            if head is not None and g.n:
                soonest = min(soonest, t + max(0.0, head[0] - g.v) / g.rate)
        shared.t_next = soonest if soonest < math.inf else None
        self._schedule_shared(shared)

    def _served_head(self, shared: SharedLink, g: Group) -> tuple | None:
        """A group's next chunk if it has been served by the link's present time."""
        head = self._group_head(shared, g)
        if head is not None and head[0] <= g.v + 1e-9 * max(1.0, abs(g.v)):
            return head
        return None

    def _on_shared(self, shared: SharedLink, t: float) -> None:
        """A flow's head chunk at the shared link is served: complete it (and any other
        due at t, lowest link first), then find the next."""
        self._touch(shared)
        self._advance_shared(shared, t)
        changed = False
        # Serving one chunk changes only its own group's head: each group is looked at
        # once, and again only after one of its chunks was served.
        due = []
        for g in shared.groups.values():
            head = self._served_head(shared, g)
            if head is not None:
                due.append((head[1], head[0], g.key))
        heapq.heapify(due)
        while due:
            link, _, key = heapq.heappop(due)
            g = shared.groups[key]
            heapq.heappop(g.heap)
            g.head_valid = False
            flow = self.flows[(link, shared.direction)]
            self._touch(flow)
            chunk = flow.q.popleft()
            if flow.q:
                flow.head_target += flow.q[0][0]
                self.version += 1
                flow.gver = self.version
                heapq.heappush(g.heap, (flow.head_target, flow.link, flow.gver))
            else:
                self._leave(shared, flow)
                changed = True
            self._chunk_done(flow, chunk, t)
            if key in shared.groups:
                head = self._served_head(shared, g)
                if head is not None:
                    heapq.heappush(due, (head[1], head[0], key))
        if changed:
            self._refill(shared, t)
        else:
            self._next_shared(shared, t)
