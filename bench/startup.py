"""What a one-round default job costs from `fedemu launch` to its exit, with local nodes
forked from the zygote and without it (FEDEMU_ZYGOTE=0, each node its own interpreter),
alternated: the median wall time, the CPU of the whole process tree, and where the wall
time goes, by phase, from the run directory's timestamps:

* launcher: from the command to config.toml (interpreter, CLI, the config, whose
  algorithm lookup imports torch);
* broker: on to broker.endpoint (the broker process binds);
* node imports: on to the server's first log line (torch and the node code imported:
  forked from the zygote, or imported by the node itself);
* data and model: on to the run's `start` event (data loaded, model built, clients
  spawned on every worker node, the clock started);
* first round: the `round` event's time after the `start` event's;
* end: on to the launcher's exit (shutdown, processes reaped).

The CPU figure is the tree's (this script is the subreaper of the launcher's processes,
so the zygote, which outlives the launcher by a moment, is counted); it is accounted two
ways: by phase (the whole tree's CPU while the phase lasted: the zygote's imports run
during the launcher's and the broker's phases), and by process (each one's own CPU: the
zygote's is the imports). Both come from /proc, sampled every 10 ms. The machine's load
average is printed with the figures: on a shared machine they move with it.

    python bench/startup.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from process_tree import adopt_orphans, children_cpu_s, descendants, reap_orphans

PHASES = ("launcher", "broker", "node imports", "data and model", "first round", "end")
# Processes by what they are, for their own CPU (the zygote's: its imports and forks).
ROLES = ("launcher", "zygote", "broker", "server", "workers", "other")


def _log_time(line: str) -> float:
    stamp = " ".join(line.split()[:2])
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _milestones(run_dir: Path) -> list[bool]:
    """Which phases' ends the run directory shows so far (PHASES, less the last: the exit)."""
    events = run_dir / "events.jsonl"
    text = events.read_text() if events.exists() else ""
    server_log = run_dir / "logs" / "server.log"
    return [(run_dir / "config.toml").exists(), (run_dir / "broker.endpoint").exists(),
            server_log.exists() and server_log.stat().st_size > 0,
            '"event": "start"' in text, '"event": "round"' in text]


def once(run_dir: Path, zygote: bool) -> dict:
    cpu_before = children_cpu_s()
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir),
            "--set", "run.rounds=1", "--set", "run.target_accuracy=0"]
    t0 = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "FEDEMU_ZYGOTE": "1" if zygote else "0"})
    # The tree's CPU at each phase's end, as this loop first sees it (every 10 ms: a
    # phase's CPU is its share of the tree's while the phase lasts, to a tick or two).
    cpu_at: list[float] = []
    by_pid: dict[int, tuple[str, float]] = {}  # each process's role and own CPU, last seen
    while proc.poll() is None:
        live = descendants()
        for pid, (own, _) in live.items():
            by_pid[pid] = (_role(pid) or by_pid.get(pid, ("other",))[0], own)
        seen = _milestones(run_dir)
        while len(cpu_at) < len(seen) and seen[len(cpu_at)]:
            cpu_at.append(children_cpu_s() + sum(own + reaped for own, reaped in live.values()) - cpu_before)
        time.sleep(0.01)
    code = proc.returncode
    t_exit = time.time()
    reap_orphans()  # the zygote, orphaned to us when the launcher exits
    cpu = children_cpu_s() - cpu_before
    if code != 0:
        raise SystemExit(f"the run failed (exit {code}): see {run_dir}")
    cpu_at += [cpu_at[-1] if cpu_at else 0.0] * (len(PHASES) - 1 - len(cpu_at)) + [cpu]  # a phase too quick to see
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    first = next(e for e in events if e["event"] == "round")
    summary_at = (run_dir / "summary.json").stat().st_mtime
    end_event = next(e for e in events if e["event"] == "end")
    t_start = summary_at - (end_event["t"] - start["t"])  # the start event, in this clock
    marks = [t0, (run_dir / "config.toml").stat().st_mtime, (run_dir / "broker.endpoint").stat().st_mtime,
             _log_time((run_dir / "logs" / "server.log").read_text().splitlines()[0]), t_start]
    phases = dict(zip(PHASES, [b - a for a, b in zip(marks, marks[1:])]))
    phases["first round"] = first["t"] - start["t"]
    phases["end"] = t_exit - t_start - phases["first round"]
    phase_cpu = dict(zip(PHASES, [b - a for a, b in zip([0.0, *cpu_at], cpu_at)]))
    roles = {role: sum(own for r, own in by_pid.values() if r == role) for role in ROLES}
    return {"wall_s": t_exit - t0, "cpu_s": cpu, **{f"{p}_s": v for p, v in phases.items()},
            **{f"{p}_cpu_s": v for p, v in phase_cpu.items()}, **{f"{r}_own_cpu_s": v for r, v in roles.items()}}


def _role(pid: int) -> str | None:
    """What a process of the run is, from its command line (a forked node shows its own)."""
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    if not text:
        return None  # exited, not yet reaped: it was what it was
    if "zygote import main" in text:
        return "zygote"
    for role, marker in (("launcher", " launch --out "), ("broker", " broker "), ("server", " node server "),
                         ("workers", " node worker ")):
        if marker in text:
            return role
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="Write every run's figures here too.")
    args = parser.parse_args()
    adopt_orphans()
    results: dict[str, list[dict]] = {"zygote": [], "no zygote": []}
    loads = []
    with tempfile.TemporaryDirectory(prefix="fedemu-startup-") as tmp:
        for i in range(args.repeats):
            for label in results:  # alternated: the machine's load falls on both alike
                loads.append(os.getloadavg()[0])
                row = once(Path(tmp) / f"{label.replace(' ', '-')}-{i}", label == "zygote")
                results[label].append(row)
                print(f"{label:>9} {i + 1}/{args.repeats}: wall {row['wall_s']:.2f} s, cpu {row['cpu_s']:.2f} s",
                      file=sys.stderr)
    print(f"one-round default job, {args.repeats} runs each, alternated; medians (s); "
          f"1-min load average {min(loads):.2f}-{max(loads):.2f} during the runs, {os.cpu_count()} cores")
    for what, keys in (("wall", ["wall_s", *(f"{p}_s" for p in PHASES)]),
                       ("CPU of the process tree", ["cpu_s", *(f"{p}_cpu_s" for p in PHASES)])):
        print(f"\n{what}, by phase:")
        print("| path | total | " + " | ".join(PHASES) + " |")
        print("|---|" + "---:|" * len(keys))
        for label, rows in results.items():
            print(f"| {label} | " + " | ".join(f"{statistics.median(r[k] for r in rows):.2f}" for k in keys) + " |")
    print("\nown CPU of each kind of process (to its last 10 ms sample; the zygote's: its imports and forks):")
    print("| path | " + " | ".join(ROLES) + " |")
    print("|---|" + "---:|" * len(ROLES))
    for label, rows in results.items():
        print(f"| {label} | " + " | ".join(f"{statistics.median(r[f'{k}_own_cpu_s'] for r in rows):.2f}"
                                         for k in ROLES) + " |")
    if args.json:
        args.json.write_text(json.dumps({"loadavg": loads, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
