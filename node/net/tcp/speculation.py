"""Speculation and rollback: how the model may simulate ahead and still answer as if it had not.

:meth:`~.scheduler.TcpTransport.next_arrival` may process events beyond the latest
input's time; an input that then comes earlier than (or at the time of) what was
simulated must see the state as it was. Before a speculative event first changes an
object (a :class:`~.state.Flow` or a :class:`~.shared.SharedLink`), :meth:`_touch`
keeps a snapshot; :meth:`_rollback` restores them all and the events run again from
there; :meth:`_commit` drops the log once no input can come before the simulated
events. So results depend only on the inputs and their times, never on when the
model was asked.

:class:`Speculation` is the part of :class:`~.scheduler.TcpTransport` that keeps the
log. Its state (set in ``TcpTransport.__init__``): ``_saved`` (object id -> (object,
snapshot)), ``_ahead`` (the latest speculative event's time), ``_base`` (when the
speculation began); it reads ``_safe`` (no input comes before it), ``_event_time``
(the event being processed) and ``_returned`` (completions handed out up to then).
"""
from __future__ import annotations

import heapq
import math

from .state import Flow


class Speculation:
    """The undo log of speculative events (see the module's docstring)."""

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
            if isinstance(obj, Flow):
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

    def _push_done(self, when: float, flow: Flow, order: int, item) -> None:
        if when <= self._returned:
            return  # found again after a rollback: it was handed out already
        heapq.heappush(self.done, (when, flow.link, flow.direction, order, item, self._event_time))
