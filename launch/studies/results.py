"""Reading what runs and sweeps wrote: a run's curve (its evaluations), its summary and
config; a sweep's points; time to a target accuracy; and the tidy table (a row per
evaluation, with the run's swept keys) that ``fedemu export`` writes for pandas, R or a
spreadsheet.

Everything here reads only the run-directory contract (config.toml, events.jsonl,
summary.json) and a sweep's SQLite index, so it works on runs still in progress (a
missing summary is a running or killed run; a torn last event line is skipped).
"""
from __future__ import annotations

import csv
import functools
import json
import math
import sqlite3
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedemu.server.runlog import EVENTS, SUMMARY, read_events

from .. import config as configuration

# What a run curve can be drawn against: (attribute, axis label, file stem, what); the
# rounds' label fits the runs drawn (x_label).
X_AXES = (
    ("rounds", "round", "rounds", "rounds"),
    ("emulated_s", "emulated time since the first round began (s)", "emulated-time", "emulated time"),
    ("mb_up", "uploaded by clients (MB, 10^6 bytes)", "uploaded", "bytes uploaded"),
)
# Keys that change what a run writes, not what it does.
VIEW_KEYS = ("run.tensorboard", "run.timeline", "run.client_log")
# Axes whose values are repetitions, not conditions: averaged over in sweep figures.
REPEAT_KEYS = ("run.seed", "data.fold")
ALGORITHM_KEY = "algorithm.name"


class ReportError(ValueError):
    """A path that is neither a run nor a sweep, or nothing to report."""


@dataclass
class Curve:
    """A run's evaluations. x values are cumulative at each evaluation: bytes count
    every round, evaluated or not."""

    rounds: np.ndarray
    emulated_s: np.ndarray
    mb_up: np.ndarray
    accuracy: np.ndarray
    loss: np.ndarray = field(default_factory=lambda: np.zeros(0))  # test loss (NaN where not logged)

    def __len__(self) -> int:
        return len(self.accuracy)


@dataclass
class RoundSeries:
    """Every round of a run, evaluated or not: how long it took (emulated) and what
    happened to its selected clients (outcome counts; empty for asynchronous rules and
    logs written before outcomes were recorded)."""

    rounds: np.ndarray
    duration_s: np.ndarray  # NaN where not logged
    outcomes: dict[str, np.ndarray]


def round_series(events: list[dict]) -> RoundSeries:
    rounds = [e for e in events if e.get("event") == "round"]
    counted = [e for e in rounds if e.get("outcome_counts")]
    names = list(dict.fromkeys(k for e in counted for k in e["outcome_counts"]))
    outcomes = {n: np.array([e["outcome_counts"].get(n, 0) for e in counted], dtype=float) for n in names} \
        if len(counted) == len(rounds) else {}
    return RoundSeries(np.array([e["round"] for e in rounds], dtype=float),
                       np.array([e.get("round_emulated_s", math.nan) for e in rounds], dtype=float), outcomes)


def x_label(attr: str, runs: list) -> str:
    """An axis label for ``attr``; for rounds, as the runs drawn count them (asynchronous
    rules evaluate every so many uploads instead)."""
    label = next(label for a, label, *_ in X_AXES if a == attr)
    if attr != "rounds":
        return label
    kinds = {r.synchronous for r in runs}
    return {frozenset({True}): "round", frozenset({False}): "evaluation"}.get(
        frozenset(kinds), "round (asynchronous rules: evaluation)")


def emulated_origin(events: list[dict], time_scale: float = 1.0) -> float:
    """The broker's clock when the run started: emulated times count from it."""
    rounds = [e for e in events if e.get("event") == "round"]
    start = next((e for e in events if e.get("event") == "start"), None)
    if start is not None and start.get("emulated_s") is not None:
        return start["emulated_s"]  # (virtual time: 0)
    if rounds and rounds[0].get("emulated_s") is not None:
        # Older logs: the broker's clock starts before the workers are up; the run's own
        # clock (t) starts with the server. Emulated time counts from the start event, scaled.
        first = rounds[0]
        if start is not None:
            return first["emulated_s"] - (first["t"] - start["t"]) * start.get("time_scale", time_scale)
        return first["emulated_s"] - first.get("round_s", 0.0) * time_scale
    return 0.0


def curve(events: list[dict], time_scale: float = 1.0) -> Curve:
    rounds = [e for e in events if e.get("event") == "round"]
    origin = emulated_origin(events, time_scale)
    xs, mb = [], 0.0
    for e in rounds:
        mb += e.get("bytes_up", 0) / 1e6
        if e.get("accuracy") is None:
            continue
        loss = e.get("loss")
        xs.append((e["round"], max(0.0, e.get("emulated_s", math.nan) - origin), mb, e["accuracy"],
                   math.nan if loss is None else loss))
    arr = np.array(xs, dtype=float).reshape(-1, 5)
    return Curve(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4])


