"""The emulated network changing while the run goes on: a round's drop-outs, links
changed on request (``set_links``) or by a scripted event, and a client's own node
told when its device goes offline or comes back (``availability``), so its training
stops as a real device's would; no other node is told (the server learns of it as a
real one would: no answer).

Apart from link emulation (emulation.py), which applies the network as it is to each
message: this module changes the network and decides who hears of it, on rounds,
requests and emulated time, on wall and virtual time alike.
"""
from __future__ import annotations

import heapq
import logging
import math
from typing import Iterable

from ..net.links import LinkConfigError, parse_ids
from ..wire import Pid

log = logging.getLogger("fedemu.broker")


class NetworkChanges:
    """Broker's network changes (a mixin of :class:`~fedemu.node.broker.Broker`)."""

    def _init_devices(self) -> None:
        # Clients' devices: the links whose owners were told they are offline, and when
        # to look again: a heap of (emulated time, link) with the one time that counts per link.
        self._devices_offline: set[int] = set()
        self._device_checks: list[tuple[float, int]] = []
        self._device_check_at: dict[int, float] = {}

    def _apply_round(self, round_: int) -> None:
        self.network.round = round_
        self._scripted_events(round_=round_)
        if self.network.availability is not None:
            self._notify_offline()  # the new round's drop-outs
            if self.network.availability.per_round > 0:
                self._check_devices(list(self._owners))

    def _check_set_links(self, body: dict) -> str | None:
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

    def _apply_set_links(self, body: dict) -> None:
        self._set_links(body)
        if body.get("offline") is True:
            self._notify_offline()
        if isinstance(body.get("offline"), bool):
            self._check_devices(list(self._owners))

    def _set_links(self, body: dict) -> None:
        """Give a group of clients a named profile, or force them offline/online (the
        request was checked by _check_set_links)."""
        clients = parse_ids(body.get("clients", []), "clients", self.spec.num_clients)
        profile = body.get("profile")
        if profile is not None:
            self.spec.apply(self.network, profile, clients)
            log.info("clients %s now on profile %s", _ids_text(clients), profile)
        if body.get("offline") is True:
            self.network.offline |= clients
        elif body.get("offline") is False:
            self.network.offline -= clients
        self._emulating = not self.network.ideal

    def _scripted_events(self, round_: int | None) -> None:
        if self.spec is None:
            return
        now = self.emulated_now()
        for event in self.spec.events:
            due = (event.at_round is not None and round_ is not None and round_ >= event.at_round) or \
                  (event.at_s is not None and now >= event.at_s)
            if due and not event.done:
                event.done = True
                self.spec.apply(self.network, event.profile, event.clients)
                self._emulating = not self.network.ideal
                log.info("scripted event: clients %s now on profile %s (round %s, t=%.3fs)",
                         _ids_text(event.clients), event.profile, round_, now)

    def _check_devices(self, links: Iterable[int]) -> None:
        """Tell the owners of these links (on their nodes) when whether they are offline
        has changed, and schedule a look at the next time-based switch. Only the client's
        own node hears of it: a device knows it is offline; the server learns of it as a
        real one would (no answer)."""
        availability = self.network.availability
        if availability is None and not self.network.offline and not self._devices_offline:
            return
        timed = availability is not None and availability.timed
        now = self.emulated_now()
        changed = []
        for link in links:
            if link not in self._owners:
                continue  # no client owns it (yet): looked at when one registers
            offline = self.network.is_offline(link, now)
            if offline != (link in self._devices_offline):
                if offline:
                    self._devices_offline.add(link)
                else:
                    self._devices_offline.discard(link)
                changed.extend((pid, offline) for pid in self._owners[link])
            if timed:
                at = availability.next_change(link, now)
                if at < math.inf and self._device_check_at.get(link) != at:
                    self._device_check_at[link] = at
                    heapq.heappush(self._device_checks, (at, link))
        self._tell_devices(changed)

    def _due_device_checks(self) -> None:
        now = self.emulated_now()
        due = []
        while self._device_checks and self._device_checks[0][0] <= now:
            at, link = heapq.heappop(self._device_checks)
            if self._device_check_at.get(link) == at:  # else superseded by a later push
                del self._device_check_at[link]
                due.append(link)
        if due:
            self._check_devices(due)

    def _tell_devices(self, changed: list[tuple[Pid, bool]]) -> None:
        by_node: dict[str, dict[str, list[int]]] = {}
        for pid, offline in changed:
            lists = by_node.setdefault(pid[0], {"offline": [], "online": []})
            lists["offline" if offline else "online"].append(pid[1])
        for node, lists in by_node.items():
            info = self._nodes.get(node)
            if info is None:
                continue
            if self.scheduler is not None:  # at the instant it happens, with the node's next advance
                self.scheduler.notify(node, {"op": "availability", **lists})
            else:
                self._send_ctl(info.identity, Pid(node, 0), {"op": "availability", **lists})

    def _next_scheduled_change(self) -> float:
        """When the network next changes by itself (availability, a scripted event)."""
        checks = self._device_checks
        while checks and self._device_check_at.get(checks[0][1]) != checks[0][0]:
            heapq.heappop(checks)  # superseded by a later look at that link
        soonest = checks[0][0] if checks else math.inf
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
