"""Cross-device scale: populations of up to 100,000 clients, up to 1,000 of them per round.

    python bench/scale.py [--populations 1000 10000 100000] [--per-round 10 100 1000]
                          [--examples 1] [--rounds 4] [--aggregation server|nodes]
                          [--cohort auto off] [--json out.json]
                          [--profile lte] [--transport tcp message] [--repeats 3]
                          [--set KEY=VALUE ...] [--timeline all|off]

For each population P and clients per round m (m <= P): ``fedemu launch`` of the default
job (MNIST 2NN, FedAvg, E=1, B=10, virtual time, one worker node per core) with
``data.clients = P``, ``algorithm.C = m / P`` and ``data.partition = "sample"``: every
client draws ``--examples`` training examples of its own (MNIST has 60,000, so 100,000
clients must share some). Real broker, server and worker-node processes, as in any run.

Printed per point:
* start: wall seconds from the launch to the run's start event (loading the data,
  starting every process, spawning and registering P clients);
* round: the median wall seconds of rounds 2..R, split into training (the CPU seconds the
  busiest worker node's pool threads, where clients train, spent per round) and the rest
  (the round's time minus that: the broker, the server, messaging, evaluation);
* CPU seconds per round (rounds 2..R) of all pool threads (training) and of everything
  else in every process of the run (in brackets, the broker's share: where the link model
  runs): the split that other load on the host does not skew;
* messages/s: messages the link model delivered (each client's download and upload)
  per second of round, and how many the broker actually relayed (a round's model goes
  to each worker node once, however many of its clients were selected);
* peak PSS: proportional set size summed over every process of the run (the tree),
  sampled every 0.2 s from /proc, and the peak of each kind of process;
* timeline: the run's timeline.csv, in KB and rows per round (``--profile`` gives every
  client a link, whose transfers it records; with ideal links it has the computations
  only). Run the same point with ``--timeline off`` for what writing it costs a round.

``--transport`` (network.transport) decides how messages cross ``--profile``'s links: the
TCP model (``tcp``, the default) or the pipe (``message``); with ideal links neither
has anything to emulate. Given both (and ``--repeats N``), each point runs N times with
each, alternated so that other load on the host falls on both alike, and the medians
follow the runs: issue 42's cost goal compares the two at 1,000 clients a round on
``lte`` links (docs/results.md, "TCP in real runs"). ``--set`` passes any other override
(``--set network.server_up_bandwidth=1Gbit``) to every run.
"""
from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import shutil
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


