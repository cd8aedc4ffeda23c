"""FedAdam and FedYogi: adaptive server optimisers (Reddi et al. 2021, "Adaptive
Federated Optimization", Algorithm 2).

Clients train as in FedAvg (E epochs of B-minibatch SGD at the client rate ``lr``, their
eta_l). The server treats the average change Delta_t = sum_k n_k/n (w_k - w_t) as a
pseudo-gradient (weighted by n_k as FedAvg averages, so a server SGD step of 1 would be
FedAvg) and moves the model with Adam's or Yogi's moments:

    m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2                               (Adam)
    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)           (Yogi)
    w_{t+1} = w_t + eta m_t / (sqrt(v_t) + tau)

with m_{-1} = 0 and v_{-1} = tau^2 (the paper asks v_{-1} >= tau^2), and, as in the
paper, no bias correction. A round that cannot aggregate leaves the moments as they are.
"""
from __future__ import annotations

import numpy as np

from fedemu.common.messages import TRAIN
from fedemu.node.schema import MAX_LEARNING_RATE, Key, interval

from .base import register
from .rounds import Strategy, average


def _beta(x) -> bool:
    return 0 <= x < 1


OPTIONS = {
    "eta": Key(float, "FedAdam/FedYogi: the server's learning rate eta (the clients' is lr, the paper's eta_l)",
               **interval(f"(0, {MAX_LEARNING_RATE:g}]"), default=0.01),
    "beta1": Key(float, "FedAdam/FedYogi: decay of the first moment", check=_beta, rule="in [0, 1)", default=0.9),
    "beta2": Key(float, "FedAdam/FedYogi: decay of the second moment", check=_beta, rule="in [0, 1)",
                 default=0.99),
    "tau": Key(float, "FedAdam/FedYogi: adaptivity tau, added to sqrt(v); v starts at tau^2",
               **interval("(0, 1000]"), default=1e-3),
}


class FedOpt(Strategy):
    options = OPTIONS
    keeps_updates = False

    def __init__(self, lr: float, lr_decay: float = 0.0, eta: float = 0.01, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3) -> None:
        super().__init__(lr, lr_decay)
        self.eta, self.beta1, self.beta2, self.tau = eta, beta1, beta2, tau
        self.m: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def second_moment(self, v: np.ndarray, delta_squared: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(TRAIN, self.round_lr(round_), lr_decay=self.lr_decay)
        if replies is None:
            return None
        w = weights.astype(np.float64)
        delta = average(replies).astype(np.float64) - w
        if self.m is None:
            self.m = np.zeros_like(w)
            self.v = np.full_like(w, self.tau ** 2)
        self.m = self.beta1 * self.m + (1 - self.beta1) * delta
        self.v = self.second_moment(self.v, delta * delta)
        return (w + self.eta * self.m / (np.sqrt(self.v) + self.tau)).astype(np.float32)


@register
class FedAdam(FedOpt):
    name = "fedadam"
    label = "FedAdam"

    def second_moment(self, v, delta_squared):
        return self.beta2 * v + (1 - self.beta2) * delta_squared


@register
class FedYogi(FedOpt):
    name = "fedyogi"
    label = "FedYogi"

    def second_moment(self, v, delta_squared):
        # Yogi's v changes by at most (1 - beta2) Delta^2 and moves toward Delta^2: it
        # grows no faster than Adam's and shrinks only as far as the update says.
        return v - (1 - self.beta2) * delta_squared * np.sign(v - delta_squared)
