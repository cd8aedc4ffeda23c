"""A worker node's clients: warmed up, spawned, named, reported to the server and, with
``run.restarts``, supervised (one for one, as in OTP)."""
from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from fedemu.common.messages import WorkerReady, client_name
from fedemu.common.ml import training
from fedemu.common.ml.data import Data
from fedemu.common.ml.devices import ComputeModel
from fedemu.common.ml.models import ModelSpec
from fedemu.common.stragglers import StragglerGroups, StragglerSpec
from fedemu.node import Down, Node, Pid

from .client import Client, ModelCache
from .cohorts import CohortTrainer
from .node_sums import KeptUpdates, NodeSums

log = logging.getLogger("fedemu.worker")


def warm_up(data: Data, indices: np.ndarray, model_spec: ModelSpec,
            device: torch.device = torch.device("cpu")) -> float:
    """Pay torch's one-time start-up costs (seconds on the first step; more for a GPU's
    context and kernels) before the node reports ready, so they do not land inside
    round 1's deadline."""
    started = time.perf_counter()  # wall: how long the warm-up took, for the log
    model = model_spec.build(device=device)
    sample = np.asarray(indices)[:10]
    training.client_update(model, data.train_x[sample], data.train_y[sample], epochs=1, batch_size=10, lr=0.0,
                           generator=torch.Generator().manual_seed(0), dataset=data.dataset)
    training.evaluate(model, data.test_x[:10], data.test_y[:10], dataset=data.dataset)
    return time.perf_counter() - started  # wall


def host_clients(
    node: Node,
    data: Data,
    shards: list[np.ndarray],
    clients: range,
    model: ModelSpec,
    server: str = "server",
    startup_timeout: float = 120.0,
    stragglers: StragglerSpec | StragglerGroups = StragglerSpec(),
    compute: ComputeModel = ComputeModel(),
    restarts: int = 0,
    device: torch.device = torch.device("cpu"),
    cohorts: bool = False,
) -> None:
    """Spawn this node's clients (training on ``device``, shared by all of them), register
    their names, and report to the server.
    With ``restarts`` > 0 a supervisor restarts a client that crashes, up to that many
    times per client, and tells the server its new pid. With ``cohorts`` (run.cohort =
    "auto") the clients that have work in hand at once train together (worker/cohorts.py)."""
    if len(clients):
        log.info("warm-up took %.2fs", warm_up(data, shards[clients[0]], model, device))
        compute.prepare(model)
    cache, anchors = ModelCache(device), ModelCache(device)
    kept = KeptUpdates()
    sums = node.spawn_behaviour(NodeSums(kept))
    trainer = None
    if cohorts:
        trainer = CohortTrainer(cache, defer=compute.known_in_advance)
        trainer.pid = node.spawn_behaviour(trainer)

    def start_client(k: int) -> Pid:
        return node.spawn_behaviour(Client(k, shards[k], data, model, cache, stragglers, compute, anchors, kept,
                                           trainer))

    entries = [(client_name(k), start_client(k), k) for k in clients]
    node.register_many(entries)
    deadline = time.monotonic() + startup_timeout  # wall: real processes starting
    server_pid, pause = node.whereis(server), 0.005
    while server_pid is None:
        if time.monotonic() > deadline or node.closed.is_set():  # wall
            raise TimeoutError(f"no process registered as {server!r} within {startup_timeout:.0f}s")
        # wall: polling for the server's name, which comes a few ms to seconds after
        # ours; from 5 ms, doubling to 0.2 s (a poll is one call to the broker)
        time.sleep(pause)
        pause = min(0.2, pause * 2)
        server_pid = node.whereis(server)
    if restarts > 0:
        node.spawn(lambda proc: _supervise(proc, {pid: k for _, pid, k in entries}, start_client, server_pid,
                                           restarts))
    # The clients live as long as the node: out of the cyclic collector's sight, so a
    # round's garbage does not make it walk 100,000 clients' objects again and again.
    gc.freeze()
    node.send(server_pid, WorkerReady(node.name, [[k, pid] for _, pid, k in entries], sums))
    log.info("node %s hosts clients %d..%d (%d)", node.name, clients.start, clients.stop - 1, len(clients))


def _supervise(proc, clients: dict[Pid, int], start_client, server_pid: Pid, limit: int) -> None:
    """One-for-one supervision (as in OTP) of this node's clients: a client that crashes
    is started afresh, under its name, and the server is told its new pid; one that
    exits normally, or has crashed ``limit`` times, stays down."""

    watched = {proc.monitor(pid): k for pid, k in clients.items()}
    crashes: dict[int, int] = {}
    while watched:
        msg = proc.receive(Down)
        k = watched.pop(msg.body.ref, None)
        if k is None or not msg.body.reason.startswith("crash"):
            continue
        crashes[k] = crashes.get(k, 0) + 1
        if crashes[k] > limit:
            log.warning("client %d crashed %d times; not restarting it (%s)", k, crashes[k], msg.body.reason)
            continue
        pid = start_client(k)
        proc.node.register_many([(client_name(k), pid, k)])
        watched[proc.monitor(pid)] = k
        log.warning("client %d crashed (%s); restarted as %s (%d of %d)", k, msg.body.reason, pid, crashes[k], limit)
        proc.send(server_pid, WorkerReady(proc.node.name, [[k, pid]]))
