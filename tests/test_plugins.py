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
from fedemu.server import algorithm
from fedemu.server.runlog import read_events
from fedemu.worker.protocol import TRAIN, TrainReply

PLUGIN = Path(__file__).parent.parent / "examples" / "plugin"
BY_PATH = "fedemu_example_plugin.algorithms:TrimmedMean"
MODEL_BY_PATH = "fedemu_example_plugin.models:mlp"
DATASET_BY_PATH = "fedemu_example_plugin.datasets:Blobs"


@pytest.fixture
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN))
    # Each test finds the plug-in afresh, as a new process would (the built-ins loaded
    # first, so the registry put back afterwards has them).
    algorithm.built_in()
    monkeypatch.setattr(algorithm._registry, "classes", {name: cls for name, cls in algorithm._registry.classes.items()
                                                         if name not in ("trimmedmean", BY_PATH)})
    from fedemu.worker.ml import models

    monkeypatch.setattr(models, "_BUILDERS", dict(models._BUILDERS))
    for name in ("mlp100", MODEL_BY_PATH):
        models._BUILDERS.pop(name, None)
    from fedemu.worker.ml import datasets

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
    with pytest.raises(algorithm.UnknownAlgorithm, match="unknown algorithm 'trimmedmean'"):
        algorithm.get("trimmedmean")
    monkeypatch.syspath_prepend(str(_entry_point_dir(tmp_path)))
    cls = algorithm.get("trimmedmean")
    assert cls.__module__ == "fedemu_example_plugin.algorithms" and cls.label == "Trimmed mean"
    assert configuration.load(None, ["algorithm.name=trimmedmean"])["algorithm"]["trim"] == 0.1


def test_a_plugin_model_by_module_path_or_entry_point(plugin_on_path, monkeypatch, tmp_path):
    from fedemu.worker.ml import models

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
    from fedemu.worker.ml import data, datasets

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
    from fedemu.launch.agent import preflight

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
    cls = algorithm.get(BY_PATH)
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
