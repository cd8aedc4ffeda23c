"""A flow-level model of TCP for every client's connection: when each message crossing
a link completes, given per-packet loss, a drop-tail buffer and the server's shared links.

One long-lived connection per client carries both directions, each a byte stream with
its own sender (congestion window, RTT estimator, retransmission timer). The model
steps each sender once per round trip, not per packet, so 1,000 concurrent flows stay
cheap. Per round (a window of segments released by the previous window's ACKs):

* **window**: initial window ``init_cwnd_segments``; slow start by bytes acknowledged
  (RFC 3465 with no limit, as Linux); congestion avoidance by CUBIC (RFC 9438, with
  Linux's Reno-friendly region, fast convergence and HyStart, Ha & Rhee 2011, with
  Linux's thresholds) or Reno (RFC 5681); after the connection sat idle longer than its
  RTO the window restarts (RFC 7661 as Linux's tcp_slow_start_after_idle = 1 does it:
  halved per RTO idle, down to min(initial window, cwnd));
* **bottleneck and buffer**: the round's segments leave at the flow's rate, which is its
  own link's bandwidth or, where the server's link is shared, its max-min fair share
  of that link (each flow bounded by its own link, rates recomputed whenever a flow
  starts or stops sending, so a flow's completion moves when another starts or ends).
  What a window holds beyond the path's pipe waits in the bottleneck's queue and
  lengthens the round trip; what exceeds the drop-tail buffer is dropped: in slow start
  the window's growth arrives at twice the bottleneck's rate, so the queue grows by
  half of what is released (the classic slow-start overshoot);
* **loss**: ``loss`` (or Gilbert-Elliott) per data segment, drawn as the gaps between
  losses (geometric), so a round costs the same whatever its size; ACKs are not lost
  (cumulative ACKs make a lost ACK nearly free);
* **recovery**: SACK-based fast retransmit when three segments after a hole arrive
  (limited transmit, RFC 3042, lends two), with proportional rate reduction (RFC 6937,
  slow-start reduction bound) and one window reduction per episode; otherwise the
  retransmission timer (RFC 6298, minimum ``rto_min_s``, doubled per expiry up to
  120 s), which restarts from a window of one; a lost retransmission, too, waits for
  the timer, as with RFC 6675 recovery. A connection whose retransmissions go
  unanswered for ``connection_timeout_s`` fails.

Interface: :meth:`TcpTransport.send`, :meth:`next_arrival`, :meth:`arrivals`,
:meth:`fail` and :meth:`update` (a link's profile changed). Calls come with
non-decreasing times. :meth:`next_arrival` may simulate ahead; an input that then comes
earlier than what it simulated restores what that changed and runs again from there, so
results depend only on the inputs and their times, never on when the model was asked. Every random
decision is drawn from a named stream (node/streams.py) of (seed, link, direction, the
flow's draw counter). Times are emulated seconds, sizes bytes, rates bytes/s.

Wire bytes count every segment's header (``header_bytes``: IPv4 20 + TCP 20 + the
timestamp option 12, the option Linux and ns-3 send on every segment); payload bytes
are the message's own.
"""
from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from .links import DOWN, UP, LinkProfile, jitter_sample
from ..streams import uniform

__all__ = ["Arrival", "Failure", "TcpTransport", "default_buffer", "DOWN", "UP"]

# Congestion control constants, as Linux (net/ipv4/tcp_cubic.c) and RFC 9438 give them.
CUBIC_C = 0.4
CUBIC_BETA = 0.7  # Linux: 717/1024
RENO_BETA = 0.5
CUBIC_RENO_ALPHA = 3 * (1 - CUBIC_BETA) / (1 + CUBIC_BETA)  # RFC 9438, Reno-friendly region
CUBIC_CNT_CLAMP = 20  # Linux: with no loss seen yet, grow at least 5% per RTT
HYSTART_LOW_WINDOW = 16  # segments
HYSTART_MIN_SAMPLES = 8  # ACKs of a round before the delay test
HYSTART_ACK_DELTA_S = 0.002  # ACKs further apart break the ACK train


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


LINUX = Stack(reno_friendly=True, hystart=True, hystart_train=0.5, hystart_delay=(8, 0.004, 0.016),
              backoff_until_sample=False, first_ack_alone=False, slow_start_overshoots=False)
NS3_337 = Stack(reno_friendly=False, hystart=True, hystart_train=1.0, hystart_delay=(1, 0.004, 1.0),
                backoff_until_sample=True, first_ack_alone=True, slow_start_overshoots=True)
STACK = LINUX
DUPTHRESH = 3  # RFC 5681
LIMITED_TRANSMIT = 2  # RFC 3042
RTO_MAX_S = 120.0  # Linux's TCP_RTO_MAX
DELAYED_ACK_SEGMENTS = 2  # RFC 1122/5681: an ACK for every second full segment
DELAYED_ACK_TIMEOUT_S = 0.04  # Linux's minimum delayed-ACK timer (TCP_ATO_MIN)
BUFFER_PACKETS = 1000  # tc-netem's default queue limit, Linux's default txqueuelen

_NONE: frozenset = frozenset()
_FULL_SEGMENT = 1448 + 52  # a default segment on the wire (the shared links' default buffer)
_OPEN, _RECOVERY, _LOSS = 0, 1, 2
_EV_SHARED, _EV_ROUND, _EV_RTO = 0, 1, 2  # event kinds, in the order they run at one instant
_SHARED = -1  # the link id of a shared link's events (sorts before every client's)


