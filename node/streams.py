"""Named random streams: every random decision of a run draws from a stream named by its
purpose (``"selection"``, ``"shuffle"``, ``"loss"``, ...) and the ids it concerns (a
client, a round, a link), derived from the run seed. Two purposes never share draws,
and a stream's draws do not depend on how many draws any other stream made, so adding a
decision somewhere leaves every other decision of a run as it was.

Two forms, one derivation (a BLAKE2b digest of the seed, the ids and the purpose):

- :func:`uniform`: one counter-based draw in [0, 1), for the broker's per-message link
  decisions (cheap, no generator object);
- :func:`generator` / :func:`seed64`: a NumPy generator, or a 64-bit seed for a torch
  generator, for decisions that draw many numbers at once (a permutation, a selection).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

# Ids are packed as 8-byte little-endian integers, then the purpose follows. Bounding
# ids below 2**53 keeps each id's top byte below 0x20, so no id's bytes can read as the
# start of a (printable ASCII) purpose: two calls with different numbers of ids cannot
# hash the same input.
_ID_LIMIT = 1 << 53


def _digest(seed: int, purpose: str, ids: tuple[int, ...], size: int) -> bytes:
    return hashlib.blake2b(struct.pack(f"<q{len(ids)}q", seed, *ids) + purpose.encode(),
                           digest_size=size).digest()


def uniform(seed: int, purpose: str, link: int, direction: int, counter: int) -> float:
    """A uniform draw in [0, 1) that depends only on its arguments (counter-based RNG).
    The broker calls it per message, so it takes exactly three ids and checks nothing."""
    digest = hashlib.blake2b(struct.pack("<qqqq", seed, link, direction, counter) + purpose.encode(),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))


def _checked(seed: int, purpose: str, ids: tuple[int, ...]) -> tuple[int, ...]:
    if not purpose or not purpose.isascii() or not purpose.isprintable():
        raise ValueError(f"a stream's purpose is a printable ASCII name, not {purpose!r}")
    if not 0 <= int(seed) < (1 << 63):
        raise ValueError(f"a seed is an integer in [0, 2**63), not {seed}")
    for value in ids:
        if not 0 <= int(value) < _ID_LIMIT:
            raise ValueError(f"stream {purpose!r}: id {value} is outside [0, 2**53)")
    return tuple(int(value) for value in ids)


def seed_sequence(seed: int, purpose: str, *ids: int) -> np.random.SeedSequence:
    """The seed sequence of stream ``purpose`` for ``ids`` under run seed ``seed``."""
    digest = _digest(int(seed), purpose, _checked(seed, purpose, ids), 16)
    return np.random.SeedSequence(int.from_bytes(digest, "little"))


def generator(seed: int, purpose: str, *ids: int) -> np.random.Generator:
    """A NumPy generator for stream ``purpose`` and ``ids``."""
    return np.random.default_rng(seed_sequence(seed, purpose, *ids))


def seed64(seed: int, purpose: str, *ids: int) -> int:
    """A 64-bit seed (for ``torch.Generator.manual_seed``) for stream ``purpose`` and ``ids``."""
    return int.from_bytes(_digest(int(seed), purpose, _checked(seed, purpose, ids), 8), "little")
