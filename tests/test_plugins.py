"""Plug-ins: an algorithm, a model and a data set from outside fedemu, found by
package.module:attr or by the fedemu.algorithms, fedemu.models and fedemu.datasets entry
points, validated, and run end to end (the server and every worker node load the data
set and build the model)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from fedemu.launch import config as configuration
from fedemu.common import algorithms
from fedemu.server.runlog import read_events
from fedemu.common.messages import TRAIN, TrainReply

PLUGIN = Path(__file__).parent.parent / "examples" / "plugin"
BY_PATH = "fedemu_example_plugin.algorithms:TrimmedMean"
MODEL_BY_PATH = "fedemu_example_plugin.models:mlp"
DATASET_BY_PATH = "fedemu_example_plugin.datasets:Blobs"


@pytest.fixture
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN))
    # Each test finds the plug-in afresh, as a new process would (the built-ins loaded
    # first, so the registry put back afterwards has them).
    algorithms.built_in()
    monkeypatch.setattr(algorithms.base._registry, "classes", {name: cls for name, cls in algorithms.base._registry.classes.items()
                                                         if name not in ("trimmedmean", BY_PATH)})
    from fedemu.common.ml import models

    monkeypatch.setattr(models, "_builders", dict(models._builders))
    for name in ("mlp100", MODEL_BY_PATH):
        models._builders.pop(name, None)
    from fedemu.common.ml import datasets

    datasets.built_in()
    monkeypatch.setattr(datasets._registry, "classes", {name: cls for name, cls in datasets._registry.classes.items()
                                                        if name not in ("blobs", DATASET_BY_PATH)})


def _entry_point_dir(tmp_path: Path) -> Path:
    """What `pip install examples/plugin` leaves where Python looks for distributions: a
    dist-info folder naming the entry point (importlib.metadata reads it from sys.path)."""
    site = tmp_path / "site"
    info = site / "fedemu_example_plugin-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedemu-example-plugin\nVersion: 0.1.0\n")
    declared = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]["entry-points"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
        for group, points in declared.items()))
    return site


def test_a_plugin_by_module_path_brings_its_options_and_their_checks(plugin_on_path):
    config = configuration.load(None, [f"algorithm.name={BY_PATH}", "algorithm.trim=0.2"])
    assert config["algorithm"]["trim"] == 0.2
    assert configuration.load(None, [f"algorithm.name={BY_PATH}"])["algorithm"]["trim"] == 0.1  # its default
    with pytest.raises(configuration.ConfigError, match=r"algorithm.trim = 0.5 is out of range; it must be in "
                                                        r"\[0, 0.5\)"):
        configuration.load(None, [f"algorithm.name={BY_PATH}", "algorithm.trim=0.5"])
    with pytest.raises(configuration.ConfigError, match="unknown key algorithm.trim;"):  # not fedavg's option
        configuration.load(None, ["algorithm.trim=0.2"])
    with pytest.raises(configuration.ConfigError, match="algorithm.name: algorithm 'fedemu_example_plugin.nope:X': "
                                                        "cannot import 'fedemu_example_plugin.nope'"):
        configuration.load(None, ["algorithm.name=fedemu_example_plugin.nope:X"])


def test_a_plugin_by_entry_point_name(plugin_on_path, monkeypatch, tmp_path):
    with pytest.raises(algorithms.UnknownAlgorithm, match="unknown algorithm 'trimmedmean'"):
        algorithms.get("trimmedmean")
    monkeypatch.syspath_prepend(str(_entry_point_dir(tmp_path)))
    cls = algorithms.get("trimmedmean")
    assert cls.__module__ == "fedemu_example_plugin.algorithms" and cls.label == "Trimmed mean"
    assert configuration.load(None, ["algorithm.name=trimmedmean"])["algorithm"]["trim"] == 0.1


def test_a_plugin_model_by_module_path_or_entry_point(plugin_on_path, monkeypatch, tmp_path):
    from fedemu.common.ml import models

    assert configuration.load(None, [f"model.name={MODEL_BY_PATH}"])["model"]["name"] == MODEL_BY_PATH
    model = models.build(MODEL_BY_PATH, (1, 28, 28), 10, seed=1)
    assert models.num_parameters(model) == 784 * 100 + 100 + 100 * 10 + 10
    assert model(__import__("torch").zeros(3, 1, 28, 28)).shape == (3, 10)
    with pytest.raises(configuration.ConfigError,
                       match="model.name: unknown model 'mlp100': fedemu has 2nn, cnn, cifar-cnn, char-lstm"):
        configuration.load(None, ["model.name=mlp100"])
    with pytest.raises(configuration.ConfigError, match="model 'fedemu_example_plugin.models:nope': module "
                                                        "'fedemu_example_plugin.models' has no 'nope'"):
        configuration.load(None, ["model.name=fedemu_example_plugin.models:nope"])
    monkeypatch.syspath_prepend(str(_entry_point_dir(tmp_path)))
    assert models.builder("mlp100") is models.builder(MODEL_BY_PATH)


def test_a_plugin_data_set_by_module_path_or_entry_point(plugin_on_path, monkeypatch, tmp_path):
    from fedemu.common.ml import data, datasets

    with pytest.raises(configuration.ConfigError, match="data.dataset: unknown data set 'blobs': fedemu has "
                                                        "mnist, fashion-mnist, cifar10, shakespeare"):
        configuration.load(None, ["data.dataset=blobs"])
    config = configuration.load(None, [f"data.dataset={DATASET_BY_PATH}", f"model.name={MODEL_BY_PATH}",
                                       "data.clients=10"])
    spec = configuration.model_spec(config)
    assert spec.dataset.input_shape == (20,) and spec.dataset.num_classes == 4
    assert spec.build(seed=0)(spec.dataset.inputs(spec.dataset.blank(3))).shape == (3, 4)

    loaded = data.load(DATASET_BY_PATH, cache=tmp_path, progress=lambda _: None)
    assert loaded.name == "blobs" and loaded.train_x.shape == (2000, 20) and loaded.train_x.dtype == np.float32
    assert data.folder(DATASET_BY_PATH, tmp_path) == tmp_path / "v2" / "blobs"
    monkeypatch.syspath_prepend(str(_entry_point_dir(tmp_path)))
    assert datasets.get("blobs") is datasets.get(DATASET_BY_PATH)
    listed = {entry["name"]: entry for entry in data.list_datasets(tmp_path)}
    assert listed["blobs"]["about"] == "Gaussian blobs: inputs 20, 4 classes"
    assert listed["blobs"]["sizes"] == {"train": 2000, "test": 500}


def test_a_data_set_that_is_not_a_data_set_is_refused(plugin_on_path):
    with pytest.raises(configuration.ConfigError, match="data.dataset: data set 'fedemu_example_plugin.models:mlp' "
                                                        "is <function mlp .*>, not a subclass of fedemu's Dataset"):
        configuration.load(None, [f"data.dataset={MODEL_BY_PATH}"])


@pytest.mark.mnist
def test_the_preflight_names_a_plugin_model_the_host_cannot_build(tmp_path):
    """What each host runs before a --machines launch (over SSH in tests/test_machines.py)."""
    from fedemu.launch.running.agent import preflight

    env = {**os.environ, "PYTHONPATH": ""}
    argv = [sys.executable, "-m", "fedemu.launch", "preflight", "--dataset", "mnist", "--model", MODEL_BY_PATH]
    missing = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120).stdout)
    assert missing["problems"] == [f"cannot build model {MODEL_BY_PATH!r} here: model {MODEL_BY_PATH!r}: cannot "
                                   f"import 'fedemu_example_plugin.models' (No module named 'fedemu_example_plugin'); "
                                   f"is the package installed, or on PYTHONPATH, on this host?"]
    found = subprocess.run(argv, env={**env, "PYTHONPATH": str(PLUGIN)}, capture_output=True, text=True, timeout=120)
    assert json.loads(found.stdout)["problems"] == []
    assert preflight("mnist", None, None, None, model="2nn")["problems"] == []


def test_the_preflight_names_a_plugin_data_set_the_host_cannot_load(tmp_path):
    argv = [sys.executable, "-m", "fedemu.launch", "preflight", "--dataset", DATASET_BY_PATH, "--model", "2nn",
            "--cache-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ""}
    missing = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120).stdout)
    assert missing["problems"] == [f"cannot use data set {DATASET_BY_PATH!r} here: data set {DATASET_BY_PATH!r}: "
                                   f"cannot import 'fedemu_example_plugin.datasets' (No module named "
                                   f"'fedemu_example_plugin'); is the package installed, or on PYTHONPATH, on "
                                   f"this host?"]
    found = subprocess.run(argv, env={**env, "PYTHONPATH": str(PLUGIN)}, capture_output=True, text=True, timeout=120)
    report = json.loads(found.stdout)
    assert report["problems"] == [] and report["dataset"] == str(tmp_path / "v2" / "blobs")


def test_the_example_plugins_trimmed_mean_hand_computed(plugin_on_path):
    """Five models, trim 0.2: drop the largest and the smallest value of each coordinate
    and average the three left: [1, 2, 3, 100, -50] -> mean(1, 2, 3) = 2; [0, 0, 9, 9, 9] -> 6."""
    cls = algorithms.get(BY_PATH)
    columns = [[1, 2, 3, 100, -50], [0, 0, 9, 9, 9]]
    replies = [TrainReply(round=1, client=k, task=TRAIN, update=np.array([a, b], np.float32), num_samples=10 * (k + 1),
                          train_loss=0.0, compute_s=0.0) for k, (a, b) in enumerate(zip(*columns))]
    calls = []

    def run_phase(task, lr, **extra):
        calls.append((task, lr, extra))
        return replies

    new = cls(lr=0.1, trim=0.2).run_round(run_phase, np.zeros(2, np.float32), 1)
    np.testing.assert_allclose(new, [2.0, 6.0])
    assert calls == [(TRAIN, 0.1, {"lr_decay": 0.0})]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module-path", "entry-point"])
def test_a_plugin_runs_end_to_end_in_real_processes(how, tmp_path):
    """The launcher validates the config, the server node imports the algorithm, and the
    server and the worker node load the data set and build the model; each finds them the
    way a user's install would make them findable."""
    paths = [str(PLUGIN)] + ([str(_entry_point_dir(tmp_path))] if how == "entry-point" else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])}
    name, model, dataset = ((BY_PATH, MODEL_BY_PATH, DATASET_BY_PATH) if how == "module-path"
                            else ("trimmedmean", "mlp100", "blobs"))
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", "1",
            "--set", f"algorithm.name={name}", "--set", "algorithm.trim=0.2", "--set", f"model.name={model}",
            "--set", f"data.dataset={dataset}", "--set", f"data.cache_dir='{tmp_path / 'cache'}'",
            "--set", "data.clients=10",
            "--set", "algorithm.C=0.5", "--set", "algorithm.B=50", "--set", "run.rounds=2",
            "--set", "run.target_accuracy=0"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["algorithm"] == "trimmedmean" and summary["rounds"] == 2
    start = next(event for event in read_events(run_dir) if event["event"] == "start")
    assert start["dataset"] == "blobs" and start["test_samples"] == 500
    assert summary["final_accuracy"] > 0.5  # chance is 0.25: the trimmed means learned


