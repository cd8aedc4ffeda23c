"""What the broker does with each control op addressed to it (the ops, who may send them
and their required fields are control.py's table, checked here first).

Apart from routing (routing.py) because these messages are requests to the broker,
not traffic: each op's handler is short and calls into the part of the broker it
concerns (the registry, the network, the scheduler), so this module reads as the
broker's half of the control protocol.
"""
from __future__ import annotations

import logging
import time

from . import control, wire
from .control import QUIET_OPS
from .holding import clock_identity
from .security import token_matches
from .wire import Pid, WireError

log = logging.getLogger("fedemu.broker")


class BrokerControl:
    """Broker's handlers of control ops (a mixin of :class:`~fedemu.node.broker.Broker`)."""

    def _control(self, identity: bytes, header: wire.Header, msg: list, known: bool) -> None:
        body = wire.unpack_body(msg[1].buffer, msg[2:])
        src = header.src
        if not known and not (isinstance(body, dict) and body.get("op") == "hello"):
            # Not in the run (yet): nothing but a hello is read, whatever it is.
            op = body.get("op") if isinstance(body, dict) else None
            self._drop("unknown-node", f"{op!r} from {src.node!r} before hello")
            self._send_ctl(identity, src, {"op": "unknown_node"})
            return
        try:
            op = control.check(body, control.BROKER,
                               controller=self._controllers is None or src.node in self._controllers)
        except control.NotEntitled as exc:
            self._drop("not-entitled", f"from {src}: {exc}")
            return
        except control.ControlError as exc:
            raise WireError(str(exc)) from None
        if op == "hello":
            if self._token is not None and not token_matches(self._token, body.get("token")):
                self._refuse(identity, src, "no token" if body.get("token") is None else "a wrong token")
                return
            self._join(identity, src.node, known)
            self._send_ctl(identity, src, {
                "op": "welcome",
                "heartbeat_interval": self.heartbeat_interval,
                "heartbeat_timeout": self.heartbeat_timeout,
                # Echo and this clock: the node's first estimate of its clock offset;
                # the clock's identity: a node on this machine needs no estimate.
                "t": body.get("t"), "now": time.monotonic(), "clock_id": clock_identity(),  # wall
                "clock": "virtual" if self.scheduler is not None else "wall", "time_scale": float(self.time_scale),
            })
            return
        if self.scheduler is not None and op not in QUIET_OPS:
            self.scheduler.heard(src.node)
        if op == "idle":
            if self.scheduler is None:
                raise WireError("idle reports are for virtual time; this broker runs on wall time")
            self.scheduler.report(src.node, body.get("seen"), body.get("next"))
        elif op == "busy":
            pass  # a node busy with work the broker did not hand it (heard() above took note)
        elif op == "clock_start":
            if self.scheduler is not None and not self.scheduler.started:
                self.scheduler.started = True
                log.info("virtual clock started by %s", src)
        elif op == "hb":
            # The node times the round trip: its send time echoed, and this clock.
            self._send_ctl(identity, src, {"op": "hb", "t": body.get("t"), "now": time.monotonic()})  # wall
        elif op == "register":
            self._register(identity, src, body.get("entries"))
        elif op == "unregister":
            names = body.get("names")
            if not isinstance(names, list):
                raise WireError("unregister needs a list of names")
            pid = body.get("pid")
            pid = pid if isinstance(pid, Pid) and pid.node == src.node else None
            self._unregister(src.node, names, pid)
        elif op == "whereis":
            name = body.get("name")
            if not isinstance(name, str):
                raise WireError(f"whereis needs a name, not {name!r}")
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": self._names.get(name)})
        elif op == "stats":
            value = self.stats.as_dict()
            value["emulated_s"] = round(self.emulated_now(), 6)
            if self._emulating:
                now = self.emulated_now()
                value["offline"] = sorted(k for k in set(self._link_of.values()) if self.network.is_offline(k, now))
            if body.get("per_link"):
                value["links"] = {k: vars(c) for k, c in self.stats.links.items()}
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": value})
        elif op == "round":
            # The server's round clock: per-round drop-outs and round-scripted events.
            round_ = body.get("round")
            if type(round_) is not int:
                raise WireError(f"round {round_!r} is not an integer")
            by = body.get("by")
            if self.scheduler is not None:
                self.scheduler.accept(by if isinstance(by, Pid) and by.node == src.node else src, "round", round_)
            else:
                self._apply_round(round_)
        elif op == "set_links":
            error = self._check_set_links(body)
            if error is None:
                if self.scheduler is not None:
                    self.scheduler.accept(src, "set_links", body)
                else:
                    self._apply_set_links(body)
            self._send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": error})
        elif op == "held_dropped":
            self._held_dropped(body.get("counts"))
        elif op == "shutdown":
            log.info("shutdown requested by %s", src)
            for info in self._nodes.values():
                self._send_ctl(info.identity, Pid(info.name, 0), {"op": "shutdown"})
            self._running = False
        elif op == "bye":
            self._forget(src.node, reason=None)

    def _refuse(self, identity: bytes, src: Pid, what: str) -> None:
        """A hello without the run's token: the process is told, and never joins (so it
        is in none of virtual time's books); counted and logged (rate-limited, as a
        stranger may keep trying)."""
        self.stats.refused += 1
        if self.stats.refused <= 20 or self.stats.refused % 1000 == 0:
            log.warning("refused hello from %s (#%d refused): %s, not this run's", src, self.stats.refused, what)
        self._send_ctl(identity, src, {"op": "refused", "reason": f"{what}: not a node of this run"})
