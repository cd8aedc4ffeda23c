"""A what-if for Nilsson et al.'s Table 1 (docs/results.md): fedemu's runs on *their*
non-IID cross-validation split, example for example, to tell a difference in the split
from a difference in the training.

Their notebook (notebooks/partition_into_folds.ipynb) drew the split once, with Python's
``random`` and seed 20180502, so all 15 of their non-IID logs (3 runs x 5 folds) trained on
one split, where fedemu's Table 1 draws one per run seed. This rebuilds theirs step by step
from the same 70,000 images (training then test, as their notebook pools them):
shuffle with ``random.seed(20180502)``; five folds of 14,000; sort each fold's
(label, image bytes) pairs; 200 shards of 70 a fold; shuffle each fold's shard list after
re-seeding with the same seed (so a car holds the same positions in every fold); car i
gets shards 2(i-1) and 2(i-1)+1 of every fold. ``check_against_notebook()`` compares the
result with what their notebook printed.

Data set plug-ins, one per held-out fold (their numbering, 1-5, as in their log names
``cv1``-``cv5``): the clients are their 100 cars (natural clients), the test set the
held-out fold.

    python bench/whatif/their_folds.py          # checks the split against their notebook
    python bench/whatif/their_folds.py --coverage sweeps/their-folds/cv5-seed1 5
    PYTHONPATH=bench/whatif fedemu launch examples/fedavg-noniid-nilsson.toml --workers 2 \\
        --set data.dataset=their_folds:NonIidCv5 --set data.partition=natural \\
        --set data.clients=100 --set run.seed=1 --out sweeps/their-folds/cv5-seed1
    python bench/whatif/fedavg_curves.py --theirs PATH --runs sweeps/their-folds

``--first-round FOLDER THEIRS``: the accuracy after round 1 of every run under FOLDER (say
40 one-round runs, ``for s in $(seq 1 40); do ... --set run.seed=$s --set run.rounds=1
--out FOLDER/s$s; done`` with the command above), beside their 15 logs' (THEIRS: a
checkout of their repository).

``--coverage RUN HELD_OUT``: how a run's accuracy changed from round to round after round
300, by how many digits the round's clients held together (a round whose clients miss
several digits is the one a non-IID average can forget them in).

Each data set has its own name, so its first run caches MNIST again under it.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np

from fedemu.common.ml.datasets.mnist import Mnist

SEED = 20180502  # their notebook's
FOLDS, SHARD_SIZE, SHARDS_PER_CAR = 5, 70, 2


def split(images: np.ndarray, labels: np.ndarray) -> list[list[np.ndarray]]:
    """``parts[f][car]``: the indices (into the pooled 70,000) car ``car`` (0-based) holds in
    fold ``f`` (0-based), in the order of their car files."""
    data = [(bytes([int(label)]), image.tobytes(), index)
            for index, (label, image) in enumerate(zip(labels, images.reshape(len(images), -1)))]
    random.seed(SEED)
    random.shuffle(data)
    fold_size = len(data) // FOLDS
    parts = []
    for f in range(FOLDS):
        # list.sort is stable and compares (label, image) only, as their list of pairs did
        fold = sorted(data[f * fold_size:(f + 1) * fold_size], key=lambda t: (t[0], t[1]))
        shards = [fold[s:s + SHARD_SIZE] for s in range(0, fold_size, SHARD_SIZE)]
        random.seed(SEED)
        random.shuffle(shards)
        per_car = len(shards) // SHARDS_PER_CAR
        parts.append([np.array([t[2] for shard in shards[SHARDS_PER_CAR * car:SHARDS_PER_CAR * (car + 1)]
                                for t in shard], dtype=np.int64) for car in range(per_car)])
    return parts


def pooled() -> tuple[np.ndarray, np.ndarray]:
    """MNIST's training then test images and labels, as fedemu caches them."""
    from fedemu.common.ml import data

    mnist = data.load("mnist")
    return (np.concatenate([mnist.train_x, mnist.test_x]).reshape(-1, 28, 28),
            np.concatenate([mnist.train_y, mnist.test_y]))


