"""The broker's side of virtual time: what the scheduler (vclock.py) calls back.

In virtual time routing hands every input to the scheduler; at quiescence the
scheduler gives each back here in its fixed order, to be applied (a message through
its link's model to its due time, a round, a change of links), and delivers what is
due through the counted sends below.

Apart from vclock.py, which decides when time moves and knows nothing of links,
names or sockets; and from routing because wall time never comes here.
"""
from __future__ import annotations

from .wire import Pid


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

    def _clock_moved(self) -> None:
        """The virtual clock moved on: time-based availability changes and scripted
        events due by now take effect."""
        self._due_device_checks()
        self._scripted_events(round_=None)

    def _wake_at(self, wall: float) -> None:
        """Have the serve loop look again (step the scheduler) by ``wall`` (monotonic)."""
        self._wake_deadline = min(self._wake_deadline, wall)
