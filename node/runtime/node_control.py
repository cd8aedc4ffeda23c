"""What a node does with each control op it receives (the ops and who may send them
are control.py's table; the I/O thread has checked the message against it).

Apart from the I/O loop (transport.py) because meaning is not transport: each op's
handler is short and calls into the part of the node it concerns (the clock, the
process table, the held messages), so this module reads as the node's half of the
control protocol.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from .. import wire
from .process import BehaviourProcess, LinkChange, Message, Stalled, ThreadProcess
from ..wire import BROKER_PID

log = logging.getLogger("fedemu.node")


class NodeControl:
    """Node's handlers of control ops (a mixin of :class:`~fedemu.node.runtime.Node`)."""

    def _control(self, header: wire.Header, body: dict) -> None:
        op = body["op"]
        if op == "hb":
            self._broker_clock.sample(body)
            return
        if op == "welcome":
            self._broker_clock.welcome(body)
            self._set_clock(body.get("clock", "wall"), body.get("time_scale", 1.0), self._broker_clock.origin(body))
            self._welcomed.set()
        elif op == "advance":
            # Virtual time: the clock is at `now`; the broker's notices for this instant
            # apply first, `count` deliveries of it follow, then this node's timers due
            # by now fire (one message, so nothing runs at the new instant before it is set).
            now, count, notices = body.get("now"), body.get("count"), body.get("notices", [])
            if type(now) is not float or type(count) is not int or count < 0 or not isinstance(notices, list):
                raise ValueError("advance needs a time, a count and a list of notices")
            self.clock.advance(now)
            for notice in notices:
                if not isinstance(notice, dict) or notice.get("op") not in ("availability", "offline", "node_down"):
                    raise ValueError(f"advance carries an unknown notice {notice!r}")
                self._control(header, notice)
            self._start_batch(count)
        elif op == "stalled":
            if self.clock.virtual:
                self.clock.advance(float(body.get("now", 0.0)))
            for proc in self.processes():
                if isinstance(proc, ThreadProcess):
                    proc._offer(Message(BROKER_PID, Stalled(float(body.get("now", 0.0)))))
        elif op == "reply":
            waiter = self._replies.pop(body["ref"], None)
            if waiter is not None:
                waiter[1].append(body["value"])
                waiter[0].set()
        elif op == "monitor":
            self._remote_monitor(header.src.node, body["watcher"], body["targets"])
        elif op == "demonitor":
            self._remote_demonitor(body["target"], body["ref"])
        elif op == "down":
            self._remote_down(body["down"])
        elif op == "offline":
            self._drop_offline(body.get("links"), body.get("at"))
        elif op == "availability":
            self._link_changes(body.get("offline"), body.get("online"))
        elif op == "node_down":
            log.warning("node %s reports node %s down", self.name, body["node"])
            self._fire_noconnection(body["node"])
        elif op == "register_failed":
            log.error("registering %r failed: held by %s", body["name"], body["holder"])
        elif op == "shutdown":
            threading.Thread(target=self.close, args=("shutdown",), daemon=True).start()
        elif op == "refused":
            if not self._welcomed.is_set():  # start() raises, naming the reason
                self._refused = f"its hello was refused ({body['reason']})"
        elif op == "unknown_node":
            # The broker declared this node lost: everyone has seen our processes as
            # DOWN, so living on would break the semantics the others rely on.
            self._lose_broker("the broker no longer knows this node")

    def _drop_offline(self, links: Any, at: Any) -> None:
        """The broker's notice that ``links`` went offline at ``at``: drop what is held
        for them, and report it back for the books."""
        counts = self._held.drop_offline(links, at)
        if not counts:
            return
        log.info("node %s dropped %d held message(s) of clients gone offline", self.name, sum(counts.values()))
        self._send_ctl(BROKER_PID, {"op": "held_dropped",
                                    "counts": [[link, d, n] for (link, d), n in sorted(counts.items())]})

    def _link_changes(self, offline: Any, online: Any) -> None:
        """The broker's word that the links of these local processes went offline or
        came back: their flags change at once (a running handler sees them), and a
        behaviour hears of it in mailbox order."""
        for ids, state in ((offline, True), (online, False)):
            if not (isinstance(ids, list) and all(type(i) is int for i in ids)):
                raise ValueError("availability needs lists of local process ids")
            for i in ids:
                proc = self._procs.get(i)
                if proc is None or proc.offline == state:
                    continue
                proc.offline = state
                if state:
                    proc.offline_count += 1
                if isinstance(proc, BehaviourProcess):
                    proc._deliver(Message(BROKER_PID, LinkChange(state)))
