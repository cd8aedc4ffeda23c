"""Cohort training (run.cohort): a worker node's clients of one instant train as one
batched computation, and each client's update, loss and step count are bit for bit what
it computes alone: FedAvg, FedProx and FSVRG's two tasks, clients of unequal sizes, a
client stopping part-way; models that cannot be batched train one by one and the node
says so; in real runs (FedAvg with drop-outs, FedProx, FSVRG, CO-OP), the same events
and weights as with cohorts off."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedemu.node import Behaviour, Message, Node, Pid
from fedemu.server.runlog import read_events
from fedemu.common.algorithms import tasks
from fedemu.common.algorithms.fedprox import ProximalTerm, proximal_term
from fedemu.common.algorithms.fsvrg import svrg_cohort, svrg_pass
from fedemu.worker.client import Client, ModelCache
from fedemu.worker.cohorts import CohortTrainer
from fedemu.common.ml import cohort, models, training
from fedemu.common.ml.data import Data
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.models import ModelSpec
from fedemu.common.messages import SVRG, TRAIN, Cancel, TaskDone, TaskStart, TrainRequest, Upload

from .test_compression import CLIENT, RUN_SEED, SERVER, _data, _Outbox

MNIST = dataset_named("mnist")  # its declaration: no data is read here


@pytest.fixture(autouse=True)
def one_torch_thread():
    """As a worker node in virtual time: a thread count that followed the cores would
    split float sums differently in the per-client and the batched products."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
SIZES = [37, 1, 120, 5, 64, 10]  # unequal: members finish at different steps, last minibatches differ


def examples(sizes: list[int], seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n).astype(np.uint8))
            for n in sizes]


def model_and_weights(name: str = "2nn") -> tuple[nn.Module, np.ndarray]:
    model = ModelSpec(name, MNIST).build(seed=1)
    return model, models.get_flat(model)


def alone(model: nn.Module, start: np.ndarray, x, y, k: int, prox_mu: float = 0.0, **kwargs) -> training.TrainResult:
    """The client's own training; with FedProx's proximal term when ``prox_mu``."""
    models.set_flat(model, start)
    hook = proximal_term(models.parameters_of(model), prox_mu) if prox_mu else None
    return training.client_update(model, x, y, generator=torch.Generator().manual_seed(k), dataset=MNIST,
                                  after_backward=hook, **kwargs)


def member(x, y, start, prox_mu: float = 0.0, **kwargs) -> cohort.Member:
    """A cohort member, with FedProx's mu in its extra when ``prox_mu``."""
    return cohort.Member(x=x, y=y, start=start, extra={"mu": prox_mu}, **kwargs)


def train_together(model, members, prox_mu: float = 0.0, **kwargs):
    return cohort.train(model, members, MNIST, term=ProximalTerm() if prox_mu else None, **kwargs)


def same(a: training.TrainResult, b: training.TrainResult | None) -> bool:
    return (b is not None and a.weights.tobytes() == b.weights.tobytes() and a.train_loss == b.train_loss
            and a.steps == b.steps)


class StopAfter:
    """A stop condition that turns true at its ``checks``-th look (before that step)."""

    def __init__(self, checks: int) -> None:
        self.checks, self.seen = checks, 0

    def __call__(self) -> bool:
        self.seen += 1
        return self.seen >= self.checks


# --- the computation: each member's own result, bit for bit ----------------------------------


