"""The sweep file: read and check it into a ``Spec`` (a base config and its axes), and
expand its grid into ``Point``s, each config resolved and validated.

A sweep file is a base config plus axes::

    [sweep]
    base = "../dropout-lte.toml"   # optional, relative to this file; default: the embedded default
    out = "sweeps/lte"             # the sweep directory (default: sweeps/<file name>)
    parallel = 0                   # points at once; 0: cores / workers_per_point (--machines: 1)
    workers_per_point = 1          # worker nodes per point (--machines: per host without slots=)
    target = 0.9                   # accuracy for the time-to-target columns and figures

    [base.run]                     # config on top of the base file, as in a run config
    rounds = 10

    [axes]                         # every combination of these (any config key)
    "network.dropout.per_round" = [0.0, 0.3]
    "run.seed" = [1, 2]

    [[zip]]                        # these move together: (fedavg, 0.1), (coop, 0.11)
    "algorithm.name" = ["fedavg", "coop"]
    "algorithm.lr" = [0.1, 0.11]

A point's identity is its config without the keys that change only how it runs
(``VOLATILE``): a resumed sweep compares it with what the index recorded.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedemu.common.ml import kfold

from .. import config as configuration
from .labels import point_id
from .results import REPEAT_KEYS, flat

SWEEP_KEYS = ("name", "base", "out", "parallel", "workers_per_point", "target")
# Keys that change how a point is run, not what it computes: not part of its identity.
VOLATILE = ("run.out", "run.workers", "run.torch_threads", "data.cache_dir")


class SweepError(ValueError):
    """A bad sweep file, a point whose config is refused, or a sweep directory that
    does not match the sweep; the message names the problem."""


@dataclass
class Spec:
    path: Path
    text: str
    name: str
    base: dict
    groups: list[tuple[list[str], list[tuple]]]  # (keys, one value tuple per step)
    out: Path
    parallel: int = 0
    workers_per_point: int | None = None  # unset: 1 here; with machines, each host's slots or cores
    target: float = 0.0

    @property
    def axes(self) -> list[str]:
        return [k for keys, _ in self.groups for k in keys]


@dataclass
class Point:
    id: str
    seq: int
    params: dict[str, Any]
    config: dict
    hash: str = ""

    def __post_init__(self) -> None:
        self.hash = config_hash(self.config)


def set_key(config: dict, key: str, value: Any, where: str) -> None:
    """Set ``section.key[.sub...]`` to a typed value, with `--set`'s key checks."""
    if key == "run.out":
        raise SweepError(f"{where}: {key} is chosen by the sweep (runs/<point>), not an axis or base key")
    try:
        configuration.apply_override(config, f"{key}={configuration.toml_value(value)}")
    except (configuration.ConfigError, TypeError) as exc:
        raise SweepError(f"{where}: {exc}") from None


