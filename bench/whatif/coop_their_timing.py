"""What-if: CO-OP on MNIST with Nilsson et al.'s testbed timing (their server the
bottleneck at about 0.37 s a merge, clients cycling in about 6 s with jitter), against the
benchmark's instant server and their logs (docs/results.md, "CO-OP's IID gap").

    python bench/whatif/coop_their_timing.py --out OUT [--partition iid|noniid] [--folds 0 1 2 3 4]
                                             [--device-groups]

--device-groups: their two device groups (bench/whatif/coop_counter_logs.py: clients 1-32
over-active about twice as often as 33-100) instead of one speed for all: clients 32-99
(fedemu counts from 0) 1.3 times slower, devices at 9.7e7 FLOP/s. Chosen, on non-IID fold
0's first 10 uploads per client, for the share of over-active checks (their logs: 0.26-0.44
per upload; these settings 0.31 there and 0.23 over a whole run, one speed of 8.2e7 0.08 and 0.01),
not for accuracy; the ratio 1.3 from a rough model (over-active checks per upload about
b_l / (merges per second x training time) - 1, with their groups' 0.6 and 0.25).

Runs each fold not yet complete in OUT (resumable; about 7 minutes a fold on 2 cores),
then prints the best accuracy so far at 10 / 25 / 50 / 100 uploads per client beside the
benchmark's CO-OP records (bench/results/nilsson-table1/coop-iid or coop-noniid), and the Bayesian
correlated t-tests on best accuracy against the benchmark's FedAvg, FSVRG and
centralised records of the same folds (seed 1, today's split).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "bench" / "results" / "nilsson-table1"
THEIR_SERVER = "algorithm.merge_s=0.37"
THEIR_TIMING = [THEIR_SERVER, "run.device_flops=8.2e7", "network.stragglers.distribution=lognormal",
                "network.stragglers.sigma=0.25", "network.stragglers.per_round=true"]
# Their two device groups instead of one speed (--device-groups).
DEVICE_GROUPS = [THEIR_SERVER, "run.device_flops=9.7e7",
                 'network.stragglers=[{distribution="fixed", factor=1.3, clients="32-99"},'
                 ' {distribution="lognormal", sigma=0.25, per_round=true}]']
BUDGETS = (10, 25, 50, 100)


def run_fold(out: Path, fold: int, partition: str, timing: list[str]) -> dict:
    run_dir = out / f"seed1-fold{fold}"
    summary = run_dir / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("status") == "completed":
        return json.loads(summary.read_text())
    if run_dir.exists():
        run_dir.rename(run_dir.with_name(run_dir.name + ".incomplete"))
    sets = [f"data.partition={'iid' if partition == 'iid' else 'shards'}", "data.folds=5", f"data.fold={fold}",
            "run.seed=1", "data.shard_order=pixels", *timing]
    subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", str(ROOT / "examples" / "coop-noniid-nilsson.toml"),
                    "--out", str(run_dir), "--workers", "2", *(a for s in sets for a in ("--set", s))], check=True)
    return json.loads(summary.read_text())


def round_events(run_dir: Path) -> list[dict]:
    """A run's round events (an evaluation each; a torn last line is skipped)."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.endswith("}")]
    return [e for e in events if e["event"] == "round"]


def curve_of(run_dir: Path) -> list[tuple[float, float]]:
    """(uploads per client, accuracy) at each evaluation (every 10 uploads, 100 clients)."""
    return [(e["round"] * 10 / 100, e["accuracy"]) for e in round_events(run_dir) if e.get("accuracy") is not None]


def over_active(run_dir: Path) -> float:
    """Age checks that came back over-active, per upload: checks less uploads less fetches."""
    rounds = round_events(run_dir)
    checks, uploads, fetches = (sum(e.get(k, 0) for e in rounds) for k in ("age_requests", "uploads", "fetches"))
    return (checks - uploads - fetches) / uploads


def best_at(curve) -> dict[int, float]:
    best, out = 0.0, {}
    for x, accuracy in curve:
        best = max(best, accuracy)
        for budget in BUDGETS:
            if abs(x - budget) < 1e-9:
                out[budget] = best
    return out


def record(cell: str, fold: int) -> dict:
    return json.loads((RECORDS / cell / f"seed1-fold{fold}.json").read_text())


def main() -> None:
    from fedemu.launch.studies.compare import test

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--folds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--partition", choices=("iid", "noniid"), default="iid")
    parser.add_argument("--device-groups", action="store_true", help="their two device groups, not one speed")
    args = parser.parse_args()
    timing = DEVICE_GROUPS if args.device_groups else THEIR_TIMING
    timed = {f: run_fold(args.out, f, args.partition, timing) for f in args.folds}
    p = args.partition
    label = "their timing, two device groups" if args.device_groups else "their timing"
    rows = {label: [best_at(curve_of(args.out / f"seed1-fold{f}")) for f in args.folds],
            "instant server (benchmark)": [best_at(record(f"coop-{p}", f)["curve"]) for f in args.folds]}
    print(f"{p}, best so far at " + " / ".join(map(str, BUDGETS)) + " uploads per client (%), mean of folds "
          + ", ".join(map(str, args.folds)))
    for name, per_fold in rows.items():
        print(f"  {name}: " + " / ".join(f"{100 * statistics.mean(b[k] for b in per_fold):.2f}" for k in BUDGETS)
              + "   at 100 by fold: " + " / ".join(f"{100 * b[100]:.2f}" for b in per_fold))
    print(f"  final accuracy: {label} {100 * statistics.mean(s['final_accuracy'] for s in timed.values()):.2f}, "
          f"instant server {100 * statistics.mean(record(f'coop-{p}', f)['summary']['final_accuracy'] for f in args.folds):.2f}")
    checks = [over_active(args.out / f"seed1-fold{f}") for f in args.folds]
    print(f"  over-active checks per upload ({label}): " + " / ".join(f"{c:.2f}" for c in checks)
          + " (their counter logs: 0.26-0.44)")
    coop = {label: np.array([timed[f]["best_accuracy"] for f in args.folds]),
            "instant server": np.array([record(f"coop-{p}", f)["summary"]["best_accuracy"] for f in args.folds])}
    print("Bayesian correlated t-test on best accuracy, rope 1 point: P(other better), P(equivalent), P(CO-OP better)")
    for other in (f"fedavg-{p}", f"fsvrg-{p}", "centralised"):
        scores = np.array([record(other, f)["summary"]["best_accuracy"] for f in args.folds])
        for name, ours in coop.items():
            p_other, p_rope, p_coop, _ = test(scores, ours, 0.01, 1)
            print(f"  {other} vs CO-OP ({name}): {p_other:.3f} / {p_rope:.3f} / {p_coop:.3f}")


if __name__ == "__main__":
    main()
