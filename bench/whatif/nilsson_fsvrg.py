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

Not a fedemu option: it reproduces a leak of the held-out fold into training, which a
user's run should not have.
"""
from __future__ import annotations

import numpy as np
import torch

from fedemu.server.strategies import FSVRG
from fedemu.worker.ml import data, models, training
from fedemu.worker.protocol import GRADIENT, SVRG


class FSVRGTheirFullGradient(FSVRG):
    name = "fsvrg-their-full-gradient"
    label = "FSVRG (their full gradient)"

    def __init__(self, lr: float, lr_decay: float = 0.0, h: float = 4.0) -> None:
        super().__init__(lr, lr_decay, h)
        self._mnist = data.load("mnist")  # the original 60,000 / 10,000 split, not the run's folds
        self._model = models.ModelSpec("2nn", self._mnist.dataset).build()

    def full_gradient(self, weights: np.ndarray) -> np.ndarray:
        models.set_flat(self._model, weights)
        with torch.enable_grad():
            gradient, _ = training.local_gradient(self._model, self._mnist.train_x, self._mnist.train_y,
                                                  self._mnist.dataset)
        return gradient.astype(np.float32)

    def run_round(self, run_phase, weights, round_):
        if run_phase(GRADIENT, 0.0) is None:  # kept: the same uploads and emulated time as FSVRG's
            return None
        replies = run_phase(SVRG, self.h, full_gradient=self.full_gradient(weights))
        return None if replies is None else replies.mean()