TRAIN_CASES = {
    "fedavg": dict(epochs=2, batch_size=10, lr=0.1),
    "fedavg-lr-decay": dict(epochs=2, batch_size=10, lr=0.1, lr_decay=0.01),
    "fedavg-full-batch": dict(epochs=3, batch_size=0, lr=0.1),
    "fedprox": dict(epochs=2, batch_size=10, lr=0.1, prox_mu=0.1),
}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
@pytest.mark.parametrize("own_starts", [False, True], ids=["one-model", "own-models"])
def test_each_members_update_is_what_it_trains_alone_bit_for_bit(case, own_starts):
    """FedAvg's and FedProx's local training for clients of 1 to 120 examples, E = 2:
    minibatches of unequal sizes side by side, clients finishing at different steps,
    each with its own batch order, learning-rate decay (from its own step count) and
    proximal term; from the one model a round sends, or from models of their own."""
    kwargs = TRAIN_CASES[case]
    model, w0 = model_and_weights()
    rng = np.random.default_rng(1)
    starts = [w0 + rng.normal(0, 0.01, w0.shape).astype(np.float32) if own_starts else w0 for _ in SIZES]
    iterations = [0, 3, 5, 0, 100, 7]
    data = examples(SIZES)
    members = [member(x, y, starts[k], generator=torch.Generator().manual_seed(k), start_iteration=iterations[k],
                      **kwargs) for k, (x, y) in enumerate(data)]
    together = train_together(model, members, kwargs.get("prox_mu", 0.0))
    for k, (x, y) in enumerate(data):
        own = alone(model, starts[k], x, y, k, start_iteration=iterations[k], **kwargs)
        assert same(own, together[k]), f"member {k} ({SIZES[k]} examples)"


def test_the_cnn_trains_as_a_cohort_bit_for_bit():
    model, w0 = model_and_weights("cnn")
    data = examples([12, 1, 7])
    members = [cohort.Member(x=x, y=y, start=w0, generator=torch.Generator().manual_seed(k), epochs=2, batch_size=5,
                             lr=0.05) for k, (x, y) in enumerate(data)]
    together = cohort.train(model, members, MNIST)
    for k, (x, y) in enumerate(data):
        assert same(alone(model, w0, x, y, k, epochs=2, batch_size=5, lr=0.05), together[k])


def test_fsvrg_gradient_and_pass_are_what_each_client_computes_alone():
    """FSVRG's two tasks: the full local gradient (clients past the 2,000-example piece
    the per-client pass cuts included) and the variance-reduced pass, one step per
    example in each client's own order, for clients of unequal sizes."""
    model, w0 = model_and_weights()
    data = examples([600, 2500, 37, 1, 37])
    gradients = cohort.gradients(model, [cohort.Member(x=x, y=y, start=w0) for x, y in data], MNIST)
    for (x, y), together in zip(data, gradients):
        models.set_flat(model, w0)
        gradient, loss = training.local_gradient(model, x, y, MNIST)
        assert together is not None and gradient.tobytes() == together[0].tobytes() and loss == together[1]
    full = np.random.default_rng(2).normal(0, 0.01, w0.shape).astype(np.float32)
    data = data[2:] + examples([60], seed=3)
    passes = svrg_cohort(model, [cohort.Member(x=x, y=y, start=w0, extra={"full_gradient": full, "stepsize": 0.5},
                                               generator=torch.Generator().manual_seed(k))
                                 for k, (x, y) in enumerate(data)], MNIST)
    anchor = ModelSpec("2nn", MNIST).build()
    for k, (x, y) in enumerate(data):
        models.set_flat(model, w0)
        models.set_flat(anchor, w0)
        own = svrg_pass(model, x, y, anchor=anchor, full_gradient=full, stepsize=0.5,
                        generator=torch.Generator().manual_seed(k), dataset=MNIST)
        assert passes[k] is not None and own.weights.tobytes() == passes[k].weights.tobytes()
        assert own.train_loss == passes[k].train_loss


