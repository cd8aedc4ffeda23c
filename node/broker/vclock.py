"""Virtual time: the broker's discrete-event clock over real processes.

With ``run.clock = "virtual"`` emulated time is not the host's clock. The broker keeps
the current instant and holds every message between processes until it is due; time
moves only when the whole run is quiescent:

* every node has reported that none of its processes is runnable or computing and that
  nothing of it waits to go out (``idle``), with its earliest pending timer, and
* no message is in flight: a node's report says how many work messages from the broker
  it has taken in (``seen``), and the broker counts what it sent (as in distributed
  termination detection), so a report older than the last delivery does not count.
  Whatever a node sends reaches the broker before its later report (one FIFO socket).

At quiescence the broker first takes what the processes sent during the instant, in a
fixed order (sender, then the sender's sequence number), through the link model: a
message gets its due time; a round announcement or a change of links takes effect in
its place in that order. Then everything due now is delivered, in (due, sender's place,
sequence) order (``_Held``); with nothing due now, the clock jumps to the earliest of a held
message's due time, a node's timer, an availability change or a scripted event. Each
node involved hears one ``advance`` (the new instant, the broker's notices for it, and
how many deliveries follow), takes the deliveries, then fires its timers due by then.

So the same config and seed give the same run whatever the host's speed or load: real
processes, real sockets, the broker on the path of every message, but the order of
events fixed by the model. Heartbeats and the loss of a node stay on wall time: a node
declared lost leaves the quiescence set, so the clock never waits for it.

With the run quiescent and nothing pending at all, no process can ever run again: the
broker offers every node a ``stalled`` notice once, and a server waiting for replies
reports the deadlock at once instead of after a watchdog.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from ..wire import Pid

if TYPE_CHECKING:
    from .timebase import VirtualTimebase

# How long (wall seconds) the run must stay quiescent with nothing pending before it is
# told it is stalled: a process started from outside the run may be on its way to say so.
STALL_GRACE_S = 0.3


@dataclass
class _NodeView:
    """What the broker knows of one node's state in virtual time."""

    idle: bool = False  # its last word was an idle report (nothing since)
    seen: int = 0  # work messages it had taken in at that report
    sent: int = 0  # work messages the broker has sent it
    next: float | None = None  # its earliest timer at that report

    @property
    def quiescent(self) -> bool:
        return self.idle and self.seen == self.sent


