"""The data cache: every data set (``fedemu.common.ml.datasets``) fetched once, with no
manual step, into ``cache_dir()/v2/<name>/`` as plain ``.npy`` files (``train_x``,
``train_y``, ``test_x``, ``test_y``, and ``train_client``, ``test_client`` for data sets
with natural clients), then memory-mapped, so a node that trains only a few clients
touches only those clients' pages.

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

import json
import os
import pathlib
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from importlib import metadata

import numpy as np

from . import datasets
from .datasets import Dataset, DatasetError, DatasetUnreachableError, Progress, SourceUnreachable, sha256_file

__all__ = ["Data", "DatasetError", "DatasetUnreachableError", "cache_dir", "fetch", "load", "publish",
           "verify", "check_sizes", "list_datasets", "folder"]

_SOURCE_FILE = "SOURCE.json"
_STAGING_PREFIX = ".partial-"
# A fetch takes seconds; a staging folder this old belongs to a killed fetch.
_STALE_STAGING_SECONDS = 3600


@dataclass(frozen=True)
class Data:
    """A data set's arrays, memory-mapped read-only from the cache, with the data set
    that says how they become tensors. ``name`` says what the arrays are (a k-fold view
    names its fold)."""

    name: str
    dataset: Dataset
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    train_client: np.ndarray | None = None
    test_client: np.ndarray | None = None


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


# The cache's layout: its arrays' names (train_x, ...). A layout that changes goes to a
# new folder, so installs of different fedemu versions sharing a cache never take each
# other's copies for damaged ones.
LAYOUT = "v2"


def _root(cache: str | os.PathLike | None) -> pathlib.Path:
    """Where this layout's data sets live: ``cache_dir(cache)/v2``."""
    root = cache_dir(cache) / LAYOUT
    root.mkdir(exist_ok=True)
    return root


def folder(name: str, cache: str | os.PathLike | None = None) -> pathlib.Path:
    """The cache folder of data set ``name`` (cached or not)."""
    return _root(cache) / datasets.get(name).name


def _is_complete(folder: pathlib.Path, dataset: Dataset) -> bool:
    # SOURCE.json alone is not enough: someone may have deleted an array since.
    return (folder / _SOURCE_FILE).is_file() and all(
        (folder / f"{array}.npy").is_file() for array in dataset.arrays()
    )


def _remove_stale_staging(root: pathlib.Path, name: str) -> None:
    cutoff = time.time() - _STALE_STAGING_SECONDS  # wall: compared with files' mtimes
    for leftover in root.glob(f".{name}{_STAGING_PREFIX}*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:
            pass  # another process cleaned it up first


def _publish(root: pathlib.Path, dataset: Dataset, arrays: dict[str, np.ndarray], source: dict) -> pathlib.Path:
    """Write the converted arrays and SOURCE.json, then rename them into place."""
    name, names = dataset.name, dataset.arrays()
    final = root / name
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}{_STAGING_PREFIX}", dir=root))
    try:
        # mkdtemp makes the folder private; the cache may be shared by users.
        staging.chmod(0o755)
        for array_name in names:
            np.save(staging / f"{array_name}.npy", arrays[array_name], allow_pickle=False)
        source = dict(source)
        source["files_sha256"] = {f"{n}.npy": sha256_file(staging / f"{n}.npy") for n in names}
        source["files_bytes"] = {f"{n}.npy": (staging / f"{n}.npy").stat().st_size for n in names}
        (staging / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        if final.exists() and (not _is_complete(final, dataset) or verify(final, dataset) is not None):
            # Not ours to keep: an incomplete or damaged folder (a hand edit, an
            # older layout, a bad disk) would block the rename below.
            _set_aside(final)
        try:
            os.rename(staging, final)
        except OSError:
            if not _is_complete(final, dataset):
                raise
            # Another process published the same data first; keep theirs.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def publish(name: str, arrays: dict[str, np.ndarray], source: dict,
            cache: str | os.PathLike | None = None) -> pathlib.Path:
    """Cache ``arrays`` as data set ``name``, checked as the data set checks what its
    sources fetch (but for its fixed split sizes), with the sizes and hashes that later
    loads check: how a test or a user's own copy of a data set gets into the cache."""
    dataset = datasets.get(name)
    dataset.check(arrays, f"the arrays published as {name}", sizes=False)
    return _publish(_root(cache), dataset, dataset.prepared(arrays), source)


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


def check_sizes(folder: pathlib.Path, dataset: Dataset) -> str | None:
    """What is wrong with a cached data set's files by their sizes (cheap), or None."""
    try:
        source = _recorded(folder)
    except DatasetError as error:
        return str(error)
    sizes = source.get("files_bytes", {})
    for array_name in dataset.arrays():
        path = folder / f"{array_name}.npy"
        try:
            actual = path.stat().st_size
        except OSError as error:
            return f"{path}: {error.strerror or error}"
        if array_name + ".npy" in sizes and actual != sizes[array_name + ".npy"]:
            return f"{path} has {actual:,} bytes; it had {sizes[array_name + '.npy']:,} when cached"
    return None


