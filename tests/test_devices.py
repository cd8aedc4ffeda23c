"""run.device: where clients train. The CPU half runs everywhere; the GPU half needs a
CUDA GPU and skips, saying so, on a machine without one."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fedemu.launch.running.agent import preflight
from fedemu.launch.config import ConfigError, load
from fedemu.common.ml import models
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.devices import DeviceUnavailable, torch_device, use_device
from fedemu.common.algorithms.fsvrg import svrg_pass
from fedemu.common.ml.training import client_update, device_of, evaluate, local_gradient

MNIST = dataset_named("mnist")
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: torch here sees none "
                               f"(torch {torch.__version__}, CUDA build: {torch.version.cuda})")
no_gpu = pytest.mark.skipif(HAS_CUDA, reason="checks a host without a CUDA GPU; this one has one")


def _data(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8),
            rng.integers(0, 10, size=count).astype(np.uint8))


def test_auto_is_the_first_gpu_where_there_is_one_else_the_cpu():
    assert torch_device("auto") == (torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu"))
    assert torch_device("cpu") == torch.device("cpu")


@no_gpu
def test_a_gpu_this_host_lacks_is_an_error_that_names_the_setting_and_the_way_out():
    for setting in ("cuda", "cuda:1"):
        with pytest.raises(DeviceUnavailable, match=rf"run.device = '{setting}'.*'cpu'"):
            torch_device(setting)


def test_a_gpu_index_beyond_the_hosts_gpus_is_refused():
    with pytest.raises(DeviceUnavailable, match="run.device = 'cuda:99'"):
        torch_device("cuda:99")


@pytest.mark.parametrize("setting", ["gpu", "cuda:", "cuda:x", "CPU", "mps"])
def test_config_refuses_a_device_it_cannot_mean(setting):
    with pytest.raises(ConfigError, match="run.device"):
        load(None, [f"run.device={setting}"])


def test_config_takes_every_documented_form():
    for setting in ("auto", "cpu", "cuda", "cuda:3"):
        assert load(None, [f"run.device={setting}"])["run"]["device"] == setting


@no_gpu
def test_preflight_names_a_hosts_missing_gpu():
    report = preflight("mnist", None, None, None, device="cuda")
    assert any("run.device = 'cuda'" in problem for problem in report["problems"]), report["problems"]
    assert preflight("mnist", None, None, None, device="cpu")["device"] == "cpu"


def test_preflight_names_a_missing_numba(monkeypatch):
    """A host whose install skipped fedemu's dependencies would fail at its first exact-sum
    addition, mid-run; the preflight says so first."""
    import sys

    assert preflight("mnist", None, None, None, device="cpu")["problems"] == []
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    [problem] = preflight("mnist", None, None, None, device="cpu")["problems"]
    assert problem.startswith("numba cannot be imported (")


@no_gpu
@pytest.mark.mnist
def test_launch_refuses_a_missing_gpu_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir),
                           "--set", "run.device=cuda", "--set", "run.rounds=1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "run.device = 'cuda'" in done.stderr + done.stdout and "nothing was started" in done.stderr + done.stdout
    assert not (run_dir / "logs" / "broker.out").exists()


def test_a_model_built_for_a_device_starts_from_the_same_weights():
    spec = models.ModelSpec("2nn", MNIST)
    on_cpu = spec.build(seed=3)
    on_device = spec.build(seed=3, device=torch_device("auto"))
    assert device_of(on_device) == torch_device("auto")
    np.testing.assert_array_equal(models.get_flat(on_cpu), models.get_flat(on_device))


# --- on a GPU ---------------------------------------------------------------------------


@pytest.fixture
def gpu_set_up_as_a_node():
    """The GPU as a worker node sets it up (deterministic kernels, full float32)."""
    use_device(torch_device("cuda"))


@needs_gpu
@pytest.mark.usefixtures("gpu_set_up_as_a_node")
# The CNN's tolerance is measured: on an H200 its weights after these ten steps were up to
# 1.8e-4 from the CPU's in full float32 (convolutions sum in another order) and 1.2e-3 with
# cuDNN's TF32, which use_device turns off.
@pytest.mark.parametrize("name, atol", [("2nn", 1e-4), ("cnn", 5e-4)])
def test_training_on_the_gpu_follows_the_cpu_and_returns_host_arrays(name, atol):
    spec = models.ModelSpec(name, MNIST)
    x, y = _data(50)
    results = {}
    for device in ("cpu", "cuda"):
        model = spec.build(seed=1, device=torch.device(device))
        result = client_update(model, x, y, epochs=2, batch_size=10, lr=0.05,
                               generator=torch.Generator().manual_seed(7), dataset=MNIST)
        assert isinstance(result.weights, np.ndarray)
        gradient, _ = local_gradient(model, x, y, MNIST)
        assert isinstance(gradient, np.ndarray)
        results[device] = (result.weights, result.train_loss, evaluate(model, x, y, dataset=MNIST))
    np.testing.assert_allclose(results["cuda"][0], results["cpu"][0], atol=atol)
    assert results["cuda"][1] == pytest.approx(results["cpu"][1], rel=1e-4)
    assert results["cuda"][2][0] == pytest.approx(results["cpu"][2][0], abs=0.02)


@needs_gpu
@pytest.mark.usefixtures("gpu_set_up_as_a_node")
def test_the_char_lstm_on_the_gpu_follows_the_cpu():
    shakespeare = dataset_named("shakespeare")
    spec = models.ModelSpec("char-lstm", shakespeare)
    rng = np.random.default_rng(3)
    x = rng.integers(0, shakespeare.num_classes, size=(40, 80), dtype=np.uint16)
    y = rng.integers(0, shakespeare.num_classes, size=(40, 80), dtype=np.uint16)
    results = {}
    for device in ("cpu", "cuda"):
        model = spec.build(seed=1, device=torch.device(device))
        result = client_update(model, x, y, epochs=1, batch_size=10, lr=1.47,
                               generator=torch.Generator().manual_seed(7), dataset=shakespeare)
        results[device] = result.weights, result.train_loss
    np.testing.assert_allclose(results["cuda"][0], results["cpu"][0], atol=1e-4)
    assert results["cuda"][1] == pytest.approx(results["cpu"][1], rel=1e-4)


@needs_gpu
@pytest.mark.usefixtures("gpu_set_up_as_a_node")
def test_svrg_on_the_gpu_follows_the_cpu():
    spec = models.ModelSpec("2nn", MNIST)
    x, y = _data(30)
    out = {}
    for device in ("cpu", "cuda"):
        model, anchor = spec.build(seed=2, device=device), spec.build(seed=2, device=device)
        full, _ = local_gradient(anchor, x, y, MNIST)
        out[device] = svrg_pass(model, x, y, anchor=anchor, full_gradient=full, stepsize=1.0,
                                generator=torch.Generator().manual_seed(1), dataset=MNIST).weights
    np.testing.assert_allclose(out["cuda"], out["cpu"], atol=1e-4)


@needs_gpu
@pytest.mark.mnist
def test_a_gpu_run_completes_and_reruns_bit_for_bit(tmp_path):
    hashes = []
    for attempt in range(2):
        run_dir = tmp_path / f"run{attempt}"
        done = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir),
                               "--workers", "2", "--set", "run.device=cuda", "--set", "run.rounds=3",
                               "--set", "run.target_accuracy=0"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        hashes.append(json.loads((run_dir / "summary.json").read_text())["weights_sha256"])
        assert "computes on cuda:0" in (run_dir / "logs" / "worker-0.log").read_text()
    assert hashes[0] == hashes[1]
