"""The emulated network changing while the run goes on, and who hears of it: a round's
drop-outs, links changed on request (``set_links``) or by a scripted event, and a
client's own node told when its device goes offline or comes back (``availability``),
so its training stops as a real device's would; no other node is told (the server
learns of it as a real one would: no answer).

The link emulator (net/emulator.py) decides what changes; this module applies the
decisions to the run: it tells the devices through the timebase (at once on the wall
clock, with the next advance in virtual time) and has the timebase drop what was in
flight on links that went offline.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

from ..wire import Pid

if TYPE_CHECKING:
    from ..net.emulator import LinkEmulator
    from .membership import Membership
    from .timebase import Timebase


class NetworkChangesHost(Protocol):
    """What NetworkChanges uses of the broker that holds it: passed in, so this module
    depends on these, not on the Broker."""

    links: LinkEmulator
    members: Membership
    time: Timebase


class NetworkChanges:
    def __init__(self, broker: NetworkChangesHost) -> None:
        self._broker = broker
        self._links = broker.links

    def start_round(self, round_: int) -> None:
        """The server's round clock: per-round drop-outs and round-scripted events."""
        if self._links.start_round(round_, self._broker.time.now()):
            self.went_offline()  # the new round's drop-outs
            if self._links.per_round_dropouts:
                self.check_devices(list(self._broker.members.owners))

    def set_links(self, body: dict) -> None:
        self._links.set_links(body, self._broker.time.now())
        if body.get("offline") is True:
            self.went_offline()
        if isinstance(body.get("offline"), bool):
            self.check_devices(list(self._broker.members.owners))

    def went_offline(self) -> None:
        """After a change that can take clients offline: what is in flight for those now
        offline never arrives (the timebase drops what it holds, each counted lost)."""
        links = self._links
        self._broker.time.drop_in_flight(lambda link, at: links.is_offline(link, at))
        links.connections_lost(self._broker.time.now())  # what TCP connections still carried

    def clock_moved(self) -> None:
        """Emulated time moved on: time-based availability changes and scripted events
        due by now take effect."""
        self.clock_moved_devices()
        self._links.scripted_events(None, self._broker.time.now())

    def clock_moved_devices(self) -> None:
        """Time-based availability changes due by now take effect (devices told)."""
        now = self._broker.time.now()
        self._tell_devices(self._links.due_device_changes(now, self._broker.members.owners))

    def owners_joined(self, owned: list[tuple[Pid, int]]) -> None:
        """New owners of links: one of a link already offline (a restarted client) is told at once."""
        self._tell_pids([(pid, True) for pid, link in owned if self._links.device_offline(link)])
        self.check_devices({link for _, link in owned})

    def check_devices(self, links: Iterable[int]) -> None:
        """Tell the owners of these links (on their nodes) when whether they are offline
        has changed, and schedule a look at the next time-based switch."""
        changes = self._links.device_changes(links, self._broker.time.now(), self._broker.members.owners)
        self._tell_devices(changes)

    def _tell_devices(self, changes: list[tuple[int, bool]]) -> None:
        gone = [link for link, offline in changes if offline]
        if gone:  # a device that goes offline takes its connection down with it
            self._links.connections_lost(self._broker.time.now(), gone)
        owners = self._broker.members.owners
        self._tell_pids([(pid, offline) for link, offline in changes for pid in owners.get(link, ())])

    def _tell_pids(self, changed: list[tuple[Pid, bool]]) -> None:
        by_node: dict[str, dict[str, list[int]]] = {}
        for pid, offline in changed:
            lists = by_node.setdefault(pid[0], {"offline": [], "online": []})
            lists["offline" if offline else "online"].append(pid[1])
        for node, lists in by_node.items():
            if node in self._broker.members.nodes:
                self._broker.time.notify(node, {"op": "availability", **lists})
