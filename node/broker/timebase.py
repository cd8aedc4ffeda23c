"""The run's time, as the broker keeps it: two timebases behind one interface.

Routing and the control ops never ask which clock runs; they hand the timebase what
processes send (:meth:`take`) and what the link model says is due (:meth:`deliver`,
:meth:`deliver_many`), and it decides when that happens:

* :class:`WallTimebase`: emulated time is the host's monotonic clock x ``time_scale``.
  What processes send takes effect at once. A message whose arrival the link model fixes
  as it enters goes to its node at once with a :class:`~fedemu.node.wire.Hold` and the
  node keeps it until due (runtime/holding.py), so the bytes' trip over loopback or the
  LAN overlaps the emulated delay; one whose arrival is still pending (``tcp``) waits
  here until the model says it has arrived.
* :class:`VirtualTimebase`: the broker's discrete-event clock (vclock.py). What processes
  send takes effect at quiescence, in (sender, sequence) order; everything is held here
  until due and delivered in (due, sender, sequence) order.
"""
from __future__ import annotations

import collections
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

from .. import wire
from ..control import WORK_OPS
from ..wire import Hold, Pid, WireError
from .vclock import VirtualScheduler

if TYPE_CHECKING:
    from ..net.emulator import LinkEmulator
    from .membership import Membership
    from .network_changes import NetworkChanges

log = logging.getLogger("fedemu.broker")

# How far back a sender's send stamp may start a message's emulated clock (wall time). A
# stamp is normally a fraction of a millisecond old; a much older one means a starved
# sender or a bad clock estimate, and must not let a message skip most of its delay.
MAX_SEND_AGE_S = 1.0


# The states of a message waiting in a pair's queue (Timebase.behind).
WAITING, READY, LOST = "waiting", "ready", "lost"


class TimebaseHost(Protocol):
    """What the timebases use of the broker that holds them: passed in, so this module
    depends on these, not on the Broker."""

    changes: NetworkChanges
    links: LinkEmulator
    members: Membership

    def apply(self, sender: Pid, sequence: int, kind: str, payload: Any) -> None: ...
    def send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None: ...
    def send_to(self, node: str, msg: list) -> None: ...


class Parcel(NamedTuple):
    """One receiver's copy of a message, on its way: what the timebase delivers when due."""

    sender: Pid
    sequence: int  # the sender's sequence (virtual time's order; 0 on the wall clock)
    receiver: Pid
    node: str
    frames: list | None  # None for a receiver of a message to many (its release is made when needed)
    fields: list | None = None  # a user message's header fields (the wall clock rewrites them with a hold)
    index: int = 0  # the receiver's place among those of one message to many
    stash: int = 0  # a message to many: the body's stash at the node (0: none)

    def outgoing(self, void: bool = False) -> list:
        """The frames that deliver it: its own, or its stash's release."""
        if self.stash:
            return Release(self.sender, self.node, self.stash, self.receiver.id, void)
        return self.frames


class Release(list):
    """The frames of a stash's release to one receiver (a message to many: the body went
    to the node once, each receiver's copy is released at its own time); ``void()``: the
    same release once the copy it stands for was lost on the way."""

    def __init__(self, src: Pid, node: str, stash: int, receiver: int, void: bool = False) -> None:
        note = {"release": stash, "to": receiver, **({"void": True} if void else {})}
        super().__init__(wire.many_frames(src, node, 1, note, []))
        self.args = (src, node, stash, receiver)

    def void(self) -> Release:
        return Release(*self.args, void=True)


