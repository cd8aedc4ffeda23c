"""Update compression (Konečný et al. 2016) on the default job: upload bytes, codec time, accuracy.

MNIST 2NN FedAvg, IID over K=100 clients, C=0.1, E=1, B=10, lr=0.1, in one process.
Every case sees the same initial model, the same client selection and the same
shuffling, so the differences come from compression alone. Per case it reports:

* bytes uploaded per client update: ``compression.encoded_size`` (array payloads,
  quantized codes bit-packed, plus the fixed header bound);
* encode and decode time per update (the client's encoding; the server's decoding).
  For structured cases "train" also shows what training in the restricted space
  costs next to plain ClientUpdate;
* test accuracy after --rounds rounds (and the first round reaching 95%).

Everything runs on one thread (--threads for torch) so the times are one core's work.

The server applies every case the same way: w <- w + sum_k n_k / n * decode(update_k).
The learning rate is the uncompressed job's for all cases (the paper tuned it per
method), and biases and layers under 1024 values travel raw (the paper's choice).

    /work/venv/bin/python bench/compression.py [--rounds 30] [--json out.json] [--cases 1,4] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# One BLAS thread, like the one torch thread below: per-update times then measure
# one core's work and do not swing with whatever else shares the machine.
# (Must be set before numpy loads OpenBLAS.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

# (name, compression spec) — the paper's points on the 2NN.
CASES = [
    ("none", {}),
    ("random mask 25%", {"structured": "random_mask", "keep_fraction": 0.25}),
    ("low rank 25%", {"structured": "low_rank", "rank_fraction": 0.25}),
    ("subsample 6.25% + HD + 2-bit", {"subsample": 0.0625, "rotate": True, "bits": 2}),
    ("subsample 6.25% + 2-bit, no HD", {"subsample": 0.0625, "bits": 2}),
    ("HD + 1-bit", {"rotate": True, "bits": 1}),
    # One bit fewer than the paper's point: here the rotation matters.
    ("subsample 6.25% + HD + 1-bit", {"subsample": 0.0625, "rotate": True, "bits": 1}),
    ("subsample 6.25% + 1-bit, no HD", {"subsample": 0.0625, "bits": 1}),
]
JOB = {"dataset": "mnist", "model": "2nn", "K": 100, "C": 0.1, "E": 1, "B": 10, "lr": 0.1, "seed": 1}
TARGET_ACCURACY = 0.95


def run_case(name: str, spec: dict, rounds: int, dataset, shards) -> dict:
    import torch

    from fedemu.common.algorithms.rounds import selected_per_round, weighted_average
    from fedemu.common.ml import compression, models, training
    from fedemu.worker.client import client_generator
    from fedemu.common.ml.structured import compressed_client_update

    seed = JOB["seed"]
    train_images, train_labels = dataset["train"]
    test_images, test_labels = dataset["test"]
    global_model = models.build(JOB["model"], (1, 28, 28), 10, seed=seed)
    local_model = models.build(JOB["model"], (1, 28, 28), 10)
    weights = models.get_flat(global_model)
    codec = compression.make_codec(spec, compression.parameter_shapes(global_model))
    # The round engine's selection RNG: every case trains the same clients.
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E1EC7]))
    m = selected_per_round(JOB["C"], JOB["K"])

    sizes, encode_s, decode_s, train_s, accuracy_curve = [], [], [], [], []
    loss = float("nan")
    for round_ in range(1, rounds + 1):
        selected = sorted(int(k) for k in rng.choice(JOB["K"], size=m, replace=False))
        deltas, counts = [], []
        for k in selected:
            models.set_flat(local_model, weights)
            update_seed = compression.update_seed(seed, round_, k)
            started = time.perf_counter()
            result = compressed_client_update(
                local_model, train_images[shards[k]], train_labels[shards[k]], codec=codec,
                seed=update_seed, epochs=JOB["E"], batch_size=JOB["B"], lr=JOB["lr"],
                generator=client_generator(seed, round_, k))
            train_s.append(time.perf_counter() - started - result.encode_s)
            encode_s.append(result.encode_s)
            sizes.append(compression.encoded_size(result.encoded))
            # --- what the server does with the reply ---
            started = time.perf_counter()
            deltas.append(codec.decode(result.encoded, update_seed))
            decode_s.append(time.perf_counter() - started)
            counts.append(result.num_samples)
        weights = (weights + weighted_average(deltas, counts)).astype(np.float32)
        models.set_flat(global_model, weights)
        accuracy, loss = training.evaluate(global_model, test_images, test_labels)
        accuracy_curve.append(accuracy)
        print(f"  [{name}] round {round_:3d}  acc {accuracy:.4f}", file=sys.stderr, flush=True)

    reached = next((r + 1 for r, a in enumerate(accuracy_curve) if a >= TARGET_ACCURACY), None)
    assert len(set(sizes)) == 1, "update sizes are fixed by spec and model"
    return {
        "case": name, "spec": codec.spec.to_dict(), "bytes_per_update": sizes[0],
        "layers": codec.describe(), "encode_ms": 1e3 * statistics.median(encode_s),
        "decode_ms": 1e3 * statistics.median(decode_s), "train_s": statistics.median(train_s),
        "accuracy": accuracy_curve[-1], "loss": loss, "accuracy_curve": accuracy_curve,
        "rounds_to_target": reached, "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="FedAvg rounds per case (default 30)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--cases", help="comma-separated case numbers to run (1-based; default all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    cases = CASES
    if args.cases:
        try:
            cases = [CASES[int(i) - 1] for i in args.cases.split(",")]
        except (ValueError, IndexError):
            parser.error(f"--cases takes numbers in 1..{len(CASES)}")

    import torch

    from fedemu.common.ml import data, partition

    torch.set_num_threads(args.threads)

    loaded = data.load(JOB["dataset"])
    # In memory: each client's shard is indexed sixty times a round per case.
    dataset = {"train": (np.asarray(loaded.train_x), np.asarray(loaded.train_y)),
               "test": (np.asarray(loaded.test_x), np.asarray(loaded.test_y))}
    shards = partition.make("iid", dataset["train"][1], JOB["K"], JOB["seed"])

    results = []
    for name, spec in cases:
        print(f"[{name}] {spec or 'no compression'}", file=sys.stderr, flush=True)
        results.append(run_case(name, spec, args.rounds, dataset, shards))

    baseline = 4 * sum(layer["size"] for layer in results[0]["layers"])  # float32 weights
    print(f"update compression, MNIST 2NN FedAvg (IID, K=100, C=0.1, E=1, B=10, lr=0.1, seed 1), "
          f"{args.rounds} rounds; {platform.processor() or platform.machine()}, "
          f"torch threads {results[0]['torch_threads']}")
    print("bytes = encoded_size per client update; x = float32 update (4 x 199,210 B) / bytes; "
          "times = median per update")
    print()
    header = (f"{'case':31} | {'bytes/update':>12} | {'x':>6} | {'encode ms':>9} | {'decode ms':>9} | "
              f"{'train s':>7} | {'acc@' + str(args.rounds):>7} | {'round >= 95%':>12}")
    print(header)
    print("-" * len(header))
    for r in results:
        r["compression_factor"] = baseline / r["bytes_per_update"]
        reached = str(r["rounds_to_target"]) if r["rounds_to_target"] else "-"
        print(f"{r['case']:31} | {r['bytes_per_update']:12,d} | {r['compression_factor']:6.1f} | "
              f"{r['encode_ms']:9.2f} | {r['decode_ms']:9.2f} | {r['train_s']:7.3f} | "
              f"{r['accuracy']:7.4f} | {reached:>12}")
    if args.json:
        args.json.write_text(json.dumps({"job": JOB, "rounds": args.rounds, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
