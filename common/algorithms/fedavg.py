"""FedAvg (McMahan et al. 2017, Algorithm 1), both halves: the server's weighted mean of
the clients' models and the clients' ClientUpdate (``Train``: E epochs of B-minibatch SGD).
FedProx, FedAdam, FedYogi and the centralised baseline reuse the client's half."""
from __future__ import annotations

from typing import Callable

import numpy as np

from fedemu.common.messages import TRAIN
from fedemu.common.ml import cohort, training
from fedemu.common.ml.compression import update_seed
from fedemu.common.ml.structured import compressed_client_update

from . import tasks
from .base import register
from .rounds import Strategy, average
from .tasks import LocalTask, TaskInput, TaskOutput, codec_for


@register
class FedAvg(Strategy):
    """McMahan et al. 2017, Algorithm 1: w <- sum_k n_k/n_sigma w_k over arrivals.
    The learning-rate decay runs on the clients, per local iteration (Keras)."""

    name = "fedavg"
    label = "FedAvg"
    keeps_updates = False

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(TRAIN, self.round_lr(round_), lr_decay=self.lr_decay)
        return None if replies is None else average(replies)


@tasks.register
class Train(LocalTask):
    """FedAvg's ClientUpdate (McMahan et al., Algorithm 1): E epochs of B-minibatch SGD;
    the update compressed when the request names a [compression] spec. An algorithm
    that trains so with a correction of its own (FedProx's proximal term) subclasses it
    and gives the correction twice: per client (``after_backward``) and batched for a
    cohort (``gradient_term``, fed by each member's ``member_extra``)."""

    name = TRAIN
    encodes_update = True

    def after_backward(self, task: TaskInput) -> Callable[[], None] | None:
        """An edit of each minibatch's gradients before its step, made for this client
        and this request; None: plain SGD."""
        return None

    def gradient_term(self, tasks: list[TaskInput]) -> cohort.GradientTerm | None:
        """``after_backward``'s batched twin for a cohort of these tasks (None: none)."""
        return None

    def member_extra(self, task: TaskInput) -> dict:
        """What ``gradient_term`` reads of this client (``cohort.Member.extra``)."""
        return {}

    def run(self, task):
        r = task.request
        hook = self.after_backward(task)
        if r.compression:
            result = compressed_client_update(
                task.model, task.x, task.y, codec=codec_for(task.model_spec, r.compression, task.model),
                seed=update_seed(r.seed, r.round, task.client), epochs=r.epochs, batch_size=r.batch_size,
                lr=r.lr, generator=task.generator, lr_decay=r.lr_decay, start_iteration=task.iterations,
                dataset=task.dataset, after_backward=hook)
            return TaskOutput(None, result.train_loss, result.steps, encoded=result.encoded)
        result = training.client_update(
            task.model, task.x, task.y, epochs=r.epochs, batch_size=r.batch_size, lr=r.lr,
            generator=task.generator, lr_decay=r.lr_decay, start_iteration=task.iterations,
            dataset=task.dataset, after_backward=hook)
        return TaskOutput(result.weights, result.train_loss, result.steps)

    @classmethod
    def cohort_problem(cls, request, model, dataset):
        if request.compression and request.compression.get("structured", "none") != "none":
            return "a structured update trains each client in a restricted space of its own"
        return cohort.problem(model, dataset)

    def run_cohort(self, tasks, stops):
        members = [cohort.Member(x=t.x, y=t.y, start=t.request.weights, generator=t.generator, stop=stop,
                                 epochs=t.request.epochs, batch_size=t.request.batch_size, lr=t.request.lr,
                                 lr_decay=t.request.lr_decay, start_iteration=t.iterations,
                                 extra=self.member_extra(t))
                   for t, stop in zip(tasks, stops)]
        outputs = []
        trained = cohort.train(tasks[0].model, members, tasks[0].dataset, term=self.gradient_term(tasks))
        for t, result in zip(tasks, trained):
            r = t.request
            if result is None:
                outputs.append(None)
            elif r.compression:  # sketched: encoded after training, as compressed_client_update does
                codec = codec_for(t.model_spec, r.compression, t.model)
                delta = result.weights - np.asarray(r.weights, dtype=np.float32)
                encoded = codec.encode(delta, update_seed(r.seed, r.round, t.client))
                outputs.append(TaskOutput(None, result.train_loss, result.steps, encoded=encoded))
            else:
                outputs.append(TaskOutput(result.weights, result.train_loss, result.steps))
        return outputs
