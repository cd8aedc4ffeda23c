"""CIFAR-10 (Krizhevsky 2009) as McMahan et al. (2017) trained on it: 32x32 colour images
of 10 classes, 50,000 for training and 10,000 for testing, preprocessed as the
TensorFlow tutorial they took their model from (their reference [38]): cropped to 24x24
(at random for training, the centre for testing), randomly flipped left-right, random
brightness and contrast, then whitened (per-image standardisation).

Sources, tried in order, each checked against the archive's well-known md5 before a
byte of it is unpickled: the standard python archive (``cifar-10-python.tar.gz``) where
``$FEDEMU_CIFAR10_ARCHIVE`` names a copy, else downloaded from its home page.
"""
from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle
import tarfile
import time

import numpy as np

from . import Arrays, Dataset, DatasetError, Progress, Source, SourceUnreachable, download_within, register

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
# The archive's md5, as its home page and torchvision publish it.
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_ARCHIVE_ENV = "FEDEMU_CIFAR10_ARCHIVE"
CIFAR10_TRAIN_BATCHES = tuple(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_BATCH = "cifar-10-batches-py/test_batch"
# 163 MB: a slow link may take minutes, but a silent one gives up soon.
DOWNLOAD_BUDGET_SECONDS = 1800.0
DOWNLOAD_SILENCE_SECONDS = 15.0

STORED_SHAPE = (3, 32, 32)
CROP = 24
# The tutorial's distortions (cifar10_input.distorted_inputs): brightness +-63 on 0..255
# pixels, contrast x[0.2, 1.8] about each channel's mean.
MAX_BRIGHTNESS_DELTA = 63.0
CONTRAST_RANGE = (0.2, 1.8)


def read_archive(raw: bytes, origin: str, expected_md5: str | None = None) -> Arrays:
    """The arrays in a cifar-10-python.tar.gz, after its md5 is checked (unpickling runs code:
    only the archive we pinned gets that far)."""
    digest = hashlib.md5(raw).hexdigest()
    expected = expected_md5 or CIFAR10_MD5
    if digest != expected:
        raise DatasetError(f"{origin}: md5 {digest}, expected {expected} (not the CIFAR-10 python archive)")

    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as archive:
            def batch(member: str) -> tuple[np.ndarray, np.ndarray]:
                stream = archive.extractfile(member)
                if stream is None:
                    raise DatasetError(f"{origin}: {member} is not a file")
                # Python 2 pickles: byte-string keys.
                entry = pickle.load(stream, encoding="bytes")
                images = np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, *STORED_SHAPE)
                return images, np.asarray(entry[b"labels"], dtype=np.uint8)

            train = [batch(member) for member in CIFAR10_TRAIN_BATCHES]
            test_x, test_y = batch(CIFAR10_TEST_BATCH)
    except (KeyError, tarfile.TarError, pickle.UnpicklingError, ValueError) as error:
        raise DatasetError(f"{origin}: not the CIFAR-10 python archive's layout ({type(error).__name__}: "
                           f"{error})") from None
    return {"train_x": np.concatenate([x for x, _ in train]), "train_y": np.concatenate([y for _, y in train]),
            "test_x": test_x, "test_y": test_y}


def _from_local_copy(progress: Progress) -> tuple[Arrays, dict]:
    named = os.environ.get(CIFAR10_ARCHIVE_ENV)
    if not named:
        raise SourceUnreachable(f"${CIFAR10_ARCHIVE_ENV} is not set (it names a copy of cifar-10-python.tar.gz)")
    path = pathlib.Path(named).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DatasetError(f"${CIFAR10_ARCHIVE_ENV} = {path}: {error.strerror or error}") from None
    progress(f"  verifying and reading {path}")
    return read_archive(raw, str(path)), {"source": f"local copy {path}", "archive_md5": CIFAR10_MD5}


def _from_home_page(progress: Progress) -> tuple[Arrays, dict]:
    progress(f"  downloading {CIFAR10_URL} (163 MB)")
    deadline = time.monotonic() + DOWNLOAD_BUDGET_SECONDS  # wall: a real download
    raw = download_within(CIFAR10_URL, deadline, DOWNLOAD_SILENCE_SECONDS)
    return read_archive(raw, CIFAR10_URL), {"source": CIFAR10_URL, "archive_md5": CIFAR10_MD5}