@pytest.mark.parametrize("task", ["fedavg", "fedprox", "fsvrg-pass", "fsvrg-gradient"])
def test_a_member_that_stops_part_way_stops_alone(task):
    """A client whose device goes offline at its third step: its slice stops (no
    result), and every other member's update is still its own, bit for bit."""
    model, w0 = model_and_weights()
    data = examples([40, 30, 1, 25] if task != "fsvrg-gradient" else [4500, 30, 1, 25])
    stops = [None, StopAfter(3), None, StopAfter(1)]
    if task == "fsvrg-gradient":  # the 4,500-example client stops before its second piece of 2,000
        stops = [StopAfter(2), None, None, StopAfter(1)]
    full = np.zeros_like(w0)
    mu = 0.1 if task == "fedprox" else 0.0
    members = [cohort.Member(x=x, y=y, start=w0, generator=torch.Generator().manual_seed(k), stop=stops[k],
                             epochs=2, batch_size=10, lr=0.1,
                             extra={"mu": mu, "full_gradient": full, "stepsize": 0.5})
               for k, (x, y) in enumerate(data)]
    if task == "fsvrg-gradient":
        results = cohort.gradients(model, members, MNIST)
        assert results[0] is None and results[3] is None and stops[0].seen == 2
        for k in (1, 2):
            models.set_flat(model, w0)
            assert training.local_gradient(model, *data[k], MNIST)[0].tobytes() == results[k][0].tobytes()
        return
    results = svrg_cohort(model, members, MNIST) if task == "fsvrg-pass" else train_together(model, members, mu)
    assert results[1] is None and results[3] is None and stops[1].seen == 3
    for k in (0, 2):
        x, y = data[k]
        if task == "fsvrg-pass":
            anchor = ModelSpec("2nn", MNIST).build()
            models.set_flat(model, w0)
            models.set_flat(anchor, w0)
            own = svrg_pass(model, x, y, anchor=anchor, full_gradient=full, stepsize=0.5,
                            generator=torch.Generator().manual_seed(k), dataset=MNIST)
            assert own.weights.tobytes() == results[k].weights.tobytes()
        else:
            assert same(alone(model, w0, x, y, k, epochs=2, batch_size=10, lr=0.1, prox_mu=mu), results[k])


def test_a_members_update_does_not_depend_on_its_cohort_or_its_chunk():
    """The same client alone, first or last among others, and in chunks of one or two
    (a memory budget that holds two 2NNs): the same bits each time."""
    model, w0 = model_and_weights()
    data = examples([23, 1, 9, 14])
    member = lambda k: cohort.Member(x=data[k][0], y=data[k][1], start=w0, generator=torch.Generator().manual_seed(k),
                                     epochs=1, batch_size=10, lr=0.1)
    reference = cohort.train(model, [member(0)], MNIST)[0].weights.tobytes()
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0]):
        for budget in (None, 2 * 4 * 199_210 * 3, 1):
            results = cohort.train(model, [member(k) for k in order], MNIST, memory_bytes=budget)
            assert results[order.index(0)].weights.tobytes() == reference, (order, budget)


def test_chunks_bound_the_stacked_models():
    """A budget for ten 2NNs and their gradients makes chunks of at most ten members."""
    model, _ = model_and_weights()
    plan = cohort.plan_of(model, MNIST)
    members = [cohort.Member(x=np.zeros((1, 28, 28), np.uint8), y=np.zeros(1, np.uint8), start=None)] * 95
    budget = 10 * 4 * (2 * plan.size + 2 * plan.activation_floats)
    sizes = [len(chunk) for chunk in cohort.chunks(plan, members, lambda m: 1, 2, budget)]
    assert sum(sizes) == 95 and max(sizes) == 10 and len(sizes) == 10


# --- what cannot be batched --------------------------------------------------------------------


class Doubled(nn.Module):
    def forward(self, x):
        return 2 * x


@pytest.mark.parametrize("model, reason", [
    (nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.BatchNorm1d(50), nn.ReLU(), nn.Linear(50, 10)),
     "BatchNorm1d keeps buffers"),
    (nn.Sequential(nn.Flatten(), nn.Linear(784, 50), Doubled(), nn.Linear(50, 10)), "it has a Doubled"),
    (nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.ReLU(), nn.Linear(8, 10)), "per-client steps' bits"),
    (ModelSpec("char-lstm", dataset_named("shakespeare")).build(seed=0), "not an nn.Sequential"),
])
def test_a_model_that_cannot_be_batched_says_why(model, reason):
    """Running statistics, a module of its own, an LSTM, and layers so small that torch
    multiplies them by other kernels when batched (the check at first use finds it)."""
    dataset = dataset_named("shakespeare") if not isinstance(model, nn.Sequential) else MNIST
    assert reason in cohort.problem(model, dataset)
    with pytest.raises(ValueError, match="cannot train this model as a cohort"):
        cohort.train(model, [], dataset)


