"""Splitting a training set among clients: McMahan et al. (2017)'s IID and pathological
non-IID shards, Hsu et al. (2019)'s Dirichlet label skew, log-normal quantity skew, a
data set's natural clients, and samples for populations larger than the data set.

Every function returns one int64 index array per client, sorted ascending
(so a client's reads from a memory-mapped data set go forward through it), and, but
for ``sample``, every example goes to exactly one client. McMahan's shards must divide
evenly (ValueError, rather than silently dropping samples); an IID split that
does not divide gives some clients one sample more.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedemu.node import streams

PARTITION_KINDS = ("iid", "shards", "dirichlet", "lognormal", "natural", "sample")


def iid(n_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle all samples and give each client an equal share: balanced, the first
    n_samples % num_clients clients one sample more where the count does not divide (a
    natural data set's IID variant keeps its number of clients, as McMahan et al. did)."""
    if num_clients <= 0:
        raise ValueError(f"num_clients must be positive, got {num_clients}")
    if n_samples < num_clients:
        raise ValueError(f"{n_samples} samples cannot give each of {num_clients} clients at least one")
    order = streams.generator(seed, "partition.iid").permutation(n_samples).astype(np.int64)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


SHARD_ORDERS = ("stable", "pixels")


def by_label(labels: np.ndarray, images: np.ndarray | None = None, order: str = "stable") -> np.ndarray:
    """Indices sorted by label. Within a label, "stable" keeps the given order; "pixels"
    sorts by the raw image bytes, as Nilsson et al.'s fold notebook did (it sorted
    (label, image bytes) pairs), which groups similar-looking images into one shard."""
    labels = np.asarray(labels)
    if order == "stable":
        return np.argsort(labels, kind="stable").astype(np.int64)
    if order != "pixels":
        raise ValueError(f"unknown shard order {order!r}; allowed: {', '.join(SHARD_ORDERS)}")
    if images is None or len(images) != len(labels):
        raise ValueError("shard order 'pixels' needs the images, one per label")
    flat = np.ascontiguousarray(images, dtype=np.uint8).reshape(len(labels), -1)
    return np.array(sorted(range(len(labels)), key=lambda i: (int(labels[i]), flat[i].tobytes())), dtype=np.int64)


def shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int,
    images: np.ndarray | None = None, order: str = "stable",
) -> list[np.ndarray]:
    """McMahan's pathological non-IID split.

    Sort the samples by label, cut them into ``num_clients * shards_per_client``
    equal shards of consecutive samples, and give each client
    ``shards_per_client`` distinct shards chosen at random. A shard spans more
    than one label only where it straddles a label boundary.
    """
    if num_clients <= 0 or shards_per_client <= 0:
        raise ValueError(
            f"num_clients and shards_per_client must be positive, "
            f"got {num_clients} and {shards_per_client}"
        )
    labels = np.asarray(labels)
    num_shards = num_clients * shards_per_client
    if len(labels) % num_shards:
        raise ValueError(
            f"{len(labels)} samples do not split into {num_shards} equal shards "
            f"({num_clients} clients x {shards_per_client} shards; "
            f"remainder {len(labels) % num_shards})"
        )
    # Stable by default, so equal labels keep data-set order and the split is reproducible.
    shard_table = by_label(labels, images, order).reshape(num_shards, -1)
    assignment = streams.generator(seed, "partition.shards").permutation(num_shards)
    return [
        np.sort(shard_table[client_shards].ravel())
        for client_shards in assignment.reshape(num_clients, shards_per_client)
    ]


def make(
    kind: str, labels: np.ndarray, num_clients: int, seed: int, **opts
) -> list[np.ndarray]:
    """Partition by ``kind``: "iid", or "shards" (option shards_per_client, default 2)."""
    if kind == "iid":
        _only(kind, opts, set())
        return iid(len(labels), num_clients, seed)
    if kind == "shards":
        _only(kind, opts, {"shards_per_client", "images", "order"})
        # Two shards per client is the paper's pathological non-IID setup.
        return shards(labels, num_clients, opts.get("shards_per_client", 2), seed,
                      images=opts.get("images"), order=opts.get("order", "stable"))
    if kind == "dirichlet":
        _only(kind, opts, {"alpha"})
        return dirichlet(labels, num_clients, opts.get("alpha", 0.5), seed)
    if kind == "lognormal":
        _only(kind, opts, {"sigma"})
        return lognormal(len(labels), num_clients, opts.get("sigma", 1.0), seed)
    if kind == "sample":
        _only(kind, opts, {"size"})
        return Samples(len(labels), num_clients, opts.get("size", 1), seed)
    if kind == "natural":
        _only(kind, opts, {"owners"})
        if opts.get("owners") is None:
            raise ValueError("partition 'natural' needs a data set with natural clients (its train_client array)")
        return natural(opts["owners"], num_clients)
    raise ValueError(f"unknown partition kind {kind!r}; allowed: {', '.join(PARTITION_KINDS)}")


def _only(kind: str, opts: dict, allowed: set[str]) -> None:
    unknown = set(opts) - allowed
    if unknown:
        takes = f"only {', '.join(sorted(allowed))}" if allowed else "no options"
        raise ValueError(f"partition {kind!r} takes {takes}, got {sorted(unknown)}")