class Timebase:
    """What both timebases share; see the module's docstring."""

    name = ""  # "wall" or "virtual", as the welcome tells the nodes

    take_at_once = False  # whether what processes send takes effect at once (else at its place in the order)

    def __init__(self, broker: TimebaseHost) -> None:
        self._broker = broker
        self._stash_ids = 0
        # Per (sender, receiver) pair with a copy still in a ``tcp`` connection, what it
        # sent since, in order: nothing may overtake that copy (a process's messages, and
        # its DOWN after them, arrive in the order it sent them, as in Erlang). Entries
        # are [parcel, state, due, link, direction], state WAITING, READY or LOST;
        # ``_waiting`` finds a pending copy's entry (by the parcel's identity).
        self.behind: dict[tuple[Pid, Pid], collections.deque] = {}
        self._waiting: dict[int, list] = {}

    def now(self) -> float:
        """Emulated seconds since the run's clock started."""
        raise NotImplementedError

    # What processes send, and what is due.

    def take(self, sender: Pid, kind: str, payload: Any) -> None:
        """Something a process sent (a user message, a message to many, relayed control, a
        round, a change of links, an ended process's link): applied by the broker's
        :meth:`~fedemu.node.broker.Broker.apply`, now or at its place in the order."""
        raise NotImplementedError

    def entry(self, sent: float | None) -> float:
        """The emulated time at which a message whose sender stamped it ``sent`` (broker
        clock; None: unstamped) enters its link."""
        raise NotImplementedError

    def deliver(self, due: float | None, parcel: Parcel, link: int = -1, direction: int = -1) -> None:
        """Deliver ``parcel`` at emulated time ``due`` (None: now, no link delays it), or,
        if an earlier copy from its sender to its receiver is still in a connection,
        right after that one."""
        queue = self.behind.get((parcel.sender, parcel.receiver)) if self.behind else None
        if queue is None:
            self._deliver(due, parcel, link, direction)
        else:
            queue.append([parcel, READY, due, link, direction])

    def _deliver(self, due: float | None, parcel: Parcel, link: int, direction: int) -> None:
        raise NotImplementedError

    def pending(self, parcel: Parcel) -> None:
        """``parcel`` is in a connection (the link model hands it back from due()): what
        its sender sends its receiver from now on waits behind it."""
        entry = [parcel, WAITING, None, -1, -1]
        self._waiting[id(parcel)] = entry
        self.behind.setdefault((parcel.sender, parcel.receiver), collections.deque()).append(entry)

    def new_stash(self) -> int:
        """An id for the body of a message to many, which its node keeps until every
        receiver's release has come."""
        self._stash_ids += 1
        return self._stash_ids

    def deliver_many(self, header: wire.Header, frames: list, stash: int,
                     arrivals: list[tuple[float | None, Parcel, int, int]], pending: int) -> None:
        """A message to many processes of one node: each receiver's copy at its own time,
        ``arrivals`` (due or None, its parcel, link, direction), or later (``pending``
        copies, which the link model hands back when they arrive). The body goes to the
        node once, as a stash, and each receiver gets a small release when due."""
        node = header.dst_node
        count = len(arrivals) + pending
        self._broker.send_to(node, wire.many_frames(header.src, node, count, {"stash": stash, "count": count},
                                                    frames[2:]))
        for due, parcel, link, direction in arrivals:
            self.deliver(due, parcel, link, direction)

    def arrived(self, now: float) -> None:
        """What the link model says has arrived by ``now`` (pending transports), each
        delivered; a lost copy of a message to many still releases its stash, void."""
        for parcel, arrival, link, direction in self._broker.links.due(now):
            entry = self._waiting.pop(id(parcel))
            if arrival is not None:
                entry[1:] = [READY, arrival, link, direction]
            elif parcel.stash:  # its node frees the body when every release has come
                entry[:] = [parcel._replace(frames=parcel.outgoing(void=True), stash=0), READY, None, -1, -1]
            else:
                entry[1] = LOST
            self._release_behind((parcel.sender, parcel.receiver), now)

    def _release_behind(self, pair: tuple[Pid, Pid], now: float) -> None:
        """Deliver, in order, what a pair's queue holds up to its next copy still in a
        connection; never earlier than ``now`` (what waited is due no sooner)."""
        queue = self.behind[pair]
        while queue and queue[0][1] is not WAITING:
            parcel, state, due, link, direction = queue.popleft()
            if state is READY:
                self._deliver(None if due is None else max(due, now), parcel, link, direction)
        if not queue:
            del self.behind[pair]

    def drop_in_flight(self, gone: Callable[[int, float], bool]) -> None:
        """Links for which ``gone(link, now)`` went offline: what is in flight on them is
        lost (each counted)."""
        raise NotImplementedError

    def notify(self, node: str, body: dict) -> None:
        """A broker notice about devices (``availability``) for ``node``."""
        raise NotImplementedError

    # The run's nodes, as the clock sees them.

    def join(self, node: str) -> None:
        pass

    def leave(self, node: str) -> None:
        pass

    def heard(self, node: str) -> None:
        """Anything from ``node`` but a heartbeat or an idle report."""

    def report(self, node: str, seen: Any, next_timer: Any) -> None:
        raise WireError("idle reports are for virtual time; this broker runs on wall time")

    def start(self, by: Pid) -> None:
        """Every worker node is up: the run's clock starts."""

    def counted(self, node: str, body: dict) -> None:
        """A control message to ``node`` (virtual time counts the work ones)."""

    # The serve loop.

    def step(self) -> None:
        """After every burst of input, and when the loop wakes."""

    def wake(self) -> float:
        """When (wall, monotonic) the loop must look again at the latest."""
        return math.inf

    @property
    def time_scale(self) -> float:
        return 1.0


