"""A data set from outside fedemu: four Gaussian blobs in 20 dimensions, made on the spot
(nothing to download), so the plug-in runs on any machine. Named
``fedemu_example_plugin.datasets:Blobs``, or ``blobs`` once the package is installed (its
entry point in the ``fedemu.datasets`` group).

What a data set declares is its shape, its classes and its sources; fedemu's cache
fetches, verifies and memory-maps the arrays, partitions them over clients and turns
batches into tensors with ``inputs``.
"""
from __future__ import annotations

import numpy as np

from fedemu.common.ml.datasets import Dataset, DatasetError, register

FEATURES, CLASSES = 20, 4
TRAIN, TEST = 2_000, 500
# The data set's definition, not a run's random decision: every host makes the same arrays.
GENERATOR_SEED = 20181030


def make_blobs(progress) -> tuple[dict[str, np.ndarray], dict]:
    rng = np.random.default_rng(GENERATOR_SEED)
    centres = rng.normal(0.0, 1.0, (CLASSES, FEATURES)).astype(np.float32)
    arrays = {}
    for split, n in (("train", TRAIN), ("test", TEST)):
        labels = np.arange(n) % CLASSES
        rng.shuffle(labels)
        arrays[f"{split}_x"] = (centres[labels] + rng.normal(0.0, 1.0, (n, FEATURES))).astype(np.float32)
        arrays[f"{split}_y"] = labels.astype(np.uint8)
    progress(f"  made {TRAIN} + {TEST} examples")
    return arrays, {"source": f"generated: {CLASSES} unit Gaussians around N(0, 1) centres, seed {GENERATOR_SEED}"}


@register
class Blobs(Dataset):
    name = "blobs"
    title = "Gaussian blobs"
    input_shape = (FEATURES,)
    num_classes = CLASSES
    sizes = {"train": TRAIN, "test": TEST}

    def sources(self):
        return [("generator", make_blobs)]

    def check(self, arrays, origin, sizes=True):
        super().check(arrays, origin, sizes)
        for split in ("train", "test"):
            if arrays[f"{split}_x"].shape[1:] != self.input_shape:
                raise DatasetError(f"{origin}: {split}_x holds {arrays[f'{split}_x'].shape[1:]}, not {self.input_shape}")

    def inputs(self, x, train=False):
        import torch

        return torch.from_numpy(np.array(x, dtype=np.float32))  # a copy: x may be a read-only memory map
