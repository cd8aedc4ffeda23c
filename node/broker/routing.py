"""Where each message goes, in the broker: the fast path that relays a well-formed user
message from a known node after reading its header alone, name resolution, control
relayed between nodes, and the slow path that names what is wrong with anything else.

Routing is the broker's per-message decision, kept in one place so the fast and the
slow path can be read side by side. A message that crosses a client's link is put
through the link emulator (net/emulator.py), and the timebase (timebase.py) delivers it
when due; what processes send takes effect when the timebase says (at once on the wall
clock, at quiescence in virtual time).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from .. import wire
from ..net.emulator import PENDING
from ..wire import BROKER_NODE, CTL, MANY, USER, VERSION, Pid
from .membership import NodeInfo
from .timebase import Parcel
from .vclock import sender_of

if TYPE_CHECKING:
    from ..net.emulator import LinkEmulator
    from .broker import BrokerStats
    from .control_ops import BrokerControl
    from .membership import Membership
    from .timebase import Timebase


class RouterHost(Protocol):
    """What Router uses of the broker that holds it: passed in, so this module
    depends on these, not on the Broker."""

    control: BrokerControl
    links: LinkEmulator
    loop_now: float  # wall
    max_message_bytes: int
    members: Membership
    stats: BrokerStats
    time: Timebase

    def drop(self, reason: str, detail: str) -> None: ...
    def send(self, identity: bytes, msg: list, node: str) -> None: ...
    def send_ctl(self, identity: bytes, dst: Pid, body: dict) -> None: ...


class Router:
    def __init__(self, broker: RouterHost) -> None:
        self._broker = broker
        self._members = broker.members
        self._links = broker.links
        self._time = broker.time
        # On the wall clock a user message is relayed as it comes; in virtual time it
        # takes effect at quiescence, in its place.
        self._user = self._user_now if broker.time.take_at_once else self._user_later

    def on_message(self, identity: bytes, frames: list) -> None:
        """One message from ``identity``: ``frames`` = [header, body, arrays...]."""
        info = self._members.by_identity.get(identity)
        if info is not None and len(frames) >= 2:
            # The fast path: a well-formed user message from a known node (nearly all
            # traffic), checked by wire.user_fields; anything else takes the slow path,
            # which names the fault. (Frame.bytes, cached by the frame, unpacks twice as
            # fast as a fresh Frame.buffer memoryview.)
            size = 0
            for f in frames:
                size += len(f)
            if size <= self._broker.max_message_bytes:
                fields = wire.user_fields(frames[0].bytes, info.name)
                if fields is not None:
                    size -= len(frames[0])  # what a link carries: see wire.link_size
                    if len(fields) == 8:
                        size += fields[7]  # the header's charge: bytes kept at the sender's node
                    info.last_seen = self._broker.loop_now
                    self._user(info, fields, frames, size, Pid(fields[2], fields[3]))
                    return
        self._on_other(identity, info, frames)

    def _user_now(self, info: NodeInfo, fields: list, frames: list, size: int, src: Pid) -> None:
        """Wall clock: relay at once; with no link to emulate, straight to the node."""
        dst_node, dst = fields[4], fields[5]
        members = self._members
        if dst_node:
            target = members.nodes.get(dst_node)
            dst_pid = (dst_node, dst)  # a Pid is a tuple: same hash, same key
        else:
            dst_pid = members.names.get(dst)
            target = members.nodes.get(dst_pid[0]) if dst_pid is not None else None
        link_of = members.link_of
        if target is not None and not (self._links.active and link_of) and not self._time.behind:
            if link_of:
                self._links.account(link_of.get(src), link_of.get(dst_pid), size)
            else:
                self._links.other(size)
            self._broker.send(target.identity, frames, target.name)
            return
        self.transmit(src, 0, fields, frames, size)

    def _user_later(self, info: NodeInfo, fields: list, frames: list, size: int, src: Pid) -> None:
        self._time.heard(info.name)
        self._time.take(src, "user", (fields, frames, size))

    def _on_other(self, identity: bytes, info: NodeInfo | None, frames: list) -> None:
        """Everything but the fast path: control traffic, emulated links, and faults."""
        broker = self._broker
        try:
            wire.check_envelope(frames, broker.max_message_bytes)
        except wire.OversizeError as exc:
            broker.drop("oversize", f"from {identity!r}: {exc}")
            return
        header = wire.unpack_header(frames[0].buffer)  # the full checks, naming the fault
        if header.src.node.encode() != identity:
            broker.drop("spoofed", f"header names node {header.src.node!r} but socket is {identity!r}")
            return
        if info is None:
            if header.kind == CTL and header.dst_node == BROKER_NODE:
                broker.control.handle(identity, header, frames, known=False)
            else:
                broker.drop("unknown-node", f"message from {header.src.node!r} before hello")
                broker.send_ctl(identity, header.src, {"op": "unknown_node"})
            return
        info.last_seen = time.monotonic()  # wall
        if header.kind == CTL:
            if header.dst_node == BROKER_NODE:
                broker.control.handle(identity, header, frames, known=True)
            else:
                self._time.heard(info.name)
                self._route_ctl(header, frames)
            return
        self._time.heard(info.name)
        if header.kind == MANY:
            self._route_many(header, frames)
            return
        # A user message whose timing field is not a send time: route it, unstamped.
        self._time.take(header.src, "user", ([VERSION, USER, header.src.node, header.src.id, header.dst_node,
                                              header.dst], frames, wire.link_size(frames) + header.charge))

    def transmit(self, src: Pid, sequence: int, fields: list, frames: list, size: int) -> None:
        """A user message sent now (on the wall clock) or at the current instant (in
        virtual time): through its link's model, if it crosses one, to its delivery."""
        destination = self._destination(fields)
        if destination is None:
            return
        dst_pid, target = destination
        parcel = Parcel(src, sequence, dst_pid, target.name, frames, fields)
        link_of = self._members.link_of
        crossing = self._links.account(link_of.get(src), link_of.get(dst_pid), size) if link_of else \
            self._links.other(size)
        if crossing is None or not self._links.active:
            self._time.deliver(None, parcel)
            return
        link, direction = crossing
        # The sender's send stamp (wall clock): the seventh header field, whatever follows it.
        arrival = self._links.transmit(link, direction, size, self._time.entry(fields[6] if len(fields) >= 7 else None),
                                       parcel)
        if arrival is PENDING:
            self._time.pending(parcel)
        elif arrival is not None:
            self._time.deliver(arrival, parcel, link, direction)

    def _route_many(self, header: wire.Header, frames: list) -> None:
        """A message to many processes of one node: each receiver's link is charged and
        emulated as for a message of its own, and the node gets the body once."""
        ids = wire.check_ids(wire.unpack_recipients(frames[1]), header.dst)
        if header.dst_node not in self._members.nodes:
            self._broker.drop("unknown-destination", f"node {header.dst_node!r} is not connected")
            return
        self._time.take(header.src, "many", (header, frames, ids))

    def transmit_many(self, src: Pid, sequence: int, header: wire.Header, frames: list, ids: list[int]) -> None:
        """A message to many sent now or at the current instant: each receiver's copy
        through its own link's model."""
        target = self._members.nodes.get(header.dst_node)
        if target is None:
            self._broker.drop("unknown-destination", f"node {header.dst_node!r} is not connected")
            return
        entry = self._time.entry(header.timing if type(header.timing) is float else None)
        size = wire.link_size(frames, MANY)
        link_of = self._members.link_of
        links = self._links
        node = target.name
        stash = self._time.new_stash()
        arrivals: list[tuple[float | None, Parcel, int, int]] = []
        pending = 0
        for index, i in enumerate(ids):
            parcel = Parcel(src, sequence, Pid(node, i), node, None, None, index, stash)
            crossing = links.account(link_of.get(src), link_of.get(parcel.receiver), size) if link_of else \
                links.other(size)
            if crossing is None or not links.active:
                arrivals.append((None, parcel, -1, -1))
                continue
            arrival = links.transmit(*crossing, size, entry, parcel)
            if arrival is PENDING:
                self._time.pending(parcel)
                pending += 1
            elif arrival is not None:
                arrivals.append((arrival, parcel, *crossing))
        if not arrivals and not pending:
            return
        stats = self._broker.stats
        stats.fanout_msgs += 1
        stats.fanout_receivers += len(arrivals) + pending
        self._time.deliver_many(header, frames, stash, arrivals, pending)

    def _destination(self, fields: list) -> tuple[Pid, NodeInfo] | None:
        """A user message's receiver and its node, or None (dropped, with the reason)."""
        dst_node, dst = fields[4], fields[5]
        if dst_node:
            dst_pid = Pid(dst_node, dst)
        else:
            dst_pid = self._members.names.get(dst)
            if dst_pid is None:
                self._broker.drop("unknown-destination", f"no process registered as {dst!r}")
                return None
        target = self._members.nodes.get(dst_pid.node)
        if target is None:
            self._broker.drop("unknown-destination", f"node {dst_pid.node!r} is not connected")
            return None
        return dst_pid, target

    def _route_ctl(self, header: wire.Header, msg: list) -> None:
        """Runtime control between nodes (monitor, demonitor, down): relayed as is (in
        virtual time, held and delivered at its instant like a message)."""
        body = wire.unpack_body(msg[1].buffer, msg[2:])
        watcher = body.get("watcher") if isinstance(body, dict) else None
        receiver = watcher if isinstance(watcher, Pid) else Pid(header.dst_node, header.dst)
        self._time.take(sender_of(header.src, body), "ctl", (header, msg, receiver))

    def relay_ctl(self, sender: Pid, sequence: int, header: wire.Header, msg: list, receiver: Pid) -> None:
        if header.dst_node:
            dst_node = header.dst_node
        else:
            pid = self._members.names.get(header.dst)
            dst_node = pid.node if pid is not None else None
        target = self._members.nodes.get(dst_node) if dst_node is not None else None
        if target is None:
            self._broker.drop("unknown-destination", f"node {dst_node or header.dst!r} is not connected")
            # A monitor or down for a lost node must still resolve: tell the sender.
            origin = self._members.nodes.get(header.src.node)
            if origin is not None and dst_node is not None:
                self._broker.send_ctl(origin.identity, header.src, {"op": "node_down", "node": dst_node})
            return
        self._time.deliver(None, Parcel(sender, sequence, receiver, target.name, msg, None))
