"""Coordinate-wise trimmed mean (Yin et al. 2018, "Byzantine-Robust Distributed Learning"),
as a fedemu plug-in: one class, registered by fedemu when ``algorithm.name`` names it.

Clients train as in FedAvg; the server sorts the m returned models coordinate by
coordinate, drops the floor(trim * m) largest and smallest values of each, and averages
the rest (unweighted). trim = 0 is the plain mean.
"""
from __future__ import annotations

import math

import numpy as np

from fedemu.common.algorithms import Strategy
from fedemu.common.messages import TRAIN
from fedemu.node.schema import Key


class TrimmedMean(Strategy):
    name = "trimmedmean"
    label = "Trimmed mean"
    options = {
        "trim": Key(float, "trimmed mean: fraction of the largest and of the smallest values dropped per "
                    "coordinate", check=lambda x: 0 <= x < 0.5, rule="in [0, 0.5)", default=0.1),
    }

    def __init__(self, lr: float, lr_decay: float = 0.0, trim: float = 0.1) -> None:
        super().__init__(lr, lr_decay)
        self.trim = trim

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(TRAIN, self.lr, lr_decay=self.lr_decay)
        if replies is None:
            return None
        models = np.sort(np.stack([r.update for r in replies]), axis=0)
        cut = math.floor(self.trim * len(replies))
        return models[cut : len(replies) - cut].mean(axis=0, dtype=np.float64).astype(np.float32)
