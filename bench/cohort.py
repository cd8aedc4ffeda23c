"""Cohort training (run.cohort): whole jobs under fedemu with cohorts on and off, against a
plain PyTorch FedAvg loop over a two-process pool, alternated in one run.

    python bench/cohort.py [--jobs 2nn cnn-e5] [--rounds 20] [--cnn-rounds 3] [--repeats 3] [--json out.json]
    python bench/cohort.py --engine [--repeats 3]     # the batched computation alone

Jobs: ``2nn`` is the default job (MNIST, McMahan et al.'s 2NN, IID over 100 clients,
C = 0.1, E = 1, B = 10, one evaluation of the 10,000 test images a round); ``cnn-e5`` the
same with their CNN and E = 5. Each repeat runs, one after the other: the plain loop,
``fedemu launch`` with ``run.cohort = "auto"``, and with ``"off"`` (the order turns by one
each repeat, so a drift of a shared machine's load does not land on one variant).

The plain loop is what one would write by hand for two cores: the main process holds the
model and the test set, a ``multiprocessing`` pool of two processes (one torch thread each,
as fedemu's worker nodes in virtual time) trains a round's clients, half each, from the
model sent to them, and the main process averages (n_k-weighted) and evaluates. It uses
fedemu's selection seed, shards, ClientUpdate and shuffling seeds, so both sides train the
same models: the final accuracies are printed side by side.

Figures: the job's wall time, launch to exit, as a user times it (start-up included), the
CPU seconds of all its processes (what a loaded machine does not stretch), and the median
round over rounds 2..R (fedemu's ``round_s``; the plain loop times the same span); the
ratios are fedemu's over the plain loop's, each the median over the repeats. The 1-minute
load average before and after says how busy the machine was.
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

from process_tree import adopt_orphans, children_cpu_s, reap_orphans

RUN_TIMEOUT_S = 3600

JOBS = {
    "2nn": [],
    # No deadline: at the default 1 GFLOP/s a client's five epochs are charged about 220 emulated s,
    # past the default 60 s, and every reply would come too late.
    "cnn-e5": ["model.name=cnn", "algorithm.E=5", "algorithm.deadline_s=0"],
}


def load_average() -> float:
    return os.getloadavg()[0]




# --- the plain loop (a subprocess: `cohort.py --plain-loop JOB`) ------------------------------

_POOL: dict = {}  # each pool process's data and model, set by _init


def _init(spec, images, labels, shards, algo, seed) -> None:
    import torch

    torch.set_num_threads(1)
    _POOL.update(model=spec.build(), images=images, labels=labels, shards=shards, algo=algo, seed=seed)


def _train(args):
    from fedemu.worker.client import client_generator
    from fedemu.common.ml import models, training

    k, round_, weights, iteration = args
    pool, algo = _POOL, _POOL["algo"]
    models.set_flat(pool["model"], weights)
    result = training.client_update(
        pool["model"], pool["images"][pool["shards"][k]], pool["labels"][pool["shards"][k]],
        epochs=algo["E"], batch_size=algo["B"], lr=algo["lr"], lr_decay=algo["lr_decay"],
        start_iteration=iteration, generator=client_generator(pool["seed"], round_, k))
    return k, result.weights, result.num_samples, result.steps


def plain_loop(job: str, rounds: int) -> dict:
    import multiprocessing

    import numpy as np

    from fedemu.launch import config as configuration
    from fedemu.node import streams
    from fedemu.common.algorithms.rounds import selected_per_round, weighted_average
    from fedemu.common.ml import models, split, training

    import torch

    started = time.monotonic()
    torch.set_num_threads(1)  # the server's evaluation in fedemu's virtual time has one thread too
    config = configuration.load(None, [f"run.rounds={rounds}", *JOBS[job]])
    run, data_cfg, algo = config["run"], config["data"], config["algorithm"]
    seed, clients = run["seed"], data_cfg["clients"]
    run_data, shards = split.run_data(configuration.data_spec(config))  # fedemu's own shards
    # In memory, as a plain script would hold them (fedemu's nodes index the memory map).
    images, labels = np.array(run_data.train_x), np.array(run_data.train_y)
    test_images, test_labels = np.array(run_data.test_x), np.array(run_data.test_y)
    shards = [np.asarray(shard) for shard in shards]
    spec = configuration.model_spec(config)
    m = selected_per_round(algo["C"], clients)
    iterations = [0] * clients
    round_seconds, accuracy = [], None
    # Forked before this process runs torch (a fork after torch's thread pools start is
    # unsafe); the pool shares the data set's pages with it, as a hand-written script would.
    with multiprocessing.get_context("fork").Pool(2, _init, (spec, images, labels, shards, algo, seed)) as pool:
        model = spec.build(seed=seed)  # the server's initial weights
        weights = models.get_flat(model)
        for round_ in range(1, rounds + 1):
            began = time.monotonic()
            selected = sorted(int(k) for k in streams.generator(seed, "selection", round_).choice(
                list(range(clients)), size=m, replace=False))  # the round engine's choice
            half = -(-len(selected) // 2)
            results = pool.map(_train, [(k, round_, weights, iterations[k]) for k in selected], chunksize=half)
            for k, _, _, steps in results:
                iterations[k] += steps
            weights = weighted_average([r[1] for r in results], [r[2] for r in results])
            models.set_flat(model, weights)
            accuracy, _ = training.evaluate(model, test_images, test_labels)
            round_seconds.append(time.monotonic() - began)
    return {"round_s": round_seconds, "accuracy": accuracy, "inside_s": time.monotonic() - started}


def run_plain(job: str, rounds: int) -> dict:
    began, cpu = time.monotonic(), children_cpu_s()
    out = subprocess.run([sys.executable, __file__, "--plain-loop", job, "--rounds", str(rounds)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=RUN_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"the plain loop failed:\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout), "wall_s": time.monotonic() - began, "cpu_s": children_cpu_s() - cpu}


def run_fedemu(job: str, rounds: int, cohort: str, run_dir: Path) -> dict:
    from fedemu.server.runlog import read_events

    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--set", f"run.rounds={rounds}",
            "--set", "run.target_accuracy=0", "--set", f"run.cohort={cohort}"]
    for override in JOBS[job]:
        argv += ["--set", override]
    began, cpu = time.monotonic(), children_cpu_s()
    out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
    wall = time.monotonic() - began
    reap_orphans()  # the zygote and its nodes' CPU (process_tree)
    cpu = children_cpu_s() - cpu
    rounds_seen = [e for e in read_events(run_dir) if e["event"] == "round"]
    if out.returncode != 0 or len(rounds_seen) != rounds:
        raise RuntimeError(f"fedemu launch failed ({out.returncode}):\n{out.stdout[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"round_s": [e["round_s"] for e in rounds_seen], "accuracy": rounds_seen[-1]["accuracy"], "wall_s": wall,
            "cpu_s": cpu, "weights_sha256": summary["weights_sha256"]}


# --- the computation alone (`cohort.py --engine`) --------------------------------------------

ENGINE_CASES = [  # (model, clients, examples each, B, E)
    ("2nn", 500, 1, 10, 1),
    ("2nn", 5, 600, 10, 1),
    ("2nn", 50, 600, 10, 1),
    ("cnn", 4, 100, 10, 1),
]


def engine(repeats: int) -> list[dict]:
    """CPU milliseconds a client of the local training alone (no process, no message):
    ``ml.cohort.train`` over all clients at once against ``training.client_update`` one
    by one, alternated, best of ``repeats``; one torch thread, memory kept as a worker
    node keeps it (lifecycle.retain_freed_memory). Both give the same bits (asserted)."""
    import numpy as np
    import torch

    from fedemu.launch.running.lifecycle import retain_freed_memory
    from fedemu.common.ml import cohort, models, training
    from fedemu.common.ml.datasets import get
    from fedemu.common.ml.models import ModelSpec

    retain_freed_memory()
    torch.set_num_threads(1)
    mnist = get("mnist")
    rows = []
    for name, clients, examples, batch, epochs in ENGINE_CASES:
        model = ModelSpec(name, mnist).build(seed=1)
        start = models.get_flat(model)
        rng = np.random.default_rng(0)
        data = [(rng.integers(0, 256, (examples, 28, 28), dtype=np.uint8), rng.integers(0, 10, examples))
                for _ in range(clients)]
        together, alone = [], []
        for _ in range(repeats):
            members = [cohort.Member(x=x, y=y, start=start, generator=torch.Generator().manual_seed(k), epochs=epochs,
                                     batch_size=batch, lr=0.1) for k, (x, y) in enumerate(data)]
            began = time.thread_time()
            batched = cohort.train(model, members, mnist)
            together.append(time.thread_time() - began)
            began = time.thread_time()
            own = []
            for k, (x, y) in enumerate(data):
                models.set_flat(model, start)
                own.append(training.client_update(model, x, y, epochs=epochs, batch_size=batch, lr=0.1,
                                                  generator=torch.Generator().manual_seed(k), dataset=mnist))
            alone.append(time.thread_time() - began)
            assert all(a.weights.tobytes() == b.weights.tobytes() for a, b in zip(own, batched))
            del batched, own
        rows.append({"model": name, "clients": clients, "examples": examples, "B": batch, "E": epochs,
                     "cohort_ms": 1000 * min(together) / clients, "alone_ms": 1000 * min(alone) / clients})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=["2nn", "cnn-e5"])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the 2NN job (>= 2)")
    parser.add_argument("--cnn-rounds", type=int, default=3, help="rounds of the CNN job (>= 2; ~1 min a round)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--engine", action="store_true",
                        help="time the batched computation alone against per-client training instead (~1 min)")
    parser.add_argument("--plain-loop", choices=sorted(JOBS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_loop:
        json.dump(plain_loop(args.plain_loop, args.rounds), sys.stdout)
        return
    adopt_orphans()
    if args.engine:
        load = load_average()
        rows = engine(args.repeats)
        print(f"local training alone, CPU ms a client (best of {args.repeats}, alternated); 1-min load average "
              f"{load:.1f} before, {load_average():.1f} after")
        print("| model | clients | examples each | B | E | cohort | one by one | ratio |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['model']} | {r['clients']} | {r['examples']} | {r['B']} | {r['E']} | {r['cohort_ms']:.3f} "
                  f"| {r['alone_ms']:.3f} | {r['cohort_ms'] / r['alone_ms']:.2f} |")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return
    variants = ["plain", "auto", "off"]
    results = []
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="fedemu-cohort-") as tmp:
        for job in args.jobs:
            rounds = args.cnn_rounds if job.startswith("cnn") else args.rounds
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for rep in range(args.repeats):
                for variant in variants[rep % 3:] + variants[:rep % 3]:
                    print(f"[{job} {rep + 1}/{args.repeats}] {variant} ({rounds} rounds; load "
                          f"{load_average():.1f}) ...", file=sys.stderr, flush=True)
                    if variant == "plain":
                        runs[variant].append(run_plain(job, rounds))
                    else:
                        runs[variant].append(run_fedemu(job, rounds, variant, Path(tmp) / f"{job}-{variant}-{rep}"))
            summary = {"job": job, "rounds": rounds}
            for variant, done in runs.items():
                summary[variant] = {
                    "wall_s": [round(r["wall_s"], 2) for r in done],
                    "median_wall_s": round(statistics.median(r["wall_s"] for r in done), 2),
                    "cpu_s": [round(r["cpu_s"], 2) for r in done],
                    "median_cpu_s": round(statistics.median(r["cpu_s"] for r in done), 2),
                    "median_round_s": round(statistics.median(s for r in done for s in r["round_s"][1:]), 3),
                    "accuracy": done[0]["accuracy"],
                }
            hashes = {r["weights_sha256"] for v in ("auto", "off") for r in runs[v]}
            summary["same_weights_on_and_off"] = len(hashes) == 1
            results.append(summary)
            if args.json:
                args.json.write_text(json.dumps({"results": results, "load_average_before": load_before}, indent=2))
    load_after = load_average()
    print(f"cohort training: fedemu launch (2 worker nodes, virtual time) with run.cohort auto / off against a "
          f"plain FedAvg loop over a two-process pool; {args.repeats} alternated repeats; {os.cpu_count()} cores; "
          f"1-min load average {load_before:.1f} before, {load_after:.1f} after")
    print("| job | rounds | plain: job s / CPU s (round s) | cohort auto: job s / CPU s (round s) | cohort off: "
          "job s / CPU s (round s) | auto / plain: wall, CPU | off / plain: wall, CPU | accuracy plain / fedemu "
          "| same weights on/off |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in results:
        cell = lambda v: f"{r[v]['median_wall_s']} / {r[v]['median_cpu_s']} ({r[v]['median_round_s']})"
        ratio = lambda v: (f"{r[v]['median_wall_s'] / r['plain']['median_wall_s']:.2f}, "
                           f"{r[v]['median_cpu_s'] / r['plain']['median_cpu_s']:.2f}")
        print(f"| {r['job']} | {r['rounds']} | {cell('plain')} | {cell('auto')} | {cell('off')} "
              f"| {ratio('auto')} | {ratio('off')} "
              f"| {r['plain']['accuracy']:.4f} / {r['auto']['accuracy']:.4f} | {r['same_weights_on_and_off']} |")
    print("job s: launch to exit, the median over the repeats (all of them in the JSON); CPU s: user + system of "
          "every process of the job; round s: the median of rounds 2..R over all repeats")


if __name__ == "__main__":
    main()