class WallTimebase(Timebase):
    name = "wall"
    take_at_once = True

    def __init__(self, broker: TimebaseHost, time_scale: float) -> None:
        super().__init__(broker)
        self._time_scale = time_scale
        self._t0 = time.monotonic()  # wall: the wall clock's origin
        # Per link, when the last message forwarded across it is due (broker clock):
        # while that is ahead, receiving nodes may hold messages of that link.
        self._flight_until: dict[int, float] = {}

    @property
    def time_scale(self) -> float:
        return self._time_scale

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self._time_scale  # wall: the wall clock's emulated time

    def _wall(self, emulated: float) -> float:
        return self._t0 + emulated / self._time_scale

    def take(self, sender: Pid, kind: str, payload: Any) -> None:
        self._broker.apply(sender, 0, kind, payload)

    def entry(self, sent: float | None) -> float:
        # The model's clock starts when the sender sent (its stamp, in this clock), so the
        # bytes' trip here is part of the emulated delay, not added to it.
        now = time.monotonic()  # wall
        entry = now if sent is None else min(now, max(sent, now - MAX_SEND_AGE_S))
        return (entry - self._t0) * self._time_scale

    def _deliver(self, due: float | None, parcel: Parcel, link: int, direction: int) -> None:
        frames = parcel.outgoing()
        if due is not None and link >= 0:
            now = time.monotonic()  # wall
            wall_due = self._wall(due)
            if wall_due > self._flight_until.get(link, 0.0):
                self._flight_until[link] = wall_due
            if parcel.fields is not None:
                frames = [wire.held_header(parcel.fields, Hold(wall_due - now, now, link, direction)), *frames[1:]]
        self._broker.send_to(parcel.node, frames)

    def deliver_many(self, header, frames, stash, arrivals, pending) -> None:
        """Every copy's time known as it enters (the ``message`` pipe): one message to the
        node with each receiver's hold, which the node's held-message heap keeps like any
        held message."""
        if pending or self.behind:  # some copy waits for, or behind, one in a connection
            super().deliver_many(header, frames, stash, arrivals, pending)
            return
        now = time.monotonic()  # wall
        holds = []
        for due, parcel, link, direction in arrivals:
            if due is None or link < 0:
                holds.append([parcel.receiver.id, 0.0, -1, -1])
                continue
            wall_due = self._wall(due)
            if wall_due > self._flight_until.get(link, 0.0):
                self._flight_until[link] = wall_due
            holds.append([parcel.receiver.id, wall_due - now, link, direction])
        node = header.dst_node
        self._broker.send_to(node, wire.many_frames(header.src, node, len(holds), {"at": now, "holds": holds},
                                                    frames[2:]))

    def drop_in_flight(self, gone: Callable[[int, float], bool]) -> None:
        """Messages held by the receiving nodes: every node hears which links went
        offline, drops what it holds for them and reports back (``held_dropped``), so the
        loss is counted like any other."""
        now = time.monotonic()  # wall
        for link in [k for k, until in self._flight_until.items() if until <= now]:
            del self._flight_until[link]  # nothing of it is held anywhere any more
        emulated = (now - self._t0) * self._time_scale
        links = [k for k in self._flight_until if gone(k, emulated)]
        if not links:
            return
        for link in links:
            del self._flight_until[link]
        members = self._broker.members
        for info in members.nodes.values():
            self._broker.send_ctl(info.identity, Pid(info.name, 0), {"op": "offline", "links": links, "at": now})

    def notify(self, node: str, body: dict) -> None:
        info = self._broker.members.nodes.get(node)
        if info is not None:
            self._broker.send_ctl(info.identity, Pid(node, 0), body)

    def step(self) -> None:
        links = self._broker.links
        now = self.now()
        if links.next_device_check() <= now:
            self._broker.changes.clock_moved_devices()
        if links.next_due() <= now:
            self.arrived(now)

    def wake(self) -> float:
        links = self._broker.links
        return self._wall(min(links.next_device_check(), links.next_due()))


