"""A what-if for Nilsson et al.'s Table 1 (docs/results.md, "Their car's code, run here"):
their car's training code, Keras, against fedemu's client, PyTorch, on the same FedAvg
rounds, to tell a difference in the clients' local training from one in how their runs
were executed.

FedAvg on their own non-IID split (``their_folds.py``; their fold 5 held out), their
server's loop: for each seed, an initial model drawn as their server drew it (every
weight and bias from N(0, 0.003), Erlang's ``rand:normal`` taking the variance), then
each round 10 of their 100 cars train from the global model, as ``Mnist_Model.train`` in
their ``lib_edge/assignment.py`` does (one model per car for the run, Keras ``fit``, E =
5, B = 20, SGD at 0.088 with Keras' decay 3.2e-6 over the car's life, shuffled epochs),
and the ten models are averaged in float64 (equal n_k), as their Erlang server did. One
side trains with Keras, the other with fedemu's ``client_update``, from the same initial
model and the same cars every round, so the sides differ only in the training code and
the batch order. Both are scored on the held-out fold by one numpy forward pass.

The Keras side is Keras 2 (``tf_keras``) with Keras 2.1's loss (their
conda_environment.yaml: keras 2.1, tensorflow 1.10): softmax output, probabilities
clipped to [1e-7, 1 - 1e-7] before the log (newer Keras takes the logits instead), and
the legacy SGD with time-based decay. It needs TensorFlow, which fedemu does not, so it
runs in its own environment and the steps hand over files:

    python bench/whatif/keras_client.py export /tmp/cars.npz          # fedemu's venv
    python -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu==2.17.1 tf_keras==2.17.0
    /tmp/tfvenv/bin/python bench/whatif/keras_client.py keras /tmp/cars.npz /tmp/k10.json --seeds 12 --rounds 10
    python bench/whatif/keras_client.py torch /tmp/cars.npz /tmp/t10.json --seeds 12 --rounds 10
    python bench/whatif/keras_client.py compare /tmp/k10.json /tmp/t10.json
    python bench/whatif/keras_client.py theirs /tmp/k10.json PATH     # beside their 15 logs

(PATH: a checkout of their repository.) Late in a run, where their logs dip and
fedemu's do not: ``--save FILE`` keeps each seed's last model (FILE-seedS.npz),
``--start FILE`` starts from one, ``--selection-seed`` draws other cars than the saved
run's; ``compare`` then also counts each side's dips:

    python bench/whatif/keras_client.py torch /tmp/cars.npz /tmp/t500.json --seeds 1 --rounds 500 --save /tmp/late
    /tmp/tfvenv/bin/python bench/whatif/keras_client.py keras /tmp/cars.npz /tmp/k-late.json --seeds 1 \
        --rounds 150 --start /tmp/late-seed1.npz --selection-seed 2
    python bench/whatif/keras_client.py torch /tmp/cars.npz /tmp/t-late.json --seeds 1 \
        --rounds 150 --start /tmp/late-seed1.npz --selection-seed 2
    python bench/whatif/keras_client.py compare /tmp/k-late.json /tmp/t-late.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HELD_OUT = 5  # their fold 5, as the --first-round comparison in their_folds.py
CLIENTS, PER_ROUND = 100, 10
EPOCHS, BATCH, LR, DECAY = 5, 20, 0.088, 3.2e-6  # their benchmark_fedavg_cv.py
INIT_VARIANCE = 0.003  # server.erl's rand:normal(0, 0.003)
SHAPES = [(784, 200), (200, 200), (200, 10)]  # Keras' kernel layout, (in, out)


def initial_model(seed: int) -> list[np.ndarray]:
    """[W1, b1, W2, b2, W3, b3] in Keras' layout, float64 as their server held it."""
    rng = np.random.default_rng([seed, 0])
    model = []
    for fan_in, fan_out in SHAPES:
        model.append(rng.normal(0.0, math.sqrt(INIT_VARIANCE), (fan_in, fan_out)))
        model.append(rng.normal(0.0, math.sqrt(INIT_VARIANCE), fan_out))
    return model


def selections(seed: int, rounds: int) -> list[list[int]]:
    """Each round's 10 cars (0-based), drawn without replacement as take_n_without_replacement."""
    rng = np.random.default_rng([seed, 1])
    return [sorted(rng.choice(CLIENTS, PER_ROUND, replace=False).tolist()) for _ in range(rounds)]