def verify(folder: pathlib.Path, dataset: Dataset) -> str | None:
    """What is wrong with a cached data set (sizes, then every file's sha256), or None."""
    problem = check_sizes(folder, dataset)
    if problem is not None:
        return problem
    hashes = _recorded(folder)["files_sha256"]
    for array_name in dataset.arrays():
        path = folder / f"{array_name}.npy"
        expected = hashes.get(f"{array_name}.npy")
        try:
            actual = sha256_file(path)
        except OSError as error:
            return f"{path}: {error.strerror or error}"
        if actual != expected:
            return f"{path} has sha256 {actual[:16]}..., not the {str(expected)[:16]}... recorded when cached"
    return None


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------

def fetch(
    name: str,
    cache: str | os.PathLike | None = None,
    progress: Progress = print,
    force: bool = False,
) -> pathlib.Path:
    """Make a verified converted copy of ``name`` exist in the cache; return its folder.
    A cached copy is checked against the sizes and hashes recorded when it was made;
    a damaged one (or any, with ``force``) is fetched again. ``name`` is what
    ``data.dataset`` says: a built-in, a plug-in's entry point or package.module:Class."""
    dataset = datasets.get(name)
    name, root = dataset.name, _root(cache)
    final = root / name
    if _is_complete(final, dataset):
        problem = "fetch --force" if force else verify(final, dataset)
        if problem is None:
            progress(f"{name}: already cached in {final} (sizes and sha256 verified)")
            return final
        if not force:
            progress(f"{name}: the cache in {final} is damaged: {problem}; fetching it again")
        _set_aside(final)
    _remove_stale_staging(root, name)

    failures: list[tuple[str, Exception]] = []
    for source_name, obtain in dataset.sources():
        progress(f"{name}: trying {source_name}")
        started = time.monotonic()  # wall: a download's duration, printed
        try:
            arrays, source = obtain(progress)
            dataset.check(arrays, source_name)
            arrays = dataset.prepared(arrays)
        except (SourceUnreachable, DatasetError, OSError, zipfile.BadZipFile) as error:
            progress(f"{name}: {source_name} failed: {error}")
            failures.append((source_name, error))
            continue
        progress(f"{name}: writing {', '.join(dataset.arrays())} to {final}")
        _publish(root, dataset, arrays, source)
        progress(f"{name}: cached in {final} ({time.monotonic() - started:.1f} s)")  # wall
        return final

    listing = "\n".join(f"  - {source_name}: {error}" for source_name, error in failures)
    message = f"could not fetch {name}; every source failed:\n{listing}"
    if all(isinstance(error, SourceUnreachable) for _, error in failures):
        raise DatasetUnreachableError(message)
    raise DatasetError(message)


def load(
    name: str,
    cache: str | os.PathLike | None = None,
    progress: Progress = print,
    auto_fetch: bool = True,
) -> Data:
    """Open a cached data set memory-mapped, fetching it first if needed."""
    dataset = datasets.get(name)
    name = dataset.name
    folder = _root(cache) / name
    if not _is_complete(folder, dataset):
        if not auto_fetch:
            raise DatasetError(
                f"{name} is not cached in {folder}; fetch it first (fetch({name!r}))"
            )
        folder = fetch(name, cache, progress)
    problem = check_sizes(folder, dataset)
    arrays = {}
    for array_name in dataset.arrays():
        if problem is not None:
            break
        try:
            arrays[array_name] = np.load(folder / f"{array_name}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            problem = f"{folder / (array_name + '.npy')} cannot be read: {error}"
    if problem is not None:
        raise DatasetError(f"the {name} cache is damaged: {problem}; fetch it again with "
                           f"`fedemu data fetch {name} --force` (a launch checks and re-fetches it)")
    return Data(name=name, dataset=dataset, **arrays)


def list_datasets(cache: str | os.PathLike | None = None) -> list[dict]:
    """Each data set fedemu has or an installed plug-in brings: its name, what it is,
    whether it is cached, its folder and sizes (split -> examples; None when not cached)."""
    root = _root(cache)
    names = list(datasets.built_in()) + sorted(
        {ep.name for ep in metadata.entry_points(group=datasets.ENTRY_POINT_GROUP)} - set(datasets.built_in()))
    listing = []
    for name in names:
        try:
            dataset = datasets.get(name)
        except DatasetError as error:  # a broken plug-in is listed, not fatal
            listing.append({"name": name, "about": str(error), "cached": False, "path": "", "sizes": None})
            continue
        folder = root / dataset.name
        cached = _is_complete(folder, dataset)
        sizes = None
        if cached:
            # mmap reads only the .npy header, so this stays cheap.
            sizes = {split: int(np.load(folder / f"{split}_y.npy", mmap_mode="r").shape[0])
                     for split in ("train", "test")}
        listing.append({"name": name, "about": dataset.describe(), "cached": cached, "path": str(folder),
                        "sizes": sizes})
    return listing
