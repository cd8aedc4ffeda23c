"""Non-IID FedAvg's learning curves, fedemu's Table 1 records against Nilsson et al.'s
cross-validation logs, in blocks of rounds (docs/results.md, "Non-IID FedAvg learns
faster than theirs"): the mean accuracy of each block, and each run's mean and spread (the
standard deviation of its accuracy, how much it oscillates) over rounds 51-100 and over
the last 300.

    python bench/whatif/fedavg_curves.py --theirs PATH [--cell fedavg-noniid] [--runs DIR] [--their-folds 5]

    python bench/whatif/fedavg_curves.py --theirs PATH --overlap

--overlap: which of their FedAvg runs ran while another FedAvg run was going (their log
names carry each run's start; a run alone took about RUN_S), and each run's mean and dips
over rounds 701-1000, the runs alone against the overlapping ones.

--runs DIR adds the run directories under DIR as a third side (e.g. the what-if runs on
their own split, bench/whatif/their_folds.py); --their-folds keeps only their logs of those
held-out folds (their numbering, 1-5).

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
    return {run_name(log): accuracies(log) for log in logs}


def run_name(log: Path) -> str:
    """'run1_cv3' for their cross-validation logs; '' for logs named by id alone."""
    return log.name.split("_id")[0].removeprefix("score_log").lstrip("_")


def accuracies(log: Path) -> list[float]:
    return [float(row[1]) for row in csv.reader(log.open()) if row]


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


def run_directories(folder: Path) -> dict[str, list[float]]:
    """Each finished run directory's accuracy after round r at index r."""
    from fedemu.server.runlog import read_events

    curves = {}
    for path in sorted(p for p in folder.iterdir() if (p / "summary.json").exists()):
        rounds = [e for e in read_events(path) if e.get("event") == "round" and e.get("accuracy") is not None]
        curves[path.name] = [float("nan")] + [e["accuracy"] for e in rounds]
    return curves


def drops(curve: list[float]) -> int:
    """Rounds 200-1000 more than 2 points below both neighbours: a round that falls and
    recovers at once."""
    return sum(curve[r - 1] - curve[r] > 0.02 and curve[r + 1] - curve[r] > 0.02 for r in range(200, 1000))


# How long one of their FedAvg runs took alone: their IID repetition 2 started its five
# folds 6,610, 6,681, 6,621 and 6,610 s apart, one after another.
RUN_S = 6600


def late_dips(curve: list[float]) -> list[float]:
    """Rounds 701-1000 more than 1 point below the run's median over them: how far below."""
    late = curve[701:1001]
    median = statistics.median(late)
    return [median - accuracy for accuracy in late if median - accuracy > 0.01]


def overlap(path: Path) -> None:
    """Their FedAvg cross-validation runs, each marked alone or overlapping (another FedAvg
    run of any of their experiments, which share run id 2, started less than RUN_S before
    it or after it), with the mean and dips over rounds 701-1000 of each, then of each group."""
    starts = {log: int(log.name.split("_id")[1][:10])
              for log in (path / "benchmark_results" / "fedavg").glob("*/score_log*_id*.csv")}
    groups: dict[tuple[str, bool], list[tuple[float, int]]] = {}
    print("| their run | start (Unix s) | overlapping | mean 701-1000 (%) | rounds > 1 point below median |")
    print("| --- | ---: | --- | ---: | ---: |")
    for cell, folder in sorted(FOLDERS.items()):
        for log in sorted((path / "benchmark_results" / folder).glob("score_log_run*"), key=starts.get):
            start = starts[log]
            others = sorted(f"{other.parent.name}/{run_name(other)}".rstrip("/")
                            for other, t in starts.items() if other != log and abs(t - start) < RUN_S)
            curve = accuracies(log)
            mean, dips = statistics.mean(curve[701:1001]) * 100, len(late_dips(curve))
            groups.setdefault((cell, bool(others)), []).append((mean, dips))
            print(f"| {cell} {run_name(log)} | {start} | {', '.join(others) or 'alone'} | {mean:.2f} | {dips} |")
    print()
    for (cell, overlapping), runs in sorted(groups.items()):
        means = [m for m, _ in runs]
        print(f"{cell}, {'overlapping' if overlapping else 'alone'}: {len(runs)} runs, mean 701-1000 "
              f"{statistics.mean(means):.2f}% ({min(means):.2f}-{max(means):.2f}), dips {[d for _, d in runs]}")


def block_mean(curve: list[float], first: int, last: int) -> float:
    return statistics.mean(curve[first:last + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--theirs", type=Path, required=True, help="a checkout of their repository")
    parser.add_argument("--cell", default="fedavg-noniid", choices=sorted(FOLDERS))
    parser.add_argument("--runs", type=Path, help="a folder of fedemu run directories, shown as a third side")
    parser.add_argument("--their-folds", type=int, nargs="+", choices=range(1, 6),
                        help="keep only their logs of these held-out folds")
    parser.add_argument("--overlap", action="store_true",
                        help="their runs alone against those that overlapped another FedAvg run")
    args = parser.parse_args()
    if args.overlap:
        overlap(args.theirs)
        return
    runs = {"theirs": theirs(args.theirs, args.cell), "fedemu": ours(args.cell)}
    if args.their_folds:
        runs["theirs"] = {name: c for name, c in runs["theirs"].items()
                          if int(name.rsplit("_cv", 1)[1]) in args.their_folds}
    if args.runs:
        runs[args.runs.name] = run_directories(args.runs)
    complete = {who: {name: c for name, c in curves.items() if len(c) > BLOCKS[-1][1]}
                for who, curves in runs.items()}
    for who, curves in complete.items():
        if not curves:
            raise SystemExit(f"no run of {who} has {BLOCKS[-1][1]} rounds")
    sides = list(complete)
    print(f"{args.cell}: mean accuracy (%) over each block of rounds, mean over runs ("
          + ", ".join(f"{len(complete[who])} of {who}" for who in sides) + ")")
    print("| rounds | " + " | ".join(sides) + " |\n| --- |" + " ---: |" * len(sides))
    for first, last in BLOCKS:
        means = [statistics.mean(block_mean(c, first, last) for c in complete[who].values()) * 100 for who in sides]
        print(f"| {first}-{last} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    print("\nEach run: mean and standard deviation (%) over rounds 51-100 and over rounds 701-1000; then, over\n"
          "rounds 701-1000, the rounds more than 1 point below the run's median and the deepest of them (points);\n"
          "then drops: rounds 200-1000 more than 2 points below both the round before and the round after")
    spreads: dict[str, list[list[float]]] = {who: [[], []] for who in sides}
    for who in sides:
        for name, curve in complete[who].items():
            early, late = curve[51:101], curve[701:1001]
            spreads[who][0].append(statistics.pstdev(early) * 100)
            spreads[who][1].append(statistics.pstdev(late) * 100)
            dips = late_dips(curve)
            print(f"  {who:6s} {name:12s} {statistics.mean(early) * 100:6.2f} sd {statistics.pstdev(early) * 100:.2f}"
                  f"   {statistics.mean(late) * 100:6.2f} sd {statistics.pstdev(late) * 100:.2f}"
                  f"   dips {len(dips):3d}, deepest {max(dips, default=0.0) * 100:5.1f}"
                  f"   drops {drops(curve):3d}")
    for i, rounds in enumerate(("51-100", "701-1000")):
        print(f"median standard deviation over rounds {rounds}: "
              + ", ".join(f"{who} {statistics.median(values[i]):.2f}" for who, values in spreads.items()))


if __name__ == "__main__":
    main()