def _equal_size(n_samples: int, num_clients: int) -> int:
    if num_clients <= 0:
        raise ValueError(f"num_clients must be positive, got {num_clients}")
    if n_samples % num_clients:
        raise ValueError(f"{n_samples} samples do not split evenly among {num_clients} clients "
                         f"(remainder {n_samples % num_clients})")
    return n_samples // num_clients


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Hsu et al. (2019)'s label skew: client k's class proportions are q_k ~ Dir(alpha p),
    p the data set's class frequencies, and it draws its equal share of examples from
    the classes by q_k, without replacement. Small alpha: a few classes per client;
    large alpha: close to IID.

    Every example is used, so the classes run out as clients fill up: a client whose
    classes are spent draws from those left, in proportion to q_k where it can and to
    what is left where q_k puts nothing on them. The clients fill in a random order,
    so no client id is the one left with the leftovers."""
    if not alpha > 0:
        raise ValueError(f"the Dirichlet concentration alpha must be > 0, got {alpha}")
    labels = np.asarray(labels)
    size = _equal_size(len(labels), num_clients)
    rng = streams.generator(seed, "partition.dirichlet")
    classes, counts = np.unique(labels, return_counts=True)
    prior = counts / counts.sum()
    pools = [rng.permutation(np.flatnonzero(labels == c)).astype(np.int64) for c in classes]
    left, taken = counts.copy(), np.zeros(len(classes), np.int64)
    parts: list[np.ndarray] = [np.empty(0, np.int64)] * num_clients
    for client in rng.permutation(num_clients):
        q = rng.dirichlet(alpha * prior)
        want, got = size, np.zeros(len(classes), np.int64)
        while want:
            weights = q * (left > 0)
            weights = weights if weights.sum() > 0 else left.astype(float)
            draw = np.minimum(rng.multinomial(want, weights / weights.sum()), left)
            got, left, want = got + draw, left - draw, want - int(draw.sum())
        parts[client] = np.sort(np.concatenate([pool[start:start + n] for pool, start, n in zip(pools, taken, got)]))
        taken += got
    return parts


def lognormal(n_samples: int, num_clients: int, sigma: float, seed: int) -> list[np.ndarray]:
    """Quantity skew: IID examples, client sizes proportional to log-normal(0, sigma^2)
    draws (rounded by largest remainder, at least one example each)."""
    if num_clients <= 0 or n_samples < num_clients:
        raise ValueError(f"{n_samples} samples cannot give each of {num_clients} clients at least one")
    if not sigma > 0:
        raise ValueError(f"the log-normal spread sigma must be > 0, got {sigma}")
    rng = streams.generator(seed, "partition.lognormal")
    weights = rng.lognormal(0.0, sigma, num_clients)
    # One example each first, the rest in proportion: no client is left empty.
    spare = n_samples - num_clients
    exact = spare * weights / weights.sum()
    sizes = np.floor(exact).astype(np.int64)
    sizes[np.argsort(sizes - exact, kind="stable")[:spare - int(sizes.sum())]] += 1
    order = rng.permutation(n_samples).astype(np.int64)
    return [np.sort(part) for part in np.split(order, np.cumsum(sizes + 1)[:-1])]


def natural(owners: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """A data set's own clients (speakers, writers, devices): ``owners[i]`` is example i's
    client id, 0..num_clients-1."""
    owners = np.asarray(owners)
    present = int(owners.max()) + 1 if len(owners) else 0
    if present != num_clients or owners.min() < 0:
        raise ValueError(f"the data set has {present} natural clients (ids 0..{present - 1}), but data.clients "
                         f"= {num_clients}; set data.clients = {present}")
    order = np.argsort(owners, kind="stable").astype(np.int64)
    parts = np.split(order, np.cumsum(np.bincount(owners, minlength=num_clients))[:-1])
    return [np.sort(part) for part in parts]


class Samples(Sequence):
    """Cross-device populations beyond the data set (100,000 phones over MNIST's 60,000
    examples): client k holds ``size`` examples drawn uniformly without replacement
    from its own stream, so clients may share examples. Lazy: a client's indices are
    drawn when asked for, so a node holds only its own clients', whatever the population."""

    def __init__(self, n_samples: int, num_clients: int, size: int, seed: int) -> None:
        if num_clients <= 0:
            raise ValueError(f"num_clients must be positive, got {num_clients}")
        if not 0 < size <= n_samples:
            raise ValueError(f"data.examples_per_client = {size}: a sample of the {n_samples} training examples "
                             f"needs 1..{n_samples}")
        self.n_samples, self.num_clients, self.size, self.seed = n_samples, num_clients, size, seed

    def __len__(self) -> int:
        return self.num_clients

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self.num_clients))]
        if not -self.num_clients <= k < self.num_clients:
            raise IndexError(f"client {k} of {self.num_clients}")
        return Draw(self, k % self.num_clients)

    def draw(self, k: int) -> np.ndarray:
        rng = streams.generator(self.seed, "partition.sample", k)
        return np.sort(rng.choice(self.n_samples, self.size, replace=False)).astype(np.int64)


class Draw:
    """Client k's share of a :class:`Samples`: its size known, its indices drawn each
    time they are read (``np.asarray``). Making a stream costs about as much as the
    rest of spawning a client, and an idle client needs none (100,000 clients start
    seconds sooner)."""

    __slots__ = ("_samples", "_k")

    def __init__(self, samples: Samples, k: int) -> None:
        self._samples, self._k = samples, k

    def __len__(self) -> int:
        return self._samples.size

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        indices = self._samples.draw(self._k)
        return indices if dtype is None else indices.astype(dtype)