def test_tasks_say_which_requests_they_batch():
    model, w0 = model_and_weights()
    request = lambda **kw: TrainRequest(round=1, task=TRAIN, weights=w0, epochs=1, batch_size=10, lr=0.1, seed=1, **kw)
    assert tasks.get(TRAIN).cohort_problem(request(), model, MNIST) is None
    assert tasks.get(TRAIN).cohort_problem(request(compression={"structured": "none", "bits": 2}), model, MNIST) is None
    assert "restricted space" in tasks.get(TRAIN).cohort_problem(
        request(compression={"structured": "random_mask"}), model, MNIST)
    assert tasks.get(SVRG).cohort_problem(request(), ModelSpec("cnn", MNIST).build(seed=0), MNIST) is not None

    class Plugin(tasks.LocalTask):
        name = "plug"

    assert Plugin.cohort_problem(request(), model, MNIST) == "it has no run_cohort"


# --- the node: a behaviour told its mailbox ran empty, and objects handed over --------------


class Collector(Behaviour):
    def __init__(self):
        self.pending, self.batches = [], []
        self.done = threading.Event()

    def handle(self, proc, msg):
        self.pending.append(msg.body)

    def drained(self, proc):
        self.batches.append(self.pending)
        self.pending = []
        if sum(map(len, self.batches)) == 50:
            self.done.set()


def test_a_behaviour_hears_when_its_mailbox_runs_empty_and_takes_objects_as_they_are(procs):
    """Fifty objects handed to a collector by another process of its node: each arrives
    as the very object handed (no codec), and drained() sees every one, after it was
    handled, in order."""
    node = Node("cohorts", procs.broker(), heartbeat_interval=0.1, heartbeat_timeout=5.0).start()
    try:
        collector = Collector()
        pid = node.spawn_behaviour(collector)
        handed = [object() for _ in range(50)]

        def hand_all(proc):
            for item in handed:
                proc.hand(pid, item)

        node.spawn(hand_all)
        assert collector.done.wait(10)
        assert [item for batch in collector.batches for item in batch] == handed
        assert all(batch for batch in collector.batches) and not collector.pending

        def elsewhere(proc):
            proc.hand(type(pid)("another-node", pid.id), object())

        box = {}
        node.spawn(lambda proc: box.setdefault("error", _raises(elsewhere, proc)))
        deadline = time.monotonic() + 5
        while "error" not in box and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "not a process of node cohorts" in box["error"]
    finally:
        node.close()


