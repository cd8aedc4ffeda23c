"""The round-based contract: ``Strategy``, what the round engine hands it (``RunPhase``,
``Replies``) and the weighted mean every rule of McMahan's family ends with.

A strategy says what selected clients are asked to do (a task) and how their replies
become the next global model. Everything else — selection, deadlines, quorum,
accounting — is the round engine's (``fedemu.server.engine``), shared by all of them.
Each built-in strategy is a module of its own beside this one (``fedavg.py``,
``fsvrg.py``...), with the local task its clients run.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from fedemu.node.schema import Key, interval
from fedemu.common.messages import TrainReply
from fedemu.common.ml.exact_sum import ExactSum

from .base import Algorithm


def selected_per_round(C: float, K: int) -> int:
    """m = max(floor(C * K), 1), as in McMahan's and Nilsson's Algorithm 1."""
    return max(int(math.floor(C * K + 1e-9)), 1)


class WeightedMean:
    """sum_k n_k u_k / sum_k n_k, folded one update at a time as they arrive, so the
    server holds one running sum, not a round's updates. Each n_k u_k is exact in
    float64 (a float32 times an integer below 2**29); the sum is float64, in arrival
    order, which virtual time fixes (due time, then client), so a rerun, on any
    placement, sums in the same order."""

    def __init__(self) -> None:
        self._sum: np.ndarray | None = None
        self._term: np.ndarray | None = None
        self.total = 0  # sum_k n_k

    def add(self, update: np.ndarray, n: int) -> None:
        if n < 0:
            raise ValueError(f"a sample count of {n}")
        if self._sum is None:
            self._sum = np.zeros(update.shape, dtype=np.float64)
            self._term = np.empty(update.shape, dtype=np.float64)
        elif update.shape != self._sum.shape:
            raise ValueError(f"an update of shape {update.shape} among updates of shape {self._sum.shape}")
        if n == 1:  # one example (cross-device): the term is the update, the same bits without a pass
            np.add(self._sum, update, out=self._sum)
        else:
            np.multiply(update, np.float64(n), out=self._term)
            self._sum += self._term
        self.total += n

    def result(self) -> np.ndarray:
        if self._sum is None:
            raise ValueError("no updates to average")
        if self.total <= 0:
            raise ValueError("sample counts sum to zero")
        return (self._sum / self.total).astype(np.float32)


def weighted_average(updates: Sequence[np.ndarray], counts: Sequence[int]) -> np.ndarray:
    """sum_k (n_k / n_sigma) u_k, in the order given (see WeightedMean)."""
    if len(updates) != len(counts):
        raise ValueError(f"{len(updates)} updates but {len(counts)} sample counts")
    mean = WeightedMean()
    for update, n in zip(updates, counts):
        mean.add(update, n)
    return mean.result()


class Replies(list):
    """A phase's replies, in arrival order, with the weighted mean of their updates
    (``mean()``), folded by the engine as they arrived. A rule that declares
    ``keeps_updates = False`` gets them without their updates.

    With ``exact`` (aggregation on the nodes), the mean is an ExactSum's: a reply whose
    update its node kept adds nothing here, and the node's sum of those is merged in as
    the phase closes (``merge_node_sum``)."""

    def __init__(self, exact: bool = False) -> None:
        super().__init__()
        self._mean = ExactSum() if exact else WeightedMean()

    def fold(self, reply: TrainReply, keep_update: bool) -> None:
        if reply.update is not None:
            self._mean.add(reply.update, reply.num_samples)
            if not keep_update:
                reply.update = None  # the received buffer can go
        elif not isinstance(self._mean, ExactSum):
            raise ValueError(f"client {reply.client}'s reply has no update")
        self.append(reply)

    def merge_node_sum(self, state: dict) -> None:
        self._mean.merge(state)

    def leave_out(self, clients: set[int]) -> None:
        """Replies whose updates were lost with their node (before any was merged)."""
        self[:] = [reply for reply in self if reply.client not in clients]

    def mean(self) -> np.ndarray:
        return self._mean.mean() if isinstance(self._mean, ExactSum) else self._mean.result()


# run_phase(task, lr, lr_decay=0.0, extra=None) sends one request to every selected
# client and returns the replies that arrived, or None when fewer than the quorum did
# (the round is then skipped and the model kept). ``task`` is a built-in task's name or a
# tasks.LocalTask subclass (the algorithm's own local work); ``extra`` is the algorithm's
# payload for it (FedProx's mu, FSVRG's full gradient), and each reply's ``extra`` is
# what the task sent back.
RunPhase = Callable[..., "list[TrainReply] | None"]


class Strategy(Algorithm):
    synchronous = True
    selects_all = False  # True: every live client takes part (FSVRG), not m = C*K
    # False: the rule needs only each phase's replies.mean(), so the engine drops each
    # update once folded into it: with 1,000 clients a round the server holds one model.
    keeps_updates = True
    population = 0  # K, the run's clients: set by the round engine before the first round

    def __init__(self, lr: float, lr_decay: float = 0.0) -> None:
        self.lr = lr
        self.lr_decay = lr_decay
        self.lr_round_decay = 1.0

    @classmethod
    def from_config(cls, algorithm):
        """lr, lr_decay, and each of the class's options as the keyword of that name;
        lr_round_decay set on the instance (a plug-in's constructor need not know it)."""
        strategy = cls(algorithm["lr"], algorithm["lr_decay"], **{key: algorithm[key] for key in cls.options})
        strategy.lr_round_decay = algorithm.get("lr_round_decay", 1.0)
        return strategy

    def round_lr(self, round_: int) -> float:
        """The learning rate of round ``round_`` (from 1): lr x lr_round_decay^(round - 1), as
        McMahan et al. decayed it per round for CIFAR-10 (0.99 for FedAvg, 0.9934 for FedSGD)."""
        return self.lr * self.lr_round_decay ** (round_ - 1)

    def run_round(self, run_phase: RunPhase, weights: np.ndarray, round_: int) -> np.ndarray | None:
        """One round; the new global model, or None if the round could not aggregate."""
        raise NotImplementedError


def average(replies: Sequence[TrainReply]) -> np.ndarray:
    """sum_k n_k/n_sigma u_k of a phase's replies: the engine's running mean when it folded
    them (``Replies``), else computed here in their order."""
    if isinstance(replies, Replies):
        return replies.mean()
    return weighted_average([r.update for r in replies], [r.num_samples for r in replies])