class VirtualScheduler:
    def __init__(self, host: VirtualTimebase) -> None:
        # Its calls back: order_of, apply, collect_due, send_work, send_work_ctl,
        # clock_moved, next_change, wake_at.
        self.host = host
        self.now = 0.0
        self.started = False  # the clock stands at 0 while the run's processes start
        self._views: dict[str, _NodeView] = {}
        # What processes sent during this instant: (sender, its sequence, what, payload).
        self._inputs: list[tuple[Pid, int, str, Any]] = []
        self._sequence: dict[Pid, int] = {}
        # Held until due, in delivery order: see _Held.
        self._held: list[_Held] = []
        self._holds = 0  # holds so far: the last tie-break, so no two entries compare equal
        # Per (sender, receiver): the latest due time held, so no later message overtakes.
        self._last_due: dict[tuple, float] = {}
        self._prune_at = 1024
        # Broker notices (availability, offline) for a node, delivered with its next advance.
        self._notices: dict[str, list[dict]] = {}
        self._stalled_told = False
        self._stall_seen: float | None = None  # when the run was first seen stuck (wall clock)
        self._announced = 0.0  # the latest instant every node has been told of
        self.instants = 0  # instants the clock has stopped at (for the books)

    # --- nodes ---------------------------------------------------------------------------

    def join(self, node: str) -> None:
        self._views[node] = _NodeView()

    def leave(self, node: str) -> None:
        """A node left or was declared lost: the clock no longer waits for it, and what
        was held for it is dropped (it could never be delivered)."""
        self._views.pop(node, None)
        self._notices.pop(node, None)
        kept = [entry for entry in self._held if entry.node != node]
        if len(kept) != len(self._held):
            heapq.heapify(kept)
            self._held = kept

    def heard(self, node: str) -> None:
        """Anything but a heartbeat or an idle report: the node is busy until it reports."""
        view = self._views.get(node)
        if view is not None:
            view.idle = False
        self._stall_seen = None

    def report(self, node: str, seen: Any, next_timer: Any) -> None:
        view = self._views.get(node)
        if view is None or type(seen) is not int or not (next_timer is None or type(next_timer) is float):
            raise ValueError(f"bad idle report from {node!r}: seen={seen!r} next={next_timer!r}")
        view.idle, view.seen, view.next = True, seen, next_timer

    def counted(self, node: str) -> None:
        """A work message went to ``node``: its next report must have seen it."""
        view = self._views.get(node)
        if view is not None:
            view.sent += 1

    # --- inputs of the current instant ---------------------------------------------------

    def accept(self, sender: Pid, kind: str, payload: Any) -> None:
        """Something a process sent during this instant; it takes effect at quiescence,
        in (sender, sequence) order."""
        sender = Pid(*sender)
        sequence = self._sequence[sender] = self._sequence.get(sender, 0) + 1
        self._inputs.append((sender, sequence, kind, payload))
        self._stalled_told = False

    def notify(self, node: str, body: dict) -> None:
        """A broker notice (a device offline or back, ...) for ``node``, delivered with
        its next advance, so it takes effect at a known instant."""
        self._notices.setdefault(node, []).append(body)

    def hold(self, due: float, sender: Pid, sequence: int, receiver: Any, node: str, frames: list,
             link: int = -1, direction: int = -1, index: int = 0) -> None:
        """Hold ``frames`` for ``node`` until ``due``; ``index``: the receiver's place
        among those of one message to many."""
        key = (sender, receiver)
        due = max(due, self.now, self._last_due.get(key, -math.inf))  # FIFO per pair of processes
        self._last_due[key] = due
        self._holds += 1
        heapq.heappush(self._held, _Held(due, self.host.order_of(sender), sequence, index, self._holds, node,
                                         frames, link, direction))

    def drop_held(self, gone: Callable[[int], bool], lost: Callable[[int, int, float], None]) -> None:
        """Drop what is in flight on links now offline (``gone(link)``), each counted
        lost. A receiver's release of a message to many is kept, void: its node frees
        the body when every release has come."""
        kept, changed = [], False
        for entry in self._held:
            if entry.link >= 0 and entry.due > self.now and gone(entry.link):
                lost(entry.link, entry.direction, entry.due)
                changed = True
                void = getattr(entry.frames, "void", None)
                if void is not None:
                    kept.append(entry._replace(frames=void(), link=-1))
            else:
                kept.append(entry)
        if changed:
            heapq.heapify(kept)
            self._held = kept

    # --- moving time ---------------------------------------------------------------------

    def step(self) -> None:
        """Called after every burst of input: if the run is quiescent, take this
        instant's inputs, deliver what is due, or move the clock to the next event."""
        while self._views and all(view.quiescent for view in self._views.values()):
            if self._inputs:
                inputs, self._inputs = self._inputs, []
                inputs.sort(key=lambda item: (item[0], item[1]))
                for sender, sequence, kind, payload in inputs:
                    self.host.apply(sender, sequence, kind, payload)
            self.host.collect_due()
            if self._deliver():
                return
            if not self.started:
                return
            at = self._next_event()
            if at == math.inf:
                self._stall()
                return
            self.now = max(self.now, at)
            self.instants += 1
            self.host.clock_moved()
            if len(self._last_due) > self._prune_at:
                self._last_due = {k: due for k, due in self._last_due.items() if due > self.now}
                self._prune_at = max(1024, 4 * len(self._last_due))

    def _next_event(self) -> float:
        candidates = [view.next for view in self._views.values() if view.next is not None]
        if self._held:
            candidates.append(self._held[0].due)
        bound = min(candidates, default=math.inf)
        return min(bound, self.host.next_change(bound))

    def _deliver(self) -> bool:
        """Everything due by now, to each node involved: one advance (the instant, its
        notices, the number of deliveries), then the deliveries in (due, sender,
        sequence) order. False if nothing is due."""
        batches: dict[str, list[list]] = {}
        held = self._held
        while held and held[0].due <= self.now:
            entry = heapq.heappop(held)
            batches.setdefault(entry.node, []).append(entry.frames)
        involved = set(batches) | set(self._notices)
        involved |= {name for name, view in self._views.items() if view.next is not None and view.next <= self.now}
        if self.now > self._announced:
            # Every node hears of a new instant, involved or not: whatever one of its
            # processes starts (a wall-time event: a signal, a restart) starts from it.
            involved |= set(self._views)
            self._announced = self.now
        involved &= set(self._views)
        if not involved:
            return False
        self._stall_seen = None
        for name in sorted(involved):
            deliveries = batches.get(name, [])
            notices = self._notices.pop(name, [])
            self.host.send_work_ctl(name, {"op": "advance", "now": float(self.now), "count": len(deliveries),
                                              "notices": notices})
            for frames in deliveries:
                self.host.send_work(name, frames)
            self._views[name].idle = False
        return True

    def _stall(self) -> None:
        """Quiescent with nothing pending: tell every node, once. Only after the state
        has held for STALL_GRACE_S of wall time: a process started from outside the run
        (a wall-time event) may be on its way to saying so."""
        if self._stalled_told:
            return
        now = time.monotonic()  # wall: the grace is real time (see STALL_GRACE_S)
        if self._stall_seen is None:
            self._stall_seen = now
        if now - self._stall_seen < STALL_GRACE_S:
            self.host.wake_at(self._stall_seen + STALL_GRACE_S)
            return
        self._stalled_told = True
        for name in sorted(self._views):
            self.host.send_work_ctl(name, {"op": "stalled", "now": float(self.now)})
            self._views[name].idle = False

    @property
    def held(self) -> int:
        return len(self._held)


class _Held(NamedTuple):
    """A message held until due. Entries compare as tuples, so the fields up to ``tie``
    are the delivery order: due time, then the sender's place (the timebase's
    ``order_of``: clients by their link, so a round's uploads reach the server in the
    same order whatever node hosts which client), the sender's sequence, the place
    among the receivers of one message to many, and the order of holding."""

    due: float
    order: tuple
    sequence: int
    index: int
    tie: int
    node: str
    frames: list
    link: int
    direction: int


def sender_of(header_src: Pid, body: Any) -> Pid:
    """Who a relayed control message speaks for: a DOWN for the process that ended (so
    it comes after that process's last messages), anything else for its node."""
    down = body.get("down") if isinstance(body, dict) else None
    pid = getattr(down, "pid", None)
    return Pid(*pid) if isinstance(pid, tuple) and len(pid) == 2 else header_src

