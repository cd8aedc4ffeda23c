"""Round-based aggregation rules: one small class per algorithm, each registered under
its name (``algorithm.py`` says what a class declares).

A strategy says what selected clients are asked to do (``task``) and how their replies
become the next global model. Everything else — selection, deadlines, quorum,
accounting — is the round engine's (``engine.py``), shared by all of them.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from fedemu.node.schema import Key, positive
from fedemu.worker.protocol import GRADIENT, SVRG, TRAIN, TrainReply

from .algorithm import Algorithm, register


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


# run_phase(task, lr, lr_decay=0.0, full_gradient=None, prox_mu=0.0) sends one request
# to every selected client and returns the replies that arrived, or None when fewer than
# the quorum did (the round is then skipped and the model kept).
RunPhase = Callable[..., "list[TrainReply] | None"]


class Strategy(Algorithm):
    synchronous = True
    selects_all = False  # True: every live client takes part (FSVRG), not m = C*K

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


def _average(replies: Sequence[TrainReply]) -> np.ndarray:
    # In client order, not arrival order: float sums depend on order, and arrival order
    # depends on timing, so the same seed gives the same model wherever clients run.
    replies = sorted(replies, key=lambda r: r.client)
    return weighted_average([r.update for r in replies], [r.num_samples for r in replies])


@register
class FedAvg(Strategy):
    """McMahan et al. 2017, Algorithm 1: w <- sum_k n_k/n_sigma w_k over arrivals.
    The learning-rate decay runs on the clients, per local iteration (Keras)."""

    name = "fedavg"
    label = "FedAvg"

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(TRAIN, self.round_lr(round_), lr_decay=self.lr_decay)
        return None if replies is None else _average(replies)


@register
class FedSGD(Strategy):
    """w <- w - eta * sum_k n_k/n_sigma g_k, each g_k a full local-batch gradient.
    One global SGD step per round, so Keras' decay counts rounds."""

    name = "fedsgd"
    label = "FedSGD"
    uploads = "gradients (one full-batch gradient per round)"

    def learning_rate(self, round_: int) -> float:
        return self.round_lr(round_) / (1.0 + self.lr_decay * (round_ - 1))

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(GRADIENT, 0.0)
        if replies is None:
            return None
        return (weights - self.learning_rate(round_) * _average(replies)).astype(np.float32)


@register
class FSVRG(Strategy):
    """Nilsson et al. 2018, Algorithm 2: every client uploads its full local gradient at
    w_t; the server forms grad f(w_t) = sum n_k/n g_k and sends it back; each client
    runs one SVRG pass with h_k = h / n_k; the server averages the models by n_k / n.
    Two uploads per client per round."""

    name = "fsvrg"
    label = "FSVRG"
    selects_all = True
    uploads = "a full gradient and then an SVRG-trained model per round"
    options = {"h": Key(float, "FSVRG stepsize h (clients use h / n_k)", check=positive, rule="> 0", default=4.0)}

    def __init__(self, lr: float, lr_decay: float = 0.0, h: float = 4.0) -> None:
        super().__init__(lr, lr_decay)
        self.h = h

    def run_round(self, run_phase, weights, round_):
        gradients = run_phase(GRADIENT, 0.0)
        if gradients is None:
            return None
        replies = run_phase(SVRG, self.h, full_gradient=_average(gradients))
        return None if replies is None else _average(replies)


@register
class Centralised(FedAvg):
    """The centralised baseline of Nilsson et al.'s Table 1: one client holds all the
    training data (data.clients = 1, partition "iid"; check_config refuses anything
    else), so a round is E epochs of B-minibatch SGD over it, with Keras' decay running
    on, and the average of its one update is the update itself."""

    name = "centralised"
    label = "Centr."
    title = "the centralised baseline"
    selects_all = True
    uploads = "one model trained on all the data (the baseline without federation)"

    @classmethod
    def check_config(cls, config):
        data = config["data"]
        if data["clients"] != 1 or data["partition"] != "iid":
            return (f"algorithm.name = 'centralised' trains one model on all the training data: it needs "
                    f"data.clients = 1 and data.partition = 'iid' (got {data['clients']} clients, partition "
                    f"{data['partition']!r}); examples/centralised-nilsson.toml sets both")
        return None
