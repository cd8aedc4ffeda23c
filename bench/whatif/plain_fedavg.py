"""FedAvg on McMahan et al.'s MNIST 2NN, written from the paper alone, in one process: an
independent check of fedemu's rounds to 97% (docs/results.md, "McMahan et al.'s 2NN needs
fewer rounds here than in their Table 1").

Nothing of fedemu's trains here: fedemu only says where its cached MNIST arrays are
(`fedemu data fetch mnist`) and counts the rounds to the target with the rule `fedemu
report` uses. The split (IID: a permutation cut into 100 clients of
600; shards: the pathological non-IID split, sorted by label, cut into 200 shards of 300,
two at random per client), the 2NN (PyTorch's default initialisation, or Glorot-uniform
weights and zero biases as TensorFlow's dense layers start), client selection, local SGD
(torch.optim.SGD, E epochs of B-minibatches in a fresh order each epoch), the
n_k-weighted average and the evaluation are written here, from Algorithm 1. Rounds to the target are counted as the paper's Table 1 counts them: on the
best-so-far test accuracy, interpolated linearly between rounds.

    python bench/whatif/plain_fedavg.py --lr 0.1 --seeds 1 2 3 [--init glorot] [--rounds 150]
    python bench/whatif/plain_fedavg.py --partition shards --lr 0.1 --seeds 1 --rounds 1000
    python bench/whatif/plain_fedavg.py --B 0 --lr 0.464 --seeds 1 --rounds 2000   # FedSGD
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedemu.launch.studies.results import time_to_target


def mnist_cache() -> Path:
    from fedemu.common.ml.data import LAYOUT, cache_dir

    folder = cache_dir() / LAYOUT / "mnist"
    if not (folder / "train_x.npy").exists():
        raise SystemExit(f"no MNIST arrays in {folder}: run `fedemu data fetch mnist` first")
    return folder


def load(cache: Path) -> tuple[torch.Tensor, ...]:
    def images(name: str) -> torch.Tensor:
        return torch.from_numpy(np.load(cache / name).reshape(-1, 784).astype(np.float32) / 255.0)

    def labels(name: str) -> torch.Tensor:
        return torch.from_numpy(np.load(cache / name).astype(np.int64))

    return images("train_x.npy"), labels("train_y.npy"), images("test_x.npy"), labels("test_y.npy")


def two_nn(init: str) -> nn.Module:
    model = nn.Sequential(nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(), nn.Linear(200, 10))
    if init == "glorot":
        for layer in model:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)
    return model


def split(labels: torch.Tensor, partition: str, clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    if partition == "iid":
        return np.array_split(rng.permutation(len(labels)), clients)
    shards = np.array_split(np.argsort(labels.numpy(), kind="stable"), 2 * clients)
    dealt = rng.permutation(2 * clients)
    return [np.concatenate([shards[dealt[2 * k]], shards[dealt[2 * k + 1]]]) for k in range(clients)]


def run(data: tuple[torch.Tensor, ...], seed: int, lr: float, init: str, rounds: int, target: float,
        partition: str = "iid", clients: int = 100, C: float = 0.1, E: int = 1, B: int = 10) -> list[float]:
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train_x, train_y, test_x, test_y = data
    parts = split(train_y, partition, clients, rng)
    model = two_nn(init)
    loss_fn = nn.CrossEntropyLoss()
    m = max(int(C * clients), 1)
    accuracies: list[float] = []
    for _ in range(rounds):
        global_state = {k: v.clone() for k, v in model.state_dict().items()}
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        n_sum = 0
        for k in rng.choice(clients, size=m, replace=False):
            model.load_state_dict(global_state)
            optimiser = torch.optim.SGD(model.parameters(), lr=lr)
            x, y = train_x[parts[k]], train_y[parts[k]]
            size = B or len(y)  # B = 0: the full local set, one step an epoch (FedSGD at E = 1)
            for _ in range(E):
                order = torch.from_numpy(rng.permutation(len(y)))
                for start in range(0, len(y), size):
                    batch = order[start:start + size]
                    optimiser.zero_grad()
                    loss_fn(model(x[batch]), y[batch]).backward()
                    optimiser.step()
            for key, value in model.state_dict().items():
                total[key] += len(y) * value
            n_sum += len(y)
        model.load_state_dict({k: v / n_sum for k, v in total.items()})
        with torch.no_grad():
            accuracies.append(float((model(test_x).argmax(1) == test_y).float().mean()))
        if accuracies[-1] >= target:
            break
    return accuracies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, nargs="+", default=[0.1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--init", choices=("torch", "glorot"), default="torch")
    parser.add_argument("--partition", choices=("iid", "shards"), default="iid")
    parser.add_argument("--E", type=int, default=1, help="local epochs")
    parser.add_argument("--B", type=int, default=10, help="local minibatch; 0 = the full local set")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.97)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load(mnist_cache())
    for lr in args.lr:
        for seed in args.seeds:
            accuracies = run(data, seed, lr, args.init, args.rounds, args.target, args.partition, E=args.E, B=args.B)
            crossed = time_to_target(np.arange(1, len(accuracies) + 1), accuracies, args.target)
            reached = f"{crossed:.1f}" if crossed is not None else f"not within {len(accuracies)}"
            print(f"{args.partition} E {args.E} B {args.B or 'inf'} init {args.init} lr {lr} seed {seed}: "
                  f"rounds to {args.target:.0%} {reached} (best {max(accuracies):.4f})", flush=True)


if __name__ == "__main__":
    main()
