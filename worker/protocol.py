"""The message vocabulary between the server and the clients: the one module both import.

Every class here is a registered wire message (``fedemu.node.message``): it crosses the
broker as msgpack with its ndarrays as raw frames.
"""
from __future__ import annotations

import numpy as np

from fedemu.node import Pid, message

TRAIN = "train"  # FedAvg: E epochs of SGD from the sent weights, return the weights
GRADIENT = "gradient"  # FedSGD: return the full-batch gradient at the sent weights


@message
class TrainRequest:
    round: int
    task: str  # TRAIN or GRADIENT
    weights: np.ndarray  # flat float32 global model
    epochs: int
    batch_size: int  # 0 means the full local set (B = infinity)
    lr: float
    seed: int  # run seed; the client derives its shuffling from (seed, round, client)


@message
class TrainReply:
    round: int
    client: int
    task: str
    update: np.ndarray  # trained weights (TRAIN) or gradient (GRADIENT), flat float32
    num_samples: int  # n_k, the weight of this update
    train_loss: float
    compute_s: float  # measured local computation time
    slowdown: float = 1.0  # straggler factor applied: the reply was held (f - 1) * compute_s


@message
class WorkerReady:
    """A worker node tells the server which clients it hosts, and their pids."""

    node: str
    clients: list  # [[client id, Pid], ...]


def client_name(k: int) -> str:
    return f"client/{k}"


def as_pid_map(clients: list) -> dict[int, Pid]:
    return {int(k): pid for k, pid in clients}
