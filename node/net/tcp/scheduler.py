"""The interface the emulator calls, and the event loop behind it.

:class:`TcpTransport` is every client's TCP connection to the server, as one object:
:meth:`~TcpTransport.send` (a message enters a connection), :meth:`~TcpTransport.next_arrival`
(when the next completion is due), :meth:`~TcpTransport.arrivals` (advance and hand
out what completed), :meth:`~TcpTransport.fail` (a client went offline) and
:meth:`~TcpTransport.update` (a link's profile changed). Calls come with
non-decreasing times; node/net/emulator.py is the caller.

Behind them, one heap of events, in the order they run at one instant: a shared
link's service (shared.py), a round's ACKs (connection.py), a retransmission timer
(connection.py, recovery.py). An entry whose time no longer matches its flow's is
stale and skipped. :meth:`~TcpTransport.next_arrival` may simulate ahead; speculation.py
makes that invisible. The other parts of the class are mixins, one concept each:
:class:`~.connection.Connections`, :class:`~.bottleneck.BottleneckQueues`,
:class:`~.shared.SharedLinks` and :class:`~.speculation.Speculation`.
"""
from __future__ import annotations

import heapq
import math
from typing import Any, Callable

from ..profiles import DOWN, UP, LinkProfile
from .bottleneck import BottleneckQueues
from .connection import Connections
from .presets import BUFFER_PACKETS, FULL_SEGMENT
from .shared import SHARED_LINK, SharedLink, SharedLinks
from .speculation import Speculation
from .state import Arrival, Failure, Flow, Message

EV_SHARED, EV_ROUND, EV_RTO = 0, 1, 2  # event kinds, in the order they run at one instant


