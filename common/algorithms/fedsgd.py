"""FedSGD (McMahan et al. 2017's baseline), both halves: each client's full local-batch
gradient (``Gradient``, which FSVRG's first phase asks for too) and the server's one
global SGD step with their weighted mean."""
from __future__ import annotations

import numpy as np

from fedemu.common.messages import GRADIENT
from fedemu.common.ml import cohort, training

from . import tasks
from .base import register
from .rounds import Strategy, average
from .tasks import LocalTask, TaskOutput


@register
class FedSGD(Strategy):
    """w <- w - eta * sum_k n_k/n_sigma g_k, each g_k a full local-batch gradient.
    One global SGD step per round, so Keras' decay counts rounds."""

    name = "fedsgd"
    label = "FedSGD"
    keeps_updates = False
    uploads = "gradients (one full-batch gradient per round)"

    def learning_rate(self, round_: int) -> float:
        return self.round_lr(round_) / (1.0 + self.lr_decay * (round_ - 1))

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(GRADIENT, 0.0)
        if replies is None:
            return None
        return (weights - self.learning_rate(round_) * average(replies)).astype(np.float32)


@tasks.register
class Gradient(LocalTask):
    """FedSGD's and FSVRG's first phase: the full local gradient at the sent weights."""

    name = GRADIENT
    per_epoch = False

    def run(self, task):
        gradient, loss = training.local_gradient(task.model, task.x, task.y, task.dataset)
        return TaskOutput(gradient, loss)

    @classmethod
    def cohort_problem(cls, request, model, dataset):
        return cohort.problem(model, dataset)

    def run_cohort(self, tasks, stops):
        members = [cohort.Member(x=t.x, y=t.y, start=t.request.weights, stop=stop) for t, stop in zip(tasks, stops)]
        return [None if result is None else TaskOutput(*result)
                for result in cohort.gradients(tasks[0].model, members, tasks[0].dataset)]
