"""Where a round's segments are lost: on the link, and at a full buffer.

* on the link: ``loss`` per data segment, or Gilbert-Elliott bursts, drawn as the gaps
  between losses (geometric), so a round costs its losses, not its size. ACKs are not
  lost (cumulative ACKs make a lost ACK nearly free);
* at the bottleneck's drop-tail buffer: how many overflow is the bottleneck's question
  (bottleneck.py, shared.py); where in the round they fall is :func:`overflow_positions`.

A round's positions map to segment ids with :func:`segment_at`. Pure functions: the
random draws come from ``draw(purpose)``, the caller's named stream for the flow
(node/streams.py), so the same seed gives the same losses whoever asks.
"""
from __future__ import annotations

import bisect
import math
import random
from typing import Callable

from ..profiles import LinkProfile
from .state import Flow


def random_losses(flow: Flow, profile: LinkProfile, n: int, draw: Callable[[str], float]) -> list[int]:
    """Positions (of the round's n segments) lost on the link: Bernoulli or
    Gilbert-Elliott per packet, drawn as geometric gaps between losses (and between
    state changes), so a round costs its losses, not its size."""
    if profile.ge_p > 0:
        return ge_losses(flow, profile, n, draw)
    p = profile.loss
    if p <= 0:
        return []
    if p >= 1:
        return list(range(n))
    out = []
    pos = -1
    log_q = math.log1p(-p)
    while True:
        pos += 1 + int(math.log1p(-draw("tcp/loss")) / log_q)
        if pos >= n:  # memoryless: the next round draws its own first gap
            return out
        out.append(pos)


def ge_losses(flow: Flow, profile: LinkProfile, n: int, draw: Callable[[str], float]) -> list[int]:
    """Gilbert-Elliott: a good and a bad state, each with its own loss rate; the time
    left in the state (``flow.ge_left``, ``flow.ge_bad``) carries over between rounds."""
    out = []
    pos = 0
    while pos < n:
        if flow.ge_left < 0:
            # Sojourn in the current state: each packet leaves it with ge_p (good) or ge_r (bad).
            leave = profile.ge_r if flow.ge_bad else profile.ge_p
            u = draw("tcp/gilbert-elliott")
            flow.ge_left = 1 + (int(math.log1p(-u) / math.log1p(-leave)) if 0 < leave < 1 else
                                (0 if leave >= 1 else 1 << 40))
        run = min(flow.ge_left, n - pos)
        p = profile.ge_loss_bad if flow.ge_bad else profile.ge_loss_good
        if p >= 1:
            out.extend(range(pos, pos + run))
        elif p > 0:
            log_q = math.log1p(-p)
            at = pos - 1
            while True:
                u = draw("tcp/loss")
                at += 1 + int(math.log1p(-u) / log_q)
                if at >= pos + run:
                    break
                out.append(at)
        pos += run
        flow.ge_left -= run
        if flow.ge_left == 0:
            flow.ge_bad = not flow.ge_bad
            flow.ge_left = -1
    return out


def overflow_positions(n: int, drops: int, alternate: bool, rng: random.Random | None) -> list[int]:
    """Where in the round's first n segments the buffer's drops fall. Released at twice
    the drain rate (slow start), the queue fills part way and then every other segment
    finds it full; a window's growth of a segment or two finds it full part way through;
    a burst (no ACK clock, or many flows at once) loses a random share after its first."""
    if drops <= 0:
        return []
    if drops >= n:
        return list(range(n))
    if alternate and 2 * drops <= n:
        return list(range(n - 2 * drops + 1, n, 2))
    if rng is None:
        step = n / (drops + 1)
        return sorted({min(n - 1, int(step * (i + 1))) for i in range(drops)})
    return sorted(rng.sample(range(1, n), drops) if drops < n else range(n))


def segment_at(order: tuple, pos: int) -> int:
    """The segment at a position of a round sent as (retransmissions, first new,
    new sent before them, new sent after)."""
    rtx, first_new, before, _ = order
    if pos < before:
        return first_new + pos
    if pos < before + len(rtx):
        return rtx[pos - before]
    return first_new + pos - len(rtx)


def count_between(sorted_values: list[int], low: int, high: int) -> int:
    """How many of the sorted values lie in [low, high)."""
    return bisect.bisect_left(sorted_values, high) - bisect.bisect_left(sorted_values, low)
