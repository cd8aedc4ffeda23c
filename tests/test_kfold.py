"""k-fold partitions (Nilsson et al. 2018, 4.2): sizes, disjointness, labels per client."""
from __future__ import annotations

import numpy as np
import pytest

from fedemu.launch import config as configuration
from fedemu.common.ml import kfold, partition, split
from fedemu.common.ml.data import Data
from fedemu.common.ml.datasets import get as dataset_named

MNIST = dataset_named("mnist")

N, K, FOLDS = 70_000, 100, 5


@pytest.fixture(scope="module")
def labels():
    # MNIST-sized and about as balanced (MNIST's classes hold 6,313-7,877 images).
    return np.random.default_rng(0).permutation(np.repeat(np.arange(10), N // 10)).astype(np.uint8)


def assert_exact_cover(split: kfold.KFold, n: int) -> None:
    everything = np.concatenate([p for fold in split.parts for p in fold])
    assert len(everything) == n
    assert np.array_equal(np.sort(everything), np.arange(n)), "parts overlap or miss samples"


def test_iid_sizes_and_disjointness():
    split = kfold.iid(N, FOLDS, K, seed=1)
    assert split.k == FOLDS and split.num_clients == K
    assert {len(p) for fold in split.parts for p in fold} == {140}  # the paper's 140 per fold
    assert_exact_cover(split, N)
    for held_out in (0, 4):
        test = split.test(held_out)
        train = split.train(held_out)
        assert len(test) == 14_000
        assert {len(t) for t in train} == {560}  # "560 in total if one fold is left out"
        pooled = np.concatenate(train)
        assert len(np.unique(pooled)) == 56_000  # clients are disjoint
        assert not np.intersect1d(pooled, test).size  # nobody trains on the test fold


def test_iid_depends_on_the_seed_only():
    a, b, c = kfold.iid(N, FOLDS, K, 1), kfold.iid(N, FOLDS, K, 1), kfold.iid(N, FOLDS, K, 2)
    assert all(np.array_equal(x, y) for fx, fy in zip(a.parts, b.parts) for x, y in zip(fx, fy))
    assert not np.array_equal(a.parts[0][0], c.parts[0][0])


def test_non_iid_follows_the_six_steps(labels):
    split = kfold.non_iid(labels, FOLDS, K, shards_per_client=2, seed=1)
    assert {len(p) for fold in split.parts for p in fold} == {140}  # two shards of 70 per fold
    assert_exact_cover(split, N)
    test, train = split.test(2), split.train(2)
    assert {len(t) for t in train} == {560} and len(test) == 14_000
    assert not np.intersect1d(np.concatenate(train), test).size
    # (3) + (4): a shard is 70 consecutive labels of its fold sorted by label, so a
    # client's labels in fold f are those of two 70-label windows of that sorted fold;
    # (5) + (6): the same two windows (positions) in every fold.
    shards = K * 2
    pairs = []  # per fold: the label counts of every two windows (shards, shards, labels)
    for f in range(FOLDS):
        windows = np.sort(labels[split.fold(f)]).reshape(shards, -1)
        counts = np.stack([np.bincount(w, minlength=10) for w in windows])
        pairs.append(counts[:, None, :] + counts[None, :, :])
    distinct = ~np.eye(shards, dtype=bool)
    for c in range(K):
        fits_every_fold = distinct.copy()
        for f in range(FOLDS):
            own = np.bincount(labels[split.parts[f][c]], minlength=10)
            fits_every_fold &= np.all(pairs[f] == own, axis=-1)
        assert fits_every_fold.any(), f"client {c}'s parts are not the same two shard positions of every sorted fold"
    unique = np.array([len(np.unique(labels[t])) for t in train])
    # The paper: "In practice, most clients had two unique labels". A shard straddling a
    # label boundary adds a third; never more than two per shard position.
    assert np.mean(unique <= 2) > 0.5 and unique.max() <= 4


def test_iid_clients_see_every_label(labels):
    train = kfold.iid(N, FOLDS, K, seed=1).train(0)
    assert min(len(np.unique(labels[t])) for t in train) == 10


def test_sizes_that_do_not_divide_are_refused_with_the_numbers(labels):
    with pytest.raises(ValueError, match="70000 samples do not split into 3 equal folds"):
        kfold.iid(N, 3, K, 1)
    with pytest.raises(ValueError, match="shards of a fold of 14000"):
        kfold.non_iid(labels, FOLDS, 100, 3, 1)
    with pytest.raises(ValueError, match="at least 2 folds"):
        kfold.iid(N, 1, K, 1)
    with pytest.raises(ValueError, match="fold 5 does not exist"):
        kfold.iid(N, FOLDS, K, 1).train(5)


def tiny_dataset() -> Data:
    rng = np.random.default_rng(3)
    train_labels = np.repeat(np.arange(10), 8).astype(np.uint8)  # 80 train + 20 test = 100
    test_labels = np.repeat(np.arange(10), 2).astype(np.uint8)
    # Each image carries its pooled index in pixel (0, 0), so the test can trace it.
    images = rng.integers(0, 255, (100, 28, 28), dtype=np.uint8)
    images[:, 0, 0] = np.arange(100)
    return Data("mnist", MNIST, images[:80], train_labels, images[80:], test_labels)


def run_config(**data) -> dict:
    config = configuration.default()
    config["data"].update(clients=5, **data)
    return config


@pytest.mark.parametrize("partition", ["iid", "shards"])
def test_run_data_trains_on_k_minus_1_folds_and_tests_on_the_held_out_one(partition):
    dataset = tiny_dataset()
    view, shards = split.split(configuration.data_spec(run_config(folds=5, fold=1, partition=partition,
                                                                  shards_per_client=2)), dataset)
    assert len(view.train_y) == 100 and len(view.test_y) == 20
    assert len(shards) == 5 and {len(s) for s in shards} == {16}
    test_ids = set(view.test_x[:, 0, 0].tolist())
    train_ids = set(np.concatenate(shards).tolist())
    assert len(train_ids) == 80 and not train_ids & test_ids
    assert train_ids | test_ids == set(range(100))
    # The pooled arrays keep image and label together.
    assert np.array_equal(view.train_y[:80], dataset.train_y)
    assert np.array_equal(view.train_y[80:], dataset.test_y)


def test_without_folds_the_data_is_the_data_set_partitioned():
    dataset = tiny_dataset()
    spec = configuration.data_spec(run_config(partition="shards", shards_per_client=2))
    view, shards = split.split(spec, dataset)
    assert view is dataset
    expected = partition.make("shards", dataset.train_y, 5, spec.seed, shards_per_client=2, images=dataset.train_x)
    assert all(np.array_equal(a, b) for a, b in zip(shards, expected, strict=True))


def test_fold_outside_the_folds_is_refused():
    with pytest.raises(ValueError, match=r"data.fold = 5 must be in 0..4"):
        kfold.check(run_config(folds=5, fold=5))
    with pytest.raises(ValueError, match=r"data.fold = 2 needs data.folds >= 2"):
        kfold.check(run_config(fold=2))
    with pytest.raises(configuration.ConfigError, match=r"data.folds = 1 is out of range"):
        configuration.load(None, ["data.folds=1"])


@pytest.mark.parametrize("order", ["stable", "pixels"])
def test_pixel_order_cuts_shards_from_each_fold_sorted_by_label_then_image_bytes(order):
    """Nilsson et al.'s notebook sorted each fold's (label, image bytes) pairs before
    cutting shards: with order = "pixels" every client's part of a fold is whole runs of
    that order; "stable" keeps the shuffle's order within a label, which is not."""
    rng = np.random.default_rng(3)
    n, k, clients, per_client = 400, 2, 5, 2
    labels = rng.integers(0, 2, n).astype(np.uint8)
    images = rng.integers(0, 256, (n, 2, 2), dtype=np.uint8)
    split = kfold.non_iid(labels, k, clients, per_client, seed=1, images=images, order=order)
    shard = n // k // (clients * per_client)
    runs_everywhere = True
    for f in range(k):
        fold = split.fold(f)
        ranked = sorted(fold, key=lambda i: (labels[i], images[i].tobytes()))
        position = {index: p for p, index in enumerate(ranked)}
        for part in split.parts[f]:
            starts = sorted(position[i] for i in part)[::shard]
            runs = {tuple(sorted(position[i] for i in part))} == {tuple(p for s in starts for p in range(s, s + shard))}
            runs_everywhere &= runs and all(s % shard == 0 for s in starts)
    assert runs_everywhere == (order == "pixels")
    with pytest.raises(ValueError, match="needs the images"):
        kfold.non_iid(labels, k, clients, per_client, seed=1, order="pixels")


def test_shard_order_is_checked_and_named():
    assert configuration.load(None)["data"]["shard_order"] == "stable"
    with pytest.raises(configuration.ConfigError, match=r"data\.shard_order"):
        configuration.load(None, ["data.shard_order=bytes"])
