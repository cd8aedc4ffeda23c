"""A what-if for Nilsson et al.'s Table 1 (docs/results.md): FSVRG with the full gradient
computed the way their cross-validation runs computed it, to test whether that explains
fedemu's FSVRG ending below theirs on IID data.

In their code the full gradient of Algorithm 2 did not come from the clients' training
folds: their verifier (`src/verifier.py`, `typ == 'fsvrg'`) computed it centrally over
`data/mnist/car*` (`lib/read_data.read_mnist_car_data`), MNIST's original 60,000
training images split over 100 cars, whatever the fold: about 12,000 of those images
sit in a held-out fold of their 5-fold split of all 70,000, and about 8,000 training
images of the fold (MNIST's original test images) are not in it.

This plug-in changes that one thing: the gradient phase still runs (same uploads, same
emulated time), but the gradient sent to the SVRG phase is the mean gradient of the
cross-entropy over MNIST's original 60,000 training images at w_t, as their verifier's
Keras ``get_gradients`` gave it (sample weights 1, the 2NN has no dropout).

    PYTHONPATH=bench/whatif fedemu launch examples/fsvrg-noniid-nilsson.toml \\
        --set algorithm.name=nilsson_fsvrg:FSVRGTheirFullGradient \\
        --set data.partition=iid --set data.folds=5 --set data.fold=0 --set run.seed=1 \\
        --set data.shard_order=pixels --workers 2

``--set algorithm.gradient_over=their-cars-in-training`` separates the two differences
(held-out images in the gradient, the fold's other training images missing from it): the
gradient is then the mean over those of MNIST's original training images that are in the
run's training folds (about 48,000; the held-out fold's left out). The plug-in cuts the
folds itself, from ``algorithm.held_out_seed``, ``held_out_fold`` and ``held_out_partition``,
which the launcher checks against ``run.seed``, ``data.fold`` and ``data.partition``.

Not a fedemu option: it reproduces a leak of the held-out fold into training, which a
user's run should not have.
"""
from __future__ import annotations

import numpy as np
import torch

from fedemu.node.schema import Key
from fedemu.common.algorithms.fsvrg import FSVRG
from fedemu.common.ml import data, kfold, models, training
from fedemu.common.messages import GRADIENT, SVRG

GRADIENT_SETS = ("their-cars", "their-cars-in-training")
# The data settings of examples/fsvrg-*-nilsson.toml the plug-in cuts its folds with.
NILSSON_DATA = {"dataset": "mnist", "folds": 5, "clients": 100, "shards_per_client": 2, "shard_order": "pixels"}


class FSVRGTheirFullGradient(FSVRG):
    name = "fsvrg-their-full-gradient"
    label = "FSVRG (their full gradient)"

    options = {
        **FSVRG.options,
        "gradient_over": Key(str, "the images of the full gradient: MNIST's original training set, or its "
                                  "images in the run's training folds", choices=GRADIENT_SETS,
                             default="their-cars"),
        "held_out_seed": Key(int, "run.seed (the plug-in cuts the folds itself)", default=1),
        "held_out_fold": Key(int, "data.fold", default=0),
        "held_out_partition": Key(str, "data.partition", choices=("iid", "shards"), default="iid"),
    }

    def __init__(self, lr: float, lr_decay: float = 0.0, h: float = 4.0, gradient_over: str = "their-cars",
                 held_out_seed: int = 1, held_out_fold: int = 0, held_out_partition: str = "iid") -> None:
        super().__init__(lr, lr_decay, h)
        self._mnist = data.load("mnist")  # the original 60,000 / 10,000 split, not the run's folds
        self._model = models.ModelSpec("2nn", self._mnist.dataset).build()
        self._x, self._y = self._mnist.train_x, self._mnist.train_y
        if gradient_over == "their-cars-in-training":
            kept = self._original_training_images_in_training_folds(held_out_seed, held_out_fold, held_out_partition)
            self._x, self._y = self._x[kept], self._y[kept]

    def _original_training_images_in_training_folds(self, seed: int, fold: int, partition: str) -> np.ndarray:
        """Indices into MNIST's original training set of its images not in the held-out fold
        (split.split's pooled order: the 60,000 training images first)."""
        pooled_x = np.concatenate([self._mnist.train_x, self._mnist.test_x])
        pooled_y = np.concatenate([self._mnist.train_y, self._mnist.test_y])
        folds = kfold.make(partition, pooled_y, NILSSON_DATA["folds"], NILSSON_DATA["clients"], seed,
                           NILSSON_DATA["shards_per_client"], images=pooled_x, order=NILSSON_DATA["shard_order"])
        original = len(self._mnist.train_y)
        held_out = folds.test(fold)
        return np.setdiff1d(np.arange(original), held_out[held_out < original])

    @classmethod
    def check_config(cls, config):
        algorithm, data_section = config["algorithm"], config["data"]
        if algorithm.get("gradient_over", "their-cars") != "their-cars-in-training":
            return None
        wanted = {"run.seed": (algorithm["held_out_seed"], config["run"]["seed"]),
                  "data.fold": (algorithm["held_out_fold"], data_section["fold"]),
                  "data.partition": (algorithm["held_out_partition"], data_section["partition"])}
        wanted.update({f"data.{key}": (value, data_section[key]) for key, value in NILSSON_DATA.items()})
        wrong = [f"{key} = {run!r} (the plug-in's {mine!r})" for key, (mine, run) in wanted.items() if mine != run]
        if wrong:
            return ("gradient_over = 'their-cars-in-training' cuts the folds as the run does; set "
                    "algorithm.held_out_seed / held_out_fold / held_out_partition to match: " + "; ".join(wrong))
        return None

    def full_gradient(self, weights: np.ndarray) -> np.ndarray:
        models.set_flat(self._model, weights)
        with torch.enable_grad():
            gradient, _ = training.local_gradient(self._model, self._x, self._y, self._mnist.dataset)
        return gradient.astype(np.float32)

    def run_round(self, run_phase, weights, round_):
        if run_phase(GRADIENT, 0.0) is None:  # kept: the same uploads and emulated time as FSVRG's
            return None
        replies = run_phase(SVRG, self.h, extra={"full_gradient": self.full_gradient(weights)})
        return None if replies is None else replies.mean()
