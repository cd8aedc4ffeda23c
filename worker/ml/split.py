"""A run's data and each client's share of it, in one place for every node.

:class:`DataSpec` is the ``[data]`` section (with ``run.seed``) as one typed value, built
once from the validated config (``launch.config.data_spec``). :func:`run_data` loads the
data set and cuts it the same way on every node: without k-fold, the training set is
partitioned over the clients (``partition``); with ``data.folds = k``, the pooled set is
cut into k folds and one is held out as the test set (``kfold``, Nilsson et al.'s
cross-validation, seeded by ``run.seed``: each seed is one repetition).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from . import data, kfold, partition


@dataclass(frozen=True)
class DataSpec:
    dataset: str
    partition: str
    clients: int
    seed: int
    shards_per_client: int = 2
    shard_order: str = "stable"
    folds: int = 0
    fold: int = 0
    cache_dir: str | os.PathLike | None = None


def run_data(spec: DataSpec, progress=print) -> tuple[data.Data, list[np.ndarray]]:
    """(the run's data, each client's indices into its training arrays). With k-fold the
    data's training arrays are the pooled set (train + test) and its test arrays the
    held-out fold ``spec.fold``."""
    return split(spec, data.load(spec.dataset, spec.cache_dir, progress))


def split(spec: DataSpec, data_set: data.Data) -> tuple[data.Data, list[np.ndarray]]:
    """:func:`run_data` on a data set already loaded."""
    if not spec.folds:
        opts = ({"shards_per_client": spec.shards_per_client, "images": data_set.train_x, "order": spec.shard_order}
                if spec.partition == "shards" else {})
        return data_set, partition.make(spec.partition, data_set.train_y, spec.clients, spec.seed, **opts)
    x = np.concatenate([data_set.train_x, data_set.test_x])
    y = np.concatenate([data_set.train_y, data_set.test_y])
    folds = kfold.make(spec.partition, y, spec.folds, spec.clients, spec.seed, spec.shards_per_client,
                       images=x, order=spec.shard_order)
    test = folds.test(spec.fold)
    view = data.Data(name=f"{data_set.name} fold {spec.fold} of {spec.folds}", dataset=data_set.dataset,
                     train_x=x, train_y=y, test_x=x[test], test_y=y[test])
    return view, folds.train(spec.fold)