class TcpTransport(Connections, BottleneckQueues, SharedLinks, Speculation):
    """Every client's TCP connection to the server, as one object the broker and the
    virtual-time scheduler ask what is due and when the next delivery is."""

    def __init__(self, seed: int, profile: Callable[[int, int], LinkProfile],
                 server_bandwidth: dict[int, float] | None = None,
                 server_buffer: dict[int, float] | None = None):
        """``profile(link, direction)`` gives a direction's current parameters;
        ``server_bandwidth[UP]`` is the server's downlink (uploads enter it),
        ``server_bandwidth[DOWN]`` its uplink (downloads leave it), math.inf if
        unlimited; ``server_buffer`` their drop-tail buffers in bytes (default:
        BUFFER_PACKETS full segments; the server's link does not know its clients'
        round trips, so no bandwidth-delay product applies)."""
        self.seed = seed
        self.profile = profile
        server_bandwidth = server_bandwidth or {}
        server_buffer = server_buffer or {}
        self.shared: dict[int, SharedLink | None] = {}
        for direction in (UP, DOWN):
            rate = server_bandwidth.get(direction, math.inf)
            if math.isfinite(rate):
                buffer = server_buffer.get(direction) or BUFFER_PACKETS * FULL_SEGMENT
                self.shared[direction] = SharedLink(direction, rate, buffer)
            else:
                self.shared[direction] = None
        self.flows: dict[tuple[int, int], Flow] = {}
        self.heap: list = []  # (time, kind, tie-break, link, direction, version)
        self.done: list = []  # (time, link, direction, order, item, made at)
        self.now = 0.0  # the latest time an input or a question has fixed
        self.version = 0
        # Speculation (speculation.py): the state of each object a speculative event changed, as it was
        # at ``now``, and the latest speculative event's time.
        self._saved: dict[int, tuple] = {}
        self._ahead = -math.inf
        self._base = 0.0  # when the speculation began
        # No input can come before this time (inputs at it can): events before it stand.
        self._safe = 0.0
        self._returned = -math.inf  # completions up to this time were handed out
        self._event_time = 0.0
        # {(link, direction): segments}: new segments lost on their first transmission,
        # besides the profile's loss (benchmarks compare recovery with a reference's).
        self.forced_losses: dict[tuple[int, int], set[int]] = {}

    @property
    def time(self) -> float:
        """The emulated time the model stands at: the event it is processing, or its
        latest input (what a profile that changes with time is asked at)."""
        return self._event_time if self._event_time != -math.inf else self.now

    def send(self, t: float, link: int, direction: int, size: int, token: Any) -> None:
        """A message of ``size`` payload bytes enters the connection of ``link`` at t."""
        self._input(t)
        flow = self._flow(link, direction)
        profile = self.profile(link, direction)
        if not flow.msgs and flow.last_delivery <= t and self._ideal(link, direction, profile):
            # Nothing to emulate: no delay, no loss, no window to wait for.
            nseg = max(1, -(-(size + profile.overhead_bytes) // profile.mss_bytes))
            wire = size + profile.overhead_bytes + nseg * profile.header_bytes
            flow.order += 1
            # Pushed as is: an input's own completion, never one found again after a rollback
            # (which _push_done skips when at or before what arrivals() handed out).
            heapq.heappush(self.done, (t, link, direction, flow.order, Arrival(token, link, direction, t, t, size, wire, 0),
                                       self._event_time))
            return
        flow.order += 1
        msg = Message(token, size, t, flow.order, flow.end_seg, profile.mss_bytes, profile.header_bytes,
                   profile.overhead_bytes)
        flow.msgs.append(msg)
        flow.end_seg += msg.nseg
        if flow.round is None and not flow.waking:
            # No ACKs are due to release it: a round starts now, with every other
            # connection's that starts at this instant (they share the bottleneck).
            flow.waking = True
            flow.t_round = t
            self._schedule(flow)

    def next_arrival(self, until: float = math.inf) -> float:
        """The earliest time at which a pending message completes (or a connection
        times out), assuming no further send, fail or update; math.inf if none.

        ``until``: the caller promises no send, fail or update before min(until, the
        answer) (a virtual-time scheduler knows when its next other event is); the model
        then simulates no further than that and keeps what it simulated. Without it,
        what the model simulates ahead is undone if an input comes earlier."""
        while True:
            best = self.done[0][0] if self.done else math.inf
            when = self._peek()
            if when > best or when == math.inf:
                return best
            if when > until:
                return math.inf if best > until else best
            if until < math.inf and when < until and when < best:
                # No input comes before min(until, the answer), and the answer is at or
                # after this event: nothing to keep for undoing it.
                self._safe = max(self._safe, math.nextafter(when, math.inf))
                if self._ahead < self._safe:
                    self._commit(self._safe)
            self._step()

    def arrivals(self, t: float) -> list:
        """Advance to t: every message (and connection failure) completing at or
        before t, in completion order, ties by link, direction and send order."""
        if t < self.now:
            raise ValueError(f"time went backwards: {t} after {self.now}")
        self._advance(t)
        self.now = t
        self._safe = max(self._safe, t)
        self._commit(t)
        self._returned = max(self._returned, t)
        out = []
        while self.done and self.done[0][0] <= t:
            out.append(heapq.heappop(self.done)[4])
        return out

    def fail(self, t: float, link: int) -> list[Failure]:
        """The client went offline at t: its pending messages, both directions, are
        lost (bytes already sent stay counted); its connection starts anew later."""
        self._input(t)
        failures = []
        for direction in (UP, DOWN):
            flow = self.flows.get((link, direction))
            if flow is not None:
                failures.extend(self._fail_flow(flow, t, "offline"))
        # Deliveries not yet due die with the connection too.
        kept = []
        for entry in self.done:
            if entry[1] == link and entry[0] > t and isinstance(entry[4], Arrival):
                a = entry[4]
                failures.append(Failure(a.token, link, a.direction, a.entry, t, "offline", a.payload_bytes,
                                        a.payload_bytes, a.wire_bytes, a.retransmitted_bytes))
            else:
                kept.append(entry)
        if len(kept) != len(self.done):
            heapq.heapify(kept)
            self.done = kept
        failures.sort(key=lambda f: (f.direction, f.entry))
        return failures

    def update(self, t: float, link: int) -> None:
        """``link``'s profile changed at t (set_links, a scripted event): rates apply from
        now on; latency, loss and the rest from the next round."""
        self._input(t)
        for direction in (UP, DOWN):
            flow = self.flows.get((link, direction))
            if flow is None or not flow.q:
                continue
            self._touch(flow)
            cap = self.profile(link, direction).bandwidth
            shared = self.shared[direction]
            if shared is not None and cap != flow.group[0]:
                self._touch(shared)
                self._advance_shared(shared, t)
                self._regroup(shared, flow, cap, t)

    def _input(self, t: float) -> None:
        """Before an input at t: what happened before t happened; events at t wait (an
        input at t comes before them, so all inputs at one instant act together)."""
        if t < self.now:
            raise ValueError(f"time went backwards: {t} after {self.now}")
        if t < self._safe:
            raise ValueError(f"an input at {t} after next_arrival(until=...) promised none before {self._safe}")
        self._rollback(t)
        self._advance(t, before=True)
        self.now = self._safe = t
        self._commit(t)
        self._event_time = -math.inf  # an input's own changes are never undone

    def _advance(self, t: float, before: bool = False) -> None:
        """Process the events at or before t (strictly before, with ``before``)."""
        while True:
            when = self._peek()
            if when > t or (before and when == t):
                return
            self._step()

    def _peek(self) -> float:
        entry = self._peek_entry()
        return math.inf if entry is None else entry[0]

    def _peek_entry(self) -> tuple | None:
        """The next valid event's heap entry (stale ones are dropped), or None. A
        flow's entry is valid while the flow still waits for that event at that time."""
        heap = self.heap
        while heap:
            when, kind, _, link, direction, ver = heap[0]
            if link == SHARED_LINK:
                shared = self.shared[direction]
                if shared.ver == ver and shared.t_next == when:
                    return heap[0]
            else:
                flow = self.flows[(link, direction)]
                if (flow.t_round if kind == EV_ROUND else flow.t_rto) == when:
                    return heap[0]
            heapq.heappop(heap)
        return None

    def _step(self) -> None:
        when, kind, _, link, direction, _ = heapq.heappop(self.heap)
        self._event_time = when
        if link == SHARED_LINK:
            self._on_shared(self.shared[direction], when)
            return
        flow = self.flows[(link, direction)]
        self._touch(flow)
        if kind == EV_RTO:
            flow.t_rto = flow.queued_rto = None
            self._on_rto(flow, when)
            return
        flow.t_round = flow.queued_round = None
        if self.shared[direction] is None:
            self._on_rounds([flow], when)
            return
        # Rounds released at the same instant into a shared link pile on its buffer
        # together (a broadcast, synchronized uploads): take them as one.
        batch = [flow]
        while True:
            top = self._peek_entry()
            if top is None or top[0] != when or top[1] != EV_ROUND or top[3] == SHARED_LINK or top[4] != direction:
                break
            heapq.heappop(self.heap)
            other = self.flows[(top[3], direction)]
            self._touch(other)
            other.t_round = other.queued_round = None
            batch.append(other)
        self._on_rounds(batch, when)

    def _schedule(self, flow: Flow, kind: int | None = None) -> None:
        """Queue the flow's pending events (of one kind, or both): an entry whose time
        no longer matches the flow's is skipped when it comes up."""
        if kind != EV_RTO and flow.t_round is not None and flow.t_round != flow.queued_round:
            flow.queued_round = flow.t_round
            heapq.heappush(self.heap, (flow.t_round, EV_ROUND, flow.tiebreak, flow.link, flow.direction, 0))
        if kind != EV_ROUND and flow.t_rto is not None and flow.t_rto != flow.queued_rto:
            flow.queued_rto = flow.t_rto
            heapq.heappush(self.heap, (flow.t_rto, EV_RTO, flow.tiebreak, flow.link, flow.direction, 0))

    def _schedule_shared(self, shared: SharedLink) -> None:
        self.version += 1
        shared.ver = self.version
        if shared.t_next is not None:
            heapq.heappush(self.heap, (shared.t_next, EV_SHARED, -1.0, SHARED_LINK, shared.direction, shared.ver))