class _HeldOut(Mnist):
    held_out = 0  # their fold number, 1-5
    natural_clients = True
    sizes = None

    def sources(self):
        return [(f"their non-IID split of MNIST, fold {self.held_out} held out", self._arrays)]

    def _arrays(self, progress):
        images, labels = pooled()
        parts = split(images, labels)
        test = np.sort(np.concatenate(parts[self.held_out - 1]))
        train = [np.concatenate([parts[f][car] for f in range(FOLDS) if f != self.held_out - 1])
                 for car in range(len(parts[0]))]
        order = np.concatenate(train)
        owners = np.repeat(np.arange(len(train)), [len(t) for t in train])
        arrays = {"train_x": images[order], "train_y": labels[order], "test_x": images[test],
                  "test_y": labels[test], "train_client": owners, "test_client": np.zeros(len(test), np.int64)}
        return arrays, {"source": f"Nilsson et al.'s partition_into_folds.ipynb (seed {SEED}) over mnist"}


class NonIidCv1(_HeldOut):
    name, held_out = "mnist-their-noniid-cv1", 1


class NonIidCv2(_HeldOut):
    name, held_out = "mnist-their-noniid-cv2", 2


class NonIidCv3(_HeldOut):
    name, held_out = "mnist-their-noniid-cv3", 3


class NonIidCv4(_HeldOut):
    name, held_out = "mnist-their-noniid-cv4", 4


class NonIidCv5(_HeldOut):
    name, held_out = "mnist-their-noniid-cv5", 5


# What their notebook printed: the first four labels after the shuffle, each fold's count of
# every digit, and the digits of cars 1-100 with fold 5 held out.
NOTEBOOK_FIRST_FOUR = [1, 6, 2, 1]
NOTEBOOK_FOLD_COUNTS = [
    (1369, 1618, 1411, 1352, 1350, 1318, 1366, 1450, 1352, 1414),
    (1387, 1601, 1350, 1482, 1342, 1278, 1396, 1470, 1341, 1353),
    (1343, 1583, 1380, 1461, 1374, 1241, 1416, 1470, 1352, 1380),
    (1372, 1529, 1397, 1511, 1346, 1248, 1403, 1456, 1383, 1355),
    (1432, 1546, 1452, 1335, 1412, 1228, 1295, 1447, 1397, 1456),
]
NOTEBOOK_CAR_DIGITS = (
    "27 17 48 1 07 12 01 3489 23 16 27 05 568 09 67 578 3 125 25 59 68 56 14 06 79 045 79 134 89 36 "
    "06 34 267 35 27 01 67 19 56 14 123 78 48 23 36 49 14 03 02 67 38 29 3 26 27 59 12 19 46 19 "
    "145 39 36 28 68 7 27 45 78 08 569 12 68 05 57 79 49 14 03 18 45 14 5 47 09 46 08 78 49 23 "
    "23 58 14 089 03 0 789 36 28 019").split()


def car_digits(labels: np.ndarray, parts: list[list[np.ndarray]], held_out: int) -> list[set[int]]:
    """The digits each car trains on with fold ``held_out`` (1-5) held out."""
    return [set(np.unique(labels[np.concatenate([parts[f][car] for f in range(FOLDS) if f != held_out - 1])]).tolist())
            for car in range(len(parts[0]))]


