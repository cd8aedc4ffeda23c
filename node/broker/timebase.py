"""The broker's side of virtual time: what the scheduler (vclock.py) calls back.

In virtual time routing hands every input to the scheduler; at quiescence the
scheduler gives each back here in its fixed order, to be applied (a message through
its link's model to its due time, a round, a change of links), and delivers what is
due through the counted sends below.

Apart from vclock.py, which decides when time moves and knows nothing of links,
names or sockets; and from routing because wall time never comes here.
"""
from __future__ import annotations

from .. import wire
from ..wire import Pid


class Release(list):
    """The frames of a stash's release to one receiver (see _transmit_virtual_many);
    ``void()``: the same release once the copy it stands for was lost on the way."""

    def __init__(self, src: Pid, node: str, stash: int, receiver: int, void: bool = False) -> None:
        note = {"release": stash, "to": receiver, **({"void": True} if void else {})}
        super().__init__(wire.many_frames(src, node, 1, note, []))
        self.args = (src, node, stash, receiver)

    def void(self) -> Release:
        return Release(*self.args, void=True)


class VirtualTimeCalls:
    """Broker's calls for the virtual-time scheduler (a mixin of :class:`~fedemu.node.broker.Broker`)."""

    def _send_work(self, node: str, frames: list) -> None:
        """A delivery of the current instant to ``node`` (counted in its books)."""
        info = self._nodes.get(node)
        if info is not None:
            self.scheduler.counted(node)
            self._send(info.identity, frames, node)

    def _send_work_ctl(self, node: str, body: dict) -> None:
        info = self._nodes.get(node)
        if info is not None:
            self._send_ctl(info.identity, Pid(node, 0), body)

    def _virtual_input(self, sender: Pid, sequence: int, kind: str, payload) -> None:
        """One thing a process sent during the instant, taken in its place in the order."""
        if kind == "user":
            self._transmit_virtual(sender, sequence, *payload)
        elif kind == "ctl":
            header, frames, receiver = payload
            self._relay_ctl(header, frames, hold=lambda node, msg: self.scheduler.hold(
                self.scheduler.now, sender, sequence, receiver, node, msg))
        elif kind == "many":
            self._transmit_virtual_many(sender, sequence, *payload)
        elif kind == "round":
            self._apply_round(payload)
        elif kind == "set_links":
            self._apply_set_links(payload)
        elif kind == "disown":
            self._disown(payload)

    def _transmit_virtual(self, src: Pid, sequence: int, fields: list, frames: list, size: int) -> None:
        """A message sent at the current instant: through its link's model (if it
        crosses one) to its due time, then held until then."""
        destination = self._destination(fields)
        if destination is None:
            return
        dst_pid, target = destination
        now = self.scheduler.now
        crossing = self._account(src, dst_pid, size) if self._link_of else self._other(size)
        if crossing is None or not self._emulating:
            self.scheduler.hold(now, src, sequence, dst_pid, target.name, frames)
            return
        link, direction = crossing
        arrival = self._arrival(link, direction, size, now)
        if arrival is not None:
            self.scheduler.hold(arrival, src, sequence, dst_pid, target.name, frames, link, direction)

    def _transmit_virtual_many(self, src: Pid, sequence: int, header: wire.Header, frames: list,
                               ids: list[int]) -> None:
        """A message to many sent at the current instant: each receiver's copy through
        its link's model to its own due time. The node gets the body now, once (a
        stash, not a delivery: it runs nothing), and each receiver a small release at
        its instant, held and ordered like any message."""
        target = self._nodes.get(header.dst_node)
        if target is None:
            self._drop("unknown-destination", f"node {header.dst_node!r} is not connected")
            return
        now = self.scheduler.now
        arrivals = []
        size = wire.link_size(frames, wire.MANY)
        for i in ids:
            crossing = self._account(src, Pid(target.name, i), size) if self._link_of else self._other(size)
            if crossing is None or not self._emulating:
                arrivals.append((now, i, -1, -1))
                continue
            arrival = self._arrival(*crossing, size, now)
            if arrival is not None:
                arrivals.append((arrival, i, *crossing))
        if not arrivals:
            return
        self._stash_ids += 1
        stash = self._stash_ids
        self.stats.fanout_msgs += 1
        self.stats.fanout_receivers += len(arrivals)
        self._send(target.identity, wire.many_frames(src, target.name, len(arrivals),
                                                     {"stash": stash, "count": len(arrivals)}, frames[2:]), target.name)
        for index, (due, i, link, direction) in enumerate(arrivals):
            self.scheduler.hold(due, src, sequence, Pid(target.name, i), target.name, Release(src, target.name, stash, i),
                                link, direction, index)

    def _order_of(self, sender: Pid) -> tuple:
        """Where a sender's messages come among those due at one instant: a client's by
        its link (its number, whichever node hosts it), then anyone else's by pid."""
        link = self._link_of.get(sender)
        return (0, link, "", 0) if link is not None else (1, -1, sender.node, sender.id)

    def _clock_moved(self) -> None:
        """The virtual clock moved on: time-based availability changes and scripted
        events due by now take effect."""
        self._due_device_checks()
        self._scripted_events(round_=None)

    def _wake_at(self, wall: float) -> None:
        """Have the serve loop look again (step the scheduler) by ``wall`` (monotonic)."""
        self._wake_deadline = min(self._wake_deadline, wall)
