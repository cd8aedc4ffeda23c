"""FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", Algorithm 2).

Each selected client minimises h_k(w; w_t) = F_k(w) + mu/2 ||w - w_t||^2 from the global
model w_t, by FedAvg's E epochs of B-minibatch SGD (the proximal term adds mu (w - w_t)
to every gradient); the server averages the models by n_k / n as FedAvg does (their
code's ``aggregate`` weights by sample counts). mu = 0 is FedAvg exactly. Li et al. chose
mu per data set from {0.001, 0.01, 0.1, 1}. What fedemu does not emulate: their
"partial work", where a straggler returns fewer epochs' worth instead of being dropped;
here a straggler is one that misses the round's deadline.
"""
from __future__ import annotations

from fedemu.common.messages import TRAIN
from fedemu.node.schema import Key, interval

from .base import register
from .fedavg import FedAvg
from .rounds import average


@register
class FedProx(FedAvg):
    name = "fedprox"
    label = "FedProx"
    options = {"mu": Key(float, "FedProx: weight mu of the proximal term mu/2 ||w - w_t||^2 in each client's "
                         "objective (0: FedAvg)", **interval("[0, 1e6]"), default=0.01)}

    def __init__(self, lr: float, lr_decay: float = 0.0, mu: float = 0.01) -> None:
        super().__init__(lr, lr_decay)
        self.mu = mu

    @classmethod
    def check_config(cls, config):
        structured = config.get("compression", {}).get("structured", "none")
        if structured != "none":
            return (f"algorithm.name = 'fedprox' with compression.structured = {structured!r}: a structured "
                    f"update trains a restricted set of parameters, to which fedemu does not apply the proximal "
                    f"term; use sketched compression (subsample, rotate, bits) or none")
        return None

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(TRAIN, self.round_lr(round_), lr_decay=self.lr_decay, prox_mu=self.mu)
        return None if replies is None else average(replies)