# --- a plug-in algorithm with its own local task: SCAFFOLD --------------------------------

SCAFFOLD = "fedemu_example_plugin.scaffold:Scaffold"


def test_scaffolds_client_step_hand_computed(plugin_on_path):
    """One full-batch step (E = 1, B = n): y = x - lr (g - c_i + c), so option II's
    c_i+ = c_i - c + (x - y) / lr is the local gradient g at x, whatever c and c_i were;
    the client keeps it and sends c_i+ - c_i. A second round starts from the kept c_i."""
    import torch

    from fedemu.common.algorithms import tasks
    from fedemu.common.ml import models, training
    from fedemu.common.ml.datasets import get
    from fedemu.common.ml.models import ModelSpec
    from fedemu.common.messages import TrainRequest

    spec = ModelSpec("2nn", get("mnist"))
    model = spec.build()
    x0 = models.get_flat(model)
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (20, 28, 28), dtype=np.uint8), rng.integers(0, 10, 20)
    g, _ = training.local_gradient(model, images, labels)
    c = rng.normal(0, 0.01, x0.shape).astype(np.float32)
    c_i = rng.normal(0, 0.01, x0.shape).astype(np.float32)
    task = tasks.get("fedemu_example_plugin.scaffold:ScaffoldTrain")
    state = {"c_i": c_i}

    def run(c_server):
        models.set_flat(model, x0)
        request = TrainRequest(round=1, task="", weights=x0, epochs=1, batch_size=0, lr=0.1, seed=1,
                               extra={"c": c_server})
        return task().run(tasks.TaskInput(model, spec, images, labels, request, torch.Generator().manual_seed(1),
                                          training.IMAGES, client=3, iterations=0, state=state))

    out = run(c)
    np.testing.assert_allclose(out.update, x0 - 0.1 * (g - c_i + c), atol=2e-6)
    np.testing.assert_allclose(state["c_i"], g, atol=2e-5)
    np.testing.assert_allclose(out.extra["delta_c"], g - c_i, atol=2e-5)
    kept = state["c_i"].copy()
    out = run(np.zeros_like(c))  # the next round corrects by 0 - c_i, c_i the gradient kept
    np.testing.assert_allclose(out.update, x0 - 0.1 * (g - kept), atol=2e-6)