def score(model: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of the 2NN on (x, y), in float64."""
    h = x
    for i in range(0, 4, 2):
        h = np.maximum(h @ model[i] + model[i + 1], 0.0)
    logits = h @ model[4] + model[5]
    logits -= logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return float((logits.argmax(axis=1) == y).mean()), float(-log_p[np.arange(len(y)), y].mean())


def export(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from their_folds import FOLDS, pooled, split

    images, labels = pooled()
    parts = split(images, labels)
    cars = [np.concatenate([parts[f][car] for f in range(FOLDS) if f != HELD_OUT - 1]) for car in range(CLIENTS)]
    test = np.sort(np.concatenate(parts[HELD_OUT - 1]))
    np.savez_compressed(out, car_x=np.stack([images[c].reshape(len(c), -1) for c in cars]),
                        car_y=np.stack([labels[c] for c in cars]),
                        test_x=images[test].reshape(len(test), -1), test_y=labels[test])
    print(f"{out}: {CLIENTS} cars of {len(cars[0])} examples, {len(test)} test examples")


def load(path: Path) -> dict[str, np.ndarray]:
    data = dict(np.load(path))
    for key in ("car_x", "test_x"):
        data[key] = data[key].astype(np.float32) / 255.0  # their _get_mnist_data_
    data["car_y"] = data["car_y"].astype(np.int64)
    data["test_y"] = data["test_y"].astype(np.int64)
    return data


class KerasCars:
    """One Keras model per car for the run, as their car process kept one."""

    def __init__(self) -> None:
        import tensorflow as tf
        import tf_keras as keras

        tf.config.threading.set_inter_op_parallelism_threads(1)
        tf.config.threading.set_intra_op_parallelism_threads(1)
        self.keras, self.tf, self.models = keras, tf, {}

    def _loss(self, target, output):
        # Keras 2.1's categorical_crossentropy on a softmax output (TensorFlow backend)
        tf = self.tf
        output = output / tf.reduce_sum(output, axis=-1, keepdims=True)
        output = tf.clip_by_value(output, 1e-7, 1.0 - 1e-7)
        return -tf.reduce_sum(target * tf.math.log(output), axis=-1)

    def _model(self, car: int):
        if car not in self.models:
            keras = self.keras
            model = keras.Sequential([keras.layers.Dense(200, input_dim=784, activation="relu"),
                                      keras.layers.Dense(200, activation="relu"),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile(loss=self._loss, optimizer=keras.optimizers.legacy.SGD(learning_rate=LR, decay=DECAY))
            self.models[car] = model
        return self.models[car]

    def train(self, car: int, start: list[np.ndarray], x: np.ndarray, y: np.ndarray, seed: int) -> list[np.ndarray]:
        model = self._model(car)
        model.set_weights([w.astype(np.float32) for w in start])
        self.tf.keras.utils.set_random_seed(seed)  # Python's, numpy's and TensorFlow's: fit's shuffle
        model.fit(x, np.eye(10, dtype=np.float32)[y], epochs=EPOCHS, batch_size=BATCH, shuffle=True, verbose=0)
        return [w.astype(np.float64) for w in model.get_weights()]


class TorchCars:
    """fedemu's client: client_update on its 2NN, Keras' decay over the client's life."""

    def __init__(self) -> None:
        import torch

        from fedemu.common.ml import models, training

        torch.set_num_threads(1)
        self.torch, self.training = torch, training
        self.model = models.build("2nn", (1, 28, 28), 10)
        self.iterations: dict[int, int] = {}

    def train(self, car: int, start: list[np.ndarray], x: np.ndarray, y: np.ndarray, seed: int) -> list[np.ndarray]:
        torch = self.torch
        linears = [m for m in self.model if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for i, linear in enumerate(linears):
                linear.weight.copy_(torch.from_numpy(start[2 * i].T.astype(np.float32)))
                linear.bias.copy_(torch.from_numpy(start[2 * i + 1].astype(np.float32)))
        images = np.round(x * 255.0).astype(np.uint8).reshape(len(x), 28, 28)
        result = self.training.client_update(
            self.model, images, y, epochs=EPOCHS, batch_size=BATCH, lr=LR,
            generator=torch.Generator().manual_seed(seed), lr_decay=DECAY,
            start_iteration=self.iterations.get(car, 0))
        self.iterations[car] = self.iterations.get(car, 0) + result.steps
        out = []
        for linear in linears:
            out += [linear.weight.detach().numpy().T.astype(np.float64), linear.bias.detach().numpy().astype(np.float64)]
        return out


def run(side: str, data_path: Path, out: Path, seeds: int, rounds: int, save: Path | None = None,
        start: Path | None = None, selection_seed: int = 0) -> None:
    data = load(data_path)
    results = {}
    started = time.time()
    for seed in range(1, seeds + 1):
        cars = KerasCars() if side == "keras" else TorchCars()  # fresh car models each run
        if start is not None:
            with np.load(start) as saved:
                model = [saved[f"p{i}"] for i in range(len(saved.files))]
        else:
            model = initial_model(seed)
        curve = []
        for round_, chosen in enumerate(selections(selection_seed * 1000 + seed, rounds)):
            trained = [cars.train(car, model, data["car_x"][car], data["car_y"][car], seed * 100_000 + round_ * 1000 + car)
                       for car in chosen]
            model = [sum(m[i] for m in trained) / len(trained) for i in range(len(model))]  # equal n_k
            curve.append(score(model, data["test_x"], data["test_y"]))
        results[seed] = curve
        if save is not None:
            np.savez(f"{save}-seed{seed}.npz", **{f"p{i}": p for i, p in enumerate(model)})
        print(f"{side} seed {seed}: " + " ".join(f"{a * 100:.1f}%/{l:.2f}" for a, l in curve)
              + f"  ({time.time() - started:.0f} s)", flush=True)
    out.write_text(json.dumps({"side": side, "rounds": rounds, "results": results}))


def compare(keras_path: Path, torch_path: Path) -> None:
    keras = json.loads(keras_path.read_text())["results"]
    torch = json.loads(torch_path.read_text())["results"]
    seeds = sorted(set(keras) & set(torch), key=int)
    rounds = min(len(keras[seeds[0]]), len(torch[seeds[0]]))
    print(f"{len(seeds)} seeds, their fold {HELD_OUT} held out; accuracy (%) and loss after each round")
    print("round | Keras mean (sd) | fedemu mean (sd) | paired difference (standard error) | Keras loss | fedemu loss")
    for r in range(rounds):
        ka = [keras[s][r][0] * 100 for s in seeds]
        ta = [torch[s][r][0] * 100 for s in seeds]
        diff = [t - k for k, t in zip(ka, ta)]
        sd = statistics.stdev if len(seeds) > 1 else (lambda values: float("nan"))
        se = sd(diff) / math.sqrt(len(diff))
        print(f"{r + 1} | {statistics.mean(ka):.1f} ({sd(ka):.1f}) | {statistics.mean(ta):.1f} "
              f"({sd(ta):.1f}) | {statistics.mean(diff):+.1f} ({se:.1f}) | "
              f"{statistics.mean(keras[s][r][1] for s in seeds):.2f} | {statistics.mean(torch[s][r][1] for s in seeds):.2f}")
    if rounds >= 20:  # their non-IID logs' dips: rounds well below the run's level, as fedavg_curves counts them
        for name, side in (("Keras", keras), ("fedemu", torch)):
            for s in seeds:
                curve = [accuracy for accuracy, _ in side[s][:rounds]]
                level = statistics.median(curve)
                drops = sum(curve[r - 1] - curve[r] > 0.02 and curve[r + 1] - curve[r] > 0.02 for r in range(1, rounds - 1))
                print(f"{name} seed {s}: mean {statistics.mean(curve) * 100:.2f}%, rounds more than 1 point below "
                      f"its median {sum(a < level - 0.01 for a in curve)} (deepest {(level - min(curve)) * 100:.2f}), "
                      f"more than 2 points below both neighbours {drops}")


def against_theirs(results_path: Path, theirs_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fedavg_curves  # their log's line r: the model after r rounds

    results = json.loads(results_path.read_text())
    ours = [[float("nan")] + [accuracy for accuracy, _ in curve] for curve in results["results"].values()]
    theirs = list(fedavg_curves.theirs(theirs_path, "fedavg-noniid").values())
    rounds = len(ours[0]) - 1
    print(f"{results['side']}: {len(ours)} seeds, their fold {HELD_OUT} held out; theirs: {len(theirs)} logs, "
          "all folds; accuracy (%), mean (sd)")
    points = [(r, r) for r in (1, 2, 3, 5, 10, 20, 50, 100) if r <= rounds]
    points += [(first, last) for first, last in ((11, 20), (21, 50), (51, 100)) if last <= rounds]
    for first, last in points:
        side = [statistics.mean(c[first:last + 1]) * 100 for c in ours]
        their = [statistics.mean(c[first:last + 1]) * 100 for c in theirs]
        error = math.sqrt(statistics.variance(side) / len(side) + statistics.variance(their) / len(their))
        label = f"round {first}" if first == last else f"rounds {first}-{last}"
        print(f"{label:>14}: {results['side']} {statistics.mean(side):.1f} ({statistics.stdev(side):.1f}), "
              f"theirs {statistics.mean(their):.1f} ({statistics.stdev(their):.1f}), difference "
              f"{statistics.mean(side) - statistics.mean(their):+.1f} (standard error {error:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("export").add_argument("out", type=Path)
    for side in ("keras", "torch"):
        p = sub.add_parser(side)
        p.add_argument("data", type=Path)
        p.add_argument("out", type=Path)
        p.add_argument("--seeds", type=int, default=40)
        p.add_argument("--rounds", type=int, default=1)
        p.add_argument("--save", type=Path, help="keep each seed's last model as SAVE-seedS.npz")
        p.add_argument("--start", type=Path, help="start from this saved model instead of a fresh one")
        p.add_argument("--selection-seed", type=int, default=0,
                       help="draw the rounds' cars from another stream (from a saved model: not its own rounds')")
    p = sub.add_parser("theirs")
    p.add_argument("results", type=Path)
    p.add_argument("path", type=Path)
    p = sub.add_parser("compare")
    p.add_argument("keras", type=Path)
    p.add_argument("torch", type=Path)
    args = parser.parse_args()
    if args.command == "export":
        export(args.out)
    elif args.command == "compare":
        compare(args.keras, args.torch)
    elif args.command == "theirs":
        against_theirs(args.results, args.path)
    else:
        run(args.command, args.data, args.out, args.seeds, args.rounds, args.save, args.start, args.selection_seed)


if __name__ == "__main__":
    main()
