"""Splitting a training set among clients, as in McMahan et al. (2017).

Every function returns one int64 index array per client, sorted ascending
(so a client's reads from a memory-mapped data set go forward through it).
Sizes that do not divide evenly raise ValueError rather than silently
dropping or unevenly spreading samples: the paper's setups always divide.
"""

from __future__ import annotations

import numpy as np

from fedemu.node import streams

PARTITION_KINDS = ("iid", "shards")


def iid(n_samples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle all samples and give each client an equal share."""
    if num_clients <= 0:
        raise ValueError(f"num_clients must be positive, got {num_clients}")
    if n_samples % num_clients:
        raise ValueError(
            f"{n_samples} samples do not split evenly among {num_clients} clients "
            f"(remainder {n_samples % num_clients})"
        )
    order = streams.generator(seed, "partition.iid").permutation(n_samples).astype(np.int64)
    return [np.sort(part) for part in order.reshape(num_clients, -1)]


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
        if opts:
            raise ValueError(f"partition 'iid' takes no options, got {sorted(opts)}")
        return iid(len(labels), num_clients, seed)
    if kind == "shards":
        unknown = set(opts) - {"shards_per_client", "images", "order"}
        if unknown:
            raise ValueError(
                f"partition 'shards' takes only shards_per_client, images and order, got {sorted(unknown)}"
            )
        # Two shards per client is the paper's pathological non-IID setup.
        return shards(labels, num_clients, opts.get("shards_per_client", 2), seed,
                      images=opts.get("images"), order=opts.get("order", "stable"))
    raise ValueError(f"unknown partition kind {kind!r}; allowed: {', '.join(PARTITION_KINDS)}")
