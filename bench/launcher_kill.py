"""How long a run's processes outlive a launcher killed outright (SIGKILL): the default
job is launched, killed once round 2 is logged, and the time until no process names the
run directory is printed, with the reason the run's summary gives.

    python bench/launcher_kill.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def left(run_dir: Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if int(pid) != os.getpid()]


def once(run_dir: Path) -> tuple[float, str]:
    launcher = subprocess.Popen([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir),
                                 "--set", "run.rounds=200", "--set", "run.target_accuracy=0",
                                 "--set", "run.heartbeat_interval_s=0.2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events = run_dir / "events.jsonl"
    while not events.exists() or events.read_text().count('"event": "round"') < 2:
        time.sleep(0.05)
    launcher.kill()
    killed = time.monotonic()  # wall
    while left(run_dir):
        time.sleep(0.05)
    gone = time.monotonic() - killed  # wall
    launcher.wait()
    return gone, json.loads((run_dir / "summary.json").read_text())["reason"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedemu-kill-") as tmp:
        for i in range(args.repeats):
            gone, reason = once(Path(tmp) / f"run-{i}")
            print(f"all processes gone {gone:.2f} s after the launcher's SIGKILL; summary: {reason}")


if __name__ == "__main__":
    main()