@dataclass(frozen=True, slots=True)
class Arrival:
    """A message whose last byte reached the receiver."""

    token: Any
    link: int
    direction: int
    entry: float  # when it entered the connection (emulated s)
    arrival: float  # when its last byte was delivered, in order
    payload_bytes: int
    wire_bytes: int  # every byte its segments put on the wire: headers and retransmissions included
    retransmitted_bytes: int  # wire bytes of its retransmitted segments (part of wire_bytes)


@dataclass(frozen=True, slots=True)
class Failure:
    """A message lost with its connection: ``cause`` is "offline" (the client went away)
    or "timeout" (retransmissions unanswered for connection_timeout_s)."""

    token: Any
    link: int
    direction: int
    entry: float
    time: float  # when the connection failed
    cause: str
    payload_bytes: int
    sent_payload_bytes: int  # of its payload, what had been sent (at least once)
    wire_bytes: int
    retransmitted_bytes: int


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


class _Msg:
    """One message in a direction's byte stream: segments [seg0, seg0 + nseg)."""

    __slots__ = ("token", "size", "entry", "order", "seg0", "nseg", "mss", "last_payload", "header",
                 "pending", "latest", "wire", "retx", "sent")

    def __init__(self, token, size: int, entry: float, order: int, seg0: int, mss: int, header: int, extra: int):
        carried = size + extra  # `overhead_bytes`: the application's framing, carried as payload
        self.token, self.size, self.entry, self.order = token, size, entry, order
        self.nseg = max(1, -(-carried // mss))
        self.seg0, self.mss, self.header = seg0, mss, header
        self.last_payload = carried - (self.nseg - 1) * mss
        self.pending = self.nseg  # segments not yet delivered
        self.latest = entry  # the latest delivery among its segments so far
        self.wire = self.retx = self.sent = 0

    def segment_wire(self, seg: int) -> int:
        payload = self.last_payload if seg == self.seg0 + self.nseg - 1 else self.mss
        return payload + self.header

    def copy(self) -> _Msg:
        other = _Msg.__new__(_Msg)
        for name in _Msg.__slots__:
            setattr(other, name, getattr(self, name))
        return other


class _Round:
    """What one round sent, kept until its ACKs come back (immutable once built)."""

    __slots__ = ("release", "n", "new", "segments", "lost", "lost_positions", "rate", "cwnd_limited")

    def __init__(self, release, n, new, segments, lost, lost_positions, rate, cwnd_limited):
        self.release, self.n, self.new = release, n, new
        # (retransmitted segment ids, first new segment, new sent before the retransmissions,
        # new sent after them)
        self.segments = segments
        self.lost, self.lost_positions = lost, lost_positions  # segment ids; their positions in the round
        self.rate = rate  # the bottleneck rate it was released at
        self.cwnd_limited = cwnd_limited  # it sent what the window allowed (not out of data)


class _Plan:
    """A round about to be released (rounds at the same instant share a buffer)."""

    __slots__ = ("flow", "profile", "order", "n", "cwnd_limited", "slow_start", "fast", "clocked", "pile",
                 "drops", "rtx_at")

    def __init__(self, flow, profile, order, n):
        self.flow, self.profile, self.order, self.n = flow, profile, order, n
        self.drops = 0


class _Flow:
    """One direction of one client's connection: its stream, its sender's state and its
    place at the bottleneck."""

    def __init__(self, link: int, direction: int):
        self.link, self.direction = link, direction
        self.msgs: list[_Msg] = []
        self.next_seg = 0  # the next new segment to send
        self.end_seg = 0  # the stream's end (segments queued so far)
        self.order = 0  # messages sent, for ties
        self.draws = 0  # random draws made (the stream counter)
        self.connected = False
        self.reset_connection()
        # Service at the bottleneck, in chunks [bytes, message, segments delivered,
        # delay from the bottleneck to the receiver, the round it clocks or None, release]
        self.q: deque = deque()  # shared link: chunks not yet served
        self.q_end = 0.0  # private link: when what is queued has left
        self.clocked_bytes = 0.0  # of the last round, what goes out as ACKs come, not at once
        self.released_at = 0.0
        self.rate = math.inf  # private link: the rate serving the queue
        self.group: float | None = None  # shared link: the cap (access rate) of its group
        self.head_target = self.end_target = 0.0  # shared link: V at the head's end, queue's end
        self.gver = 0  # version of its entry in its group's heap
        self.back = 0.0  # from a segment's arrival to its ACK's arrival at the sender
        self.segment_wire = 1500  # a full segment's wire bytes
        self.ack_end = 0.0  # when the ACK of the last segment sent comes back
        self.window_bytes = 0.0  # on a shared link: the bytes its last round put in flight
        self.rtt_base = 0.0  # and its base round trip (0: not counted there)
        self.tiebreak = 0.0  # orders its events among others at the same instant
        # Pending events (time or None): the next round (ACKs back), the timer.
        self.t_round: float | None = None
        self.t_rto: float | None = None
        self.queued_round = self.queued_rto = None  # the times last put on the heap
        self.waking = False  # its t_round starts a round for data that came while idle
        self.last_delivery = 0.0  # deliveries of a stream never overtake one another

    def reset_connection(self) -> None:
        """A new connection: no RTT known beyond the handshake's, an initial window."""
        self.cwnd = 0.0
        self.ssthresh = math.inf
        self.phase = _OPEN
        self.srtt = self.rttvar = None
        self.rto = 1.0  # RFC 6298 before any sample; the handshake's sample replaces it
        self.backoff = 1.0
        self.stall_since: float | None = None
        self.lsnd = -math.inf  # last time data was sent
        self.round: _Round | None = None  # the round whose ACKs are awaited
        self.rounds = 0  # rounds sent on this connection
        self.clock = 0  # segments the last ACKs delivered: they release the next round
        self.ss_grown = 0.0  # the window's growth in slow start from those ACKs
        self.pre_sends = self.pre_clock = 0  # a detection round: sends before the retransmissions
        self.detect_delay = 0.0  # and how long after its start the retransmissions go
        self.last_sent = 0  # segments released by the last round that sent any
        self.prr_last = 0  # segments delivered in the last round of a recovery
        self.lost: list[int] = []  # detected lost segments, to retransmit
        self.undetected: list[int] = []  # lost, not yet detected
        self.dupacks = 0  # segments delivered after the first undetected hole
        self.stuck: list[int] = []  # lost retransmissions: only the timer finds them
        self.recover = 0  # recovery ends when everything below this is delivered
        self.prr_delivered = self.prr_out = 0
        self.recover_fs = 1
        # CUBIC (Linux names)
        self.w_max = 0.0
        self.epoch: float | None = None
        self.k = 0.0
        self.origin = 0.0
        self.w_est = 0.0
        self.delay_min = math.inf
        self.found = False  # HyStart has ended slow start once (until a timeout)
        self.ge_bad = False
        self.ge_left = -1  # packets left in the Gilbert-Elliott state; -1: not drawn yet

    def snapshot(self) -> dict:
        state = self.__dict__.copy()
        # Messages change as their segments arrive; the queued chunks point at them.
        copies = {id(m): m.copy() for m in self.msgs}
        state["msgs"] = [copies[id(m)] for m in self.msgs]
        state["q"] = deque([c[0], copies.get(id(c[1]), c[1]), *c[2:]] for c in self.q)
        for name in ("lost", "undetected", "stuck"):
            state[name] = list(state[name])
        return state

    def restore(self, state: dict) -> None:
        self.__dict__.clear()
        self.__dict__.update(state)


class _Group:
    """Active flows of a shared link with the same cap (their own link's rate): they
    progress together, so one virtual clock V (bytes served to each) serves them all."""

    __slots__ = ("cap", "v", "rate", "n", "sum_end", "heap")

    def __init__(self, cap: float):
        self.cap, self.v, self.rate, self.n, self.sum_end = cap, 0.0, cap, 0, 0.0
        self.heap: list = []  # (head target, link, version)


class _Shared:
    """A link every client's flow in one direction crosses: the server's downlink
    (uploads) or uplink (downloads), shared max-min fairly among the flows sending."""

    def __init__(self, direction: int, bandwidth: float, buffer: float):
        self.direction, self.bandwidth, self.buffer = direction, bandwidth, buffer
        self.t = 0.0
        self.groups: dict[float, _Group] = {}
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
                "groups": {cap: (g.v, g.rate, g.n, g.sum_end) for cap, g in self.groups.items()}}

    def restore(self, state: dict) -> None:
        self.t, self.fair, self.t_next, self.ver = state["t"], state["fair"], state["t_next"], state["ver"]
        self.members, self.sum_window, self.sum_rtt = state["members"], state["sum_window"], state["sum_rtt"]
        self.draws = state["draws"]
        groups = {}
        for cap, (v, rate, n, sum_end) in state["groups"].items():
            g = self.groups.get(cap) or _Group(cap)
            g.v, g.rate, g.n, g.sum_end, g.heap = v, rate, n, sum_end, []
            groups[cap] = g
        self.groups = groups


class TcpTransport:
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
        self.shared: dict[int, _Shared | None] = {}
        for direction in (UP, DOWN):
            rate = server_bandwidth.get(direction, math.inf)
            if math.isfinite(rate):
                buffer = server_buffer.get(direction) or BUFFER_PACKETS * _FULL_SEGMENT
                self.shared[direction] = _Shared(direction, rate, buffer)
            else:
                self.shared[direction] = None
        self.flows: dict[tuple[int, int], _Flow] = {}
        self.heap: list = []  # (time, kind, tie-break, link, direction, version)
        self.done: list = []  # (time, link, direction, order, item, made at)
        self.now = 0.0  # the latest time an input or a question has fixed
        self.version = 0
        # Speculation: the state of each object a speculative event changed, as it was
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

    # --- the interface -------------------------------------------------------------

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
        msg = _Msg(token, size, t, flow.order, flow.end_seg, profile.mss_bytes, profile.header_bytes,
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
            if shared is not None and cap != flow.group:
                self._touch(shared)
                self._advance_shared(shared, t)
                left_head = flow.head_target - shared.groups[flow.group].v
                left_all = flow.end_target - shared.groups[flow.group].v
                self._leave(shared, flow)
                self._join(shared, flow, cap, left_head, left_all)
                self._refill(shared, t)

    # --- time, events and the undo log ---------------------------------------------

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
            if link == _SHARED:
                shared = self.shared[direction]
                if shared.ver == ver and shared.t_next == when:
                    return heap[0]
            else:
                flow = self.flows[(link, direction)]
                if (flow.t_round if kind == _EV_ROUND else flow.t_rto) == when:
                    return heap[0]
            heapq.heappop(heap)
        return None

    def _step(self) -> None:
        when, kind, _, link, direction, _ = heapq.heappop(self.heap)
        self._event_time = when
        if link == _SHARED:
            self._on_shared(self.shared[direction], when)
            return
        flow = self.flows[(link, direction)]
        self._touch(flow)
        if kind == _EV_RTO:
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
            if top is None or top[0] != when or top[1] != _EV_ROUND or top[3] == _SHARED or top[4] != direction:
                break
            heapq.heappop(self.heap)
            other = self.flows[(top[3], direction)]
            self._touch(other)
            other.t_round = other.queued_round = None
            batch.append(other)
        self._on_rounds(batch, when)

    def _schedule(self, flow: _Flow, kind: int | None = None) -> None:
        """Queue the flow's pending events (of one kind, or both): an entry whose time
        no longer matches the flow's is skipped when it comes up."""
        if kind != _EV_RTO and flow.t_round is not None and flow.t_round != flow.queued_round:
            flow.queued_round = flow.t_round
            heapq.heappush(self.heap, (flow.t_round, _EV_ROUND, flow.tiebreak, flow.link, flow.direction, 0))
        if kind != _EV_ROUND and flow.t_rto is not None and flow.t_rto != flow.queued_rto:
            flow.queued_rto = flow.t_rto
            heapq.heappush(self.heap, (flow.t_rto, _EV_RTO, flow.tiebreak, flow.link, flow.direction, 0))

    def _schedule_shared(self, shared: _Shared) -> None:
        self.version += 1
        shared.ver = self.version
        if shared.t_next is not None:
            heapq.heappush(self.heap, (shared.t_next, _EV_SHARED, -1.0, _SHARED, shared.direction, shared.ver))

    def _touch(self, obj) -> None:
        """Before a speculative event first changes ``obj``, keep what it was, so an
        input that comes before (or at the time of) that event can undo it. Events at
        ``now`` or later are speculative, and every event once a speculation began."""
        if self._event_time >= self._safe or self._saved:
            key = id(obj)
            if not self._saved:
                self._base = self._safe
            if key not in self._saved:
                self._saved[key] = (obj, obj.snapshot())
            if self._event_time > self._ahead:
                self._ahead = self._event_time

    def _commit(self, t: float) -> None:
        """Everything simulated before t stands (no input can come before t)."""
        if self._ahead < t:
            self._saved.clear()
            self._ahead = -math.inf

    def _rollback(self, t: float) -> None:
        """An input at t came before (or at the time of) events already simulated: go
        back to the state when the speculation began; the events before t run again."""
        if self._ahead < t:
            return
        links = set()
        for obj, state in self._saved.values():
            obj.restore(state)
            if isinstance(obj, _Flow):
                # Its events as they were (what the speculation popped or queued is gone
                # or stale: entries whose time no longer matches are skipped).
                obj.queued_round = obj.queued_rto = None
                self._schedule(obj)
            else:
                links.add(obj.direction)
        self._saved.clear()
        self._ahead = -math.inf
        for direction in links:  # a restored shared link's group heaps come from its flows
            shared = self.shared[direction]
            for flow in self.flows.values():
                if flow.direction == direction and flow.group is not None and flow.q:
                    self.version += 1
                    flow.gver = self.version
                    heapq.heappush(shared.groups[flow.group].heap, (flow.head_target, flow.link, flow.gver))
            self._schedule_shared(shared)
        # Completions found while speculating are found again; those already handed
        # out (up to the last arrivals() call) are not handed out twice.
        self.done = [entry for entry in self.done if entry[5] < self._base]
        heapq.heapify(self.done)

    def _push_done(self, when: float, flow: _Flow, order: int, item) -> None:
        if when <= self._returned:
            return  # found again after a rollback: it was handed out already
        heapq.heappush(self.done, (when, flow.link, flow.direction, order, item, self._event_time))

    # --- flows ------------------------------------------------------------------------

    def _flow(self, link: int, direction: int) -> _Flow:
        flow = self.flows.get((link, direction))
        if flow is None:
            flow = self.flows[(link, direction)] = _Flow(link, direction)
        return flow

    def _ideal(self, link: int, direction: int, profile: LinkProfile) -> bool:
        if self.shared[direction] is not None or not math.isinf(profile.bandwidth):
            return False
        if profile.latency_ms or profile.jitter_ms or profile.loss or profile.ge_p:
            return False
        reverse = self.profile(link, 1 - direction)
        return not (reverse.latency_ms or reverse.jitter_ms)

    def _wake(self, flow: _Flow, t: float, profile: LinkProfile) -> int:
        """Data to send and no round awaiting ACKs: open the connection, or restart its
        window after idle. Returns what is still in flight from before."""
        if not flow.connected:
            flow.connected = True
            flow.cc = profile.congestion
            flow.cwnd = float(profile.init_cwnd_segments)
            flow.segment_wire = profile.mss_bytes + profile.header_bytes
            # The handshake's round trip is the first RTT sample (RFC 6298 2.2).
            rtt = self._base_rtt(flow, profile)
            self._rtt_sample(flow, rtt, 1, profile)
            flow.delay_min = rtt
            return 0
        if not (flow.lost or flow.undetected or flow.stuck) and t - flow.lsnd > flow.rto and t >= flow.ack_end:
            self._restart_window(flow, t, profile)
        return self._outstanding(flow, t)

    def _restart_window(self, flow: _Flow, t: float, profile: LinkProfile) -> None:
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

    def _base_rtt(self, flow: _Flow, profile: LinkProfile) -> float:
        reverse = self.profile(flow.link, 1 - flow.direction)
        segment = profile.mss_bytes + profile.header_bytes
        rate = self._path_rate(flow, profile)
        return ((profile.latency_ms + reverse.latency_ms) / 1000.0 + segment / rate
                + profile.header_bytes / reverse.bandwidth)

    def _path_rate(self, flow: _Flow, profile: LinkProfile) -> float:
        shared = self.shared[flow.direction]
        return profile.bandwidth if shared is None else min(profile.bandwidth, shared.bandwidth)

    # --- RTT estimation (RFC 6298) ----------------------------------------------------------

    def _rtt_sample(self, flow: _Flow, sample: float, acks: int, profile: LinkProfile) -> None:
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
        flow.rto = min(max(profile.rto_min_s, flow.srtt + 4 * flow.rttvar), RTO_MAX_S)

    # --- rounds ---------------------------------------------------------------------------

    def _on_round(self, flow: _Flow, t: float) -> None:
        """The ACKs of the last round arrive (or data arrived at an idle connection):
        learn from them, then release the next round."""
        self._on_rounds([flow], t)

    def _on_rounds(self, flows: list[_Flow], t: float) -> None:
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
                self._feedback(flow, rnd, t, profile)
            if flow.connected:
                plan = self._plan_round(flow, t, profile, in_flight)
                if plan is not None:
                    plans.append(plan)
        if plans:
            self._release(plans, t)

    def _feedback(self, flow: _Flow, rnd: _Round, t: float, profile: LinkProfile) -> None:
        """What the ACKs of ``rnd`` tell the sender: RTT, what arrived, what was lost."""
        n, lost = rnd.n, rnd.lost
        delivered = n - len(lost)
        flow.clock = delivered  # the ACKs that clock the next round
        flow.ss_grown = 0.0  # of which, ACKs that grew the window in slow start
        sample = t - rnd.release
        if rnd.new and delivered:  # Karn: a round of retransmissions only gives no sample
            self._rtt_sample(flow, sample, max(1, delivered // DELAYED_ACK_SEGMENTS), profile)
            flow.delay_min = min(flow.delay_min, sample)
        had_holes = bool(flow.undetected or flow.stuck or flow.lost)
        acked_to = self._first_hole(flow, rnd.segments[0][0] if rnd.segments[0] else math.inf)
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
            if not STACK.backoff_until_sample or (rnd.new and first_lost > 0):
                flow.backoff = 1.0
            flow.stall_since = None
        if flow.stuck:
            if flow.t_rto is None:
                flow.t_rto = t + flow.rto * flow.backoff
        elif not flow.undetected and not flow.lost:
            flow.t_rto = None
        acked = 0 if had_holes else first_lost  # cumulatively acknowledged, before any hole
        if STACK.first_ack_alone and flow.rounds == 1 and not lost and n % 2 == 0 and acked \
                and sample < DELAYED_ACK_TIMEOUT_S:
            acked -= 1  # the first window's last segment is ACKed with the next window
            flow.clock -= 1
        if flow.phase == _RECOVERY:
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
                flow.phase = _OPEN
                flow.cwnd = max(flow.ssthresh, 1.0)
            acked = 0
        elif flow.phase == _LOSS:
            # After a timeout the cumulative ACK jumps over what SACK had seen arrive:
            # the window grows by that advance.
            advance = self._first_hole(flow, math.inf) - acked_to
            if advance > 0:
                self._slow_start(flow, advance, rnd, t, sample)
            if not flow.lost and not flow.stuck:
                flow.phase = _OPEN
            acked = 0
        if flow.phase == _OPEN:
            if acked:  # these ACKs come before the duplicates
                self._grow(flow, acked, rnd, t, sample)
            if flow.undetected and flow.dupacks >= DUPTHRESH:
                self._enter_recovery(flow, rnd, acked, delivered - acked if acked else delivered)

    @staticmethod
    def _first_hole(flow: _Flow, also: float) -> float:
        """The first segment not yet delivered (what the cumulative ACK stops at)."""
        first = min(also, flow.next_seg)
        for holes in (flow.lost, flow.stuck, flow.undetected):
            if holes and holes[0] < first:
                first = holes[0]
        return first

    def _grow(self, flow: _Flow, acked: int, rnd: _Round, t: float, sample: float) -> None:
        if not rnd.cwnd_limited:
            # Linux's tcp_is_cwnd_limited: an application-limited window grows only in
            # slow start, and only up to twice what was out.
            if flow.cwnd < flow.ssthresh:
                flow.cwnd += max(0.0, min(acked, 2 * rnd.n - flow.cwnd, flow.ssthresh - flow.cwnd))
            return
        if flow.cwnd < flow.ssthresh:
            acked = self._slow_start(flow, acked, rnd, t, sample)
        if acked > 0:
            self._avoid(flow, acked, t)

    def _slow_start(self, flow: _Flow, acked: int, rnd: _Round, t: float, sample: float) -> int:
        """cwnd grows by what was acked (ABC), up to ssthresh or HyStart's exit;
        returns what is left over for congestion avoidance."""
        if flow.cc == "cubic" and STACK.hystart and not flow.found and flow.phase == _OPEN:
            self._hystart(flow, acked, rnd, sample)
        if STACK.slow_start_overshoots and flow.cc == "cubic":
            grow = acked
        else:
            grow = min(acked, max(0.0, flow.ssthresh - flow.cwnd))
        flow.cwnd += grow
        flow.ss_grown += grow
        return int(acked - grow)

    def _hystart(self, flow: _Flow, acked: int, rnd: _Round, sample: float) -> None:
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
            train = STACK.hystart_train * delay_min * rnd.rate / flow.segment_wire  # segments acked by then
            if train < acked:
                exit_at = max(start, train)
        samples = DELAYED_ACK_SEGMENTS * HYSTART_MIN_SAMPLES
        if acked >= samples:
            share, low, high = STACK.hystart_delay
            threshold = delay_min + min(max(delay_min / share, low), high)
            if sample > threshold:
                exit_at = min(exit_at, max(start, samples))
        if exit_at < math.inf:
            flow.found = True
            flow.ssthresh = min(flow.ssthresh, flow.cwnd + exit_at)

    def _avoid(self, flow: _Flow, acked: int, t: float) -> None:
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
        if STACK.reno_friendly and flow.w_est > cwnd:
            cnt = min(cnt, cwnd / (flow.w_est - cwnd))
        cnt = max(cnt, 2.0)  # at most 1.5x per round trip
        flow.cwnd = cwnd + acked / cnt

    def _reduce(self, flow: _Flow) -> None:
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

    def _enter_recovery(self, flow: _Flow, rnd: _Round, acked: int, after: int) -> None:
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
        flow.phase = _RECOVERY
        self._reduce(flow)
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

    def _on_rto(self, flow: _Flow, t: float) -> None:
        """The retransmission timer expired: everything unacknowledged is taken as
        lost, the window restarts from one segment, the timer backs off (RFC 6298)."""
        profile = self.profile(flow.link, flow.direction)
        if flow.stall_since is None:
            flow.stall_since = t
        elif t - flow.stall_since >= profile.connection_timeout_s:
            self._connection_timeout(flow, t)
            return
        rnd, flow.round = flow.round, None
        flow.t_round, flow.waking = None, False
        if rnd is not None:  # what that round lost is lost; what it delivered is SACKed
            flow.lost = flow.lost + rnd.lost
        if flow.phase != _LOSS:
            self._reduce(flow)
        flow.phase = _LOSS
        flow.lost = sorted(set(flow.lost + flow.undetected + flow.stuck))
        flow.undetected, flow.stuck, flow.dupacks = [], [], 0
        flow.cwnd = 1.0
        # CUBIC forgets its history on a timeout (Linux's bictcp_reset and hystart reset).
        flow.w_max, flow.epoch, flow.delay_min, flow.found = 0.0, None, math.inf, False
        flow.backoff = min(flow.backoff * 2, RTO_MAX_S / flow.rto)
        flow.clock = 0
        self._send_round(flow, t, profile)

    def _connection_timeout(self, flow: _Flow, t: float) -> None:
        for direction in (UP, DOWN):
            other = self.flows.get((flow.link, direction))
            if other is None:
                continue
            self._touch(other)
            for failure in self._fail_flow(other, t, "timeout"):
                self._push_done(t, other, -1, failure)

    def _fail_flow(self, flow: _Flow, t: float, cause: str) -> list[Failure]:
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

    def _send_round(self, flow: _Flow, t: float, profile: LinkProfile, in_flight: int = 0) -> None:
        """Release the next round of one flow (see _plan_round and _release)."""
        plan = self._plan_round(flow, t, profile, in_flight)
        if plan is not None:
            self._release([plan], t)

    def _plan_round(self, flow: _Flow, t: float, profile: LinkProfile, in_flight: int = 0) -> _Plan | None:
        """What the next round sends: retransmissions first (after what the window slid
        by before a loss was detected), then new data, as the window (or PRR, in
        recovery) allows. None when it sends nothing."""
        flow.segment_wire = profile.mss_bytes + profile.header_bytes
        available = flow.end_seg - flow.next_seg
        before = 0  # new segments sent ahead of the retransmissions
        clock = flow.clock  # the ACKs releasing this round
        if flow.phase == _RECOVERY:
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
            if flow.undetected and flow.phase == _OPEN:
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
        if flow.phase == _RECOVERY:
            flow.prr_out += len(rtx) + new
            # PRR's window is what is in flight once it has sent (a timeout in recovery
            # reduces from there).
            flow.cwnd = float(n)
        plan = _Plan(flow, profile, (rtx, flow.next_seg, before, new), n)
        plan.rtx_at = t + flow.detect_delay
        flow.detect_delay = 0.0
        plan.cwnd_limited = new < available or n >= int(flow.cwnd)
        plan.slow_start = flow.phase != _RECOVERY and flow.cwnd < flow.ssthresh
        # What leaves faster than the ACK clock drains it piles up at the bottleneck: in
        # slow start the window's growth (released at twice the drain rate); with no ACK
        # clock (a first round, after idle or a timeout) the whole burst, as fast as the
        # link before the bottleneck brings it.
        plan.fast = before if before else n
        plan.clocked = clock > 0
        if not plan.clocked:
            plan.pile = plan.fast
        elif flow.phase == _RECOVERY and not before:
            plan.pile = 0  # PRR sends no faster than what is delivered
        else:
            # Beyond what the ACKs clock out; in slow start, two segments go out for each
            # ACKed one until the window (or the data) is used, so half of that part piles
            # up even when the data runs out first.
            plan.pile = max(plan.fast - clock, (min(plan.fast, 2 * int(flow.ss_grown)) + 1) // 2)
        flow.next_seg += before + new
        flow.lsnd = t
        return plan

    def _release(self, plans: list[_Plan], t: float) -> None:
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

    def _shared_overflow(self, plans: list[_Plan]) -> None:
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
        rng = random.Random(uniform(self.seed, "tcp/shared-drops", _SHARED, shared.direction, counter))
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

    def _private_overflow(self, plan: _Plan, t: float) -> int:
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

    def _launch(self, plan: _Plan, t: float) -> None:
        """Draw the round's losses and queue it at the bottleneck."""
        flow, profile, n = plan.flow, plan.profile, plan.n
        rtx, first_new, before, new = order = plan.order
        rng = None
        if plan.drops and (not plan.clocked or 2 * plan.drops > plan.fast):
            rng = random.Random(self._draw(flow, "tcp/drop-positions"))
        doubling = plan.slow_start or before > 0 or flow.ss_grown > 0  # released two for one
        dropped = _overflow_positions(plan.fast, plan.drops, plan.clocked and doubling, rng)
        lost_positions = self._random_losses(flow, profile, n) if profile.loss or profile.ge_p else []
        forced = self.forced_losses.get((flow.link, flow.direction)) if self.forced_losses else None
        if forced:
            # New segments chosen to be lost once (to compare recovery with a reference).
            chosen = [p for p in range(n) if (p < before or p >= before + len(rtx))
                      and _segment_at(order, p) in forced]
            for p in chosen:
                forced.discard(_segment_at(order, p))
            lost_positions = sorted(set(lost_positions).union(chosen))
        if dropped:
            lost_positions = sorted(set(lost_positions).union(dropped))
        if self.shared[flow.direction] is not None:
            self._hold_window(flow, profile, (n - len(dropped)) * flow.segment_wire)
            # Its next events' place among others' at the same instant (they interact).
            flow.tiebreak = self._draw(flow, "tcp/order")
        lost = [_segment_at(order, p) for p in lost_positions] if lost_positions else []
        rnd = _Round(t, n, before + new, order, lost, lost_positions, self._rate(flow, profile), plan.cwnd_limited)
        flow.round = rnd
        flow.last_sent = n
        flow.rounds += 1
        flow.clocked_bytes = max(0, n - len(dropped) - max(0, plan.pile - len(dropped))) * flow.segment_wire
        flow.released_at = t
        self._queue_round(flow, rnd, t, profile, set(dropped) if dropped else _NONE, plan.rtx_at)

    def _stall(self, flow: _Flow, t: float) -> None:
        """Nothing the window allows to send: wait for the timer if a hole is left
        that no further ACK will reveal, else the sender is idle until more data."""
        if (flow.undetected or flow.stuck or flow.lost) and flow.t_rto is None:
            flow.t_rto = t + flow.rto * flow.backoff
        flow.clock = 0  # the next round starts without an ACK clock
        self._hold_window(flow, self.profile(flow.link, flow.direction), 0.0)
        self._schedule(flow)

    def _outstanding(self, flow: _Flow, t: float) -> int:
        """At a wake-up: segments of the last round not yet acknowledged (the sender
        went quiet while they were out, so no round counted them acked)."""
        if t >= flow.ack_end or not flow.srtt:
            return 0
        return min(flow.last_sent, math.ceil(flow.last_sent * (flow.ack_end - t) / flow.srtt))

    def _rate(self, flow: _Flow, profile: LinkProfile) -> float:
        shared = self.shared[flow.direction]
        if shared is None:
            return profile.bandwidth
        return min(profile.bandwidth, shared.fair)

    def _hold_window(self, flow: _Flow, profile: LinkProfile, window: float) -> None:
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

    def _backlog(self, flow: _Flow, t: float) -> float:
        """Bytes of the flow still queued at its bottleneck at t."""
        if flow.group is not None:
            shared = self.shared[flow.direction]
            return max(0.0, flow.end_target - shared.groups[flow.group].v) if flow.q else 0.0
        if math.isinf(flow.rate) or flow.q_end <= t:
            return 0.0
        return (flow.q_end - t) * flow.rate

    def _random_losses(self, flow: _Flow, profile: LinkProfile, n: int) -> list[int]:
        """Positions (of the round's n segments) lost on the link: Bernoulli or
        Gilbert-Elliott per packet, drawn as geometric gaps between losses (and between
        state changes), so a round costs its losses, not its size."""
        if profile.ge_p > 0:
            return self._ge_losses(flow, profile, n)
        p = profile.loss
        if p <= 0:
            return []
        if p >= 1:
            return list(range(n))
        out = []
        pos = -1
        log_q = math.log1p(-p)
        while True:
            pos += 1 + int(math.log1p(-self._draw(flow, "tcp/loss")) / log_q)
            if pos >= n:  # memoryless: the next round draws its own first gap
                return out
            out.append(pos)

    def _ge_losses(self, flow: _Flow, profile: LinkProfile, n: int) -> list[int]:
        out = []
        pos = 0
        while pos < n:
            if flow.ge_left < 0:
                # Sojourn in the current state: each packet leaves it with ge_p (good) or ge_r (bad).
                leave = profile.ge_r if flow.ge_bad else profile.ge_p
                u = self._draw(flow, "tcp/gilbert-elliott")
                flow.ge_left = 1 + (int(math.log1p(-u) / math.log1p(-leave)) if 0 < leave < 1 else
                                    (0 if leave >= 1 else 1 << 40))
            run = min(flow.ge_left, n - pos)
            p = profile.ge_loss_bad if flow.ge_bad else profile.ge_loss_good
            if p >= 1:
                out.extend(range(pos, pos + run))
            elif p > 0:
                log_q = math.log1p(-p)
                at = pos - 1
                while True:
                    u = self._draw(flow, "tcp/loss")
                    at += 1 + int(math.log1p(-u) / log_q)
                    if at >= pos + run:
                        break
                    out.append(at)
            pos += run
            flow.ge_left -= run
            if flow.ge_left == 0:
                flow.ge_bad = not flow.ge_bad
                flow.ge_left = -1
        return out

    def _draw(self, flow: _Flow, purpose: str) -> float:
        counter = flow.draws
        flow.draws += 1
        return uniform(self.seed, purpose, flow.link, flow.direction, counter)

    def _queue_round(self, flow: _Flow, rnd: _Round, t: float, profile: LinkProfile, dropped: set[int],
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
                    n_drop = _count_between(drop_positions, pos, pos + count)
                    served -= n_drop * (m.mss + m.header)
                    if n_drop and short and (pos + count - 1) in dropped:
                        served += short
                delivered = count - _count_between(positions, pos, pos + count) if positions else count
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

    # --- service at the bottleneck --------------------------------------------------------

    def _enqueue(self, flow: _Flow, t: float, chunks: list, profile: LinkProfile) -> None:
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
            shared.groups[flow.group].sum_end += total

    def _chunk_done(self, flow: _Flow, chunk: list, t: float) -> None:
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

    def _complete(self, flow: _Flow) -> None:
        """Messages at the head of the stream whose every segment arrived are done."""
        msgs = flow.msgs
        while msgs and msgs[0].pending == 0:
            m = msgs.pop(0)
            arrival = Arrival(m.token, flow.link, flow.direction, m.entry, m.latest, m.size, m.wire, m.retx)
            self._push_done(m.latest, flow, m.order, arrival)
            if msgs and msgs[0].latest < m.latest:
                msgs[0].latest = m.latest

    # --- shared links ------------------------------------------------------------------------

    def _advance_shared(self, shared: _Shared, t: float) -> None:
        dt = t - shared.t
        if dt > 0:
            for g in shared.groups.values():
                if g.n:
                    g.v += g.rate * dt
            shared.t = t

    def _join(self, shared: _Shared, flow: _Flow, cap: float, head: float, total: float) -> None:
        g = shared.groups.get(cap)
        if g is None:
            g = shared.groups[cap] = _Group(cap)
        flow.group = cap
        g.n += 1
        flow.head_target = g.v + head
        flow.end_target = g.v + total
        g.sum_end += flow.end_target
        self.version += 1
        flow.gver = self.version
        heapq.heappush(g.heap, (flow.head_target, flow.link, flow.gver))

    def _leave(self, shared: _Shared, flow: _Flow) -> None:
        g = shared.groups[flow.group]
        g.n -= 1
        g.sum_end -= flow.end_target
        if g.n == 0:
            g.sum_end = 0.0
        flow.group = None

    def _refill(self, shared: _Shared, t: float) -> None:
        """Max-min fair rates: groups whose cap is below the fair share get their cap,
        the rest share what is left equally."""
        active = sorted((g for g in shared.groups.values() if g.n), key=lambda g: g.cap)
        remaining, count = shared.bandwidth, sum(g.n for g in active)
        fair = math.inf
        for i, g in enumerate(active):
            if g.cap * count <= remaining:
                g.rate = g.cap
                remaining -= g.cap * g.n
                count -= g.n
            else:
                fair = remaining / count
                for h in active[i:]:
                    h.rate = fair
                break
        shared.fair = fair
        self._next_shared(shared, t)

    def _group_head(self, shared: _Shared, g: _Group) -> tuple | None:
        """A group's next chunk to be served (target, link, version), its stale entries
        (a flow since regrouped, re-queued or emptied) dropped; None if it has none."""
        heap = g.heap
        while heap:
            _, link, ver = heap[0]
            flow = self.flows[(link, shared.direction)]
            if flow.gver == ver and flow.group == g.cap and flow.q:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _next_shared(self, shared: _Shared, t: float) -> None:
        soonest = math.inf
        for g in shared.groups.values():
            head = self._group_head(shared, g)
            if head is not None and g.n:
                soonest = min(soonest, t + max(0.0, head[0] - g.v) / g.rate)
        shared.t_next = soonest if soonest < math.inf else None
        self._schedule_shared(shared)

    def _on_shared(self, shared: _Shared, t: float) -> None:
        """A flow's head chunk at the shared link is served: complete it (and any other
        due at t), then find the next."""
        self._touch(shared)
        self._advance_shared(shared, t)
        changed = False
        while True:
            due = None
            for g in shared.groups.values():
                head = self._group_head(shared, g)
                if head is not None and g.n and head[0] <= g.v + 1e-9 * max(1.0, abs(g.v)):
                    if due is None or (head[1], head[0]) < (due[1][1], due[1][0]):
                        due = (g, head)
            if due is None:
                break
            g, (_, link, _) = due
            heapq.heappop(g.heap)
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
        if changed:
            self._refill(shared, t)
        else:
            self._next_shared(shared, t)


def _segment_at(order: tuple, pos: int) -> int:
    """The segment at a position of a round sent as (retransmissions, first new,
    new sent before them, new sent after)."""
    rtx, first_new, before, _ = order
    if pos < before:
        return first_new + pos
    if pos < before + len(rtx):
        return rtx[pos - before]
    return first_new + pos - len(rtx)


def _overflow_positions(n: int, drops: int, alternate: bool, rng: random.Random | None) -> list[int]:
    """Where in the round's first n segments the buffer's drops fall. Released at twice
    the drain rate (slow start), the queue fills part way and then every other segment
    finds it full; a window's growth of a segment or two finds it full part way through;
    a burst (no ACK clock, or many flows at once) loses a random share after its first."""
    if drops <= 0:
        return []
    if drops >= n:
        return list(range(n))
    if alternate and 2 * drops <= n:
        return list(range(n - 2 * drops + 1, n, 2))
    if rng is None:
        step = n / (drops + 1)
        return sorted({min(n - 1, int(step * (i + 1))) for i in range(drops)})
    return sorted(rng.sample(range(1, n), drops) if drops < n else range(n))


def _count_between(sorted_values: list[int], low: int, high: int) -> int:
    """How many of the sorted values lie in [low, high)."""
    return bisect.bisect_left(sorted_values, high) - bisect.bisect_left(sorted_values, low)
