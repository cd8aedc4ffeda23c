"""Scale: one machine carries many emulated clients, with only the selected ones busy.

    python bench/scale.py [--clients 100 1000 10000] [--rounds 6] [--json out.json]

For each client count K: ``fedemu launch`` of the default job (MNIST 2NN, FedAvg, IID,
one worker node per core) with C = 10 / K, so 10 clients train per round whatever K,
and every client under an on/off drop-out (mean 60 s up, 20 s down), so the broker
keeps telling the worker nodes of devices going offline and coming back. The server
over-selects 10 more and closes a round at the first 10 updates, so an offline client
does not hold it to its deadline. Real broker, server and worker-node processes, as in
any run.

Printed per K: wall seconds from the launch to the server's start event (loading the
data, starting every process, spawning and registering K clients), the median round
time over rounds 2..R, the mean number of clients offline at a round's end (the
drop-out at work), and the peak resident memory of each kind of process (broker,
server, each worker node), sampled every 0.1 s from /proc. Memory that grows with K
is the clients' own state. A client's IID shard is 60,000 / K samples, so rounds get
shorter as K grows: compare round times within a K, not across.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def descendants(root: int) -> list[int]:
    """Pids of every process below ``root`` (from /proc: no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def role_and_rss(pid: int) -> tuple[str, int] | None:
    """("broker" | "server" | "worker-N", resident kB) of a fedemu process, else None."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    if "broker" in args:
        role = "broker"
    elif "server" in args:
        role = "server"
    elif "worker" in args and "--index" in args:
        role = f"worker-{args[args.index('--index') + 1]}"
    else:
        return None
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return role, rss


def run(clients: int, rounds: int, out: Path) -> dict:
    command = [sys.executable, "-m", "fedemu.launch", "launch",
               "--set", f"data.clients={clients}", "--set", f"algorithm.C={10 / clients}",
               "--set", f"run.rounds={rounds}", "--set", "run.target_accuracy=0",
               "--set", "network.dropout.on_off.mean_up_s=60", "--set", "network.dropout.on_off.mean_down_s=20",
               "--set", "algorithm.over_select=10", "--set", "algorithm.deadline_s=30", "--set", f"run.out={out}"]
    started = time.monotonic()
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak: dict[str, int] = {}
    to_start = None
    while launcher.poll() is None:
        if to_start is None and any(log.stat().st_size > 0 for log in out.glob("*/events.jsonl")):
            to_start = time.monotonic() - started  # the start event is the log's first line
        for pid in descendants(launcher.pid):
            found = role_and_rss(pid)
            if found is not None:
                peak[found[0]] = max(peak.get(found[0], 0), found[1])
        time.sleep(0.1)
    output = launcher.stdout.read()
    if launcher.returncode != 0:
        raise RuntimeError(f"the run with {clients} clients failed:\n{output[-3000:]}")
    wall = time.monotonic() - started
    run_dir = next(out.iterdir())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open() if line.endswith("\n")]
    round_events = [e for e in events if e["event"] == "round"]
    return {
        "clients": clients, "rounds": len(round_events), "wall_s": round(wall, 2),
        "start_s": round(to_start, 2) if to_start is not None else None,
        "median_round_s": round(statistics.median(e["round_s"] for e in round_events[1:]), 3),
        "mean_offline": round(statistics.mean(len(e["offline"]) for e in round_events), 1),
        "peak_rss_mb": {role: round(kb / 1024) for role, kb in sorted(peak.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (>= 2; round 1 is not timed)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    if args.rounds < 2 or min(args.clients) < 10:
        parser.error("need --rounds >= 2 and at least 10 clients (10 train per round)")
    results = []
    with tempfile.TemporaryDirectory(prefix="fedemu-scale-") as tmp:
        for clients in args.clients:
            print(f"  {clients} clients ...", file=sys.stderr, flush=True)
            results.append(run(clients, args.rounds, Path(tmp) / str(clients)))
    roles = sorted({role for r in results for role in r["peak_rss_mb"]})
    print(f"scale: default job, 10 clients per round, on/off drop-out on every client; {os.cpu_count()} cores; "
          f"1-min load average at end {os.getloadavg()[0]:.2f}")
    print("| clients | to start (s) | median round (s) | offline at round end | "
          + " | ".join(f"{role} peak RSS (MB)" for role in roles) + " |")
    print("|" + " ---: |" * (4 + len(roles)))
    for r in results:
        print(f"| {r['clients']} | {r['start_s']} | {r['median_round_s']} | {r['mean_offline']} | "
              + " | ".join(str(r["peak_rss_mb"].get(role, "")) for role in roles) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