def test_a_client_keeps_its_task_state_between_rounds(plugin_on_path):
    """The client hands a task the same state every round (SCAFFOLD's c_i) and returns
    the task's extra beside the update; the device model charges the task's passes."""
    from fedemu.worker.client import Client, ModelCache
    from fedemu.common.ml.data import Data
    from fedemu.common.ml.datasets import get
    from fedemu.common.ml.devices import ComputeModel
    from fedemu.common.ml.models import ModelSpec
    from fedemu.common.messages import TrainRequest

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 255, (40, 28, 28), dtype=np.uint8), rng.integers(0, 10, 40)
    spec = ModelSpec("2nn", get("mnist"))
    client = Client(0, np.arange(40), Data("fake", get("mnist"), images, labels, images, labels), spec, ModelCache(),
                    compute=ComputeModel(clock="virtual", charge="model", device_flops=1e9))
    weights = _flat_2nn(spec)

    def train(round_):
        request = TrainRequest(round=round_, task="fedemu_example_plugin.scaffold:ScaffoldTrain", weights=weights,
                               epochs=2, batch_size=10, lr=0.1, seed=1, extra={"c": np.zeros_like(weights)})
        return client._run_task(request)[0]

    first = train(1)
    kept = client.task_state["c_i"].copy()
    assert np.abs(kept).max() > 0
    np.testing.assert_array_equal(first.extra["delta_c"], kept)
    second = train(2)
    np.testing.assert_allclose(second.extra["delta_c"], client.task_state["c_i"] - kept, atol=1e-7)
    assert client.iterations == 2 * 2 * 4  # two rounds of E = 2 epochs of 4 batches
    plain = Client(1, np.arange(40), client.data, spec, ModelCache(), compute=client.compute)
    fedavg = plain._run_task(TrainRequest(round=1, task=TRAIN, weights=weights, epochs=2, batch_size=10, lr=0.1,
                                          seed=1))[0]
    assert first.compute_s == fedavg.compute_s > 0  # E x n_k training passes, as FedAvg's