class VirtualTimebase(Timebase):
    name = "virtual"

    def __init__(self, broker: TimebaseHost) -> None:
        super().__init__(broker)
        self.scheduler = VirtualScheduler(self)
        self._wake_deadline = math.inf  # the scheduler's next look, in wall time

    def now(self) -> float:
        return self.scheduler.now

    def take(self, sender: Pid, kind: str, payload: Any) -> None:
        self.scheduler.accept(sender, kind, payload)

    def entry(self, sent: float | None) -> float:
        return self.scheduler.now

    def _deliver(self, due: float | None, parcel: Parcel, link: int, direction: int) -> None:
        self.scheduler.hold(self.scheduler.now if due is None else due, parcel.sender, parcel.sequence,
                            parcel.receiver, parcel.node, parcel.outgoing(), link, direction, parcel.index)

    def drop_in_flight(self, gone: Callable[[int, float], bool]) -> None:
        emulated = self.scheduler.now
        links = self._broker.links
        self.scheduler.drop_held(lambda link: gone(link, emulated),
                                 lambda link, direction, due: links.lost(link, direction, "offline", emulated, due))

    def notify(self, node: str, body: dict) -> None:
        self.scheduler.notify(node, body)  # at the instant it happens, with the node's next advance

    def join(self, node: str) -> None:
        self.scheduler.join(node)

    def leave(self, node: str) -> None:
        self.scheduler.leave(node)

    def heard(self, node: str) -> None:
        self.scheduler.heard(node)

    def report(self, node: str, seen: Any, next_timer: Any) -> None:
        self.scheduler.report(node, seen, next_timer)

    def start(self, by: Pid) -> None:
        if not self.scheduler.started:
            self.scheduler.started = True
            log.info("virtual clock started by %s", by)

    def counted(self, node: str, body: dict) -> None:
        if body.get("op") in WORK_OPS:
            self.scheduler.counted(node)

    def step(self) -> None:
        self.scheduler.step()

    def wake(self) -> float:
        wake, self._wake_deadline = self._wake_deadline, math.inf
        return wake

    # --- the scheduler's calls back (vclock.VirtualScheduler) ------------------------------

    def order_of(self, sender: Pid) -> tuple:
        return self._broker.members.order_of(sender)

    def apply(self, sender: Pid, sequence: int, kind: str, payload: Any) -> None:
        self._broker.apply(sender, sequence, kind, payload)

    def collect_due(self) -> None:
        """Pending transports' arrivals due by now, held for delivery at this instant."""
        now = self.scheduler.now
        if self._broker.links.next_due(until=now) <= now:
            self.arrived(now)

    def send_work(self, node: str, frames: list) -> None:
        """A delivery of the current instant to ``node`` (counted in its books)."""
        if node in self._broker.members.nodes:
            self.scheduler.counted(node)
            self._broker.send_to(node, frames)

    def send_work_ctl(self, node: str, body: dict) -> None:
        info = self._broker.members.nodes.get(node)
        if info is not None:
            self._broker.send_ctl(info.identity, Pid(node, 0), body)

    def clock_moved(self) -> None:
        self._broker.changes.clock_moved()

    def next_change(self, bound: float = math.inf) -> float:
        """The next instant at which the network changes or a pending transfer arrives,
        given that nothing else happens before ``bound`` (the scheduler's next other
        event), so a transport need not look further."""
        links = self._broker.links
        change = links.next_change()
        return min(change, links.next_due(until=min(bound, change)))

    def wake_at(self, wall: float) -> None:
        """Have the serve loop look again (step the scheduler) by ``wall`` (monotonic)."""
        self._wake_deadline = min(self._wake_deadline, wall)