def _raises(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return ""


# --- a client and its node's trainer -------------------------------------------------------


class Hands(_Outbox):
    """Stands in for a process of the node: keeps what it sends and what it hands."""

    alive = True

    def __init__(self, pid: Pid):
        super().__init__()
        self.pid, self.handed = pid, []

    def hand(self, pid, body):
        self.handed.append(body)


def client_with_trainer() -> tuple:
    """Client 0 on 20 images, its node's trainer, stand-ins for both their processes,
    and a global model to start from."""
    images, labels = _data(20)
    cache = ModelCache()
    trainer = CohortTrainer(cache)
    trainer.pid = Pid("worker-0", 2)
    client = Client(0, np.arange(20), Data("fake", MNIST, images, labels, images, labels), ModelSpec("2nn", MNIST),
                    cache, trainer=trainer)
    weights = models.get_flat(models.build("2nn", (1, 28, 28), 10, seed=3))
    return client, trainer, Hands(CLIENT), Hands(trainer.pid), weights


def test_an_asynchronous_job_whose_task_ended_while_it_waited_is_dropped():
    """algorithm.concurrency: a client hands its task's local update to the trainer, then
    handles, in the same turn of its mailbox, the TaskDone that ends the task and the
    start of a new one. The trainer drops the first job (its task is over), trains the
    second, and the client uploads once, from the new task; nothing crashes."""
    client, trainer, device, trainer_proc, weights = client_with_trainer()

    def start(model: int) -> TaskStart:
        return TaskStart(rule="fedbuff", weights=weights, age=0, epochs=1, batch_size=10, lr=0.1, lr_decay=0.0,
                         seed=RUN_SEED, model=model)

    for body in (start(1), TaskDone(0, "timeout"), start(2)):
        client.handle(device, Message(SERVER, body))
    assert len(device.handed) == 2 and not device.sent  # both jobs wait at the trainer
    for job in device.handed:
        trainer.handle(trainer_proc, Message(CLIENT, job))
    trainer.drained(trainer_proc)
    assert not trainer_proc.handed  # no job came back to train alone or to crash its client
    assert (trainer.cohorts, trainer.members) == (1, 1)
    (upload,) = device.sent
    assert isinstance(upload, Upload) and upload.base == 2 and client.trainings_stopped == 0


def test_a_device_that_went_offline_and_came_back_while_its_job_waited_trains_again():
    """Wall clock: a client hands its local update to the trainer; before the trainer runs,
    the client handles its device going offline and coming back. The trainer's work is
    lost (the device was offline during it), and since the comeback was already handled,
    the client starts its next training then, not never."""
    client, trainer, device, trainer_proc, weights = client_with_trainer()
    client.handle(device, Message(SERVER, TaskStart(rule="fedbuff", weights=weights, age=0, epochs=1, batch_size=10,
                                                    lr=0.1, lr_decay=0.0, seed=RUN_SEED,
                                                    model=1)))
    assert len(device.handed) == 1
    device.offline, device.offline_count = True, 1
    client.link_changed(device, True)
    device.offline = False
    client.link_changed(device, False)
    trainer.handle(trainer_proc, Message(CLIENT, device.handed.pop()))
    trainer.drained(trainer_proc)
    assert client.trainings_stopped == 1 and not [m for m in device.sent if isinstance(m, Upload)]
    (again,) = device.handed  # the next training, handed to the trainer in turn
    trainer.handle(trainer_proc, Message(CLIENT, again))
    trainer.drained(trainer_proc)
    (upload,) = [m for m in device.sent if isinstance(m, Upload)]
    assert upload.base == 1


def test_a_round_cancelled_while_its_job_waited_sends_no_reply():
    """Over-selection: a client hands its round's training to the trainer and then handles
    the Cancel that closes the round without it (the Cancel is no longer in its mailbox
    when the trainer runs). The trainer's output is dropped: no late reply is sent."""
    client, trainer, device, trainer_proc, weights = client_with_trainer()
    client.handle(device, Message(SERVER, TrainRequest(round=3, task=TRAIN, weights=weights, epochs=1, batch_size=10,
                                                       lr=0.1, seed=1)))
    client.handle(device, Message(SERVER, Cancel(3)))
    (job,) = device.handed
    trainer.handle(trainer_proc, Message(CLIENT, job))
    trainer.drained(trainer_proc)
    assert not device.sent and client.trainings_stopped == 1


# --- real runs: nothing changes but speed ------------------------------------------------------


def launch(run_dir: Path, cohort_setting: str, *overrides: str, env: dict | None = None) -> dict:
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", "2",
            "--set", f"run.cohort={cohort_setting}", "--set", "run.target_accuracy=0", "--set", "run.rounds=3",
            "--set", "data.clients=20", "--set", "algorithm.C=0.5", *overrides]
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


WALL_FIELDS = ("t", "round_s", "wall_s")


def emulated_events(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in WALL_FIELDS} for e in read_events(run_dir)]


def worker_logs(run_dir: Path) -> str:
    return "".join(path.read_text() for path in sorted((run_dir / "logs").glob("worker-*.log")))


LOSSY = ["--set", 'network.default_profile="lossy"', "--set", "network.profiles.lossy.latency_ms=35",
         "--set", "network.profiles.lossy.loss=0.02", "--set", 'network.profiles.lossy.down.bandwidth="12Mbit"',
         "--set", 'network.profiles.lossy.up.bandwidth="5Mbit"', "--set", 'run.aggregation="nodes"',
         "--set", "data.partition=lognormal"]
HELD_LOST = {"held-cancelled": "closed without it; its held reply is not sent",
             "held-offline": "went offline before its round"}

