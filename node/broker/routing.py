"""Where each message goes, in the broker: the fast path that relays a well-formed user
message from a known node after reading its header alone, name resolution, control
relayed between nodes, and the slow path that names what is wrong with anything else.

Apart from the broker's loop (broker.py) because routing is the broker's per-message
decision, kept in one place so the fast and the slow path can be read side by side: a
message that crosses a client's link is handed to link emulation (emulation.py), and
in virtual time everything is handed to the scheduler (broker_vtime.py).
"""
from __future__ import annotations

import time

from .. import wire
from .registry import NodeInfo
from .vclock import sender_of
from ..wire import BROKER_NODE, CTL, MANY, USER, VERSION, Pid


class Routing:
    """Broker's routing (a mixin of :class:`~fedemu.node.broker.Broker`)."""

    def _on_message(self, identity: bytes, frames: list) -> None:
        """One message from ``identity``: ``frames`` = [header, body, arrays...]."""
        info = self._by_identity.get(identity)
        if info is not None and len(frames) >= 2:
            # The fast path: a well-formed user message from a known node (nearly all
            # traffic), checked by wire.user_fields; anything else takes the slow path,
            # which names the fault. (Frame.bytes, cached by the frame, unpacks twice as
            # fast as a fresh Frame.buffer memoryview.)
            size = 0
            for f in frames:
                size += len(f)
            if size <= self.max_message_bytes:
                fields = wire.user_fields(frames[0].bytes, info.name)
                if fields is not None:
                    size -= len(frames[0])  # what a link carries: see wire.link_size
                    if len(fields) == 8:
                        size += fields[7]  # the header's charge: bytes kept at the sender's node
                    src_node, src_id, dst_node, dst = fields[2:6]
                    info.last_seen = self._now
                    if self.scheduler is not None:
                        self.scheduler.heard(info.name)
                        self._route_user(fields, frames, size, Pid(src_node, src_id))
                        return
                    if dst_node:
                        target = self._nodes.get(dst_node)
                        dst_pid = (dst_node, dst)  # a Pid is a tuple: same hash, same key
                    else:
                        dst_pid = self._names.get(dst)
                        target = self._nodes.get(dst_pid[0]) if dst_pid is not None else None
                    if target is not None and not (self._emulating and self._link_of):
                        if self._link_of:
                            self._account((src_node, src_id), dst_pid, size)
                        else:
                            self.stats.other_bytes += size
                            self.stats.other_msgs += 1
                        self._send(target.identity, frames, target.name)
                    else:
                        self._route_user(fields, frames, size, Pid(src_node, src_id))
                    return
        self._on_other(identity, info, frames)

    def _on_other(self, identity: bytes, info: NodeInfo | None, frames: list) -> None:
        """Everything but the fast path: control traffic, emulated links, and faults."""
        try:
            wire.check_envelope(frames, self.max_message_bytes)
        except wire.OversizeError as exc:
            self._drop("oversize", f"from {identity!r}: {exc}")
            return
        header = wire.unpack_header(frames[0].buffer)  # the full checks, naming the fault
        if header.src.node.encode() != identity:
            self._drop("spoofed", f"header names node {header.src.node!r} but socket is {identity!r}")
            return
        if info is None:
            if header.kind == CTL and header.dst_node == BROKER_NODE:
                self._control(identity, header, frames, known=False)
            else:
                self._drop("unknown-node", f"message from {header.src.node!r} before hello")
                self._send_ctl(identity, header.src, {"op": "unknown_node"})
            return
        info.last_seen = time.monotonic()  # wall
        if header.kind == CTL:
            if header.dst_node == BROKER_NODE:
                self._control(identity, header, frames, known=True)
            else:
                if self.scheduler is not None:
                    self.scheduler.heard(info.name)
                self._route_ctl(header, frames)
            return
        if self.scheduler is not None:
            self.scheduler.heard(info.name)
        if header.kind == MANY:
            self._route_many(header, frames)
            return
        # A user message whose timing field is not a send time: route it, unstamped.
        self._route_user([VERSION, USER, header.src.node, header.src.id, header.dst_node, header.dst],
                         frames, wire.link_size(frames) + header.charge, header.src)

    def _route_user(self, fields: list, frames: list, size: int, src: Pid) -> None:
        if self.scheduler is not None:  # takes effect at quiescence, in its place
            self.scheduler.accept(src, "user", (fields, frames, size))
            return
        destination = self._destination(fields)
        if destination is None:
            return
        dst_pid, target = destination
        crossing = self._account(src, dst_pid, size) if self._link_of else self._other(size)
        if crossing is not None and self._emulating:
            self._emulate(crossing, size, target, fields, frames)
            return
        self._send(target.identity, frames, target.name)

    def _route_many(self, header: wire.Header, frames: list) -> None:
        """A message to many processes of one node: each receiver's link is charged and
        emulated as for a message of its own, and the node gets the body once, with
        each receiver's hold (in virtual time: a stash, and a release per receiver)."""
        ids = wire.check_ids(wire.unpack_recipients(frames[1]), header.dst)
        target = self._nodes.get(header.dst_node)
        if target is None:
            self._drop("unknown-destination", f"node {header.dst_node!r} is not connected")
            return
        if self.scheduler is not None:
            self.scheduler.accept(header.src, "many", (header, frames, ids))
            return
        now = time.monotonic()  # wall
        sent = header.timing if type(header.timing) is float else None
        to = []
        size = wire.link_size(frames, MANY)
        for i in ids:
            crossing = self._account(header.src, Pid(header.dst_node, i), size) if self._link_of else self._other(size)
            if crossing is None or not self._emulating:
                to.append([i, 0.0, -1, -1])
                continue
            due = self._wall_due(*crossing, size, sent, now)
            if due is not None:
                to.append([i, due - now, *crossing])
        if to:
            self.stats.fanout_msgs += 1
            self.stats.fanout_receivers += len(to)
            self._send(target.identity, wire.many_frames(header.src, target.name, len(to), {"at": now, "holds": to},
                                                         frames[2:]), target.name)

    def _destination(self, fields: list) -> tuple[Pid, NodeInfo] | None:
        """A user message's receiver and its node, or None (dropped, with the reason)."""
        dst_node, dst = fields[4], fields[5]
        if dst_node:
            dst_pid = Pid(dst_node, dst)
        else:
            dst_pid = self._names.get(dst)
            if dst_pid is None:
                self._drop("unknown-destination", f"no process registered as {dst!r}")
                return None
        target = self._nodes.get(dst_pid.node)
        if target is None:
            self._drop("unknown-destination", f"node {dst_pid.node!r} is not connected")
            return None
        return dst_pid, target

    def _route_ctl(self, header: wire.Header, msg: list) -> None:
        """Runtime control between nodes (monitor, demonitor, down): relayed as is (in
        virtual time, held and delivered at its instant like a message)."""
        if self.scheduler is not None:
            body = wire.unpack_body(msg[1].buffer, msg[2:])
            watcher = body.get("watcher") if isinstance(body, dict) else None
            receiver = watcher if isinstance(watcher, Pid) else (header.dst_node, header.dst)
            self.scheduler.accept(sender_of(header.src, body), "ctl", (header, msg, receiver))
            return
        self._relay_ctl(header, msg)

    def _relay_ctl(self, header: wire.Header, msg: list, hold=None) -> None:
        if header.dst_node:
            dst_node = header.dst_node
        else:
            pid = self._names.get(header.dst)
            dst_node = pid.node if pid is not None else None
        target = self._nodes.get(dst_node) if dst_node is not None else None
        if target is None:
            self._drop("unknown-destination", f"node {dst_node or header.dst!r} is not connected")
            # A monitor or down for a lost node must still resolve: tell the sender.
            sender = self._nodes.get(header.src.node)
            if sender is not None and dst_node is not None:
                self._send_ctl(sender.identity, header.src, {"op": "node_down", "node": dst_node})
            return
        if hold is not None:
            hold(target.name, msg)
            return
        self._send(target.identity, msg, target.name)
