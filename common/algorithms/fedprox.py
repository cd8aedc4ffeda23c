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

from typing import Callable

import torch

from fedemu.common.ml import cohort
from fedemu.common.ml.models import parameters_of
from fedemu.node.schema import Key, interval

from . import tasks
from .base import register
from .fedavg import FedAvg, Train
from .rounds import average
from .tasks import TaskInput


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
        replies = run_phase(Proximal, self.round_lr(round_), lr_decay=self.lr_decay, extra={"mu": self.mu})
        return None if replies is None else average(replies)


@tasks.register
class Proximal(Train):
    """FedProx's client: FedAvg's E epochs of B-minibatch SGD on h_k(w; w_t), i.e. with
    mu (w - w_t) added to every minibatch gradient (the reported loss is the data term
    alone). mu comes in the request's ``extra``; mu = 0 trains exactly as FedAvg's."""

    name = "fedprox"

    def after_backward(self, task):
        mu = task.request.extra["mu"]
        return proximal_term(parameters_of(task.model), mu) if mu else None

    def gradient_term(self, tasks):
        return ProximalTerm() if any(t.request.extra["mu"] for t in tasks) else None

    def member_extra(self, task):
        return {"mu": task.request.extra["mu"]}


def proximal_term(params: list[torch.Tensor], mu: float) -> Callable[[], None]:
    """A gradient hook that adds mu (w - w_start) to each gradient, w_start being the
    weights when it was made: the gradient of mu/2 ||w - w_start||^2."""
    start = [p.detach().clone() for p in params]

    def add() -> None:
        for p, p0 in zip(params, start):
            p.grad.add_(p.detach() - p0, alpha=mu)

    return add


class ProximalTerm(cohort.GradientTerm):
    """``proximal_term`` for a cohort: mu_k (w_k - w_t) joins each member's gradient."""

    def add(self, grad, weights, starts, members):
        mus = [m.extra["mu"] for m in members]
        if any(mus):
            cohort.each(grad, weights - starts, mus, lambda g, d, mu: g.add_(d, alpha=mu))

