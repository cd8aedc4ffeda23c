"""CIFAR-10: the standard python archive (a tiny synthetic one in the same format: the real
one has no offline source here), fetched from a local copy or over HTTP, verified,
cached; the tutorial's preprocessing; McMahan et al.'s model; a run end to end."""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import pickle
import tarfile
import threading

import numpy as np
import pytest
import torch

from fedemu.common.ml import data, models
from fedemu.common.ml.datasets import cifar10
from fedemu.common.ml.training import client_update, evaluate

PER_BATCH = 10  # 5 training batches and a test batch of 10 images each
SMALL = {"train": 5 * PER_BATCH, "test": PER_BATCH}


def _images(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[int]]:
    """Learnable images: class c fills channel c % 3 of rows 3c..3c+2 with bright pixels."""
    labels = [int(c) for c in rng.integers(0, 10, n)]
    images = rng.integers(0, 80, (n, 3, 32, 32)).astype(np.uint8)
    for i, c in enumerate(labels):
        images[i, c % 3, 3 * c:3 * c + 3, :] = 240
    return images, labels


def synthetic_archive(seed: int = 0) -> tuple[bytes, dict[str, np.ndarray]]:
    """A cifar-10-python.tar.gz in the real one's layout: Python-2-style pickles of
    {b'data': (n, 3072) uint8, b'labels': [int]}."""
    rng = np.random.default_rng(seed)
    buffer, arrays = io.BytesIO(), {"train_x": [], "train_y": [], "test_x": [], "test_y": []}
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for member in (*cifar10.CIFAR10_TRAIN_BATCHES, cifar10.CIFAR10_TEST_BATCH):
            images, labels = _images(rng, PER_BATCH)
            split = "test" if member == cifar10.CIFAR10_TEST_BATCH else "train"
            arrays[f"{split}_x"].append(images)
            arrays[f"{split}_y"].append(np.array(labels, np.uint8))
            raw = pickle.dumps({b"batch_label": b"synthetic", b"labels": labels,
                                b"data": images.reshape(PER_BATCH, -1)}, protocol=2)
            info = tarfile.TarInfo(member)
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    return buffer.getvalue(), {name: np.concatenate(parts) for name, parts in arrays.items()}


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(cifar10.Cifar10, "sizes", SMALL)


def test_a_local_copy_is_verified_read_and_cached(tmp_path, monkeypatch, small):
    raw, expected = synthetic_archive()
    (tmp_path / "copy.tar.gz").write_bytes(raw)
    monkeypatch.setenv(cifar10.CIFAR10_ARCHIVE_ENV, str(tmp_path / "copy.tar.gz"))
    # The real archive's md5 refuses it before a byte is unpickled.
    with pytest.raises(data.DatasetError, match=f"md5 {hashlib.md5(raw).hexdigest()}, expected "
                                                f"{cifar10.CIFAR10_MD5}"):
        data.fetch("cifar10", cache=tmp_path / "cache", progress=lambda _: None)
    monkeypatch.setattr(cifar10, "CIFAR10_MD5", hashlib.md5(raw).hexdigest())
    loaded = data.load("cifar10", cache=tmp_path / "cache", progress=lambda _: None)
    for name, array in expected.items():
        np.testing.assert_array_equal(getattr(loaded, name), array)
    assert loaded.train_x.shape == (50, 3, 32, 32) and loaded.dataset.input_shape == (3, 24, 24)


