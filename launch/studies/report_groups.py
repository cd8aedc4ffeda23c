"""How the report groups a sweep's runs: the condition axes (not the algorithm, not the
repetitions), their combinations of values, the algorithms, and per cell (condition,
algorithm) a metric over its repetitions. The figures and the tables both group so."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .results import ALGORITHM_KEY, REPEAT_KEYS, RunRecord, SweepData, time_to_target


def condition_axes(data: SweepData) -> list[str]:
    """The axes that are conditions: not the algorithm, not repetitions, and of zipped
    axes only the first (the others move with it, e.g. a learning rate per algorithm)."""
    return [g[0] for g in data.groups
            if ALGORITHM_KEY not in g and g[0] not in REPEAT_KEYS]


def _value_key(v) -> str:
    return json.dumps(v, sort_keys=True)


def axis_values(data: SweepData, key: str) -> list:
    seen = {}
    for r in data.runs:
        if key in r.params:
            seen.setdefault(_value_key(r.params[key]), r.params[key])
    return list(seen.values())


def combinations(data: SweepData, keys: list[str]) -> list[dict]:
    combos = [{}]
    for k in keys:
        combos = [{**c, k: v} for c in combos for v in axis_values(data, k)]
    return combos


def matches(run: RunRecord, combo: dict) -> bool:
    return all(_value_key(run.params.get(k)) == _value_key(v) for k, v in combo.items())


def algorithms(data: SweepData) -> list[str]:
    return list(dict.fromkeys(r.algorithm for r in data.runs))


@dataclass
class Cell:
    """The repetitions of one (condition, algorithm): mean, min and max of a metric."""

    values: list[float | None]

    @property
    def reached(self) -> list[float]:
        return [v for v in self.values if v is not None]

    def mean(self) -> float | None:
        return float(np.mean(self.reached)) if self.reached else None


def metric(run: RunRecord, name: str, target: float) -> float | None:
    if name == "final_accuracy":
        v = run.final_accuracy()
        return None if v is None else v * 100
    if name == "best_accuracy":
        v = run.best_accuracy()
        return None if v is None else v * 100
    attr = name.removeprefix("tt_")
    return time_to_target(getattr(run.curve, attr), run.curve.accuracy, target)