def _flat_2nn(spec):
    from fedemu.common.ml import models

    return models.get_flat(spec.build())


def test_scaffolds_server_step_hand_computed(plugin_on_path):
    """x <- mean of the clients' models (eta_g = 1; weighted by n_k as FedAvg's), or
    x + eta_g (mean - x); c <- c + (1/N) sum delta_c, N the population, and the next round
    sends that c."""
    from fedemu.common.algorithms.rounds import Replies

    sent = []

    def run_phase(task, lr, extra=None, **_):
        sent.append((task, extra["c"].copy()))
        replies = Replies()
        for k, (model, delta_c, n) in enumerate([([1, 2], [3, 0], 10), ([3, 6], [1, 2], 30)]):
            replies.fold(TrainReply(round=1, client=k, task="", update=np.array(model, np.float32), num_samples=n,
                                    train_loss=0.0, compute_s=0.0, extra={"delta_c": np.array(delta_c, np.float32)}),
                         keep_update=True)
        return replies

    cls = algorithms.get(SCAFFOLD)
    strategy = cls(lr=0.1)
    strategy.population = 4
    np.testing.assert_allclose(strategy.run_round(run_phase, np.zeros(2, np.float32), 1), [2.5, 5.0])
    np.testing.assert_allclose(strategy.c, [1.0, 0.5])
    assert sent[0][0].__name__ == "ScaffoldTrain" and not sent[0][1].any()
    halfway = cls(lr=0.1, eta_g=0.5)
    halfway.population = 4
    np.testing.assert_allclose(halfway.run_round(run_phase, np.ones(2, np.float32), 1), [1.75, 3.0])
    strategy.run_round(run_phase, np.zeros(2, np.float32), 2)
    np.testing.assert_allclose(sent[-1][1], [1.0, 0.5])  # round 2 sent round 1's c


