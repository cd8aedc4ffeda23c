"""Fault soak: stop signals to every kind of process of a run, at random points, many times.

    python bench/fault_soak.py [--repeats 3] [--seed 1] [--json out.json]

For each repeat, every (process, signal, algorithm) of launcher / broker / server node /
worker node x SIGTERM / SIGHUP / SIGKILL x FedAvg / CO-OP: a tiny real run (4 clients, a
synthetic 400-example data set), the signal sent after a number of evaluations drawn
from the seeded generator (1..8), then the checks tests/test_faults.py makes once per
cell: the launcher's exit code is non-zero unless the run completed; every line of
events.jsonl parses; summary.json has the expected status and a reason naming the cause;
no process of the run is alive 10 s later.

Printed: one line per run (cell, point, outcome, seconds from the signal until the last
process of the run was gone), then per cell the passes out of the repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_faults import (ALGORITHMS, TINY, broker_pid, evaluations, expected_outcome,  # noqa: E402
                               processes_of)
from tests.test_launch import node_pid  # noqa: E402
from tests.test_sweep import tiny_mnist  # noqa: E402

KINDS = ("launcher", "broker", "server", "worker")
SIGNALS = ("SIGTERM", "SIGHUP", "SIGKILL")


def one_run(root: Path, cache: Path, kind: str, signame: str, algorithm: str, point: int) -> dict:
    run_dir = root / f"{kind}-{signame}-{algorithm}-{point}-{time.monotonic_ns()}"
    budget = ["run.max_wall_s=12"] if kind == "worker" else []
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", "2",
            "--set", "run.target_accuracy=0", "--set", "run.heartbeat_interval_s=0.2",
            "--set", f"data.cache_dir='{cache}'"]
    for item in [*TINY, *ALGORITHMS[algorithm], *budget]:
        argv += ["--set", item]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    problems = []
    deadline = time.monotonic() + 120
    while evaluations(run_dir) < point:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            return {"ok": False, "problems": [f"evaluation {point} never came"], "clean_s": None}
        time.sleep(0.05)
    target = {"launcher": lambda: proc.pid, "broker": lambda: broker_pid(run_dir),
              "server": lambda: node_pid(run_dir, "server"), "worker": lambda: node_pid(run_dir, "worker-1")}[kind]()
    signalled = time.monotonic()
    os.kill(target, getattr(signal, signame))
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        problems.append("the launcher did not end within 120 s")
    while processes_of(run_dir) and time.monotonic() - signalled < 60:
        time.sleep(0.05)
    clean_s = time.monotonic() - signalled
    left = processes_of(run_dir)
    if left:
        problems.append(f"processes left: {left}")
    status, words = expected_outcome(kind, signame, proc.pid)
    if not (kind == "launcher" and signame == "SIGKILL") and (proc.returncode == 0) != (status == "completed"):
        problems.append(f"exit code {proc.returncode} for a {status} run")
    try:
        text = (run_dir / "events.jsonl").read_text()
        [json.loads(line) for line in text.splitlines()]
        if text and not text.endswith("\n"):
            problems.append("a torn last line")
    except (OSError, ValueError) as exc:
        problems.append(f"events.jsonl: {exc}")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("status") != status:
            problems.append(f"status {summary.get('status')}, expected {status}: {summary.get('reason')}")
        missing = [w for w in words if w not in str(summary.get("reason"))]
        if missing:
            problems.append(f"reason {summary.get('reason')!r} lacks {missing}")
    except (OSError, ValueError) as exc:
        problems.append(f"summary.json: {exc}")
    return {"ok": not problems, "problems": problems, "clean_s": round(clean_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="fedemu-soak-") as tmp:
        root = Path(tmp)
        tiny_mnist(root / "cache")
        for repeat in range(args.repeats):
            for kind in KINDS:
                for signame in SIGNALS:
                    for algorithm in ALGORITHMS:
                        point = rng.randint(1, 8)
                        outcome = one_run(root, root / "cache", kind, signame, algorithm, point)
                        results.append({"repeat": repeat, "kind": kind, "signal": signame, "algorithm": algorithm,
                                        "point": point, **outcome})
                        print(f"{repeat} {kind:8s} {signame:7s} {algorithm:6s} after eval {point}: "
                              f"{'ok' if outcome['ok'] else 'FAIL ' + '; '.join(outcome['problems'])}"
                              f"  (clean {outcome['clean_s']} s)", flush=True)
    print("\n| process | signal | algorithm | passed | slowest clean-up (s) |\n| --- | --- | --- | ---: | ---: |")
    for kind in KINDS:
        for signame in SIGNALS:
            for algorithm in ALGORITHMS:
                cell = [r for r in results if (r["kind"], r["signal"], r["algorithm"]) == (kind, signame, algorithm)]
                slowest = max((r["clean_s"] or 0 for r in cell), default=0)
                print(f"| {kind} | {signame} | {algorithm} | {sum(r['ok'] for r in cell)}/{len(cell)} | {slowest} |")
    passed = sum(r["ok"] for r in results)
    print(f"\n{passed}/{len(results)} runs passed every check")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