RUNS = {
    # Unequal shards (quantity skew), a deadline, and clients dropping out during rounds.
    "fedavg": ["--set", "data.partition=lognormal", "--set", "algorithm.deadline_s=4",
               "--set", "network.dropout.per_round=0.2"],
    # Lossy links: downloads arrive at different instants, so a node's trainer holds the
    # jobs until the earliest is due and trains those in hand together (cohorts.py).
    # Meanwhile over-selected clients are cancelled (the first m replies closed the round)
    # or their devices go offline, and the updates are summed on the nodes.
    "held-cancelled": [*LOSSY, "--set", "algorithm.over_select=4",
                       "--set", "network.dropout.on_off={mean_up_s=60.0, mean_down_s=10.0}"],
    "held-offline": [*LOSSY, "--set", "algorithm.deadline_s=6",
                     "--set", "network.dropout.on_off={mean_up_s=8.0, mean_down_s=1.0}"],
    "fedprox": ["--set", "algorithm.name=fedprox", "--set", "algorithm.mu=0.1", "--set", "data.partition=lognormal"],
    "fsvrg": ["--set", "algorithm.name=fsvrg", "--set", "algorithm.C=1.0", "--set", "data.partition=lognormal",
              "--set", "run.rounds=2"],
    # An asynchronous rule: every client starts at once (one cohort a node), then trains alone or in small cohorts.
    "coop": ["--set", "algorithm.name=coop", "--set", "run.max_uploads_per_client=3", "--set", "run.rounds=1000",
             "--set", "data.partition=lognormal"],
    # Tasks at a fixed concurrency (TaskStart, TaskDone), devices of varied speed.
    "fedbuff-tasks": ["--set", "algorithm.name=fedbuff", "--set", "algorithm.concurrency=5",
                      "--set", "algorithm.buffer_size=5", "--set", "algorithm.eval_every_uploads=10",
                      "--set", "run.rounds=3", "--set", "network.stragglers.distribution=lognormal",
                      "--set", "network.stragglers.sigma=1.0", "--set", "network.stragglers.per_round=true"],
}

# Every row of these is emulated (times, bytes, outcomes): the same with cohorts or without.
EMULATED_TABLES = ("clients.csv", "timeline.csv", "tasks.csv")


@pytest.mark.mnist
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", sorted(RUNS))
def test_cohorts_change_nothing_but_speed(tmp_path, algorithm):
    """The same run with cohorts and without, in virtual time: every event (accuracy,
    losses, emulated times, stragglers, drop-outs, bytes), every client's row and
    timeline, and the final weights agree bit for bit; the nodes said they trained in
    cohorts only when asked to."""
    on = launch(tmp_path / "on", "auto", *RUNS[algorithm])
    off = launch(tmp_path / "off", "off", *RUNS[algorithm])
    assert on["weights_sha256"] == off["weights_sha256"]
    assert emulated_events(tmp_path / "on") == emulated_events(tmp_path / "off")
    tables = [name for name in EMULATED_TABLES if (tmp_path / "off" / name).exists()]
    assert "timeline.csv" in tables  # each client's computation spans, from when its work arrived
    for name in tables:
        assert (tmp_path / "on" / name).read_text() == (tmp_path / "off" / name).read_text(), name
    assert "clients train in cohorts" in worker_logs(tmp_path / "on")
    assert "cohort" not in worker_logs(tmp_path / "off")
    if algorithm == "fedavg":
        rounds = [e for e in read_events(tmp_path / "on") if e["event"] == "round"]
        assert any(set(e["offline"]) & set(e["selected"]) for e in rounds)  # drop-outs took selected clients
    if algorithm in HELD_LOST:  # jobs were held across instants, and a held one's reply was lost as the case says
        assert "arrived at different instants train together" in worker_logs(tmp_path / "on")
        assert HELD_LOST[algorithm] in worker_logs(tmp_path / "on")


BATCH_NORM_MODEL = """
from torch import nn

def bn_mlp(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, num_classes))
"""


@pytest.mark.mnist
@pytest.mark.slow
def test_a_model_that_cannot_be_batched_trains_one_by_one_and_the_node_says_so_once(tmp_path):
    (tmp_path / "bn_model.py").write_text(BATCH_NORM_MODEL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    on = launch(tmp_path / "on", "auto", "--set", "model.name=bn_model:bn_mlp", env=env)
    off = launch(tmp_path / "off", "off", "--set", "model.name=bn_model:bn_mlp", env=env)
    assert on["weights_sha256"] == off["weights_sha256"]
    for node in ("worker-0", "worker-1"):
        log = (tmp_path / "on" / "logs" / f"{node}.log").read_text()
        assert log.count("clients train one by one for task train: its BatchNorm1d keeps buffers") == 1, node
        assert "clients train in cohorts" not in log
