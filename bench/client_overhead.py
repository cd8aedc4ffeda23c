"""CPU time of one client task of one example (the cross-device case of bench/scale.py):
load the round's weights into the model, one SGD step, the weights out; and of adding
its update to a worker node's exact sum (aggregation on the nodes). Prints the min and
median over 7 repeats of 1,000 tasks (and 1,000 additions) on one thread.

    python bench/client_overhead.py [LABEL]

Run it alternately from two checkouts to compare them (the label says which is which).
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from fedemu.launch.running.lifecycle import retain_freed_memory
from fedemu.common.ml import models, training
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.exact_sum import ExactSum

TASKS, REPEATS, WARM_UP = 1000, 7, 200


def main() -> None:
    torch.set_num_threads(1)  # as in virtual time
    retain_freed_memory()  # as a node does: otherwise fresh pages for every update dominate
    mnist = dataset_named("mnist")
    model = models.ModelSpec("2nn", mnist).build(seed=0)
    weights = models.get_flat(model)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (1, 28, 28), dtype=np.uint8), np.array([3], dtype=np.uint8)

    def task() -> None:
        models.set_flat(model, weights)
        training.client_update(model, x, y, epochs=1, batch_size=10, lr=0.1,
                               generator=torch.Generator().manual_seed(1), dataset=mnist)

    label = sys.argv[1] if len(sys.argv) > 1 else ""
    task_ms = per_call_ms(task)
    print(f"{label} CPU ms per one-example task: min {min(task_ms):.3f}, "
          f"median {statistics.median(task_ms):.3f}".strip())
    exact = ExactSum()
    sum_ms = per_call_ms(lambda: exact.add(weights, 1))
    print(f"{label} CPU ms per exact-sum addition: min {min(sum_ms):.3f}, "
          f"median {statistics.median(sum_ms):.3f}".strip())


def per_call_ms(call) -> list[float]:
    for _ in range(WARM_UP):
        call()
    per_call = []
    for _ in range(REPEATS):
        started = time.thread_time()
        for _ in range(TASKS):
            call()
        per_call.append((time.thread_time() - started) / TASKS * 1e3)
    return per_call


if __name__ == "__main__":
    main()