def _leaves(table: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in table.items():
        if isinstance(v, dict):
            out += _leaves(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def load_spec(path: str | Path, out: str | Path | None = None) -> Spec:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SweepError(f"sweep file {path} does not exist") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SweepError(f"sweep file {path} is not valid TOML: {exc}") from None
    unknown = set(raw) - {"sweep", "base", "axes", "zip"}
    if unknown:
        raise SweepError(f"{path}: unknown table [{sorted(unknown)[0]}]; a sweep file has [sweep], [base.*], "
                         f"[axes] and [[zip]] (a run config goes in [sweep] base = FILE or [base.SECTION])")
    head = raw.get("sweep", {})
    bad = set(head) - set(SWEEP_KEYS)
    if bad:
        raise SweepError(f"{path}: unknown key sweep.{sorted(bad)[0]}; [sweep] has {', '.join(SWEEP_KEYS)}")
    base_file = head.get("base")
    base_path = (path.parent / base_file) if base_file else None
    if base_path is not None and not base_path.exists():
        raise SweepError(f"{path}: sweep.base = {base_file!r}: {base_path} does not exist")
    try:
        base = configuration.load(base_path)
    except configuration.ConfigError as exc:
        raise SweepError(f"{path}: base config: {exc}") from None
    for key, value in _leaves(raw.get("base", {})):
        if "." not in key:
            raise SweepError(f"{path}: base.{key} must be inside a section, e.g. [base.run]")
        set_key(base, key, value, f"{path}: base")

    groups: list[tuple[list[str], list[tuple]]] = []
    axes = raw.get("axes", {})
    if not isinstance(axes, dict):
        raise SweepError(f"{path}: [axes] must be a table of \"section.key\" = [values]")
    for key, values in axes.items():
        groups.append(([key], [(v,) for v in _values(path, key, values)]))
    zips = raw.get("zip", [])
    if not isinstance(zips, list):
        raise SweepError(f"{path}: zipped axes go in [[zip]] tables (an array of tables)")
    for i, table in enumerate(zips):
        columns = {key: _values(path, key, values) for key, values in table.items()}
        lengths = {key: len(v) for key, v in columns.items()}
        if len(set(lengths.values())) > 1:
            raise SweepError(f"{path}: zip[{i}]: zipped axes need lists of one length, got "
                             + ", ".join(f"{k}: {n}" for k, n in lengths.items()))
        if columns:
            groups.append((list(columns), list(zip(*columns.values()))))
    keys = [k for ks, _ in groups for k in ks]
    if len(set(keys)) < len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise SweepError(f"{path}: axis {dup} is given twice")
    if not groups:
        raise SweepError(f"{path}: no axes; give at least one in [axes] or [[zip]]")
    # Repetitions (seeds, folds) outermost: a half-done sweep then covers every
    # condition once before it repeats any.
    groups.sort(key=lambda g: 0 if any(k in REPEAT_KEYS for k in g[0]) else 1)

    name = head.get("name", path.stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise SweepError(f"{path}: sweep.name = {name!r} must be letters, digits, '.', '_' or '-'")
    spec = Spec(path=path, text=text, name=name, base=base, groups=groups,
                out=Path(out or head.get("out") or Path("sweeps") / name))
    for key, kind, check in (("parallel", int, lambda v: v >= 0), ("workers_per_point", int, lambda v: v >= 1),
                             ("target", (int, float), lambda v: 0 <= v <= 1)):
        if key in head:
            v = head[key]
            if isinstance(v, bool) or not isinstance(v, kind) or not check(v):
                raise SweepError(f"{path}: sweep.{key} = {v!r} is not allowed "
                                 f"({'>= 0' if key == 'parallel' else '>= 1' if key == 'workers_per_point' else 'in [0, 1]'})")
            setattr(spec, key, v)
    if "target" not in head:
        spec.target = base["run"]["target_accuracy"]
    return spec


def _values(path: Path, key: str, values: Any) -> list:
    if "." not in key or not re.fullmatch(r"[A-Za-z0-9_.-]+", key):
        raise SweepError(f"{path}: axis {key!r} must name a config key as \"section.key\"")
    if not isinstance(values, list) or not values:
        raise SweepError(f"{path}: axis {key} must be a non-empty list of values, got {values!r}")
    seen = [json.dumps(v, sort_keys=True) for v in values]
    if len(set(seen)) < len(seen):
        raise SweepError(f"{path}: axis {key} repeats a value: {values!r}")
    return values


def config_hash(config: dict) -> str:
    stable = {k: v for k, v in flat(config).items() if k not in VOLATILE}
    return hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode()).hexdigest()[:16]


def expand(spec: Spec) -> list[Point]:
    """Every point of the grid, each config resolved and validated."""
    points, ids = [], set()
    for seq, combo in enumerate(itertools.product(*(values for _, values in spec.groups))):
        params = {k: v for (keys, _), step in zip(spec.groups, combo) for k, v in zip(keys, step)}
        config = json.loads(json.dumps(spec.base))  # a deep copy
        pid = point_id(params)
        where = f"point {pid}"
        for key, value in params.items():
            set_key(config, key, value, where)
        configuration.absolute_trace_paths(config)  # a trace file as an axis: named from here, as in a launch
        try:
            configuration.validate(config)
            kfold.check(config)
        except (configuration.ConfigError, ValueError) as exc:
            raise SweepError(f"{where}: {exc}") from None
        if pid in ids:
            raise SweepError(f"{where}: two points share this name; make the axis values distinct")
        ids.add(pid)
        points.append(Point(pid, seq, params, config))
    return points
