"""Seconds per round of the default job: fedemu against a plain single-process loop.

Issue requirement (a): the default job (MNIST 2NN, IID, K=100, C=0.1, E=1, B=10,
lr=0.1, one evaluation on the 10k test set per round) run by ``fedemu launch``,
against a plain PyTorch loop doing the same training in one process, as a ratio
measured in one run. Aim: round-time overhead under 15%.

Two cases:

* overhead: fedemu with one worker node and 1 torch thread everywhere, against the
  plain loop with 1 torch thread: the pure cost of processes, broker and wire.
* user: fedemu with its default worker count and threads (what a user gets),
  against the plain loop with torch's default thread count.

fedemu's figure is ``round_s`` from ``events.jsonl`` (wall seconds of a round, from
client selection to the end of its evaluation); the plain loop times the same span.
Round 1 of every run is left out (warm-up: first allocations, page faults on the
data set, lazy torch initialisation). Each case alternates fedemu and plain runs
(``--repeats``, default 2) and pools their rounds, so slow drift of a shared
machine does not land on one side only.

The plain loop reuses fedemu's own pieces where they *are* the training (selection
seed, shards, ClientUpdate, per-client shuffling seed, n_k-weighted average,
evaluate), so both sides compute the same models: the final test accuracies are
printed side by side as a check. It runs in a subprocess so that its torch thread
setting cannot leak into anything else.

    /work/venv/bin/python bench/round_overhead.py [--rounds 20] [--repeats 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Plenty for 20 rounds of the default job on 2 cores (~3 s a round at worst).
RUN_TIMEOUT_S = 1800


def load_average() -> float:
    """The 1-minute load average: other work on the machine skews every figure here."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def _tail(path: Path, lines: int = 15) -> str:
    """The end of a log, for an error message: the temporary folder goes away on exit."""
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return "\n".join(text[-lines:]) or "(no output)"


# --- the plain loop (runs in a subprocess: `round_overhead.py --plain-loop`) ---------------


def plain_loop(rounds: int, threads: int | None) -> dict:
    """FedAvg on the default job in one process; returns per-round wall seconds."""
    import numpy as np
    import torch

    from fedemu.launch import config as configuration
    from fedemu.common.algorithms.rounds import selected_per_round, weighted_average
    from fedemu.common.ml import data, models, partition, training
    from fedemu.worker.client import client_generator

    if threads is not None:
        torch.set_num_threads(threads)
    config = configuration.load(None, [f"run.rounds={rounds}"])
    run, data_cfg, algo = config["run"], config["data"], config["algorithm"]
    seed, clients = run["seed"], data_cfg["clients"]

    dataset = data.load(data_cfg["dataset"], data_cfg["cache_dir"] or None)
    # Copied into memory, as a plain script would hold it (fedemu's workers index the memory map).
    train_images, train_labels = np.array(dataset.train_x), np.array(dataset.train_y)
    test_images, test_labels = np.array(dataset.test_x), np.array(dataset.test_y)
    opts = {"shards_per_client": data_cfg["shards_per_client"]} if data_cfg["partition"] == "shards" else {}
    shards = partition.make(data_cfg["partition"], train_labels, clients, seed, **opts)

    if algo["name"] != "fedavg":
        raise SystemExit(f"the plain loop is FedAvg only; the default job says {algo['name']!r}")
    model_spec = configuration.model_spec(config)
    global_model = model_spec.build(seed=seed)  # same initial weights as the server
    local_model = model_spec.build()  # reused for every client, like a worker's
    weights = models.get_flat(global_model)
    # The round engine's selection RNG, so the same clients train in every round.
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E1EC7]))
    m = selected_per_round(algo["C"], clients)
    everyone = list(range(clients))
    iterations = [0] * clients  # SGD steps each client has taken: its lr decay clock, as on a worker

    round_seconds, accuracy = [], None
    for round_ in range(1, rounds + 1):
        started = time.monotonic()
        selected = sorted(int(k) for k in rng.choice(everyone, size=m, replace=False))
        updates, counts = [], []
        for k in selected:
            models.set_flat(local_model, weights)
            result = training.client_update(
                local_model, train_images[shards[k]], train_labels[shards[k]],
                epochs=algo["E"], batch_size=algo["B"], lr=algo["lr"], lr_decay=algo["lr_decay"],
                start_iteration=iterations[k], generator=client_generator(seed, round_, k))
            iterations[k] += result.steps
            updates.append(result.weights)
            counts.append(result.num_samples)
        weights = weighted_average(updates, counts)
        models.set_flat(global_model, weights)
        accuracy, _ = training.evaluate(global_model, test_images, test_labels)
        round_seconds.append(time.monotonic() - started)
    return {"round_s": round_seconds, "accuracy": accuracy, "torch_threads": torch.get_num_threads()}


def run_plain(rounds: int, threads: int | None, log: Path) -> dict:
    argv = [sys.executable, __file__, "--plain-loop", "--rounds", str(rounds)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    with open(log, "wb") as err:
        out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, check=False, timeout=RUN_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"the plain loop failed ({out.returncode}):\n{_tail(log)}")
    return json.loads(out.stdout)


# --- fedemu ---------------------------------------------------------------------------------


