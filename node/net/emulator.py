"""The broker's side of link emulation: each message that crosses a client's link is
counted on that link and direction, and the link model (links.py) decides at once
whether it is lost and when it arrives; when clients go offline, what is still in
flight for them is dropped and counted.

For a message that crosses a client's link the broker starts the model's clock at the
sender's send time (stamped in the header, in the broker's clock) and forwards it at
once with a :class:`~fedemu.node.wire.Hold` in the header; the receiving node keeps it
until it is due (holding.py). So the time the bytes take to cross loopback or the LAN
overlaps the emulated delay instead of adding to it, and a busy broker loop does not
deliver late. A client that goes offline while messages to or from it are held gets
an ``offline`` notice to every node; they drop what is held for it and report back,
so the loss is counted here like any other.

Apart from routing (routing.py) because these are the model's decisions and the books
they fill, the same on wall and virtual time; routing only asks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .. import wire
from .links import DOWN, UP, Network, NetworkSpec
from ..broker.registry import NodeInfo
from ..wire import Hold, Pid, WireError

log = logging.getLogger("fedemu.broker")

# How far back a sender's send stamp may start a message's emulated clock. A stamp is
# normally a fraction of a millisecond old; a much older one means a starved sender
# or a bad clock estimate, and must not let a message skip most of its delay.
MAX_SEND_AGE_S = 1.0


@dataclass
class LinkCounters:
    """Per client link. Bytes and messages count what entered the link (sent), lost
    ones included; ``*_lost`` counts what never arrived (loss, queue, offline)."""

    up_bytes: int = 0
    up_msgs: int = 0
    down_bytes: int = 0
    down_msgs: int = 0
    up_lost: int = 0
    down_lost: int = 0
    up_transfer_s: float = 0.0  # emulated seconds from entry to arrival, summed
    down_transfer_s: float = 0.0


@dataclass
class BrokerStats:
    links: dict[int, LinkCounters] = field(default_factory=dict)
    other_bytes: int = 0
    other_msgs: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    refused: int = 0  # connections refused by authentication
    fanout_msgs: int = 0  # messages to many, each relayed once to its node
    fanout_receivers: int = 0  # the receivers those reached (each also counted on its link)

    def as_dict(self) -> dict[str, Any]:
        links = self.links.values()
        return {
            "bytes_up": sum(c.up_bytes for c in links),
            "bytes_down": sum(c.down_bytes for c in links),
            "msgs_up": sum(c.up_msgs for c in links),
            "msgs_down": sum(c.down_msgs for c in links),
            "lost_up": sum(c.up_lost for c in links),
            "lost_down": sum(c.down_lost for c in links),
            "transfer_s_up": round(sum(c.up_transfer_s for c in links), 6),
            "transfer_s_down": round(sum(c.down_transfer_s for c in links), 6),
            "bytes_other": self.other_bytes,
            "msgs_other": self.other_msgs,
            "dropped": dict(self.dropped),
            "refused": self.refused,
            "fanout_msgs": self.fanout_msgs,
            "fanout_receivers": self.fanout_receivers,
        }


class LinkEmulation:
    """Broker's link emulation and its books (a mixin of :class:`~fedemu.node.broker.Broker`)."""

    def _init_emulation(self, network: NetworkSpec | None) -> None:
        self.spec = network
        self.network = network.build() if network is not None else Network()
        self._emulating = not self.network.ideal
        # Per link, when the last message forwarded across it is due (broker clock):
        # while that is ahead, receiving nodes may hold messages of that link.
        self._flight_until: dict[int, float] = {}

    def _other(self, size: int) -> None:
        self.stats.other_bytes += size
        self.stats.other_msgs += 1
        return None

    def _account(self, src: Pid, dst: Pid, size: int) -> tuple[int, int] | None:
        """Count a message on the client link it crosses; returns (link, direction).

        A message from a link owner goes up its link; one to a link owner comes down
        its link (client-to-client traffic is counted on both, emulated on the uplink).
        """
        src_link = self._link_of.get(src)
        dst_link = self._link_of.get(dst)
        if dst_link is not None:
            c = self._counters(dst_link)
            c.down_bytes += size
            c.down_msgs += 1
        if src_link is not None:
            c = self._counters(src_link)
            c.up_bytes += size
            c.up_msgs += 1
            return src_link, UP
        if dst_link is not None:
            return dst_link, DOWN
        return self._other(size)

    def _emulate(self, crossing: tuple[int, int], size: int, target: NodeInfo, fields: list, frames: list) -> None:
        link, direction = crossing
        now = time.monotonic()  # wall
        due = self._wall_due(link, direction, size, fields[6] if len(fields) == 7 else None, now)
        if due is None:
            return
        header = wire.held_header(fields, Hold(due - now, now, link, direction))
        self._send(target.identity, [header, *frames[1:]], target.name)

    def _wall_due(self, link: int, direction: int, size: int, sent: float | None, now: float) -> float | None:
        """Wall time: when (broker clock) a message the sender sent at ``sent`` (its
        stamp; None: unstamped) arrives over ``link``, or None if it is lost (counted)."""
        # The model's clock starts when the sender sent (its stamp, in this clock),
        # so the bytes' trip here is part of the emulated delay, not added to it.
        entry = now if sent is None else min(now, max(sent, now - MAX_SEND_AGE_S))
        arrival = self._arrival(link, direction, size, (entry - self._t0) * self.time_scale)
        if arrival is None:
            return None
        due = self._t0 + arrival / self.time_scale
        if due > self._flight_until.get(link, 0.0):
            self._flight_until[link] = due
        return due

    def _arrival(self, link: int, direction: int, size: int, entry: float) -> float | None:
        """When a message entering ``link`` at emulated time ``entry`` arrives, by the
        link model, or None if it is lost (counted)."""
        verdict = self.network.transmit(link, direction, size, entry)
        if verdict.dropped is not None:
            self._lost(link, direction, verdict.dropped)
            return None
        c = self._counters(link)
        if direction == UP:
            c.up_transfer_s += verdict.transfer_s
        else:
            c.down_transfer_s += verdict.transfer_s
        # Offline when it would arrive (a scheduled drop-out): lost in flight. Offline
        # changes made later (set_links, a new round) reach held messages by notice.
        if self.network.is_offline(link, verdict.arrival):
            self._lost(link, direction, "offline")
            return None
        return verdict.arrival

    def _notify_offline(self) -> None:
        """After a change that can take clients offline: every node drops what it holds
        for the clients now offline (in flight when they went), and reports back. In
        virtual time the broker holds it all, and drops it here."""
        if self.scheduler is not None:
            emulated = self.scheduler.now
            self.scheduler.drop_held(lambda link: self.network.is_offline(link, emulated),
                                     lambda link, direction: self._lost(link, direction, "offline"))
            return
        now = time.monotonic()  # wall
        for link in [k for k, until in self._flight_until.items() if until <= now]:
            del self._flight_until[link]  # nothing of it is held anywhere any more
        emulated = (now - self._t0) * self.time_scale
        links = [k for k in self._flight_until if self.network.is_offline(k, emulated)]
        if not links:
            return
        for link in links:
            del self._flight_until[link]
        for info in self._nodes.values():
            self._send_ctl(info.identity, Pid(info.name, 0), {"op": "offline", "links": links, "at": now})

    def _held_dropped(self, counts: Any) -> None:
        """A node's report of held messages it dropped on an ``offline`` notice."""
        if not isinstance(counts, list):
            raise WireError("held_dropped needs a list of [link, direction, count]")
        for entry in counts:
            if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry)
                    and entry[1] in (UP, DOWN) and 0 < entry[2] <= 1_000_000):
                raise WireError(f"bad held_dropped entry {entry!r}")
            link, direction, count = entry
            for _ in range(count):
                self._lost(link, direction, "offline")

    def _lost(self, link: int, direction: int, reason: str) -> None:
        c = self._counters(link)
        if direction == UP:
            c.up_lost += 1
        else:
            c.down_lost += 1
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        log.debug("link %d %s: message dropped (%s)", link, "up" if direction == UP else "down", reason)

    def _counters(self, link: int) -> LinkCounters:
        c = self.stats.links.get(link)
        if c is None:
            c = self.stats.links[link] = LinkCounters()
        return c