@pytest.mark.slow
def test_a_plugin_task_runs_end_to_end_in_real_processes(tmp_path):
    """SCAFFOLD in real processes: its first round is FedAvg's (c = c_i = 0), bit for bit
    in virtual time; then the control variates, sent both ways and charged on the links,
    make it another run. A task no host can import fails the run, naming it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "missing_task.py").write_text(
        "from fedemu.common.algorithms import Strategy\n"
        "class Missing(Strategy):\n"
        "    name = 'missing'\n"
        "    def run_round(self, run_phase, weights, round_):\n"
        "        return run_phase('nosuchpackage.tasks:Nope', self.lr)\n")
    summaries, first = {}, {}
    for name in (SCAFFOLD, "fedavg", "missing_task:Missing"):
        run_dir = tmp_path / name.split(":")[-1]
        argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", "2",
                "--set", f"algorithm.name={name}", "--set", "data.partition=shards", "--set", "data.clients=20",
                "--set", "algorithm.C=0.5", "--set", "run.rounds=3", "--set", "run.target_accuracy=0"]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        summaries[name] = json.loads((run_dir / "summary.json").read_text())
        rounds = [e for e in read_events(run_dir) if e["event"] == "round"]
        first[name] = (rounds[0]["accuracy"], rounds[0]["loss"]) if rounds else None
        if name != "missing_task:Missing":
            assert done.returncode == 0, done.stdout + done.stderr
    scaffold, fedavg, missing = summaries[SCAFFOLD], summaries["fedavg"], summaries["missing_task:Missing"]
    assert scaffold["status"] == "completed" and scaffold["rounds"] == 3
    assert first[SCAFFOLD] == first["fedavg"]
    assert scaffold["weights_sha256"] != fedavg["weights_sha256"]
    # Each upload carries the model and a delta_c of its size; each request the model and c.
    assert 1.9 < scaffold["bytes_up"] / fedavg["bytes_up"] < 2.1
    assert 1.9 < scaffold["bytes_down"] / fedavg["bytes_down"] < 2.1
    assert missing["status"] == "failed" and "local task 'nosuchpackage.tasks:Nope'" in missing["reason"]
    assert "No module named 'nosuchpackage'" in missing["reason"] and missing["uploads"] == 0


def test_the_plugin_sweep_expands_to_valid_points(plugin_on_path):
    from fedemu.launch.studies.sweep_spec import expand, load_spec

    points = expand(load_spec(PLUGIN / "sweeps" / "scaffold-noniid.toml"))
    assert sorted({p.config["algorithm"]["name"] for p in points}) == ["fedavg", SCAFFOLD]
    assert len(points) == 6


def test_a_task_output_that_cannot_travel_is_named():
    """A plug-in task's mistake fails its client with a message naming the task, before
    the reply is held back for the device's time (a failed delayed send would only be
    logged on the node)."""
    import torch

    from fedemu.common.algorithms import tasks

    class Sloppy(tasks.LocalTask):
        name = "sloppy"

    flat = np.zeros(4, np.float32)
    assert tasks.checked(Sloppy, tasks.TaskOutput(flat, 0.0, extra={"c": flat, "n": 3})).extra["n"] == 3
    for output, message in [
        (tasks.TaskOutput(flat, 0.0, extra={"c": torch.zeros(3)}), "returned an extra that cannot be sent: cannot "
                                                                   "send an object of type Tensor"),
        (tasks.TaskOutput(flat.reshape(2, 2), 0.0), r"returned an update of type ndarray and shape \(2, 2\); it must be a flat"),
        (tasks.TaskOutput(torch.zeros(4), 0.0), "returned an update of type Tensor;"),
        (tasks.TaskOutput(None, 0.0), "returned no update"),
    ]:
        with pytest.raises(tasks.BadTaskOutput, match=rf"local task '.*Sloppy' {message}"):
            tasks.checked(Sloppy, output)


# --- an asynchronous plug-in rule with its own client policy: fresh FedAsync ----------------

FRESH = "fedemu_example_plugin.fresh_async:FreshFedAsync"


def test_the_fresh_clients_policy_uploads_only_a_model_young_enough(plugin_on_path):
    """After each update it asks the age; then it uploads at t - tau <= max_staleness
    and fetches the current model past it; the bound travels in the start's payload."""
    cls = algorithms.get(FRESH)
    rule = cls.from_config(configuration.load(None, [f"algorithm.name={FRESH}", "algorithm.max_staleness=3"])
                           ["algorithm"])
    client = cls.client(cls, rule.client_payload())
    assert client.after_training() == algorithms.ASK_AGE
    assert [client.on_age(server_age, 10) for server_age in (10, 13, 14, 40)] == [
        algorithms.UPLOAD, algorithms.UPLOAD, algorithms.FETCH, algorithms.FETCH]
    with pytest.raises(configuration.ConfigError, match="max_staleness"):
        configuration.load(None, [f"algorithm.name={FRESH}", "algorithm.max_staleness=-1"])


