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
    dirichlet_alpha: float = 0.5
    lognormal_sigma: float = 1.0
    examples_per_client: int = 1
    folds: int = 0
    fold: int = 0
    cache_dir: str | os.PathLike | None = None


def run_data(spec: DataSpec, progress=print, shares: bool = True) -> tuple[data.Data, list[np.ndarray] | None]:
    """(the run's data, each client's indices into its training arrays). With k-fold the
    data's training arrays are the pooled set (train + test) and its test arrays the
    held-out fold ``spec.fold``. ``shares=False``: the data alone (the server, which
    trains no client, need not cut the partition; the shares are then None without k-fold)."""
    return split(spec, data.load(spec.dataset, spec.cache_dir, progress), shares)


def split(spec: DataSpec, data_set: data.Data, shares: bool = True) -> tuple[data.Data, list[np.ndarray] | None]:
    """:func:`run_data` on a data set already loaded."""
    if not spec.folds:
        if not shares:
            return data_set, None
        return data_set, partition.make(spec.partition, data_set.train_y, spec.clients, spec.seed,
                                        **_options(spec, data_set))
    x = np.concatenate([data_set.train_x, data_set.test_x])
    y = np.concatenate([data_set.train_y, data_set.test_y])
    folds = kfold.make(spec.partition, y, spec.folds, spec.clients, spec.seed, spec.shards_per_client,
                       images=x, order=spec.shard_order)
    test = folds.test(spec.fold)
    view = data.Data(name=f"{data_set.name} fold {spec.fold} of {spec.folds}", dataset=data_set.dataset,
                     train_x=x, train_y=y, test_x=x[test], test_y=y[test])
    return view, folds.train(spec.fold)


def _options(spec: DataSpec, data_set: data.Data) -> dict:
    """The options ``partition.make`` takes for the spec's partition."""
    if spec.partition == "shards":
        return {"shards_per_client": spec.shards_per_client, "images": data_set.train_x, "order": spec.shard_order}
    if spec.partition == "dirichlet":
        return {"alpha": spec.dirichlet_alpha}
    if spec.partition == "lognormal":
        return {"sigma": spec.lognormal_sigma}
    if spec.partition == "natural":
        return {"owners": data_set.train_client}
    if spec.partition == "sample":
        return {"size": spec.examples_per_client}
    return {}


def share_stats(run_data: data.Data, shares: list[np.ndarray]) -> list[dict]:
    """Per client: its examples and how many targets of each class they hold (one per
    example, or one per scored position of a sequence)."""
    labels = np.asarray(run_data.train_y)
    classes = run_data.dataset.num_classes
    rows = []
    for client, share in enumerate(shares):
        held = labels[np.asarray(share)]
        if run_data.dataset.ignore_label is not None:
            held = held[held != run_data.dataset.ignore_label]
        counts = np.bincount(held.ravel().astype(np.int64), minlength=classes)
        rows.append({"client": client, "examples": len(share), "classes": int(np.count_nonzero(counts)),
                     "class_counts": counts.tolist()})
    return rows


def describe_shares(spec: DataSpec, run_data: data.Data, stats: list[dict], shown: int) -> str:
    """``fedemu data stats``: a summary over every client, then the first ``shown``."""
    options = {"shards": f"{spec.shards_per_client} shards each, order {spec.shard_order}",
               "dirichlet": f"alpha {spec.dirichlet_alpha:g}", "lognormal": f"sigma {spec.lognormal_sigma:g}"}
    how = spec.partition + (f" ({options[spec.partition]})" if spec.partition in options else "")
    sizes = np.array([row["examples"] for row in stats])
    kinds = np.array([row["classes"] for row in stats])
    lines = [f"{run_data.name}: {len(run_data.train_y):,} training examples over {len(stats)} clients, "
             f"partition {how}, run.seed {spec.seed}",
             f"examples per client: min {sizes.min():,}, median {np.median(sizes):,.0f}, max {sizes.max():,}",
             f"classes per client:  min {kinds.min()}, median {np.median(kinds):g}, max {kinds.max()} "
             f"(of {run_data.dataset.num_classes})",
             "", f"{'client':>6}  {'examples':>8}  {'classes':>7}  largest classes (class: targets)"]
    for row in stats[:shown]:
        counts = np.array(row["class_counts"])
        top = [f"{c}: {counts[c]:,}" for c in np.argsort(-counts, kind="stable")[:4] if counts[c]]
        lines.append(f"{row['client']:>6}  {row['examples']:>8,}  {row['classes']:>7}  {', '.join(top)}")
    if len(stats) > shown:
        lines.append(f"   ... {len(stats) - shown} more (--clients N, or --json for all)")
    return "\n".join(lines)
