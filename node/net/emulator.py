"""The link emulator: the one home of every client link's state, of how each message
crosses its link, of the network's changes and of the books.

The broker asks it, always with the current emulated time, and never the other way
round: :meth:`LinkEmulator.transmit` takes a message entering a client's link and says
when it arrives (a time fixed at once, as the ``message`` pipe gives), that it was lost,
or that it is :data:`PENDING`: a transport whose deliveries move when other flows start
or end (``tcp``) hands it back from :meth:`LinkEmulator.due` once it has arrived, and
:meth:`LinkEmulator.next_due` says when that can next happen. The network's own
changes (availability switching a device, scripted events, a round's drop-outs,
``set_links``) are asked the same way: :meth:`next_change`, :meth:`device_changes`.

No sockets, no clock of its own: the broker's timebase (wall or virtual) decides when
to ask, and where what is due goes. So wall and virtual time play the same model, and
the model can be tested alone.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import math
from dataclasses import dataclass
from typing import Any, Collection, Iterable

from .availability import parse_ids

from .links import Network

from .network_spec import NetworkSpec

from .profiles import DOWN, UP, LinkConfigError, LinkProfile
from .tcp import Arrival, TcpTransport

log = logging.getLogger("fedemu.broker")


class _Pending:
    """The answer of :meth:`LinkEmulator.transmit` for a message whose arrival is not
    known yet: :meth:`LinkEmulator.due` returns it once it has arrived."""

    def __repr__(self) -> str:
        return "PENDING"


PENDING = _Pending()

# A transfer in the timeline: its link and direction (UP: client to server), when it
# entered its link and when it ended (arrived, or was lost), its payload and wire bytes
# (headers included), the bytes sent again, how it ended ("delivered", "loss", "queue",
# "offline", "timeout"), and for one lost in flight (entry None) the arrival it would
# have had.
TRANSFER_FIELDS = ("link", "direction", "entry_s", "end_s", "bytes", "wire_bytes", "retransmitted_bytes", "outcome",
                   "due_s")


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
    # What the emulated link carried for those messages: headers included (the
    # ``message`` pipe's overhead_bytes; TCP/IP headers per segment), retransmissions too.
    up_wire_bytes: int = 0
    down_wire_bytes: int = 0
    up_retransmitted_bytes: int = 0  # of the wire bytes, those sent again after a loss
    down_retransmitted_bytes: int = 0


class LinkEmulator:
    """Every client link of a run (``spec``; None: ideal links, nothing emulated)."""

    def __init__(self, spec: NetworkSpec | None) -> None:
        self.spec = spec
        self.network = spec.build() if spec is not None else Network()
        # False while no message could be delayed or dropped: the broker skips the model.
        self.active = not self.network.ideal
        self.counters: dict[int, LinkCounters] = {}
        self.lost_by_reason: dict[str, int] = {}
        self.other_bytes = 0  # messages that cross no client link
        self.other_msgs = 0
        # Clients' devices: the links whose owners were told they are offline, and when
        # to look again: a heap of (emulated time, link) with the one time that counts per link.
        self._devices_offline: set[int] = set()
        self._device_checks: list[tuple[float, int]] = []
        self._device_check_at: dict[int, float] = {}
        # The timeline's raw facts, until the server takes them (``take_timeline``):
        # every transfer as it ended (TRANSFER_FIELDS) and every device's switch between
        # online and offline as its owners were told ([link, emulated time, offline]).
        self._transfers: list[list] = []
        self._availability: list[list] = []
        # The ``tcp`` transport, made when a link first needs it; what it lost with a
        # connection and not yet handed back by due() (parcel, link, direction).
        self._tcp: TcpTransport | None = None
        self._failed: list[tuple[Any, int, int]] = []

    # --- books ---------------------------------------------------------------------------

    def account(self, src_link: int | None, dst_link: int | None, size: int) -> tuple[int, int] | None:
        """Count a message on the client link it crosses; returns (link, direction), or
        None when it crosses none (counted apart). A message from a link owner goes up
        its link; one to a link owner comes down its link (client-to-client traffic is
        counted on both, emulated on the uplink)."""
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
        self.other(size)
        return None

    def other(self, size: int) -> None:
        """A message that crosses no client link."""
        self.other_bytes += size
        self.other_msgs += 1

    def lost(self, link: int, direction: int, reason: str, at: float | None = None, due: float | None = None) -> None:
        """A message on ``link`` never arrives: counted. ``at``: when it was lost after it
        was given an arrival time ``due`` (its device went offline while it was in
        flight): the timeline records that too."""
        if at is not None:
            self._transfers.append([link, direction, None, at, 0, 0, 0, "offline", due])
        c = self._counters(link)
        if direction == UP:
            c.up_lost += 1
        else:
            c.down_lost += 1
        self.lost_by_reason[reason] = self.lost_by_reason.get(reason, 0) + 1
        log.debug("link %d %s: message dropped (%s)", link, "up" if direction == UP else "down", reason)

    def books(self) -> dict[str, Any]:
        """The run's traffic so far, summed over links (the broker's ``stats``)."""
        links = self.counters.values()
        return {
            "bytes_up": sum(c.up_bytes for c in links),
            "bytes_down": sum(c.down_bytes for c in links),
            "msgs_up": sum(c.up_msgs for c in links),
            "msgs_down": sum(c.down_msgs for c in links),
            "lost_up": sum(c.up_lost for c in links),
            "lost_down": sum(c.down_lost for c in links),
            "transfer_s_up": round(sum(c.up_transfer_s for c in links), 6),
            "transfer_s_down": round(sum(c.down_transfer_s for c in links), 6),
            "wire_bytes_up": sum(c.up_wire_bytes for c in links),
            "wire_bytes_down": sum(c.down_wire_bytes for c in links),
            "retransmitted_bytes_up": sum(c.up_retransmitted_bytes for c in links),
            "retransmitted_bytes_down": sum(c.down_retransmitted_bytes for c in links),
            "bytes_other": self.other_bytes,
            "msgs_other": self.other_msgs,
        }

    def take_timeline(self) -> dict[str, list[list]]:
        """The transfers that ended and the devices' switches since the last call, for
        the run's timeline; forgotten here once taken. A transfer is
        ``TRANSFER_FIELDS``; a switch is [link, emulated time, offline]."""
        transfers, self._transfers = self._transfers, []
        availability, self._availability = self._availability, []
        return {"transfers": transfers, "availability": availability}

    def _wired(self, link: int, direction: int, wire_bytes: int, retransmitted: int) -> None:
        c = self._counters(link)
        if direction == UP:
            c.up_wire_bytes += wire_bytes
            c.up_retransmitted_bytes += retransmitted
        else:
            c.down_wire_bytes += wire_bytes
            c.down_retransmitted_bytes += retransmitted

    def _counters(self, link: int) -> LinkCounters:
        c = self.counters.get(link)
        if c is None:
            c = self.counters[link] = LinkCounters()
        return c

    # --- messages --------------------------------------------------------------------------

    def transmit(self, link: int, direction: int, size: int, entry: float, parcel: Any = None) -> Any:
        """A message of ``size`` bytes entering ``link`` in ``direction`` at emulated time
        ``entry``: its arrival time, None if it is lost (counted), or PENDING (``tcp``:
        ``parcel`` comes back from due() once it has arrived, or was lost)."""
        if self.network.profile(link, direction).transport == "tcp":
            return self._send_tcp(link, direction, size, entry, parcel)
        verdict = self.network.transmit(link, direction, size, entry)
        wire_size = size + self.network.profile(link, direction).overhead_bytes
        if verdict.dropped != "offline":  # lost to loss or a full queue: its bytes went on the wire
            self._wired(link, direction, wire_size, 0)
        if verdict.dropped is not None:
            self.lost(link, direction, verdict.dropped)
            sent = 0 if verdict.dropped == "offline" else wire_size  # offline as it entered: nothing was sent
            self._transfers.append([link, direction, entry, entry, size, sent, 0, verdict.dropped, None])
            return None
        c = self._counters(link)
        if direction == UP:
            c.up_transfer_s += verdict.transfer_s
        else:
            c.down_transfer_s += verdict.transfer_s
        # Offline when it would arrive (a scheduled drop-out): lost in flight. Offline
        # changes made later (set_links, a new round) reach what is held by the broker's
        # timebase (drop_in_flight).
        if self.network.is_offline(link, verdict.arrival):
            self.lost(link, direction, "offline")
            self._transfers.append([link, direction, entry, verdict.arrival, size, wire_size, 0, "offline", None])
            return None
        self._transfers.append([link, direction, entry, verdict.arrival, size, wire_size, 0, "delivered", None])
        return verdict.arrival

    def _send_tcp(self, link: int, direction: int, size: int, entry: float, parcel: Any) -> Any:
        if self.network.is_offline(link, entry):  # no connection to send on
            self.lost(link, direction, "offline")
            self._transfers.append([link, direction, entry, entry, size, 0, 0, "offline", None])
            return None
        tcp = self._transport()
        # The model takes its inputs in time order; on the wall clock a sender's stamp may
        # lie a little before what the model has already seen.
        tcp.send(max(entry, tcp.now), link, direction, size, parcel)
        return PENDING

    def next_due(self, until: float = math.inf) -> float:
        """When a PENDING message can next arrive, or be lost with its connection (math.inf:
        none is pending). ``until``: no message enters any link before min(until, the
        answer) (virtual time knows its next other event): the model need not look further."""
        if self._failed:
            return -math.inf
        return math.inf if self._tcp is None else self._tcp.next_arrival(until)

    def due(self, now: float) -> list[tuple[Any, float | None, int, int]]:
        """PENDING messages that arrived, or were lost, by ``now``: (parcel, arrival or
        None if lost, link, direction), losses first, then arrivals in arrival order."""
        out: list[tuple[Any, float | None, int, int]] = [(parcel, None, link, direction)
                                                         for parcel, link, direction in self._failed]
        self._failed = []
        if self._tcp is None:
            return out
        for item in self._tcp.arrivals(now):
            link, direction = item.link, item.direction
            self._wired(link, direction, item.wire_bytes, item.retransmitted_bytes)
            if not isinstance(item, Arrival):  # its connection timed out: retransmissions unanswered
                self.lost(link, direction, item.cause)
                self._transfers.append([link, direction, item.entry, item.time, item.payload_bytes, item.wire_bytes,
                                        item.retransmitted_bytes, item.cause, None])
                out.append((item.token, None, link, direction))
                continue
            if self.network.is_offline(link, item.arrival):  # its device went offline unseen: lost
                self.lost(link, direction, "offline")
                self._transfers.append([link, direction, item.entry, item.arrival, item.payload_bytes,
                                        item.wire_bytes, item.retransmitted_bytes, "offline", None])
                out.append((item.token, None, link, direction))
                continue
            c = self._counters(link)
            if direction == UP:
                c.up_transfer_s += item.arrival - item.entry
            else:
                c.down_transfer_s += item.arrival - item.entry
            self._transfers.append([link, direction, item.entry, item.arrival, item.payload_bytes, item.wire_bytes,
                                    item.retransmitted_bytes, "delivered", None])
            out.append((item.token, item.arrival, link, direction))
        return out

    def connections_lost(self, now: float, links: Iterable[int] | None = None) -> None:
        """Clients that went offline at ``now`` (``links``; None: every link offline now):
        what their TCP connections still carried is lost, the bytes already sent counted;
        due() hands the parcels back."""
        tcp = self._tcp
        if tcp is None:
            return
        if links is None:
            links = {link for link, _ in tcp.flows if self.network.is_offline(link, now)}
        for link in sorted(set(links)):
            for failure in tcp.fail(max(now, tcp.now), link):
                self._wired(link, failure.direction, failure.wire_bytes, failure.retransmitted_bytes)
                self.lost(link, failure.direction, "offline")
                self._transfers.append([link, failure.direction, failure.entry, failure.time, failure.payload_bytes,
                                        failure.wire_bytes, failure.retransmitted_bytes, "offline", None])
                self._failed.append((failure.token, link, failure.direction))

    def _transport(self) -> TcpTransport:
        if self._tcp is None:
            network = self.network
            varying = bool(network.link_traces) or (network.time_of_day is not None
                                                   and network.time_of_day.bandwidth is not None)
            server = {d: (b.bandwidth if b is not None else math.inf) for d, b in network.server_links.items()}
            self._tcp = TcpTransport(self.network.seed, self._tcp_profile if varying else network.profile, server,
                                     self.spec.server_buffers if self.spec is not None else None)
        return self._tcp

    def _tcp_profile(self, link: int, direction: int) -> LinkProfile:
        """A link's profile as the TCP model asks for it while it stands at a time: a trace's
        latency and loss at that time, and the rate averaged over one base round trip (the
        model takes one rate per round trip, so a rate that changes within one is seen as
        its mean; a link with no rate at all for the round is as good as stalled)."""
        t = self._tcp.time
        profile = self.network.profile_at(link, direction, t)
        rate = self.network.rate(link, direction, profile.bandwidth)
        if rate is None:
            return profile
        rtt = max((profile.latency_ms + self.network.profile(link, 1 - direction).latency_ms) / 1000.0, 1e-3)
        return dataclasses.replace(profile, bandwidth=max(rate.served(t, t + rtt) / rtt, 1.0))

    def profiles_changed(self, clients: Iterable[int] | None, now: float) -> None:
        """``clients``' profiles changed at ``now`` (None: everyone's): the TCP model's
        connections take their new rates from now."""
        tcp = self._tcp
        if tcp is None:
            return
        links = {link for link, _ in tcp.flows} if clients is None else set(clients)
        for link in sorted(links):
            if (link, UP) in tcp.flows or (link, DOWN) in tcp.flows:
                tcp.update(max(now, tcp.now), link)

    # --- the network changing ------------------------------------------------------------

    def is_offline(self, link: int, now: float) -> bool:
        return self.network.is_offline(link, now)

    def offline_links(self, links: Iterable[int], now: float) -> list[int]:
        return sorted(k for k in set(links) if self.network.is_offline(k, now))

    @property
    def per_round_dropouts(self) -> bool:
        availability = self.network.availability
        return availability is not None and availability.per_round > 0

    def start_round(self, round_: int, now: float) -> bool:
        """The server's round ``round_`` begins: per-round drop-outs and round-scripted
        events. True if clients may have gone offline (what is in flight for them dies)."""
        self.network.round = round_
        self.scripted_events(round_, now)
        return self.network.availability is not None

    def check_set_links(self, body: dict) -> str | None:
        """None if a set_links request is valid, else the error that names what is wrong."""
        try:
            if self.spec is None:
                raise LinkConfigError("this broker runs without a network spec")
            parse_ids(body.get("clients", []), "clients", self.spec.num_clients)
            profile = body.get("profile")
            if profile is not None and profile not in self.spec.profiles:
                raise LinkConfigError(f"profile {profile!r} is unknown; profiles are {', '.join(self.spec.profiles)}")
        except LinkConfigError as exc:
            return str(exc)
        return None

    def set_links(self, body: dict, now: float) -> None:
        """Give a group of clients a named profile, or force them offline/online (the
        request was checked by check_set_links)."""
        clients = parse_ids(body.get("clients", []), "clients", self.spec.num_clients)
        profile = body.get("profile")
        if profile is not None:
            self.spec.apply(self.network, profile, clients)
            self.profiles_changed(clients, now)
            log.info("clients %s now on profile %s", _ids_text(clients), profile)
        if body.get("offline") is True:
            self.network.offline |= clients
        elif body.get("offline") is False:
            self.network.offline -= clients
        self.active = not self.network.ideal

    def scripted_events(self, round_: int | None, now: float) -> None:
        """Scripted events due by round ``round_`` (None: no new round) or by ``now``."""
        if self.spec is None:
            return
        for event in self.spec.events:
            due = (event.at_round is not None and round_ is not None and round_ >= event.at_round) or \
                  (event.at_s is not None and now >= event.at_s)
            if due and not event.done:
                event.done = True
                self.spec.apply(self.network, event.profile, event.clients)
                self.profiles_changed(event.clients, now)
                self.active = not self.network.ideal
                log.info("scripted event: clients %s now on profile %s (round %s, t=%.3fs)",
                         _ids_text(event.clients), event.profile, round_, now)

    def device_changes(self, links: Iterable[int], now: float, owned: Collection[int]) -> list[tuple[int, bool]]:
        """Which of these links' devices changed between online and offline since their
        owners were last told: (link, offline) for each; schedules a look at each link's
        next time-based switch. Only ``owned`` links count (no client owns the others yet:
        they are looked at when one registers)."""
        availability = self.network.availability
        if availability is None and not self.network.offline and not self._devices_offline:
            return []
        timed = availability is not None and availability.timed
        changed = []
        for link in links:
            if link not in owned:
                continue
            offline = self.network.is_offline(link, now)
            if offline != (link in self._devices_offline):
                self._availability.append([link, now, offline])
                if offline:
                    self._devices_offline.add(link)
                else:
                    self._devices_offline.discard(link)
                changed.append((link, offline))
            if timed:
                at = availability.next_change(link, now)
                if at < math.inf and self._device_check_at.get(link) != at:
                    self._device_check_at[link] = at
                    heapq.heappush(self._device_checks, (at, link))
        return changed

    def due_device_changes(self, now: float, owned: Collection[int]) -> list[tuple[int, bool]]:
        """Device changes whose time-based switch is due by ``now``."""
        due = []
        while self._device_checks and self._device_checks[0][0] <= now:
            at, link = heapq.heappop(self._device_checks)
            if self._device_check_at.get(link) == at:  # else superseded by a later push
                del self._device_check_at[link]
                due.append(link)
        return self.device_changes(due, now, owned) if due else []

    def device_offline(self, link: int) -> bool:
        """Whether the owners of ``link`` were last told its device is offline."""
        return link in self._devices_offline

    def next_device_check(self) -> float:
        """When a device may next switch by itself (emulated; math.inf: never)."""
        checks = self._device_checks
        while checks and self._device_check_at.get(checks[0][1]) != checks[0][0]:
            heapq.heappop(checks)  # superseded by a later look at that link
        return checks[0][0] if checks else math.inf

    def next_change(self) -> float:
        """When the network next changes by itself (availability, a scripted event)."""
        soonest = self.next_device_check()
        if self.spec is not None:
            for event in self.spec.events:
                if event.at_s is not None and not event.done:
                    soonest = min(soonest, event.at_s)
        return soonest


def _ids_text(ids) -> str:
    if ids is None:
        return "all"
    ids = sorted(ids)
    return f"{ids[0]}..{ids[-1]} ({len(ids)})" if len(ids) > 3 else str(ids)
