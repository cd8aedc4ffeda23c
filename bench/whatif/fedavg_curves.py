"""Non-IID FedAvg's learning curves, fedemu's Table 1 records against Nilsson et al.'s
cross-validation logs, in blocks of rounds (docs/results.md, "Non-IID FedAvg learns
faster than theirs"): the mean accuracy of each block, and each run's mean and spread (the
standard deviation of its accuracy, how much it oscillates) over rounds 51-100 and over
the last 300.

    python bench/whatif/fedavg_curves.py --theirs PATH [--cell fedavg-noniid]

PATH: a checkout of FraunhoferChalmersCentre/fl-performance-evaluation. Their log's line r
is the model after r rounds (line 0: the initial model); a record's curve point i is the
model after round i + 1.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = [(1, 5), (6, 10), (11, 20), (21, 50), (51, 100), (101, 200), (201, 400), (401, 700), (701, 1000)]
FOLDERS = {"fedavg-noniid": "fedavg/cross_validations", "fedavg-iid": "fedavg/cross_validations_iid"}


def theirs(path: Path, cell: str) -> dict[str, list[float]]:
    logs = sorted((path / "benchmark_results" / FOLDERS[cell]).glob("score_log_run*"))
    if not logs:
        raise SystemExit(f"no score_log_run* under {path}/benchmark_results/{FOLDERS[cell]}")
    return {log.name.split("_id")[0].removeprefix("score_log_"):
            [float(row[1]) for row in csv.reader(log.open()) if row] for log in logs}


def ours(cell: str) -> dict[str, list[float]]:
    """Each record's accuracy after round r at index r; a record not evaluated after every
    round (FedAvg: 10 uploads a round, 100 clients) is left out, since blocks are rounds."""
    records = sorted(p for p in (ROOT / "bench" / "results" / "nilsson-table1" / cell).glob("seed*-fold*.json")
                     if "@" not in p.name)  # '@before-...': runs of an earlier split
    curves = {}
    for path in records:
        curve = json.loads(path.read_text())["curve"]
        if [round(uploads * 10) for uploads, _ in curve] != list(range(1, len(curve) + 1)):
            print(f"(left out: {path.name} was not evaluated after every round)")
            continue
        curves[path.stem] = [float("nan")] + [accuracy for _, accuracy in curve]
    return curves


def block_mean(curve: list[float], first: int, last: int) -> float:
    return statistics.mean(curve[first:last + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--theirs", type=Path, required=True, help="a checkout of their repository")
    parser.add_argument("--cell", default="fedavg-noniid", choices=sorted(FOLDERS))
    args = parser.parse_args()
    runs = {"theirs": theirs(args.theirs, args.cell), "fedemu": ours(args.cell)}
    complete = {who: {name: c for name, c in curves.items() if len(c) > BLOCKS[-1][1]}
                for who, curves in runs.items()}
    for who, curves in complete.items():
        if not curves:
            raise SystemExit(f"no run of {who} has {BLOCKS[-1][1]} rounds")
    print(f"{args.cell}: mean accuracy (%) over each block of rounds, mean over runs "
          f"({len(complete['theirs'])} of theirs, {len(complete['fedemu'])} of fedemu's)")
    print("| rounds | theirs | fedemu |\n| --- | ---: | ---: |")
    for first, last in BLOCKS:
        means = [statistics.mean(block_mean(c, first, last) for c in complete[who].values()) * 100
                 for who in ("theirs", "fedemu")]
        print(f"| {first}-{last} | {means[0]:.2f} | {means[1]:.2f} |")
    print("\nEach run: mean and standard deviation (%) over rounds 51-100 and over rounds 701-1000")
    spreads: dict[str, list[float]] = {"theirs": [], "fedemu": []}
    for who in ("theirs", "fedemu"):
        for name, curve in complete[who].items():
            early, late = curve[51:101], curve[701:1001]
            spreads[who].append(statistics.pstdev(early) * 100)
            print(f"  {who:6s} {name:12s} {statistics.mean(early) * 100:6.2f} sd {statistics.pstdev(early) * 100:.2f}"
                  f"   {statistics.mean(late) * 100:6.2f} sd {statistics.pstdev(late) * 100:.2f}")
    print("mean standard deviation over rounds 51-100: "
          + ", ".join(f"{who} {statistics.mean(values):.2f}" for who, values in spreads.items()))


if __name__ == "__main__":
    main()