def best_so_far(accuracy: np.ndarray) -> np.ndarray:
    return np.maximum.accumulate(accuracy) if len(accuracy) else accuracy


def time_to_target(x: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
    """The x at which the best-so-far accuracy first reaches ``target``, interpolated
    linearly between the evaluation before and the one that reached it (the papers'
    rounds-to-accuracy). None if never reached; the first x if the first evaluation
    already reached it (there is no earlier point to interpolate from)."""
    best = best_so_far(np.asarray(accuracy, dtype=float))
    x = np.asarray(x, dtype=float)
    hit = np.flatnonzero(best >= target)
    if not hit.size:
        return None
    i = int(hit[0])
    if i == 0:
        return float(x[0])
    # best is monotone and best[i-1] < target <= best[i], so the slope is positive.
    frac = (target - best[i - 1]) / (best[i] - best[i - 1])
    return float(x[i - 1] + frac * (x[i] - x[i - 1]))


def first_round_reaching(c: Curve, target: float) -> int | None:
    """The first evaluated round whose accuracy reached ``target`` (what the launcher's
    "reached target accuracy ... in round N" names), beside time_to_target's
    interpolated figure; None if never reached."""
    hit = np.flatnonzero(np.asarray(c.accuracy, dtype=float) >= target)
    return int(c.rounds[hit[0]]) if hit.size else None


def times_to_target(c: Curve, target: float) -> dict[str, float | None]:
    return {attr: time_to_target(getattr(c, attr), c.accuracy, target) for attr, *_ in X_AXES}


@dataclass
class RunRecord:
    """A run as read back from its directory or a sweep's record (what reports and
    comparisons work on); a run being launched is launch.api's Run."""

    path: Path
    config: dict
    summary: dict | None
    curve: Curve
    params: dict = field(default_factory=dict)  # a sweep point's axis values
    series: RoundSeries | None = None  # every round (None: a run record, no event log)

    @property
    def synchronous(self) -> bool:
        """Round-based (else an asynchronous rule, whose "rounds" are evaluations)."""
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        from fedemu.common.algorithms.base import UnknownAlgorithm, get

        try:
            return get(self.algorithm).synchronous
        except UnknownAlgorithm:
            return True

    @property
    def status(self) -> str:
        if self.summary is not None:
            return self.summary.get("status", "?")
        return "running" if len(self.curve) else "started"

    @property
    def algorithm(self) -> str:
        return self.config.get("algorithm", {}).get("name", "?")

    def final_accuracy(self) -> float | None:
        return float(self.curve.accuracy[-1]) if len(self.curve) else None

    def best_accuracy(self) -> float | None:
        return float(self.curve.accuracy.max()) if len(self.curve) else None


@functools.cache
def _todays_defaults() -> dict:
    """The default config, read once: a sweep loads hundreds of runs (only read here)."""
    return configuration.default()


def with_current_defaults(config: dict) -> dict:
    """A run's config with every key it lacks at today's default: a run recorded before
    a key existed (algorithm.merge_s, say) ran as that default, so it compares equal to
    a run of today that leaves the key at its default."""
    for section, defaults in _todays_defaults().items():
        values = config.setdefault(section, {})
        if isinstance(values, dict):
            for key, value in defaults.items():
                values.setdefault(key, value)
    return config


def load_run(path: str | Path, params: dict | None = None) -> RunRecord:
    path = Path(path)
    if not (path / "config.toml").exists():
        raise ReportError(f"{path} is not a run directory (no config.toml)")
    config = with_current_defaults(tomllib.loads((path / "config.toml").read_text()))
    summary = json.loads((path / SUMMARY).read_text()) if (path / SUMMARY).exists() else None
    scale = config.get("run", {}).get("time_scale", 1.0)
    events = read_events(path) if (path / EVENTS).exists() else []
    return RunRecord(path, config, summary, curve(events, scale), dict(params or {}), round_series(events))


def load_record(path: str | Path) -> RunRecord:
    """A run kept as one JSON file, ``{"config": {...}, "summary": {...}, ...}``, as
    bench/nilsson_table1.py keeps its runs in the repository: enough to compare (no
    curve; the run directory is gone)."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{path}: not a readable run record ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict) \
            or not isinstance(record.get("summary"), dict):
        raise ReportError(f"{path}: a run record needs a 'config' and a 'summary' object")
    return RunRecord(path, with_current_defaults(record["config"]), record["summary"], curve([]))


def flat(config: dict, prefix: str = "") -> dict:
    """{"section.key": value} for every leaf of a config (tables of tables included)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differing_keys(configs: list[dict]) -> list[str]:
    """Config keys whose values are not the same in every config (in config order)."""
    flats = [flat(c) for c in configs]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    ignore = {"run.out", "run.workers", "run.torch_threads", "data.cache_dir", *VIEW_KEYS}
    return [k for k in keys if k not in ignore and len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]


@dataclass
class SweepData:
    path: Path
    axes: list[str]          # axis keys in grid order
    groups: list[list[str]]  # axes that move together ([[zip]]) share a group
    target: float            # accuracy for time-to-target
    runs: list[RunRecord]          # points with a run directory
    rows: list[dict]         # every row of the index

    @property
    def completed(self) -> list[RunRecord]:
        """Runs that finished: the only ones a final or time-to-target figure may use."""
        return [r for r in self.runs if r.status == "completed"]


def is_sweep(path: Path) -> bool:
    return (path / "sweep.db").exists()


def default_folder(paths: list[str | Path], name: str) -> Path:
    """Where a study's output goes unless told: under the one run or sweep it is about
    (RUN/report, SWEEP/compare), never the current folder, where the next one would
    overwrite it. Several inputs have no such home, so the caller must choose."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        return Path(paths[0]) / name
    raise ReportError(f"{len(paths)} inputs have no one folder for the {name}: choose one with -o/--out "
                      f"(a single run or sweep gets its own, e.g. RUN/{name})")


def load_sweep(path: str | Path) -> SweepData:
    path = Path(path)
    db = sqlite3.connect(f"file:{path / 'sweep.db'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        rows = [dict(r) for r in db.execute("SELECT * FROM points WHERE current = 1 ORDER BY seq")]
    finally:
        db.close()
    axes = json.loads(meta["axes"])
    runs = []
    for row in rows:
        run_dir = path / row["run_dir"] if row["run_dir"] else None
        if run_dir is not None and (run_dir / "config.toml").exists():
            runs.append(load_run(run_dir, json.loads(row["params"])))
    groups = json.loads(meta.get("groups", "null")) or [[a] for a in axes]
    return SweepData(path, axes, groups, float(meta.get("target", 0) or 0), runs, rows)


# --- the tidy table -------------------------------------------------------------------------

# What each evaluation row carries from its round event (asynchronous rules: an evaluation
# every eval_every_uploads uploads), beside the run's columns; absent values stay empty.
EVALUATION_COLUMNS = ("round", "accuracy", "loss", "train_loss", "participants", "uploads", "total_uploads",
                      "bytes_up", "bytes_down", "emulated_s", "wall_s")


def evaluation_records(paths: list[str | Path]) -> list[dict]:
    """A row per evaluation of every run in ``paths`` (run directories or sweeps), in a
    form pandas (``DataFrame(records)``), R or a spreadsheet takes: the run's path and
    status, its algorithm, the keys that vary (a sweep's axes; between loose runs, the
    config keys that differ), then the evaluation. ``emulated_s`` counts from the run's
    start; ``wall_s`` is the host's seconds since the server started."""
    groups: list[tuple[list[RunRecord], list[str]]] = []
    loose: list[RunRecord] = []
    for path in map(Path, paths):
        if is_sweep(path):
            sweep = load_sweep(path)
            groups.append((sweep.runs, sweep.axes))
        else:
            loose.append(load_run(path))
    if loose:
        groups.append((loose, differing_keys([r.config for r in loose])))
    if not any(runs for runs, _ in groups):
        raise ReportError(f"no runs in {', '.join(map(str, paths))}")
    keys = list(dict.fromkeys(k for _, axes in groups for k in axes if k != ALGORITHM_KEY))
    records = []
    for runs, _ in groups:
        for run in runs:
            config = flat(run.config)
            fixed = {"run": str(run.path), "status": run.status, "algorithm": run.algorithm,
                     **{k: run.params.get(k, config.get(k)) for k in keys}}
            for event in _evaluations(run.path, run.config.get("run", {}).get("time_scale", 1.0)):
                records.append({**fixed, **{c: event.get(c) for c in EVALUATION_COLUMNS}})
    return records


def _evaluations(run_dir: Path, time_scale: float) -> list[dict]:
    events = read_events(run_dir) if (run_dir / EVENTS).exists() else []
    origin = emulated_origin(events, time_scale)
    rows = []
    for e in events:
        if e.get("event") == "round" and e.get("accuracy") is not None:
            emulated = e.get("emulated_s")
            rows.append({**e, "wall_s": e.get("t"),
                         "emulated_s": None if emulated is None else round(emulated - origin, 6)})
    return rows


def write_csv(records: list[dict], out) -> None:
    """The records as CSV (a header, then a row each) into a text stream."""
    columns = list(dict.fromkeys(k for r in records for k in r))
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({k: "" if v is None else _cell(v) for k, v in record.items()})


def _cell(value):
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def __getattr__(name: str):
    if name == "Run":  # its name until it was told apart from launch.api.Run
        warnings.warn("fedemu.launch.results.Run is now RunRecord", DeprecationWarning, stacklevel=2)
        return RunRecord
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