def standardise(images):
    """TensorFlow's per_image_standardization: each image to mean 0 and unit variance
    (the deviation floored at 1/sqrt(pixels), so a flat image does not blow up)."""
    # torch where it is used: this module is read without it, where a config is checked
    import torch

    flat = images.reshape(len(images), -1)
    mean = flat.mean(dim=1, keepdim=True)
    floor = torch.tensor(1.0 / np.sqrt(flat.shape[1]), dtype=images.dtype, device=images.device)
    std = torch.maximum(flat.std(dim=1, unbiased=False, keepdim=True), floor)
    return ((flat - mean) / std).view_as(images)


@register
class Cifar10(Dataset):
    name = "cifar10"
    title = "CIFAR-10"
    input_shape = (3, CROP, CROP)
    num_classes = 10
    model = "cifar-cnn"
    sizes = {"train": 50_000, "test": 10_000}

    def sources(self) -> list[Source]:
        return [(f"a local copy (${CIFAR10_ARCHIVE_ENV})", _from_local_copy),
                (f"the home page ({CIFAR10_URL})", _from_home_page)]

    def check(self, arrays: Arrays, origin: str, sizes: bool = True) -> None:
        super().check(arrays, origin, sizes)
        for split in ("train", "test"):
            x = arrays[f"{split}_x"]
            if x.dtype != np.uint8 or x.shape[1:] != STORED_SHAPE:
                raise DatasetError(f"{origin}: {split} images are {x.dtype} {x.shape[1:]}, expected uint8 "
                                   f"{'x'.join(map(str, STORED_SHAPE))}")

    def prepared(self, arrays: Arrays) -> Arrays:
        return {name: np.ascontiguousarray(arrays[name], dtype=np.uint8) for name in self.arrays()}

    def blank(self, n: int) -> np.ndarray:
        return np.zeros((n, *STORED_SHAPE), dtype=np.uint8)

    def inputs(self, x: np.ndarray, train: bool = False):
        """Evaluation: the centre 24x24, whitened. Training: the whole 32x32 image in 0..255,
        for ``augment`` to crop and distort."""
        # torch where it is used: this module is read without it, where a config is checked
        import torch

        images = torch.from_numpy(np.asarray(x).astype(np.float32)).view(-1, *STORED_SHAPE)
        if train:
            return images
        margin = (STORED_SHAPE[1] - CROP) // 2
        return standardise(images[:, :, margin:margin + CROP, margin:margin + CROP].contiguous())

    def augment(self, batch, generator):
        """The tutorial's distorted_inputs, per image: a random 24x24 crop, a left-right flip
        with probability 1/2, brightness + U(-63, 63), contrast x U(0.2, 1.8) about each
        channel's mean, then whitening. Every draw from ``generator`` (on the CPU, whatever
        device the batch is on: a GPU run draws the same)."""
        # torch where it is used: this module is read without it, where a config is checked
        import torch

        n = len(batch)
        device = batch.device
        tops = torch.randint(0, STORED_SHAPE[1] - CROP + 1, (n,), generator=generator)
        lefts = torch.randint(0, STORED_SHAPE[2] - CROP + 1, (n,), generator=generator)
        flips = (torch.rand(n, generator=generator) < 0.5).to(device)
        brightness = ((torch.rand(n, generator=generator) * 2 - 1) * MAX_BRIGHTNESS_DELTA).to(device)
        low, high = CONTRAST_RANGE
        contrast = (low + torch.rand(n, generator=generator) * (high - low)).to(device)
        crops = torch.stack([batch[i, :, top:top + CROP, left:left + CROP]
                             for i, (top, left) in enumerate(zip(tops.tolist(), lefts.tolist()))])
        crops = torch.where(flips.view(n, 1, 1, 1), crops.flip(-1), crops)
        crops = crops + brightness.view(n, 1, 1, 1)
        means = crops.mean(dim=(2, 3), keepdim=True)
        crops = (crops - means) * contrast.view(n, 1, 1, 1) + means
        return standardise(crops)
