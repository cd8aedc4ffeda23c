"""What the model remembers, and the records it hands back.

:class:`Arrival` and :class:`Failure` are what the interface (scheduler.py) returns.
The rest is the senders' state, in plain objects that speculation.py can snapshot and
restore: :class:`Message` (one message in a direction's byte stream), :class:`Round`
(what one round sent, kept until its ACKs return), :class:`Plan` (a round about to be
released) and :class:`Flow` (one direction of one client's connection: its stream, its
sender and its place at the bottleneck). OPEN, RECOVERY and LOSS are a sender's phases:
nothing to repair, fast recovery (recovery.py), and after a retransmission timeout.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

OPEN, RECOVERY, LOSS = 0, 1, 2


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


class Message:
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

    def copy(self) -> Message:
        other = Message.__new__(Message)
        for name in Message.__slots__:
            setattr(other, name, getattr(self, name))
        return other


class Round:
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


class Plan:
    """A round about to be released (rounds at the same instant share a buffer)."""

    __slots__ = ("flow", "profile", "order", "n", "cwnd_limited", "slow_start", "fast", "clocked", "pile",
                 "drops", "rtx_at")

    def __init__(self, flow, profile, order, n):
        self.flow, self.profile, self.order, self.n = flow, profile, order, n
        self.drops = 0


class Flow:
    """One direction of one client's connection: its stream, its sender's state and its
    place at the bottleneck."""

    def __init__(self, link: int, direction: int):
        self.link, self.direction = link, direction
        self.msgs: list[Message] = []
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
        self.group: tuple[float, float] | None = None  # shared link: its group's (cap, weight)
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
        self.phase = OPEN
        self.srtt = self.rttvar = None
        self.rto = 1.0  # RFC 6298 before any sample; the handshake's sample replaces it
        self.backoff = 1.0
        self.stall_since: float | None = None
        self.lsnd = -math.inf  # last time data was sent
        self.round: Round | None = None  # the round whose ACKs are awaited
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