def test_the_home_page_source_downloads_and_verifies(tmp_path, monkeypatch, small):
    raw, expected = synthetic_archive(1)

    class Archive(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Archive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.delenv(cifar10.CIFAR10_ARCHIVE_ENV, raising=False)
        monkeypatch.setattr(cifar10, "CIFAR10_URL", f"http://127.0.0.1:{server.server_address[1]}/c.tar.gz")
        monkeypatch.setattr(cifar10, "CIFAR10_MD5", hashlib.md5(raw).hexdigest())
        lines: list[str] = []
        loaded = data.load("cifar10", cache=tmp_path, progress=lines.append)
    finally:
        server.shutdown()
        server.server_close()
    assert any("is not set" in line for line in lines)  # the local copy was tried first
    np.testing.assert_array_equal(loaded.test_x, expected["test_x"])


def test_a_damaged_archive_is_named(tmp_path, monkeypatch):
    raw = b"\x1f\x8b not really gzip"
    monkeypatch.setattr(cifar10, "CIFAR10_MD5", hashlib.md5(raw).hexdigest())
    with pytest.raises(data.DatasetError, match="somewhere: not the CIFAR-10 python archive's layout"):
        cifar10.read_archive(raw, "somewhere")


def test_evaluation_inputs_are_the_whitened_centre():
    dataset = cifar10.Cifar10()
    images = np.random.default_rng(2).integers(0, 256, (3, 3, 32, 32)).astype(np.uint8)
    inputs = dataset.inputs(images)
    assert inputs.shape == (3, 3, 24, 24)
    flat = inputs.reshape(3, -1)
    np.testing.assert_allclose(flat.mean(dim=1), 0, atol=1e-5)
    np.testing.assert_allclose(flat.std(dim=1, unbiased=False), 1, atol=1e-4)
    centre = torch.from_numpy(images[:, :, 4:28, 4:28].astype(np.float32)).reshape(3, -1)
    expected = (centre - centre.mean(1, keepdim=True)) / centre.std(1, unbiased=False, keepdim=True)
    np.testing.assert_allclose(flat, expected, atol=1e-5)
    # A flat image does not divide by zero.
    assert torch.isfinite(dataset.inputs(np.full((1, 3, 32, 32), 7, np.uint8))).all()


def test_augmentation_crops_flips_and_draws_from_the_generator(monkeypatch):
    dataset = cifar10.Cifar10()
    images = np.random.default_rng(3).integers(0, 256, (16, 3, 32, 32)).astype(np.uint8)
    batch = dataset.inputs(images, train=True)
    first = dataset.augment(batch, torch.Generator().manual_seed(5))
    assert first.shape == (16, 3, 24, 24)
    assert torch.equal(first, dataset.augment(batch, torch.Generator().manual_seed(5)))
    assert not torch.equal(first, dataset.augment(batch, torch.Generator().manual_seed(6)))
    # Without brightness and contrast, each output is one whitened 24x24 window of its
    # image, or that window mirrored; over 16 images both kinds occur.
    monkeypatch.setattr(cifar10, "MAX_BRIGHTNESS_DELTA", 0.0)
    monkeypatch.setattr(cifar10, "CONTRAST_RANGE", (1.0, 1.0))
    out = dataset.augment(batch, torch.Generator().manual_seed(7))
    flips = []
    for image, augmented in zip(batch, out):
        crops = {(top, left): image[:, top:top + 24, left:left + 24] for top in range(9) for left in range(9)}
        windows = {(top, left, flip): cifar10.standardise((crop.flip(-1) if flip else crop)[None])[0]
                   for (top, left), crop in crops.items() for flip in (False, True)}
        found = [key for key, window in windows.items() if torch.allclose(window, augmented, atol=1e-5)]
        assert found, "not a crop of its image"
        flips.append(found[0][2])
    assert any(flips) and not all(flips)


def test_mcmahans_cifar_model_trains_on_augmented_batches_and_is_scored_on_centre_crops():
    model = models.build("cifar-cnn", (3, 24, 24), 10, seed=0)
    # Two 5x5x64 convolutions, 384 and 192 units, 10 logits: "about 10^6 parameters".
    assert models.num_parameters(model) == (5 * 5 * 3 * 64 + 64) + (5 * 5 * 64 * 64 + 64) + (6 * 6 * 64 * 384 + 384) \
        + (384 * 192 + 192) + (192 * 10 + 10) == 1_068_298
    dataset = cifar10.Cifar10()
    _, arrays = synthetic_archive(4)
    seen: list[torch.Tensor] = []  # what the model was given in training
    hook = model.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    before = models.get_flat(model).copy()
    result = client_update(model, arrays["train_x"], arrays["train_y"], epochs=1, batch_size=10, lr=0.05,
                           generator=torch.Generator().manual_seed(0), dataset=dataset)
    hook.remove()
    assert result.steps == 5 and np.isfinite(result.train_loss)
    assert not np.array_equal(before, result.weights)
    # Augmented: whitened 24x24 windows, almost none of them an image's plain centre crop
    # (what evaluation sees). A window is the centre one unflipped with probability 1/162,
    # so 6 or more of 50 happen by chance with probability 7e-7; unaugmented, all 50 are.
    trained_on = torch.cat(seen).reshape(50, -1)
    assert torch.cat(seen).shape == (50, 3, 24, 24)
    np.testing.assert_allclose(trained_on.mean(dim=1), 0, atol=1e-4)
    centres = dataset.inputs(arrays["train_x"]).reshape(50, -1)
    plain = int((torch.cdist(trained_on, centres).min(dim=1).values < 1.0).sum())
    assert plain <= 5, f"{plain} of 50 training inputs were an image's plain centre crop"
    # Scored on the whitened centre crops, as computed here from the model's logits.
    accuracy, loss = evaluate(model, arrays["test_x"], arrays["test_y"], dataset=dataset)
    model.eval()
    with torch.no_grad():
        logits = model(dataset.inputs(arrays["test_x"]))
    targets = torch.from_numpy(arrays["test_y"].astype(np.int64))
    assert accuracy == pytest.approx((logits.argmax(dim=1) == targets).float().mean().item())
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(logits, targets).item(), rel=1e-5)


@pytest.mark.slow
def test_a_cifar_run_end_to_end(tmp_path):
    """Published into a cache as a user's own copy would be, then a FedAvg run in real
    processes: the server and both worker nodes build the CIFAR model for 24x24 crops."""
    from .test_launch import launch

    rng = np.random.default_rng(6)
    arrays = {}
    for split, n in (("train", 200), ("test", 50)):
        images, labels = _images(rng, n)
        arrays[f"{split}_x"], arrays[f"{split}_y"] = images, np.array(labels, np.uint8)
    data.publish("cifar10", arrays, {"source": "synthetic, for tests"}, tmp_path / "cache")
    proc = launch(tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}", "data.dataset=cifar10",
                  "model.name=cifar-cnn", "data.clients=4", "algorithm.C=0.5", "algorithm.E=1", "algorithm.B=10",
                  "algorithm.lr=0.05", "run.rounds=2", "run.torch_threads=1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2
    assert summary["bytes_down"] >= 2 * 2 * 1_068_298 * 4  # two clients a round get the 1.07M-weight model
