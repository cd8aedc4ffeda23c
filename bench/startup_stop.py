"""How long a run stopped while it starts up takes to end: the default job is launched
and sent SIGTERM the moment its run directory holds config.toml (the launcher is
fetching the data set) or logs/server.out (the server is importing); printed are the
seconds until the launcher has exited and no process names the run directory, its exit
code and the summary's status and reason.

    python bench/startup_stop.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POINTS = {"config written": "config.toml", "server importing": "logs/server.out"}


def left(run_dir: Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if int(pid) != os.getpid()]


def once(run_dir: Path, marker: str) -> tuple[float, int, dict]:
    launcher = subprocess.Popen([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir),
                                 "--set", "run.rounds=200", "--set", "run.target_accuracy=0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (run_dir / marker).exists():
        time.sleep(0.01)
    launcher.send_signal(signal.SIGTERM)
    stopped = time.monotonic()  # wall
    code = launcher.wait()
    while left(run_dir):
        time.sleep(0.05)
    return time.monotonic() - stopped, code, json.loads((run_dir / "summary.json").read_text())  # wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedemu-startup-stop-") as tmp:
        for point, marker in POINTS.items():
            for i in range(args.repeats):
                gone, code, summary = once(Path(tmp) / f"{marker.replace('/', '-')}-{i}", marker)
                print(f"SIGTERM when {point}: all gone {gone:.2f} s later, exit code {code}; "
                      f"{summary['status']}: {summary['reason']}")


if __name__ == "__main__":
    main()