def role(pid: int) -> str | None:
    """"broker", "server" or "worker-N" for a fedemu process, else None."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    if "broker" in args:
        return "broker"
    if "server" in args:
        return "server"
    if "worker" in args and "--index" in args:
        return f"worker-{args[args.index('--index') + 1]}"
    return None


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def pool_cpu_s(pid: int) -> float:
    """CPU seconds of a worker node's pool threads (named ``<node>-pool``): where its
    clients' handlers, their local training above all, run."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tasks:
        try:
            if "-pool" not in Path(f"/proc/{pid}/task/{tid}/comm").read_text():
                continue
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / tick


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a whole process, all threads."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def run(population: int, per_round: int, examples: int, rounds: int, out: Path, aggregation: str = "server",
        profile: str | None = None, timeline: str = "all", transport: str | None = None,
        overrides: list[str] = (), cohort: str = "auto") -> dict:
    extra = ["--set", f"network.default_profile={profile}"] if profile else []
    if transport:
        extra += ["--set", f"network.transport={transport}"]
    for item in overrides:
        extra += ["--set", item]
    command = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(out), *extra,
               "--set", f"run.timeline={timeline}", "--set", f"run.aggregation={aggregation}",
               "--set", f"run.cohort={cohort}",
               "--set", f"data.clients={population}", "--set", f"algorithm.C={per_round / population!r}",
               "--set", "data.partition=sample", "--set", f"data.examples_per_client={examples}",
               "--set", f"run.rounds={rounds}", "--set", "run.target_accuracy=0"]
    started = time.monotonic()
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_tree, peak_role = 0, {}
    workers: dict[int, str] = {}
    pool_after_round_1: dict[str, float] | None = None
    pool_last: dict[str, float] = {}
    cpu_after_round_1: dict[int, float] | None = None
    cpu_last: dict[int, float] = {}  # every process of the run
    kinds: dict[int, str] = {}
    to_start = None
    while launcher.poll() is None:
        if to_start is None and events(out):
            to_start = time.monotonic() - started  # the start event is the log's first line
        tree = 0
        for pid in descendants(launcher.pid):
            kind = role(pid)
            if kind is None:
                continue
            kb = pss_kb(pid)
            tree += kb
            cpu_last[pid] = process_cpu_s(pid) or cpu_last.get(pid, 0.0)
            kinds[pid] = kind
            peak_role[kind] = max(peak_role.get(kind, 0), kb)
            if kind.startswith("worker"):
                workers[pid] = kind
        peak_tree = max(peak_tree, tree)
        for pid, kind in workers.items():
            # CPU time only grows: a lower reading is a node shutting down, its pool threads
            # gone while a thread one of them started (a name is inherited) lingers.
            pool_last[kind] = max(pool_cpu_s(pid), pool_last.get(kind, 0.0))
        if pool_after_round_1 is None and any(e["event"] == "round" for e in events(out)):
            pool_after_round_1, cpu_after_round_1 = dict(pool_last), dict(cpu_last)
        time.sleep(0.2)
    output = launcher.stdout.read()
    if launcher.returncode != 0:
        raise RuntimeError(f"the run with {population} clients, {per_round} per round failed:\n{output[-3000:]}")
    log = events(out)
    timed = [e for e in log if e["event"] == "round"][1:]
    median_round = statistics.median(e["round_s"] for e in timed)
    before = pool_after_round_1 or {}
    training = max((pool_last[k] - before.get(k, 0.0)) / len(timed) for k in pool_last) if pool_last else 0.0
    # CPU, not wall: what the rest costs beside training whatever else runs on the host.
    training_cpu = sum(pool_last[k] - before.get(k, 0.0) for k in pool_last) / len(timed)
    all_cpu = sum(cpu_last[p] - (cpu_after_round_1 or {}).get(p, 0.0) for p in cpu_last) / len(timed)
    # The broker's own: where the link model (the TCP model above all) runs.
    broker_cpu = sum(cpu_last[p] - (cpu_after_round_1 or {}).get(p, 0.0) for p in cpu_last
                     if kinds.get(p) == "broker") / len(timed)
    delivered = sum(e["msgs_up"] + e["msgs_down"] for e in timed)
    stats = broker_stats(out)
    relayed_share = ((stats["msgs_up"] + stats["fanout_msgs"] + stats["msgs_down"] - stats["fanout_receivers"])
                     / max(stats["msgs_up"] + stats["msgs_down"], 1))
    round_wall = sum(e["round_s"] for e in timed)
    timeline_file = out / "timeline.csv"
    timeline_kb = timeline_file.stat().st_size / 1024 if timeline_file.exists() else 0.0
    timeline_rows = sum(1 for _ in open(timeline_file)) - 1 if timeline_file.exists() else 0
    all_rounds = len(timed) + 1
    return {
        "population": population, "per_round": per_round, "examples": examples, "rounds": len(timed) + 1,
        "start_s": round(to_start, 2) if to_start is not None else None, "median_round_s": round(median_round, 3),
        "training_s": round(training, 3), "rest_s": round(median_round - training, 3),
        "training_cpu_s": round(training_cpu, 3), "rest_cpu_s": round(all_cpu - training_cpu, 3),
        "broker_cpu_s": round(broker_cpu, 3),
        "delivered_per_s": round(delivered / round_wall), "relayed_per_s": round(delivered * relayed_share / round_wall),
        "peak_tree_pss_mb": round(peak_tree / 1024), "peak_pss_mb": {k: round(v / 1024) for k, v in sorted(peak_role.items())},
        "timeline_kb_per_round": round(timeline_kb / all_rounds, 1),
        "timeline_rows_per_round": round(timeline_rows / all_rounds),
        "wall_s": round(time.monotonic() - started, 1),
    }


