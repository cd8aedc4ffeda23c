"""Where link emulation ends, on the receiving node: messages held until they are due.

A message that crossed an emulated link arrives with a :class:`~fedemu.node.wire.Hold`
from the broker; the node's I/O thread keeps it in a small heap until it is due, then
hands it to its process. Times on the wire are in the broker's clock; the node
estimates its offset to it from the heartbeats' round trips (the sample with the
shortest round trip of the last few), so nodes on other machines need no synchronized
clocks.

Apart from the I/O loop (transport.py) because this is one job with its own state,
touched by the I/O thread only: the loop asks what is due and gets the messages back
through one callback.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import time
from pathlib import Path
from typing import Any, Callable

from ..wire import Hold, Pid

# Round-trip samples kept for the clock offset: 16 heartbeats (8 s at the default
# interval) bound the drift between two machines' clocks while still finding a quick one.
CLOCK_SAMPLES = 16


def clock_identity() -> str | None:
    """Names this process's monotonic clock: processes under one running kernel (one
    boot) and one time namespace read the same CLOCK_MONOTONIC, across network
    namespaces and containers too. None where it cannot be told (not Linux)."""
    global _CLOCK_IDENTITY
    if _CLOCK_IDENTITY is None:
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            return None
        try:  # a time namespace may shift the monotonic clock (Linux 5.6+)
            shift = " ".join(line for line in Path("/proc/self/timens_offsets").read_text().splitlines()
                             if line.startswith("monotonic"))
        except OSError:
            shift = ""
        _CLOCK_IDENTITY = f"{boot}/{shift}"
    return _CLOCK_IDENTITY


_CLOCK_IDENTITY: str | None = None


class BrokerClock:
    """This node's estimate of the broker's clock: ``offset`` = broker clock - local
    clock, None until the welcome. A broker on this machine reads the same clock: the
    offset is then exactly 0, not an estimate off by up to half a round trip (which
    would release a held message a fraction of a millisecond before its time)."""

    def __init__(self) -> None:
        # (round trip, offset) samples.
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=CLOCK_SAMPLES)
        self.offset: float | None = None
        self.shared = False

    def welcome(self, body: dict) -> None:
        """The broker's welcome: its clock's identity, and a first sample."""
        broker_clock = body.get("clock_id")
        if isinstance(broker_clock, str) and broker_clock == clock_identity():
            self.shared, self.offset = True, 0.0
        self.sample(body)

    def origin(self, body: dict) -> float | None:
        """From the welcome: the local monotonic instant at which the broker's emulated
        time was zero (None if it did not say, or no offset is known)."""
        broker_now, emulated, scale = body.get("now"), body.get("emulated"), body.get("time_scale")
        if self.offset is None or type(broker_now) is not float or type(emulated) is not float \
                or type(scale) is not float or scale <= 0:
            return None
        return broker_now - emulated / scale - self.offset

    def sample(self, body: dict) -> None:
        """A round trip to the broker (our send time echoed, the broker's clock): its
        offset is known to within half the round trip, so the shortest recent wins."""
        if self.shared:
            return
        t1 = time.monotonic()  # wall: a round trip to the broker's clock
        t0, broker_now = body.get("t"), body.get("now")
        if type(t0) is float and type(broker_now) is float and 0 <= t1 - t0 < 10:
            self._samples.append((t1 - t0, broker_now - (t0 + t1) / 2))
            self.offset = min(self._samples)[1]


class HeldMessages:
    """Messages held until due (I/O thread only). ``heap`` holds (due in broker clock,
    seq, release time in local clock, (sender, local id), body, link, direction);
    ``pairs`` holds per (sender, local id) pair [held count, latest due], so nothing
    overtakes them. ``deliver(sender, local id, body)`` takes what is released."""

    def __init__(self, deliver: Callable[[Pid, int, Any], None], clock: BrokerClock) -> None:
        self._deliver = deliver
        self._clock = clock
        self.heap: list = []
        self._seq = itertools.count()
        self.pairs: dict[tuple[Pid, int], list] = {}

    def arrive(self, src: Pid, dst_id: int, body: Any, timing: Any) -> None:
        """Deliver now, or hold until due; either way never ahead of an earlier
        message of the same pair that is still held (FIFO per pair)."""
        key = (src, dst_id)
        pair = self.pairs.get(key)
        if type(timing) is Hold:
            now = time.monotonic()  # wall
            due = timing.sent_at + timing.hold
            # Due in this clock; never later than `hold` from now (what the broker
            # asked for), whatever the offset estimate says.
            release = now + timing.hold
            offset = self._clock.offset
            if offset is not None and due - offset < release:
                release = due - offset
            if release <= now and pair is None:
                self._deliver(src, dst_id, body)
                return
            link, direction = timing.link, timing.direction
        elif pair is None:
            self._deliver(src, dst_id, body)
            return
        else:  # not emulated (a DOWN, or a link that became ideal): right behind the pair's last
            due, release, link, direction = pair[1], float("-inf"), -1, -1
        if pair is None:
            pair = self.pairs[key] = [0, due]
        pair[0] += 1
        if due > pair[1]:
            pair[1] = due
        heapq.heappush(self.heap, (due, next(self._seq), release, key, body, link, direction))

    def release_due(self) -> None:
        """Hand every held message that is due to its process, in due order (so in
        the model's order: FIFO per link, or the model's reordering with `reorder`)."""
        held = self.heap
        now = time.monotonic()  # wall
        while held and held[0][2] <= now:
            _, _, _, key, body, _, _ = heapq.heappop(held)
            self._unhold(key)
            self._deliver(key[0], key[1], body)

    def _unhold(self, key: tuple[Pid, int]) -> None:
        pair = self.pairs[key]
        pair[0] -= 1
        if pair[0] == 0:
            del self.pairs[key]

    def drop_offline(self, links: Any, at: Any) -> collections.Counter:
        """The broker's notice that ``links`` went offline at ``at`` (its clock): what
        is held for them and due after that never arrives. Returns how many were
        dropped per (link, direction), for the broker's books."""
        if not (isinstance(links, list) and all(type(k) is int for k in links) and type(at) is float):
            raise ValueError("offline needs a list of links and a time")
        gone = set(links)
        kept, counts = [], collections.Counter()
        for entry in self.heap:
            if entry[5] in gone and entry[0] > at:
                counts[(entry[5], entry[6])] += 1
                self._unhold(entry[3])
            else:
                kept.append(entry)
        if counts:
            heapq.heapify(kept)
            self.heap[:] = kept  # the I/O loop holds this list
        return counts
