"""FSVRG (Konečný et al. 2016; Nilsson et al. 2018, Algorithm 2), both halves: a round of
two phases, full gradients (FedSGD's ``Gradient`` task) and then one SVRG pass per
client (``Svrg``), whose models the server averages."""
from __future__ import annotations

from fedemu.common.messages import GRADIENT, SVRG
from fedemu.common.ml import cohort, models, training
from fedemu.node.schema import Key, interval

from . import tasks
from .base import register
from .rounds import Strategy, average
from .tasks import LocalTask, TaskOutput


@register
class FSVRG(Strategy):
    """Nilsson et al. 2018, Algorithm 2: every client uploads its full local gradient at
    w_t; the server forms grad f(w_t) = sum n_k/n g_k and sends it back; each client
    runs one SVRG pass with h_k = h / n_k; the server averages the models by n_k / n.
    Two uploads per client per round."""

    name = "fsvrg"
    label = "FSVRG"
    keeps_updates = False
    selects_all = True
    uploads = "a full gradient and then an SVRG-trained model per round"
    options = {"h": Key(float, "FSVRG stepsize h (clients use h / n_k)", **interval("(0, 1e6]"), default=4.0)}

    def __init__(self, lr: float, lr_decay: float = 0.0, h: float = 4.0) -> None:
        super().__init__(lr, lr_decay)
        self.h = h

    def run_round(self, run_phase, weights, round_):
        gradients = run_phase(GRADIENT, 0.0)
        if gradients is None:
            return None
        replies = run_phase(SVRG, self.h, full_gradient=average(gradients))
        return None if replies is None else average(replies)


@tasks.register
class Svrg(LocalTask):
    """FSVRG's second phase (Nilsson et al., Algorithm 2): one variance-reduced pass with
    stepsize h / n_k; each step takes two gradients, at the current weights and at w_t."""

    name = SVRG
    passes = 2.0
    per_epoch = False
    needs_anchor = True

    def run(self, task):
        r = task.request
        models.set_flat(task.anchor, r.weights)
        result = training.svrg_pass(task.model, task.x, task.y, anchor=task.anchor, full_gradient=r.full_gradient,
                                    stepsize=r.lr, generator=task.generator, dataset=task.dataset)
        return TaskOutput(result.weights, result.train_loss)

    @classmethod
    def cohort_problem(cls, request, model, dataset):
        return cohort.svrg_problem(model, dataset)

    def run_cohort(self, tasks, stops):
        members = [cohort.Member(x=t.x, y=t.y, start=t.request.weights, generator=t.generator, stop=stop,
                                 full_gradient=t.request.full_gradient, stepsize=t.request.lr)
                   for t, stop in zip(tasks, stops)]
        return [None if result is None else TaskOutput(result.weights, result.train_loss)
                for result in cohort.svrg(tasks[0].model, members, tasks[0].dataset)]
