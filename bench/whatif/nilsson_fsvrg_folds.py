"""The FSVRG what-if of docs/results.md over the folds of Table 1's first repetition
(run.seed = 1): FSVRG with the full gradient their verifier computed, beside FSVRG as
fedemu runs it (Algorithm 2, the benchmark's records) and their cross-validation logs.

    python bench/whatif/nilsson_fsvrg_folds.py --partition iid --gradient their-cars-in-training --folds 0 1 2
    python bench/whatif/nilsson_fsvrg_folds.py --partition shards --gradient their-cars
    python bench/whatif/nilsson_fsvrg_folds.py --report-only --theirs PATH

``--gradient`` is the plug-in's ``algorithm.gradient_over`` (bench/whatif/nilsson_fsvrg.py):
``their-cars``, MNIST's original 60,000 training images (held-out images among them), as
their runs had it; ``their-cars-in-training``, those of them in the run's training folds.
Resumable like the benchmark: each run is OUT/<gradient>-<partition>/seed1-fold<F>, and a
completed one is kept as a record in bench/results/nilsson-fsvrg-whatif/.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import nilsson_table1 as table1  # noqa: E402

RECORDS = table1.ROOT / "bench" / "results" / "nilsson-fsvrg-whatif"
GRADIENTS = ("their-cars", "their-cars-in-training")
SEED = 1  # the what-if's folds are those of the benchmark's first repetition
CELL_OF = {"iid": "fsvrg-iid", "shards": "fsvrg-noniid"}


def cell(gradient: str, partition: str) -> str:
    return f"{gradient}-{partition}"


def run(out: Path, gradient: str, partition: str, fold: int, workers: int) -> None:
    path = table1.run_dir(out, cell(gradient, partition), SEED, fold)
    if table1.completed(path) or table1.record_path(RECORDS, cell(gradient, partition), path.name).exists():
        return
    settings = {"algorithm.name": "nilsson_fsvrg:FSVRGTheirFullGradient", "algorithm.gradient_over": gradient,
                "algorithm.held_out_seed": SEED, "algorithm.held_out_fold": fold,
                "algorithm.held_out_partition": partition, "data.partition": partition,
                "data.folds": table1.FOLDS, "data.fold": fold, "run.seed": SEED, "data.shard_order": "pixels"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    table1.launch_and_record(path, RECORDS, cell(gradient, partition), "fsvrg-noniid-nilsson.toml", settings,
                             f"{cell(gradient, partition)} fold {fold}", workers, env=env)


def _curves(records: Path, name: str, folds: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    found = {}
    for fold in folds:
        file = table1.record_path(records, name, f"seed{SEED}-fold{fold}")
        if file.exists():
            found[fold] = table1._record_curve(json.loads(file.read_text()))
    return found


def _row(label: str, curves: list) -> list[str]:
    return [label] + [f"{np.mean(table1._best_at(curves, u)):.2f}" if curves else "-" for u in table1.AT_UPLOADS]


def report(partition: str, theirs: Path | None) -> str:
    """Best accuracy so far at each budget, fold by fold: each variant beside Algorithm 2's."""
    folds = list(range(table1.FOLDS))
    variants = {"Algorithm 2 (fedemu)": _curves(table1.RECORDS, CELL_OF[partition], folds)}
    variants.update({f"gradient over {g}": _curves(RECORDS, cell(g, partition), folds) for g in GRADIENTS})
    rows = [["best accuracy so far (%) at uploads per client"] + [f"{u}" for u in table1.AT_UPLOADS]]
    present = [set(curves) for curves in variants.values() if curves]
    common = sorted(set.intersection(*present)) if present else []
    for label, curves in variants.items():
        for fold, curve in sorted(curves.items()):
            rows.append(_row(f"{label}, fold {fold}", [curve]))
        if len(curves) > 1:
            rows.append(_row(f"{label}, mean of folds {', '.join(map(str, sorted(curves)))}", list(curves.values())))
        if 1 < len(common) < len(curves):  # the same folds as the variants run on fewer
            rows.append(_row(f"{label}, mean of folds {', '.join(map(str, common))}", [curves[f] for f in common]))
    if theirs is not None:
        published = table1.their_curves(theirs, "fsvrg", partition)
        rows.append(_row(f"theirs, mean of their {len(published)} logs", published))
    return "\n".join([f"## FSVRG, {table1.PARTITION[partition]}", ""] + table1._markdown(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=table1.ROOT / "sweeps" / "nilsson-fsvrg-whatif")
    parser.add_argument("--partition", choices=("iid", "shards"), default="iid")
    parser.add_argument("--gradient", choices=GRADIENTS, default="their-cars-in-training")
    parser.add_argument("--folds", type=int, nargs="*", default=list(range(table1.FOLDS)))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--theirs", type=Path, help="a checkout of their repository: their logs' means too")
    args = parser.parse_args()
    if not args.report_only:
        for fold in args.folds:
            run(args.out, args.gradient, args.partition, fold, args.workers)
    for partition in ("iid", "shards"):
        print(report(partition, args.theirs) + "\n")


if __name__ == "__main__":
    main()
