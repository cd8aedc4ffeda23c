"""The vocabulary of config schemas: a :class:`Key` says one key's type, meaning and
allowed values. ``fedemu.launch.config`` builds the run's sections from Keys, and every
algorithm declares the ``algorithm.*`` keys it owns as Keys (``common/algorithms/base.py``),
so one validator can name any bad key and what it accepts. It lives at the bottom
layer because every layer above may declare options."""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Key:
    type: type | tuple[type, ...]
    doc: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # says what `check` requires, for the error message
    default: Any = None  # an algorithm's option: its value when the config does not set it


def positive(x: Any) -> bool:
    return x > 0


def non_negative(x: Any) -> bool:
    return x >= 0


def fraction(x: Any) -> bool:
    return 0 < x <= 1


def unit_interval(x: Any) -> bool:
    return 0 <= x <= 1


# The largest learning rate or step size a key may hold: no published rate comes near it,
# and beyond it a step overflows float32 long before it learns anything.
MAX_LEARNING_RATE = 1000.0

# Every integer key holds a count or an id that numpy and the wire keep in an int64.
INT64 = (-2**63, 2**63 - 1)


def interval(text: str) -> dict[str, Any]:
    """A Key's ``check`` and ``rule`` for the interval ``text`` in the usual notation,
    ``"(0, 1000]"``, ``"[0.01, 60]"``, ``"[0, 2**63)"`` (bounds are Python literals, or
    ``2**N``): ``Key(float, "...", **interval("(0, 1000]"))``."""
    match = re.fullmatch(r"\s*([\[(])\s*([^,]+?)\s*,\s*([^\])]+?)\s*([\])])\s*", text)
    if match is None:
        raise ValueError(f"not an interval: {text!r}")
    opening, low, high, closing = match.groups()
    lo, hi = _bound(low), _bound(high)

    def check(x: Any) -> bool:
        return (lo < x if opening == "(" else lo <= x) and (x < hi if closing == ")" else x <= hi)

    return {"check": check, "rule": f"in {opening}{low}, {high}{closing}"}


def _bound(text: str) -> float:
    power = re.fullmatch(r"2\*\*(\d+)", text)
    value = 2 ** int(power.group(1)) if power else float(text)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"an interval's bounds are finite, not {text!r}")
    return value


def close_match(word: Any, candidates: Iterable[str]) -> str | None:
    """The candidate ``word`` most likely misspells (difflib's ratio, ignoring case), or
    None when none is close: what a "did you mean" names."""
    if not isinstance(word, str):
        return None
    by_folded = {}
    for candidate in candidates:
        by_folded.setdefault(str(candidate).casefold(), str(candidate))
    found = difflib.get_close_matches(word.casefold(), list(by_folded), n=1, cutoff=0.6)
    return by_folded[found[0]] if found and by_folded[found[0]] != word else None


def did_you_mean(word: Any, candidates: Iterable[str], show: Callable[[str], str] = repr) -> str:
    """`` (did you mean X?)`` for the candidate ``word`` most likely misspells, shown by
    ``show``, or "" when none is close: an error message says it right after the word."""
    match = close_match(word, candidates)
    return "" if match is None else f" (did you mean {show(match)}?)"


def did_you_mean_key(where: str, key: Any, keys: Iterable[str]) -> str:
    """:func:`did_you_mean` for an unknown ``key`` of the table ``where``, shown as ``where.key``."""
    return did_you_mean(key, keys, show=lambda k: f"{where}.{k}")
