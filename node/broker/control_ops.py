"""What the broker does with each control op addressed to it (the ops, who may send them
and their required fields are control.py's table, checked here first).

Apart from routing (routing.py) because these messages are requests to the broker,
not traffic: each op's handler is short and calls into the part of the broker it
concerns (the members, the network, the scheduler), so this module reads as the
broker's half of the control protocol.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from .. import control, wire
from ..control import QUIET_OPS
from ..runtime.holding import clock_identity
from ..security import token_matches
from ..wire import Pid, WireError

if TYPE_CHECKING:
    from ..net.emulator import LinkEmulator
    from .broker import BrokerStats
    from .membership import Membership
    from .timebase import Timebase

log = logging.getLogger("fedemu.broker")


class ControlHost(Protocol):
    """What BrokerControl uses of the broker that holds it: passed in, so this module
    depends on these, not on the Broker."""

    controllers: frozenset[str] | None
    heartbeat_interval: float
    heartbeat_timeout: float
    links: LinkEmulator
    members: Membership
    stats: BrokerStats
    time: Timebase
    token: str | None

    def drop(self, reason: str, detail: str) -> None: ...
    def send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None: ...
    def stop(self) -> None: ...


class BrokerControl:
    """The broker's handlers of control ops."""

    def __init__(self, broker: ControlHost) -> None:
        self._broker = broker

    def handle(self, identity: bytes, header: wire.Header, msg: list, known: bool) -> None:
        broker = self._broker
        members, links, clock = broker.members, broker.links, broker.time
        body = wire.unpack_body(msg[1].buffer, msg[2:])
        src = header.src
        if not known and not (isinstance(body, dict) and body.get("op") == "hello"):
            # Not in the run (yet): nothing but a hello is read, whatever it is.
            op = body.get("op") if isinstance(body, dict) else None
            broker.drop("unknown-node", f"{op!r} from {src.node!r} before hello")
            broker.send_ctl(identity, src, {"op": "unknown_node"})
            return
        try:
            op = control.check(body, control.BROKER,
                               controller=broker.controllers is None or src.node in broker.controllers)
        except control.NotEntitled as exc:
            broker.drop("not-entitled", f"from {src}: {exc}")
            return
        except control.ControlError as exc:
            raise WireError(str(exc)) from None
        if op == "hello":
            if broker.token is not None and not token_matches(broker.token, body.get("token")):
                self._refuse(identity, src, "no token" if body.get("token") is None else "a wrong token")
                return
            members.join(identity, src.node, known)
            broker.send_ctl(identity, src, {
                "op": "welcome",
                "heartbeat_interval": broker.heartbeat_interval,
                "heartbeat_timeout": broker.heartbeat_timeout,
                # Echo and this clock: the node's first estimate of its clock offset;
                # the clock's identity: a node on this machine needs no estimate.
                "t": body.get("t"), "now": time.monotonic(), "clock_id": clock_identity(),  # wall
                # The emulated time at that instant (wall clock: a node's clock counts from its zero).
                "emulated": float(clock.now()),
                "clock": clock.name, "time_scale": float(clock.time_scale),
            })
            return
        if op not in QUIET_OPS:
            clock.heard(src.node)
        if op == "idle":
            clock.report(src.node, body.get("seen"), body.get("next"))
        elif op == "busy":
            pass  # a node busy with work the broker did not hand it (heard() above took note)
        elif op == "clock_start":
            clock.start(src)
        elif op == "hb":
            # The node times the round trip: its send time echoed, and this clock.
            broker.send_ctl(identity, src, {"op": "hb", "t": body.get("t"), "now": time.monotonic()})  # wall
        elif op == "register":
            members.register(identity, src, body.get("entries"))
        elif op == "unregister":
            names = body.get("names")
            if not isinstance(names, list):
                raise WireError("unregister needs a list of names")
            pid = body.get("pid")
            pid = pid if isinstance(pid, Pid) and pid.node == src.node else None
            members.unregister(src.node, names, pid)
        elif op == "whereis":
            name = body.get("name")
            if not isinstance(name, str):
                raise WireError(f"whereis needs a name, not {name!r}")
            broker.send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": members.names.get(name)})
        elif op == "stats":
            value = broker.stats.as_dict(links)
            now = clock.now()
            value["emulated_s"] = round(now, 6)
            if links.active:
                value["offline"] = links.offline_links(members.link_of.values(), now)
            if body.get("timeline"):  # the transfers and device switches since the last asker took them
                value.update(links.take_timeline())
            if body.get("per_link"):
                value["links"] = {k: vars(c) for k, c in links.counters.items()}
            broker.send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": value})
        elif op == "round":
            # The server's round clock: per-round drop-outs and round-scripted events.
            round_ = body.get("round")
            if type(round_) is not int:
                raise WireError(f"round {round_!r} is not an integer")
            by = body.get("by")
            clock.take(by if isinstance(by, Pid) and by.node == src.node else src, "round", round_)
        elif op == "set_links":
            error = links.check_set_links(body)
            if error is None:
                clock.take(src, "set_links", body)
            broker.send_ctl(identity, src, {"op": "reply", "ref": body.get("ref"), "value": error})
        elif op == "held_dropped":
            _held_dropped(broker, body.get("counts"))
        elif op == "shutdown":
            log.info("shutdown requested by %s", src)
            for info in members.nodes.values():
                broker.send_ctl(info.identity, Pid(info.name, 0), {"op": "shutdown"})
            broker.stop()
        elif op == "bye":
            members.forget(src.node, reason=None)

    def _refuse(self, identity: bytes, src: Pid, what: str) -> None:
        """A hello without the run's token: the process is told, and never joins (so it
        is in none of virtual time's books); counted and logged (rate-limited, as a
        stranger may keep trying)."""
        stats = self._broker.stats
        stats.refused += 1
        if stats.refused <= 20 or stats.refused % 1000 == 0:
            log.warning("refused hello from %s (#%d refused): %s, not this run's", src, stats.refused, what)
        self._broker.send_ctl(identity, src, {"op": "refused", "reason": f"{what}: not a node of this run"})


def _held_dropped(broker, counts: Any) -> None:
    """A node's report of held messages it dropped on an ``offline`` notice (wall clock)."""
    if not isinstance(counts, list):
        raise WireError("held_dropped needs a list of [link, direction, count]")
    for entry in counts:
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)
                and entry[1] in (0, 1) and 0 < entry[2] <= 1_000_000):
            raise WireError(f"bad held_dropped entry {entry!r}")
        link, direction, count = entry
        for _ in range(count):
            broker.links.lost(link, direction, "offline", broker.time.now())
