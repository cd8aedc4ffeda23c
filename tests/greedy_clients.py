"""A plug-in algorithm whose clients cannot allocate what their local task asks for:
4 EiB, more than any host has, so every client it asks crashes with a real MemoryError
from numpy, as a client that runs out of memory does (tests/test_faults.py). Named
``tests.greedy_clients:GreedyFedAvg``; the nodes import it from the repository root."""
from __future__ import annotations

import numpy as np

from fedemu.common.algorithms.fedavg import FedAvg
from fedemu.common.algorithms.tasks import LocalTask, TaskOutput


class GreedyTrain(LocalTask):
    name = "greedy-train"

    def run(self, task) -> TaskOutput:
        np.ones(2**62, dtype=np.uint8)  # MemoryError: Unable to allocate 4.00 EiB
        raise AssertionError("a host allocated 4 EiB")


class GreedyFedAvg(FedAvg):
    name = "greedy-fedavg"
    label = "FedAvg whose clients ask for 4 EiB"

    def run_round(self, run_phase, weights, round_):
        replies = run_phase(GreedyTrain, self.round_lr(round_), lr_decay=self.lr_decay)
        return None if replies is None else weights
