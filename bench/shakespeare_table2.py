"""McMahan et al. 2017's Table 2, Shakespeare rows: communication rounds to 54% next-
character accuracy for FedSGD and FedAvg (E = 1 and 5, B = 10), by role and IID, C = 0.1,
the char LSTM, in virtual time. The learning rate is tuned per row as the paper did: a
multiplicative grid (resolution 10^(1/3) by default) around a centre, the best rate of
each row reported with its rounds.

    python bench/shakespeare_table2.py                         # the grid: long (see below)
    python bench/shakespeare_table2.py --rows fedavg-e1-b10 --partitions natural --lrs 1.47
    python bench/shakespeare_table2.py --measure 3             # 3 rounds per row: time per round
    python bench/shakespeare_table2.py --report-only

Resumable: each run is OUT/<row>-<partition>/lr<lr>; a completed one is kept. --measure
runs every row for a few rounds and prints the wall time per round and what the paper's
rounds would take on this machine, which is how to decide what to run where (on 2 CPU
cores a round of 110 clients takes most of a minute: a GPU host is the place for the grid).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fedavg-shakespeare.toml"
TARGET = 0.54

# (row, algorithm, E, B (0: all local data), the paper's centre lr)
ROWS = [
    ("fedsgd", "fedsgd", 1, 0, 1.47),
    ("fedavg-e1-b10", "fedavg", 1, 10, 1.47),
    ("fedavg-e5-b10", "fedavg", 5, 10, 1.47),
]
# Rounds to 54% in the paper's Table 2 (IID, by role); the FedAvg rows' u is 7.4 and 37.1.
PAPER_ROUNDS = {"fedsgd": {"iid": 2488, "natural": 3906}, "fedavg-e1-b10": {"iid": 460, "natural": 164},
                "fedavg-e5-b10": {"iid": 192, "natural": 41}}
PARTITIONS = ("natural", "iid")


def run_dir(out: Path, row: str, partition: str, lr: float) -> Path:
    return out / f"{row}-{partition}" / f"lr{lr:.4g}"


def summary(path: Path) -> dict | None:
    try:
        found = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return found if found.get("status") == "completed" else None


def grid(centre: float, points: int, resolution: float) -> list[float]:
    half = points // 2
    return [round(centre * resolution ** k, 4) for k in range(-half, points - half)]


def launch(path: Path, row: tuple, partition: str, lr: float, rounds: int, workers: int) -> dict:
    name, algorithm, epochs, batch, _ = row
    if path.exists():  # an interrupted run: start it again
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sets = [f"algorithm.name={algorithm}", f"algorithm.E={epochs}", f"algorithm.B={batch}", f"algorithm.lr={lr}",
            f"data.partition={partition}", f"run.rounds={rounds}", f"run.target_accuracy={TARGET}"]
    command = [sys.executable, "-m", "fedemu.launch", "launch", str(EXAMPLE), "--out", str(path),
               "--workers", str(workers)] + [arg for item in sets for arg in ("--set", item)]
    started = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = summary(path)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{path} failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
    found["bench_wall_s"] = time.monotonic() - started
    return found


def read_events(path: Path) -> list[dict]:
    from fedemu.server.runlog import read_events as read

    return read(path)


def report(out: Path) -> str:
    lines = [f"# McMahan et al. 2017, Table 2 (Shakespeare LSTM, 54%), in fedemu ({out})", "",
             "| row | partition | rounds to 54% (fedemu, best lr) | best lr | lrs run | paper |", "|---|---|---|---|---|---|"]
    for name, *_ in ROWS:
        for partition in PARTITIONS:
            runs = [(path, summary(path)) for path in sorted((out / f"{name}-{partition}").glob("lr*"))]
            runs = [(path, s) for path, s in runs if s is not None]
            reached = [(s["reached_target_round"], float(path.name[2:])) for path, s in runs
                       if s.get("reached_target_round")]
            best = min(reached) if reached else None
            cap = max((s["rounds"] for _, s in runs), default=0)
            shown = f"{best[0]}" if best else (f"not within {cap}" if runs else "not run")
            lines.append(f"| {name} | {'by role' if partition == 'natural' else 'IID'} | {shown} | "
                         f"{best[1] if best else ''} | {len(runs)} | {PAPER_ROUNDS[name][partition]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "sweeps" / "shakespeare-table2")
    parser.add_argument("--rows", nargs="*", default=[r[0] for r in ROWS], choices=[r[0] for r in ROWS])
    parser.add_argument("--partitions", nargs="*", default=list(PARTITIONS), choices=PARTITIONS)
    parser.add_argument("--lrs", type=float, nargs="*", help="learning rates (default: a grid around each row's)")
    parser.add_argument("--grid-points", type=int, default=5)
    parser.add_argument("--resolution", type=float, default=10 ** (1 / 3))
    parser.add_argument("--rounds", type=int, default=4000, help="cap per run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--measure", type=int, metavar="ROUNDS",
                        help="time ROUNDS (>= 2) rounds of each row, then stop")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    rows = [r for r in ROWS if r[0] in args.rows]
    if args.measure is not None and args.measure < 2:
        parser.error("--measure needs at least 2 rounds (the time between the first and the last)")
    if args.measure:
        for row in rows:
            for partition in args.partitions:
                path = args.out / "measure" / f"{row[0]}-{partition}"
                launch(path, row, partition, row[4], args.measure, args.workers)
                # Between the first round's end and the last's: start-up and the first
                # evaluation's warm-up left out.
                ends = [e["t"] for e in read_events(path) if e.get("event") == "round"]
                per_round = (ends[-1] - ends[0]) / (len(ends) - 1)
                paper = PAPER_ROUNDS[row[0]][partition]
                print(f"{row[0]:>14} {partition:>7}: {per_round:6.1f} s a round here (wall); the paper's {paper} "
                      f"rounds would take {paper * per_round / 3600:.1f} h", flush=True)
        return
    if not args.report_only:
        for row in rows:
            for partition in args.partitions:
                for lr in args.lrs or grid(row[4], args.grid_points, args.resolution):
                    path = run_dir(args.out, row[0], partition, lr)
                    if summary(path) is None:
                        found = launch(path, row, partition, lr, args.rounds, args.workers)
                        print(f"{row[0]} {partition} lr {lr}: reached 54% in round "
                              f"{found.get('reached_target_round')} ({found['bench_wall_s']:.0f} s)", flush=True)
    print(report(args.out))


if __name__ == "__main__":
    main()
