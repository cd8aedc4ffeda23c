"""What a sweep of short runs costs against the same points launched one by one (issue 53):
24 points of three-round FedAvg jobs on `lte`-like links, 4 uplink bandwidths × 3 loss
rates × 2 seeds, run by one `fedemu sweep` (one point at a time, and --parallel 2), and
as 24 cold `fedemu launch` runs with the same settings. Prints the wall time of each
way, the sweep's over the cold runs', and whether every point's weights_sha256 and
events (less wall-clock fields) equal its cold run's.

    python bench/sweep_startup.py [--json FILE]

To time another checkout (today's main, say) run it with PYTHONPATH on that checkout, as
bench/README.md shows: the commands run as `python -m fedemu.launch`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

BANDWIDTHS = ["1Mbit", "2Mbit", "5Mbit", "10Mbit"]
LOSSES = [0.0, 0.01, 0.02]
SEEDS = [1, 2]
# The run's events, less what the wall clock decides (tests/test_transport_regression.py's list).
WALL_FIELDS = {"t", "round_s", "wall_s", "placement"}

SWEEP = """
[base.run]
rounds = 3
target_accuracy = 0.0
workers = 1

[base.network]
default_profile = "mobile"

[base.network.profiles.mobile]
latency_ms = 35
down = {{ bandwidth = "12Mbit" }}

[axes]
"network.profiles.mobile.up.bandwidth" = {bandwidths}
"network.profiles.mobile.loss" = {losses}
"run.seed" = {seeds}
"""


def fedemu(*args: str, cwd: Path) -> float:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"fedemu {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return time.monotonic() - t0


def outcome(run_dir: Path) -> tuple[str, list]:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [{k: v for k, v in json.loads(line).items() if k not in WALL_FIELDS}
              for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return summary["weights_sha256"], events


def point_of(run_dir: Path) -> tuple[str, float, int]:
    config = tomllib.loads((run_dir / "config.toml").read_text())
    mobile = config["network"]["profiles"]["mobile"]
    return mobile["up"]["bandwidth"], float(mobile.get("loss", 0.0)), config["run"]["seed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    grid = list(itertools.product(BANDWIDTHS, LOSSES, SEEDS))
    figures: dict = {"points": len(grid), "load_before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="sweep-startup-") as tmp:
        tmp = Path(tmp)
        spec = tmp / "grid.toml"
        spec.write_text(SWEEP.format(bandwidths=json.dumps(BANDWIDTHS), losses=json.dumps(LOSSES),
                                     seeds=json.dumps(SEEDS)))
        sweeps = {}
        for parallel in (1, 2):
            out = tmp / f"sweep-p{parallel}"
            figures[f"sweep_parallel_{parallel}_s"] = fedemu("sweep", str(spec), "--out", str(out), "--parallel",
                                                             str(parallel), cwd=tmp)
            sweeps[parallel] = {point_of(d.parent): outcome(d.parent) for d in out.rglob("summary.json")
                                if (d.parent / "events.jsonl").exists()}
            print(f"sweep --parallel {parallel}: {figures[f'sweep_parallel_{parallel}_s']:.1f} s, "
                  f"{len(sweeps[parallel])} points", flush=True)
        cold, cold_s = {}, 0.0
        for bandwidth, loss, seed in sweeps[1]:
            run_dir = tmp / "cold" / f"{bandwidth}-{loss}-{seed}"
            cold_s += fedemu("launch", "--out", str(run_dir), "--set", "run.rounds=3", "--set", "run.target_accuracy=0",
                             "--set", "run.workers=1", "--set", f"run.seed={seed}",
                             "--set", 'network.default_profile="mobile"',
                             "--set", "network.profiles.mobile.latency_ms=35",
                             "--set", 'network.profiles.mobile.down.bandwidth="12Mbit"',
                             "--set", f'network.profiles.mobile.up.bandwidth="{bandwidth}"',
                             "--set", f"network.profiles.mobile.loss={loss}", cwd=tmp)
            cold[(bandwidth, loss, seed)] = outcome(run_dir)
        figures["cold_runs_s"] = cold_s
        print(f"{len(cold)} cold runs: {cold_s:.1f} s", flush=True)
        for parallel, sweep in sweeps.items():
            figures[f"same_results_parallel_{parallel}"] = sweep == cold
        figures["load_after"] = os.getloadavg()[0]
    print(f"{figures['points']} points of 3-round FedAvg jobs on lte-like links, 2 cores, "
          f"1-min load {figures['load_before']:.1f} before, {figures['load_after']:.1f} after")
    print("| way | wall s | / cold runs | same weights and events as the cold runs |")
    print("|---|---:|---:|---|")
    print(f"| {len(cold)} cold `fedemu launch` | {cold_s:.1f} | 1.00 | |")
    for parallel in (1, 2):
        s = figures[f"sweep_parallel_{parallel}_s"]
        print(f"| `fedemu sweep --parallel {parallel}` | {s:.1f} | {s / cold_s:.2f} | "
              f"{figures[f'same_results_parallel_{parallel}']} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