def check_against_notebook() -> None:
    images, labels = pooled()
    random.seed(SEED)
    order = list(range(len(labels)))
    random.shuffle(order)
    first_four = [int(labels[i]) for i in order[:4]]
    parts = split(images, labels)
    counts = [tuple(int(c) for c in np.bincount(labels[np.concatenate(fold)], minlength=10)) for fold in parts]
    digits = ["".join(map(str, sorted(held))) for held in car_digits(labels, parts, held_out=5)]
    for what, ours, theirs in (("first four labels", first_four, NOTEBOOK_FIRST_FOUR),
                               ("digit counts per fold", counts, NOTEBOOK_FOLD_COUNTS),
                               ("digits of cars 1-100 (fold 5 held out)", digits, NOTEBOOK_CAR_DIGITS)):
        print(f"{what}: {'same as their notebook' if ours == theirs else 'DIFFERENT'}")
        if ours != theirs:
            print(f"  ours:   {ours}\n  theirs: {theirs}")
    held = [sum(len(set(d)) == n for d in digits) for n in (1, 2, 3, 4)]
    print(f"cars holding 1/2/3/4 digits: {held[0]}/{held[1]}/{held[2]}/{held[3]}")


def coverage(run: Path, held_out: int) -> None:
    from fedemu.server.runlog import read_events

    images, labels = pooled()
    parts = split(images, labels)
    digits = car_digits(labels, parts, held_out)
    rounds = [e for e in read_events(run) if e.get("event") == "round" and e.get("accuracy") is not None]
    changes: dict[int, list[float]] = {}
    for before, after in zip(rounds[299:], rounds[300:]):
        covered = len(set().union(*(digits[car] for car in after["answered"])))
        changes.setdefault(covered, []).append((after["accuracy"] - before["accuracy"]) * 100)
    print(f"{run}: accuracy change from the round before (points), rounds 301-{rounds[-1]['round']}")
    for covered in sorted(changes):
        values = changes[covered]
        print(f"  clients holding {covered:2d} digits: {len(values):4d} rounds, mean {np.mean(values):+.2f}, "
              f"worst {min(values):+.2f}")


def first_round(folder: Path, theirs: Path) -> None:
    import statistics

    import fedavg_curves  # beside this file: both read curves indexed by rounds done

    ours = [curve[1] for curve in fedavg_curves.run_directories(folder).values() if len(curve) > 1]
    their = [curve[1] for curve in fedavg_curves.theirs(theirs, "fedavg-noniid").values()]
    for who, values in (("fedemu", ours), ("theirs", their)):
        if len(values) < 2:
            raise SystemExit(f"{who}: {len(values)} runs; need at least 2")
        print(f"{who}: accuracy after round 1 over {len(values)} runs: mean {statistics.mean(values) * 100:.1f}%, "
              f"sd {statistics.stdev(values) * 100:.1f}, range {min(values) * 100:.1f}-{max(values) * 100:.1f}")
    error = math.sqrt(statistics.variance(ours) / len(ours) + statistics.variance(their) / len(their))
    print(f"difference {(statistics.mean(ours) - statistics.mean(their)) * 100:.1f} points, "
          f"standard error {error * 100:.1f}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Nilsson et al.'s non-IID split: check it against their "
                                                 "notebook (no options), or read runs made on it.")
    parser.add_argument("--first-round", nargs=2, metavar=("FOLDER", "THEIRS"), type=Path,
                        help="accuracy after round 1 of the runs under FOLDER beside their logs (THEIRS: their checkout)")
    parser.add_argument("--coverage", nargs=2, metavar=("RUN", "HELD_OUT"),
                        help="a run's accuracy changes by the digits its rounds' clients held (HELD_OUT: 1-5)")
    args = parser.parse_args()
    for folder in [*(args.first_round or []), *(args.coverage or [])[:1]]:
        if not Path(folder).is_dir():
            parser.error(f"{folder} is not a folder")
    if args.first_round:
        first_round(*args.first_round)
    elif args.coverage:
        run, held_out = args.coverage
        if held_out not in {"1", "2", "3", "4", "5"}:
            parser.error(f"HELD_OUT is their fold number, 1-5, not {held_out!r}")
        coverage(Path(run), int(held_out))
    else:
        check_against_notebook()


if __name__ == "__main__":
    main()