@pytest.mark.slow
def test_an_async_plugin_with_its_own_client_policy_runs_end_to_end(tmp_path):
    """Real processes: the worker nodes find the rule's client half by its path; with a
    tight bound its clients ask the age after every update and fetch instead of
    uploading a stale one, which plain FedAsync never does; a loose bound uploads every
    update, as FedAsync does."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), os.environ.get("PYTHONPATH", "")])}
    events = {}
    for label, sets in {"tight": [f"algorithm.name={FRESH}", "algorithm.max_staleness=0"],
                        "loose": [f"algorithm.name={FRESH}", "algorithm.max_staleness=1000"],
                        "fedasync": ["algorithm.name=fedasync"]}.items():
        run_dir = tmp_path / label
        argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", "2",
                "--set", "data.partition=shards", "--set", "data.clients=10", "--set", "run.rounds=3",
                "--set", "algorithm.eval_every_uploads=5", "--set", "run.target_accuracy=0",
                *[arg for s in sets for arg in ("--set", s)]]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
        events[label] = [e for e in read_events(run_dir) if e["event"] == "round"]
    tight, loose, plain = events["tight"], events["loose"], events["fedasync"]
    assert sum(e["fetches"] for e in tight) > 0 and sum(e["age_requests"] for e in tight) > 0
    assert sum(e["fetches"] for e in loose) == 0 and sum(e["age_requests"] for e in loose) > 0
    assert all("age_requests" not in e for e in plain)  # FedAsync's own clients never ask
