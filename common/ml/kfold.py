"""k-fold cross-validation partitions of a whole data set, as in Nilsson et al. (2018), 4.2.

For cross-validation the training and test images are pooled (MNIST: 70,000) and cut
into k folds; a run trains on k - 1 folds and tests on the one held out. Every client
owns a part of *every* fold, so holding out fold f removes the same share from each
client and the runs over f = 0..k-1 are paired, which the correlated t-test assumes.

IID: shuffle, cut into k folds, cut each fold into K equal parts; client c gets part c
of every fold (MNIST, k = 5, K = 100: 140 images per fold, 560 with one held out).

Non-IID, the paper's six steps:
  (1) shuffle the data set, (2) divide it into k folds, (3) sort each fold by label,
  (4) divide each fold into K * s shards (MNIST: 200 shards of 70), (5) give each
  client s distinct random shard *positions*, (6) give it the shards at its positions
  in every fold.
Sorted folds put the same labels at the same positions, so a client still sees about
s labels although it holds s shards in each of the k folds.

Indices refer to the pooled set: train images first, then test images.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedemu.node import streams

from . import partition


@dataclass(frozen=True)
class KFold:
    """Client parts of every fold: ``parts[f][c]`` holds client c's indices in fold f."""

    parts: list[list[np.ndarray]]

    @property
    def k(self) -> int:
        return len(self.parts)

    @property
    def num_clients(self) -> int:
        return len(self.parts[0])

    def fold(self, f: int) -> np.ndarray:
        """Every index in fold f, sorted."""
        self._check(f)
        return np.sort(np.concatenate(self.parts[f]))

    def train(self, held_out: int) -> list[np.ndarray]:
        """Each client's training indices: its parts of every fold but ``held_out``."""
        self._check(held_out)
        return [np.sort(np.concatenate([self.parts[f][c] for f in range(self.k) if f != held_out]))
                for c in range(self.num_clients)]

    def test(self, held_out: int) -> np.ndarray:
        """The held-out fold: the test set of the run that leaves it out."""
        return self.fold(held_out)

    def _check(self, f: int) -> None:
        if not 0 <= f < self.k:
            raise ValueError(f"fold {f} does not exist; folds are 0..{self.k - 1}")


def _check_split(n: int, parts: int, what: str) -> int:
    if parts <= 0:
        raise ValueError(f"{what} must be positive, got {parts}")
    if n % parts:
        raise ValueError(f"{n} samples do not split into {parts} equal {what} (remainder {n % parts})")
    return n // parts


def iid(n_samples: int, k: int, num_clients: int, seed: int) -> KFold:
    """Shuffle, k folds, each fold in num_clients equal parts."""
    if k < 2:
        raise ValueError(f"k-fold needs at least 2 folds, got {k}")
    fold_size = _check_split(n_samples, k, "folds")
    _check_split(fold_size, num_clients, f"client parts of a fold of {fold_size}")
    order = streams.generator(seed, "kfold.iid").permutation(n_samples).astype(np.int64)
    return KFold([[np.sort(p) for p in fold.reshape(num_clients, -1)] for fold in order.reshape(k, fold_size)])


def non_iid(labels: np.ndarray, k: int, num_clients: int, shards_per_client: int, seed: int,
            images: np.ndarray | None = None, order: str = "stable") -> KFold:
    """Nilsson et al.'s six steps (module docstring)."""
    if k < 2:
        raise ValueError(f"k-fold needs at least 2 folds, got {k}")
    labels = np.asarray(labels)
    fold_size = _check_split(len(labels), k, "folds")
    num_shards = num_clients * shards_per_client
    _check_split(fold_size, num_shards, f"shards of a fold of {fold_size} ({num_clients} clients x {shards_per_client})")
    rng = streams.generator(seed, "kfold.shards")
    folds = rng.permutation(len(labels)).astype(np.int64).reshape(k, fold_size)          # (1), (2)
    # "stable": the order within a label is the shuffle's; "pixels": by image bytes, as theirs.
    folds = [fold[partition.by_label(labels[fold], None if images is None else images[fold], order)]
             for fold in folds]                                                          # (3)
    shards = [fold.reshape(num_shards, -1) for fold in folds]                           # (4)
    positions = rng.permutation(num_shards).reshape(num_clients, shards_per_client)     # (5)
    return KFold([[np.sort(table[pos].ravel()) for pos in positions] for table in shards])  # (6)


def make(kind: str, labels: np.ndarray, k: int, num_clients: int, seed: int,
         shards_per_client: int = 2, images: np.ndarray | None = None, order: str = "stable") -> KFold:
    """The k-fold split for ``data.partition`` ("iid" or "shards")."""
    if kind == "iid":
        return iid(len(labels), k, num_clients, seed)
    if kind == "shards":
        return non_iid(labels, k, num_clients, shards_per_client, seed, images, order)
    raise ValueError(f"no k-fold split for partition {kind!r}; use 'iid' or 'shards'")


def check(config: dict) -> None:
    """Refuse data.fold outside 0..data.folds-1 (a rule across two keys)."""
    folds, fold = config["data"].get("folds", 0), config["data"].get("fold", 0)
    if folds and not 0 <= fold < folds:
        raise ValueError(f"data.fold = {fold} must be in 0..{folds - 1} (data.folds = {folds})")
    if not folds and fold:
        raise ValueError(f"data.fold = {fold} needs data.folds >= 2 (k-fold cross-validation)")
    if folds and config["data"]["partition"] not in ("iid", "shards"):
        raise ValueError(f"data.folds = {folds}: k-fold splits are made for partition 'iid' or 'shards' (Nilsson "
                         f"et al.'s), not {config['data']['partition']!r}")
