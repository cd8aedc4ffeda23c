"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", Algorithm 1 with option II), as a fedemu plug-in: an algorithm that
needs its own local work, so it brings a local task beside its strategy.

Each client keeps a control variate c_i (zero until it first trains) and corrects every
local SGD step by c - c_i, where c is the server's control variate:
y <- y - eta_l (g_i(y) - c_i + c). After K steps it sets c_i+ = c_i - c + (x - y) / (K eta_l)
(with Keras' decay, K eta_l is the sum of the steps' rates) and returns y and
delta_c = c_i+ - c_i. The server sets x <- x + eta_g (mean y - x), the mean weighted by n_k
as FedAvg's (the paper's plain mean when the shares are equal), and
c <- c + (1 / N) sum delta_c over the round's clients, N the population.

With c = c_i = 0, as in round 1, a round is FedAvg's round. c_i lives in the client's
process (``TaskInput.state``): a client restarted after a crash starts again from zero.
"""
from __future__ import annotations

import numpy as np

from fedemu.common.algorithms import LocalTask, Strategy, TaskOutput
from fedemu.common.ml import models, training
from fedemu.node.schema import MAX_LEARNING_RATE, Key, interval


class ScaffoldTrain(LocalTask):
    """E epochs of B-minibatch SGD with SCAFFOLD's correction; the server's c arrives in
    ``request.extra["c"]``."""

    name = "scaffold-train"

    def run(self, task):
        r = task.request
        c = np.asarray(r.extra["c"], dtype=np.float32)
        c_i = task.state.get("c_i")
        if c_i is None:
            c_i = np.zeros_like(c)
        x = r.weights
        params = models.parameters_of(task.model)
        correction = models.split_flat(task.model, c - c_i)

        def correct() -> None:
            for p, v in zip(params, correction):
                p.grad.add_(v)

        result = training.client_update(
            task.model, task.x, task.y, epochs=r.epochs, batch_size=r.batch_size, lr=r.lr, generator=task.generator,
            lr_decay=r.lr_decay, start_iteration=task.iterations, dataset=task.dataset, after_backward=correct)
        rates = r.lr / (1.0 + r.lr_decay * (task.iterations + np.arange(result.steps, dtype=np.float64)))
        new_c_i = (c_i - c + (x - result.weights) / rates.sum()).astype(np.float32)
        task.state["c_i"] = new_c_i
        return TaskOutput(result.weights, result.train_loss, result.steps, extra={"delta_c": new_c_i - c_i})


class Scaffold(Strategy):
    name = "scaffold"
    label = "SCAFFOLD"
    uploads = "a model and a control-variate delta per round (twice FedAvg's bytes)"
    keeps_updates = False  # the mean of the models is all it needs of them (aggregation on the nodes works)
    options = {"eta_g": Key(float, "SCAFFOLD: the server's step size on the mean model change",
                            **interval(f"(0, {MAX_LEARNING_RATE:g}]"), default=1.0)}

    def __init__(self, lr: float, lr_decay: float = 0.0, eta_g: float = 1.0) -> None:
        super().__init__(lr, lr_decay)
        self.eta_g = eta_g
        self.c: np.ndarray | None = None

    def run_round(self, run_phase, weights, round_):
        if self.c is None:
            self.c = np.zeros_like(weights)
        replies = run_phase(ScaffoldTrain, self.round_lr(round_), lr_decay=self.lr_decay, extra={"c": self.c})
        if replies is None:
            return None
        delta_c = np.sum([r.extra["delta_c"] for r in replies], axis=0, dtype=np.float64)
        self.c = (self.c + delta_c / self.population).astype(np.float32)
        mean = replies.mean()
        if self.eta_g == 1.0:  # exactly FedAvg's average, not x + (mean - x) rounded
            return mean
        return (weights + self.eta_g * (mean - weights)).astype(np.float32)
