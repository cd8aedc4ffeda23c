"""The control protocol: every op the broker and the nodes exchange as control messages
(wire kind CTL, body ``{"op": ..., fields}``), who may send it, its fields (optional ones
in parentheses), and what it means. The broker and the nodes check what they receive with :func:`check`
before acting on it, so a control message from the wrong sender, of an unknown op or
without its fields is dropped with a reason naming the op and the field.

Who may send: a node joins with ``hello``, carrying the run's token where the broker has
one (security.py); until then the broker takes nothing else from it, and a stranger never
joins. The ops that steer the whole run (``CONTROLLER_OPS``: marked * below) are honoured
only from the broker's *controllers*, the nodes it was told at start (a run's ``server``,
``launcher`` and ``operator``), never from a worker node.

Node to broker (``BROKER``):

=============== ============================== ==================================================
op              fields                         meaning
=============== ============================== ==================================================
hello           (t, token)                     join; the broker answers ``welcome`` (or ``refused``)
hb              (t)                            heartbeat; the broker echoes it (clock offset)
bye                                            leaving: forget this node
register        entries                        [name, pid, link] triples: names, client links
unregister      names (pid)                    a process ended: free its names
whereis         name, ref                      which pid holds a name (``reply``)
stats           ref (per_link, timeline)       the broker's counters (``reply``); timeline: the transfers
                                               and device switches not yet taken
round*          round (by)                     the server's round clock: per-round drop-outs
set_links*      ref (clients, profile,         change links while running (``reply``: an error
                offline)                       or None)
held_dropped    counts                         held messages dropped on an ``offline`` notice
shutdown*                                      end the run: the broker tells every node
idle            seen, next                     virtual time: quiescent, with what it has seen
busy                                           virtual time: busy with work the broker did not send
clock_start*                                   virtual time: every worker node is up
=============== ============================== ==================================================

Broker to node (``NODE``, from the broker only):

=============== ============================== ==================================================
welcome         (heartbeat_interval,           the answer to hello: liveness settings, the
                heartbeat_timeout, t, now,     clock's kind and time scale, a first clock sample,
                emulated, clock_id, clock,     the emulated time at ``now``, the broker clock's
                time_scale)                    identity (holding.clock_identity)
hb              (t, now)                       the heartbeat's echo
reply           ref, value                     the answer to whereis, stats or set_links
unknown_node                                   this node was declared lost: it must close
refused         reason                         this hello is not the run's (no or a wrong token)
node_down       node                           a node was lost: its processes are DOWN
register_failed name, holder                   a name is held by another process
shutdown                                       close
offline         links, at                      wall clock: these links went offline at ``at``
availability    offline, online                links that went offline or came back
advance         now, count (notices)           virtual time: the clock is at ``now``; ``count``
                                               deliveries follow
stalled         now                            virtual time: nothing is pending anywhere
=============== ============================== ==================================================

Node to node, relayed by the broker (``NODE``; ``watcher`` is a pid of the sending node):

=============== ============================== ==================================================
monitor         watcher, targets               watch processes of the receiving node: ``targets``
                                               is a list of [ref, target id]
demonitor       ref, target                    stop watching
down            down (watcher)                 the watched process ended (a ``Down``)
=============== ============================== ==================================================
"""
from __future__ import annotations

from dataclasses import dataclass

BROKER, NODE = "broker", "node"  # who receives an op


@dataclass(frozen=True)
class Op:
    receiver: str
    required: tuple[str, ...] = ()
    from_broker_only: bool = False  # received by a node: only the broker may send it


OPS: dict[tuple[str, str], Op] = {}


def _ops(receiver: str, from_broker_only: bool = False, **ops: tuple[str, ...]) -> None:
    for name, required in ops.items():
        OPS[(receiver, name)] = Op(receiver, required, from_broker_only)


# Required: what a receiver cannot act without; the rest of each row above is optional
# (a heartbeat without its send time still counts as one, but gives no clock sample).
_ops(BROKER, hello=(), hb=(), bye=(), register=("entries",), unregister=("names",),
     whereis=("name", "ref"), stats=("ref",), round=("round",), set_links=("ref",), held_dropped=("counts",),
     shutdown=(), idle=("seen", "next"), busy=(), clock_start=())
_ops(NODE, from_broker_only=True, welcome=(), hb=(), reply=("ref", "value"), unknown_node=(), refused=("reason",),
     node_down=("node",),
     register_failed=("name", "holder"), shutdown=(), offline=("links", "at"),
     availability=("offline", "online"), advance=("now", "count"), stalled=("now",))
_ops(NODE, monitor=("watcher", "targets"), demonitor=("ref", "target"), down=("down",))

# Broker-to-node messages that carry work for a node's processes: in virtual time the
# broker counts them per node, and a node's idle report must have seen them all.
RELAYED_OPS = frozenset(name for (receiver, name), op in OPS.items() if receiver == NODE and not op.from_broker_only)
WORK_OPS = RELAYED_OPS | {"advance", "availability", "offline", "node_down", "stalled"}
# Ops that steer the whole run: only the broker's controllers may send them.
CONTROLLER_OPS = frozenset({"shutdown", "round", "set_links", "clock_start"})
# Messages from a node that do not make it busy in virtual time's books.
QUIET_OPS = frozenset({"hb", "idle", "hello", "bye"})

# Liveness, unless a run says otherwise (a node heartbeats every interval; silence past
# the timeout is a loss): the defaults of both ends, and of launch/config/default.toml's run
# section (tests/test_config.py checks they agree).
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 5.0


class ControlError(ValueError):
    """A control message the receiver must drop; the message says why."""


class NotEntitled(ControlError):
    """A control op from a sender that may not send it (the broker counts these apart)."""


def check(body: object, receiver: str, from_broker: bool = True, controller: bool = True) -> str:
    """The op of a control ``body`` received by ``receiver`` (BROKER or NODE), or
    ControlError naming what is wrong: not a map with an op, an op this receiver does
    not take, one only the broker may send, one only a controller may send (NotEntitled;
    ``controller``: whether the sending node is one), or a missing field."""
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise ControlError(f"control message {body!r} is not a map with an 'op'")
    name = body["op"]
    op = OPS.get((receiver, name))
    if op is None:
        raise ControlError(f"unknown control op {name!r} for a {receiver}")
    if op.from_broker_only and not from_broker:
        raise NotEntitled(f"control {name!r} comes from the broker only")
    if receiver == BROKER and name in CONTROLLER_OPS and not controller:
        raise NotEntitled(f"control {name!r} is for the run's controllers only")
    missing = [field for field in op.required if field not in body]
    if missing:
        raise ControlError(f"control {name!r} lacks {', '.join(missing)}")
    return name
