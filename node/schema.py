"""The vocabulary of config schemas: a :class:`Key` says one key's type, meaning and
allowed values. ``fedemu.launch.config`` builds the run's sections from Keys, and every
algorithm declares the ``algorithm.*`` keys it owns as Keys (``server/algorithm.py``),
so one validator can name any bad key and what it accepts. It lives at the bottom
layer because every layer above may declare options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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