def run_fedemu(rounds: int, run_dir: Path, extra: list[str]) -> dict:
    from fedemu.server.runlog import read_events

    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir),
            "--set", f"run.rounds={rounds}", "--set", "run.target_accuracy=0", *extra]
    log = run_dir.with_suffix(".out")
    with open(log, "wb") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=RUN_TIMEOUT_S)
    events = read_events(run_dir)
    round_events = [e for e in events if e["event"] == "round"]
    if proc.returncode != 0 or len(round_events) != rounds:
        raise RuntimeError(f"fedemu launch failed ({proc.returncode}, {len(round_events)} of {rounds} rounds):\n"
                           f"{_tail(log)}")
    workers = next(len(e["placement"]) for e in events if e["event"] == "start")
    return {"round_s": [e["round_s"] for e in round_events], "accuracy": round_events[-1]["accuracy"],
            "workers": workers, "argv": argv[2:]}


# --- the benchmark ----------------------------------------------------------------------------


def summarise(runs: list[list[float]]) -> dict:
    """Median and mean over every run's rounds 2..R (round 1 of each run is warm-up)."""
    steady = [s for round_s in runs for s in round_s[1:]]
    return {"median_s": statistics.median(steady), "mean_s": statistics.fmean(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds per run (>= 2; round 1 is not counted)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="fedemu and plain runs per case, alternating; their rounds are pooled")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--keep", type=Path, help="keep the fedemu run directories and logs in this folder")
    parser.add_argument("--plain-loop", action="store_true", help=argparse.SUPPRESS)  # the subprocess side
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error("--rounds must be at least 2: round 1 is warm-up and not counted")
    if args.plain_loop:
        json.dump(plain_loop(args.rounds, args.threads), sys.stdout)
        return

    cores = os.cpu_count() or 1
    load_before = load_average()
    cases = [
        # (name, fedemu launch options, plain-loop torch threads; None = torch's default)
        ("overhead", ["--workers", "1", "--set", "run.torch_threads=1"], 1),
        ("user", [], None),
    ]
    results = []
    with tempfile.TemporaryDirectory(prefix="fedemu-bench-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name, fedemu_opts, threads in cases:
            feds, plains = [], []
            # Alternate fedemu and plain runs: slow drift of the machine hits both alike.
            for rep in range(1, args.repeats + 1):
                print(f"[{name} {rep}/{args.repeats}] fedemu launch {' '.join(fedemu_opts) or '(defaults)'}, "
                      f"{args.rounds} rounds ...", file=sys.stderr, flush=True)
                feds.append(run_fedemu(args.rounds, work / f"{stamp}-{name}-{rep}-fedemu", fedemu_opts))
                print(f"[{name} {rep}/{args.repeats}] plain loop, torch threads {threads or 'default'} ...",
                      file=sys.stderr, flush=True)
                plains.append(run_plain(args.rounds, threads, work / f"{stamp}-{name}-{rep}-plain.err"))
            f, p = summarise([r["round_s"] for r in feds]), summarise([r["round_s"] for r in plains])
            workers = feds[0]["workers"]
            results.append({
                "case": name, "fedemu_workers": workers,
                "fedemu_torch_threads": 1 if threads == 1 else max(1, cores // workers),  # per worker node
                "plain_torch_threads": plains[0]["torch_threads"],
                "fedemu_median_s": f["median_s"], "fedemu_mean_s": f["mean_s"],
                "plain_median_s": p["median_s"], "plain_mean_s": p["mean_s"],
                "ratio": f["median_s"] / p["median_s"], "ratio_mean": f["mean_s"] / p["mean_s"],
                "fedemu_accuracy": feds[0]["accuracy"], "plain_accuracy": plains[0]["accuracy"],
                "fedemu_round_s": [r["round_s"] for r in feds], "plain_round_s": [r["round_s"] for r in plains],
            })

    load_after = load_average()
    print(f"round time, default job (MNIST 2NN, IID, K=100, C=0.1, E=1, B=10, lr=0.1, eval each round); "
          f"{cores} cores ({platform.processor() or platform.machine()})")
    print(f"{args.repeats} fedemu and {args.repeats} plain runs per case, alternating, {args.rounds} rounds each; "
          f"s/round = median (mean) over rounds 2..{args.rounds} of every run")
    print(f"1-min load average at start {load_before:.2f}, at end {load_after:.2f} "
          "(this benchmark keeps about 1-2 cores busy; more means other work was running)")
    print()
    header = (f"{'case':8} | {'fedemu setup':24} | {'plain':9} | {'fedemu s/round':15} | "
              f"{'plain s/round':15} | {'ratio':5} | {'overhead':8} | {'acc fedemu/plain':16}")
    print(header)
    print("-" * len(header))
    for r in results:
        setup = f"{r['fedemu_workers']} worker node(s) x {r['fedemu_torch_threads']} thr"
        print(f"{r['case']:8} | {setup:24} | {str(r['plain_torch_threads']) + ' thr':9} | "
              f"{r['fedemu_median_s']:6.3f} ({r['fedemu_mean_s']:6.3f}) | "
              f"{r['plain_median_s']:6.3f} ({r['plain_mean_s']:6.3f}) | {r['ratio']:5.2f} | "
              f"{(r['ratio'] - 1):+8.1%} | {r['fedemu_accuracy']:.4f}/{r['plain_accuracy']:.4f}")
    print()
    print("fedemu: thr = torch threads per worker node (the server node evaluates with cores/1 threads "
          "in the user case, 1 in the overhead case); plain: thr = torch.get_num_threads() of the loop")
    overhead = next(r for r in results if r["case"] == "overhead")
    print(f"aim: round-time overhead under 15%: {'met' if overhead['ratio'] < 1.15 else 'NOT met'} "
          f"({overhead['ratio'] - 1:+.1%})")

    if args.json:
        args.json.write_text(json.dumps({"benchmark": "round_overhead", "cores": cores, "rounds": args.rounds,
                                         "repeats": args.repeats, "load_average": [load_before, load_after],
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