def broker_stats(run_dir: Path) -> dict:
    """The broker's final counters, from the line it logs as it stops."""
    for line in (run_dir / "logs" / "broker.log").read_text().splitlines():
        if "broker stopped;" in line:
            return ast.literal_eval(line.split("broker stopped; ", 1)[1])
    raise RuntimeError(f"no final counters in {run_dir / 'logs' / 'broker.log'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--populations", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--per-round", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--examples", type=int, default=1, help="training examples per client")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (>= 2; round 1 is not timed)")
    parser.add_argument("--aggregation", choices=("server", "nodes"), default="server",
                        help="run.aggregation: the server adds every update, or each worker node sums its clients'")
    parser.add_argument("--cohort", nargs="+", choices=("auto", "off"), default=["auto"],
                        help="run.cohort: with both, each point runs with each in turn (alternated)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--profile", help="network.default_profile (e.g. lte): links whose transfers the timeline "
                                          "records (default: ideal links)")
    parser.add_argument("--timeline", choices=("all", "off"), default="all", help="run.timeline")
    parser.add_argument("--transport", choices=("tcp", "message"), nargs="+", default=[None],
                        help="network.transport: how messages cross the links (default: the config's, tcp); "
                             "several: each point runs with each, alternating")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each point, transport and cohort setting, alternated; medians are printed "
                             "after the runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="another override for every run (repeatable)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("need --rounds >= 2")
    if args.repeats < 1:
        parser.error("need --repeats >= 1")
    results = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fedemu-scale-") as tmp:
        for population in args.populations:
            for per_round in args.per_round:
                if per_round > population:
                    continue
                # Alternated, so that load from elsewhere on the host falls on every variant alike.
                for repeat in range(args.repeats):
                    for transport, cohort in itertools.product(args.transport, args.cohort):
                        print(f"  {population} clients, {per_round} per round, transport {transport or 'tcp'}, "
                              f"cohort {cohort}, run {repeat + 1} of {args.repeats} (load "
                              f"{os.getloadavg()[0]:.1f}) ...", file=sys.stderr, flush=True)
                        out = Path(tmp) / f"{population}-{per_round}-{transport}-{cohort}-{repeat}"
                        figures = run(population, per_round, args.examples, args.rounds, out, args.aggregation,
                                      args.profile, args.timeline, transport, args.overrides, cohort)
                        results.append({"transport": transport or "tcp", "cohort": cohort, "repeat": repeat + 1,
                                        **figures})
                        shutil.rmtree(out, ignore_errors=True)  # 100,000 clients' logs add up over repeats
                        if args.json:  # as it goes: a long grid keeps what it measured
                            args.json.write_text(json.dumps(results, indent=2))
    roles = sorted({kind for r in results for kind in r["peak_pss_mb"]})
    print(f"scale: MNIST 2NN, FedAvg E=1 B=10, virtual time, {args.examples} example(s) per client (partition "
          f"'sample'), aggregation on the {args.aggregation}, links {args.profile or 'ideal'}"
          f"{''.join(', ' + o for o in args.overrides)}, timeline {args.timeline}; {os.cpu_count()} cores; "
          f"1-min load average at start {load_before:.2f}, at end {os.getloadavg()[0]:.2f}")
    print("| clients | per round | transport | cohort | start (s) | round (s) | training (s) | rest (s) "
          "| CPU s/round: training / rest (broker) | delivered msg/s | relayed msg/s | tree PSS (MB) | "
          + " | ".join(f"{kind} (MB)" for kind in roles) + " | timeline KB / rows per round |")
    print("|" + " ---: |" * 2 + " --- | --- |" + " ---: |" * (10 + len(roles)))
    for r in results:
        print(f"| {r['population']} | {r['per_round']} | {r['transport']} | {r['cohort']} | {r['start_s']} | {r['median_round_s']} "
              f"| {r['training_s']} | {r['rest_s']} | {r['training_cpu_s']} / {r['rest_cpu_s']} ({r['broker_cpu_s']}) "
              f"| {r['delivered_per_s']} | {r['relayed_per_s']} | {r['peak_tree_pss_mb']} | "
              + " | ".join(str(r["peak_pss_mb"].get(kind, "")) for kind in roles)
              + f" | {r['timeline_kb_per_round']} / {r['timeline_rows_per_round']} |")
    if args.repeats > 1 or len(args.transport) > 1 or len(args.cohort) > 1:
        print_medians(results)


def print_medians(results: list[dict]) -> None:
    """Per point and transport, the medians over the repeats; and each median round
    against the same point's with the ``message`` transport (issue 42's goal: ``tcp``
    within 10%), or against the first transport run."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["population"], r["per_round"], r["transport"], r["cohort"]), []).append(r)
    medians = {key: {field: statistics.median(r[field] for r in runs)
                     for field in ("median_round_s", "rest_cpu_s", "broker_cpu_s", "training_cpu_s")}
               for key, runs in groups.items()}
    base_name = "message" if any(t == "message" for _, _, t, _ in groups) else next(iter(groups))[2]
    print(f"\nmedians over the runs (round: against {base_name}):")
    print(f"| clients | per round | transport | cohort | runs | round (s) | / {base_name} | rest CPU s/round "
          "| broker CPU s/round | training CPU s/round |")
    print("|" + " ---: |" * 10)
    for (population, per_round, transport, cohort), m in medians.items():
        base = medians.get((population, per_round, base_name, cohort))
        ratio = f"{m['median_round_s'] / base['median_round_s']:.3f}" if base else ""
        print(f"| {population} | {per_round} | {transport} | {cohort} | {len(groups[population, per_round, transport, cohort])} "
              f"| {m['median_round_s']:.3f} | {ratio} | {m['rest_cpu_s']:.3f} | {m['broker_cpu_s']:.3f} "
              f"| {m['training_cpu_s']:.3f} |")


if __name__ == "__main__":
    main()
