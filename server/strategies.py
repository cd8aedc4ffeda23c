"""Round-based aggregation rules: one small class per algorithm.

A strategy says what selected clients are asked to do (``task``) and how their replies
become the next global model. Everything else — selection, deadlines, quorum,
accounting — is the round engine's (``engine.py``), shared by all of them.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from fedemu.worker.protocol import GRADIENT, TRAIN, TrainReply


def selected_per_round(C: float, K: int) -> int:
    """m = max(floor(C * K), 1), as in McMahan's and Nilsson's Algorithm 1."""
    return max(int(math.floor(C * K + 1e-9)), 1)


def weighted_average(updates: Sequence[np.ndarray], counts: Sequence[int]) -> np.ndarray:
    """sum_k (n_k / n_sigma) u_k over the updates that arrived (float64 accumulation)."""
    if not updates:
        raise ValueError("no updates to average")
    if len(updates) != len(counts):
        raise ValueError(f"{len(updates)} updates but {len(counts)} sample counts")
    total = float(sum(counts))
    if total <= 0:
        raise ValueError("sample counts sum to zero")
    acc = np.zeros(updates[0].shape, dtype=np.float64)
    for update, n in zip(updates, counts):
        acc += (n / total) * update
    return acc.astype(np.float32)


class Strategy:
    name = ""
    task = TRAIN

    def __init__(self, lr: float, lr_decay: float = 0.0) -> None:
        self.lr = lr
        self.lr_decay = lr_decay

    def learning_rate(self, round_: int) -> float:
        """Keras-style time decay, as Nilsson et al. used: lr / (1 + lambda * t)."""
        return self.lr / (1.0 + self.lr_decay * (round_ - 1))

    def aggregate(self, weights: np.ndarray, replies: Sequence[TrainReply], round_: int) -> np.ndarray:
        raise NotImplementedError


class FedAvg(Strategy):
    """McMahan et al. 2017, Algorithm 1: w <- sum_k n_k/n_sigma w_k over arrivals."""

    name = "fedavg"
    task = TRAIN

    def aggregate(self, weights, replies, round_):
        return weighted_average([r.update for r in replies], [r.num_samples for r in replies])


class FedSGD(Strategy):
    """w <- w - eta * sum_k n_k/n_sigma g_k, each g_k a full local-batch gradient."""

    name = "fedsgd"
    task = GRADIENT

    def aggregate(self, weights, replies, round_):
        gradient = weighted_average([r.update for r in replies], [r.num_samples for r in replies])
        return (weights - self.learning_rate(round_) * gradient).astype(np.float32)


STRATEGIES = {cls.name: cls for cls in (FedAvg, FedSGD)}


def make(name: str, lr: float, lr_decay: float = 0.0) -> Strategy:
    try:
        return STRATEGIES[name](lr, lr_decay)
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; round-based ones are {', '.join(STRATEGIES)}") from None
