"""Aggregation on the worker nodes (``run.aggregation = "nodes"``): a client keeps its
update at its node and answers the server with a token that weighs, on its link, what
the update would have; as the phase closes the server asks each node for the exact sum
(common/ml/exact_sum.py) of the updates that counted, and adds the node sums. A round of
1,000 clients then moves a few sums through the broker instead of 1,000 models, and the
model is the same bits whatever node hosts which client.
"""
from __future__ import annotations

import logging
import threading

import numpy as np

from fedemu.node import Behaviour, BehaviourProcess, Message, wire

from fedemu.common.ml.exact_sum import ExactSum
from fedemu.common.messages import SumReply, SumRequest, TrainReply

log = logging.getLogger(__name__)


class _ThreadPhase:
    """What one pool thread kept of one phase: the updates, and their sum so far (added
    as each task ends, while the update is still in the core's cache)."""

    __slots__ = ("lock", "sum", "updates")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sum = ExactSum()
        self.updates: dict[int, tuple[np.ndarray, int]] = {}


class KeptUpdates:
    """A worker node's clients' updates, kept until the server asks for their sum. Each
    client's task adds its update to its thread's running sum of the phase as it answers
    (threads do not wait for each other); the node's NodeSums takes a phase's sums when
    the server asks, and takes back the updates that did not count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phases: dict[tuple[int, str, int], _ThreadPhase] = {}  # (round, task, thread) ->
        self._closed_before = 0  # rounds below this have been summed: a late update is dropped

    def keep(self, reply: TrainReply) -> None:
        """Keep ``reply``'s update here and turn the reply into the token that stands for
        it: no update, the bytes it would have added charged on its link."""
        full = wire.message_size(wire.pack_body(reply))
        update = reply.update
        reply.update = None
        # The token plus its charge weighs what the full reply would: the charge's own
        # encoded width counts in the token, so settle it (two passes at most).
        for _ in range(3):
            token = wire.message_size(wire.pack_body(reply))
            if token + reply.link_charge == full:
                break
            reply.link_charge = full - token
        key = (reply.round, reply.task, threading.get_ident())
        with self._lock:
            if reply.round < self._closed_before:
                return  # the server has summed this round already; the reply will not count either
            phase = self._phases.get(key)
            if phase is None:
                phase = self._phases[key] = _ThreadPhase()
        with phase.lock:
            phase.sum.add(update, reply.num_samples)
            phase.updates[reply.client] = (update, reply.num_samples)

    def take(self, round_: int, task: str) -> list[_ThreadPhase]:
        """A phase's kept updates and sums, removed; and anything kept for an earlier
        round, dropped (no phase of it can be asked for once a later round is)."""
        with self._lock:
            taken = [phase for key, phase in self._phases.items() if key[:2] == (round_, task)]
            self._phases = {key: phase for key, phase in self._phases.items()
                            if key[0] >= round_ and key[:2] != (round_, task)}
            self._closed_before = max(self._closed_before, round_)
        return taken

    def sum_of(self, round_: int, task: str, clients: list[int]) -> tuple[ExactSum, list[int]]:
        """The exact sum of ``clients``' kept updates of a phase, and those of them not
        kept here; the phase is taken."""
        total, kept = ExactSum(), {}
        phases = self.take(round_, task)
        for phase in phases:
            with phase.lock:  # a task of this phase may still be adding (a straggler)
                total.merge(phase.sum.state())
                kept.update(phase.updates)
        wanted = set(clients)
        unwanted = [k for k in sorted(kept) if k not in wanted]
        try:
            for k in unwanted:
                total.subtract(*kept[k])
        except ValueError:  # a non-finite update cannot be taken back: sum the wanted ones afresh
            total = ExactSum()
            for k in sorted(wanted & kept.keys()):
                total.add(*kept[k])
        return total, [k for k in clients if k not in kept]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(phase.updates) for phase in self._phases.values())


class NodeSums(Behaviour):
    """The process on a worker node that answers the server's SumRequest."""

    def __init__(self, kept: KeptUpdates) -> None:
        self.kept = kept

    def handle(self, proc: BehaviourProcess, msg: Message) -> None:
        request = msg.body
        if not isinstance(request, SumRequest):
            log.warning("the node's sums ignore %r from %s", type(request).__name__, msg.sender)
            return
        total, missing = self.kept.sum_of(request.round, request.task, request.clients)
        if missing:
            log.warning("round %d: the server asked for the updates of clients %s, which this node does not hold",
                        request.round, missing[:10])
        proc.send(msg.sender, SumReply(request.round, request.task, proc.node.name, total.state(), missing))
