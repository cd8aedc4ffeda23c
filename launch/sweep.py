"""`fedemu sweep SWEEP.toml`: run a grid of configurations, resumably, indexed in SQLite.

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

The sweep directory holds ``sweep.toml`` (the file as last run), ``sweep.db`` (one row
per point: its axis values as columns, status, run directory, summary figures) and
``runs/<point>/`` (ordinary run directories). Rerunning the same sweep skips completed
points and retries the others; a point whose resolved config changed (the base file
was edited) is refused, naming the keys, since its old result would silently stand for
a different experiment.

With ``--machines``/``--hostfile`` every point is a multi-machine launch: its broker and
server run here, its worker nodes on the hosts. ``--parallel N`` splits the hosts into N
groups and runs N points at once, each on a group of its own.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import sqlite3
import threading
import time
import tomllib
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from . import config as configuration
from .lifecycle import DirectoryInUse, DirLock
from .labels import fmt, point_id
from .results import REPEAT_KEYS, curve, flat, times_to_target

if TYPE_CHECKING:
    from .machines import Machines

SWEEP_KEYS = ("name", "base", "out", "parallel", "workers_per_point", "target")
# Keys that change how a point is run, not what it computes: not part of its identity.
VOLATILE = ("run.out", "run.workers", "run.torch_threads", "data.cache_dir")
DB_FILE = "sweep.db"


class SweepError(ValueError):
    """A bad sweep file, a point whose config is refused, or a sweep directory that
    does not match the sweep; the message names the problem."""


# --- the sweep file -------------------------------------------------------------------


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
        configuration.apply_override(config, f"{key}={configuration._toml_value(value)}")
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
    from fedemu.worker.ml import kfold

    points, ids = [], set()
    for seq, combo in enumerate(itertools.product(*(values for _, values in spec.groups))):
        params = {k: v for (keys, _), step in zip(spec.groups, combo) for k, v in zip(keys, step)}
        config = json.loads(json.dumps(spec.base))  # a deep copy
        pid = point_id(params)
        where = f"point {pid}"
        for key, value in params.items():
            set_key(config, key, value, where)
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


# --- the index ------------------------------------------------------------------------

COLUMNS = {
    "id": "TEXT PRIMARY KEY", "seq": "INTEGER", "current": "INTEGER DEFAULT 1", "status": "TEXT",
    "params": "TEXT", "config_hash": "TEXT", "config": "TEXT", "run_dir": "TEXT", "attempts": "INTEGER DEFAULT 0",
    "reason": "TEXT", "started_at": "TEXT", "finished_at": "TEXT", "wall_s": "REAL", "rounds": "INTEGER",
    "uploads": "INTEGER", "final_accuracy": "REAL", "best_accuracy": "REAL", "bytes_up": "INTEGER",
    "bytes_down": "INTEGER", "emulated_s": "REAL", "target": "REAL", "tt_rounds": "REAL",
    "tt_emulated_s": "REAL", "tt_mb_up": "REAL", "pids": "TEXT", "weights_sha256": "TEXT",
}


def _sql_value(v: Any) -> Any:
    return v if isinstance(v, (int, float, str)) and not isinstance(v, bool) else json.dumps(v)


class Index:
    """sweep.db. One connection per thread is not needed: only the main thread writes."""

    def __init__(self, path: Path):
        self.db = sqlite3.connect(path)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")  # readers (report, users' SQL) never block the sweep
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        cols = ", ".join(f'"{k}" {t}' for k, t in COLUMNS.items())
        self.db.execute(f"CREATE TABLE IF NOT EXISTS points ({cols})")
        existing = {r[1] for r in self.db.execute("PRAGMA table_info(points)")}
        for key, kind in COLUMNS.items():  # an index made by an earlier version gains the new columns
            if key not in existing:
                self.db.execute(f'ALTER TABLE points ADD COLUMN "{key}" {kind.replace("PRIMARY KEY", "")}')
        self.db.commit()

    def rows(self) -> dict[str, dict]:
        return {r["id"]: dict(r) for r in self.db.execute("SELECT * FROM points")}

    def check_compatible(self, points: list[Point]) -> None:
        """Refuse a sweep whose points' configs changed under the same names."""
        old = self.rows()
        changed = [(p, old[p.id]) for p in points if p.id in old and old[p.id]["config_hash"] != p.hash
                   and old[p.id]["status"] != "pending"]
        if not changed:
            return
        p, row = changed[0]
        before, after = flat(json.loads(row["config"])), flat(p.config)
        diffs = [f"{k}: {fmt(before.get(k, '(unset)'))} -> {fmt(after.get(k, '(unset)'))}"
                 for k in sorted(set(before) | set(after))
                 if k not in VOLATILE and json.dumps(before.get(k)) != json.dumps(after.get(k))]
        raise SweepError(
            f"the base config changed since this sweep ran: {len(changed)} point(s) already run would "
            f"now mean something else ({'; '.join(diffs[:6]) or 'config differs'}; first: {p.id}). "
            "Run it into a new directory (--out), or restore the base config")

    def sync(self, spec: Spec, points: list[Point]) -> None:
        existing = {r[1] for r in self.db.execute("PRAGMA table_info(points)")}
        for key in spec.axes:
            if key not in existing:
                self.db.execute(f'ALTER TABLE points ADD COLUMN "{key}"')
        old = self.rows()
        self.db.execute("UPDATE points SET current = 0")
        for p in points:
            axis_cols = "".join(f', "{k}"' for k in p.params)
            marks = ", ?" * len(p.params)
            values = [_sql_value(v) for v in p.params.values()]
            if p.id in old:
                self.db.execute("UPDATE points SET current = 1, seq = ?, config_hash = ?, config = ? WHERE id = ?",
                                (p.seq, p.hash, json.dumps(p.config), p.id))
            else:
                self.db.execute(f"INSERT INTO points (id, seq, current, status, params, config_hash, config{axis_cols}) "
                                f"VALUES (?, ?, 1, 'pending', ?, ?, ?{marks})",
                                (p.id, p.seq, json.dumps(p.params), p.hash, json.dumps(p.config), *values))
        meta = {"name": spec.name, "axes": json.dumps(spec.axes), "target": str(spec.target),
                "groups": json.dumps([keys for keys, _ in spec.groups]),
                "sweep_file": str(spec.path.resolve())}
        self.db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", meta.items())
        self.db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('created', ?)", (_now(),))
        self.db.commit()

    def update(self, pid: str, **fields: Any) -> None:
        sets = ", ".join(f'"{k}" = ?' for k in fields)
        self.db.execute(f"UPDATE points SET {sets} WHERE id = ?", (*fields.values(), pid))
        self.db.commit()

    def counts(self) -> dict[str, int]:
        """The current points by status."""
        return {r["status"]: r["n"] for r in self.db.execute(
            "SELECT status, count(*) AS n FROM points WHERE current = 1 GROUP BY status")}

    def close(self) -> None:
        self.db.close()


def _now() -> str:
    return datetime.now().isoformat(timespec="seconds")


def summary_fields(run_dir: Path, summary: dict, target: float) -> dict:
    """The row's figures from a finished (or stopped) run."""
    from fedemu.server.runlog import read_events

    events = read_events(run_dir)
    c = curve(events, _time_scale(run_dir))
    tt = times_to_target(c, target) if target else {"rounds": None, "emulated_s": None, "mb_up": None}
    return {
        "reason": summary.get("reason"), "rounds": summary.get("rounds"), "uploads": summary.get("uploads"),
        "final_accuracy": summary.get("final_accuracy"), "best_accuracy": summary.get("best_accuracy"),
        "bytes_up": summary.get("bytes_up"), "bytes_down": summary.get("bytes_down"),
        "wall_s": summary.get("wall_s"), "emulated_s": float(c.emulated_s[-1]) if len(c) else None,
        "target": target or None, "tt_rounds": tt["rounds"], "tt_emulated_s": tt["emulated_s"], "tt_mb_up": tt["mb_up"],
        "weights_sha256": summary.get("weights_sha256"),
    }


def _time_scale(run_dir: Path) -> float:
    try:
        return tomllib.loads((run_dir / "config.toml").read_text())["run"]["time_scale"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return 1.0


# --- one point ------------------------------------------------------------------------


def run_point(config: dict, run_dir: Path, *, workers: int | None, stop: threading.Event,
              on_start: Callable[[list[int]], None] | None = None, machines: Machines | None = None) -> dict:
    """Run one configuration into ``run_dir`` and return its summary: on this machine with
    ``workers`` worker nodes, or with worker nodes on ``machines`` (``workers``: slots
    of a host without ``slots=``). What the launcher would print goes to logs/launch.out."""
    from .rundir import make_run_dir

    _, lock = make_run_dir(config, run_dir)
    try:
        return _run_point(config, run_dir, workers=workers, stop=stop, on_start=on_start, machines=machines)
    finally:
        lock.close()


def _run_point(config: dict, run_dir: Path, *, workers: int | None, stop: threading.Event,
               on_start: Callable[[list[int]], None] | None, machines: Machines | None) -> dict:
    from .launcher import open_run
    from .rundir import LaunchError, write_run_file

    try:
        write_run_file(run_dir / "config.toml", configuration.to_toml(config))
    except LaunchError as exc:
        return {"status": "failed", "reason": str(exc)}

    def echo(line: str) -> None:  # opened per line: host reader threads may outlive this call
        with open(run_dir / "logs" / "launch.out", "a", encoding="utf-8") as log:
            log.write(line + "\n")

    run = open_run(config, run_dir, workers or 1, echo, machines, default_slots=workers)
    try:
        try:
            run.start()
            if on_start is not None:
                on_start([p.pid for p in run.procs.values()])
            server, asked, last, reported = run.procs["server"], None, 0.0, set()
            while server.poll() is None:
                run.check_exits(reported)
                if stop.is_set() and time.monotonic() - last > 2:
                    # The server writes an "interrupted" summary and stops the nodes. Again
                    # every 2 s: a server still starting up may not have its handler yet.
                    run.interrupt()
                    asked, last = asked or time.monotonic(), time.monotonic()
                if asked is not None and time.monotonic() - asked > 30:
                    break  # run.stop() below terminates what is left
                run.check_hosts()
                time.sleep(0.2)
        finally:
            # Stopping: a server killed before it could tell its nodes leaves them waiting
            # for it; do not give them the normal 15 s before terminating them.
            run.stop(grace=3.0 if stop.is_set() else 15.0)
    except LaunchError as exc:
        echo(f"failed: {exc}")
        return run.record_failure(str(exc))
    # After stop(): a server terminated there has written its summary by now.
    return run.summary()


def alive(pids: list[int], run_dir: Path) -> list[int]:
    """Which of ``pids`` still run this point: every node's command line names a file
    in its run directory (a pid may have been reused since)."""
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "fedemu.launch" in cmdline and str(run_dir) in cmdline:
            out.append(pid)
    return out


# --- the sweep ------------------------------------------------------------------------


@dataclass
class Progress:
    total: int
    done: int = 0
    failed: int = 0
    skipped: int = 0
    walls: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def line(self, running: int, parallel: int) -> str:
        left = self.total - self.done - self.failed - self.skipped
        eta = ""
        if self.walls and left:
            secs = sum(self.walls) / len(self.walls) * left / max(1, min(parallel, left))
            eta = f", about {_duration(secs)} left"
        return (f"[{self.done + self.skipped}/{self.total} done, {running} running, {self.failed} failed{eta}, "
                f"{_duration(time.monotonic() - self.started)} so far]")


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


@dataclass
class Layout:
    """Where the points run: how many at once, worker nodes each, and with --machines
    the hosts of each concurrent point (disjoint groups, one per slot)."""

    parallel: int
    workers_per_point: int | None  # with machines: slots of a host without slots= (None: its cores)
    host_groups: list[Machines] | None = None

    def describe(self) -> str:
        if self.host_groups is None:
            return f"{self.parallel} at a time, {self.workers_per_point} worker node(s) each"
        slots = f"{self.workers_per_point} per host" if self.workers_per_point else "each host's slots or cores"
        return (f"{self.parallel} at a time, on hosts " + " | ".join(",".join(map(str, g.hosts)) for g in self.host_groups)
                + f", worker nodes: {slots}")

    def point_config(self, config: dict) -> dict:
        """A copy of a point's config with its worker nodes, and on this machine torch
        threads that share the cores between the points running at once."""
        config = json.loads(json.dumps(config))  # a deep copy
        config["run"]["workers"] = self.workers_per_point or 0
        if self.host_groups is None and not config["run"]["torch_threads"] and config["run"]["clock"] == "wall":
            # Points share the cores: torch's default (all cores per node) would oversubscribe.
            config["run"]["torch_threads"] = max(1, (os.cpu_count() or 1) // (self.parallel * self.workers_per_point))
        return config


def plan(spec: Spec, parallel: int | None, workers_per_point: int | None,
         machines: Machines | None = None) -> Layout:
    wpp = workers_per_point or spec.workers_per_point
    par = parallel if parallel is not None else spec.parallel
    if machines is None:
        wpp = wpp or 1
        # One worker node keeps about one core busy; the server and broker mostly wait.
        return Layout(par or max(1, (os.cpu_count() or 1) // wpp), wpp)
    # A point spans its share of the hosts; by default all of them, as one launch would.
    par = par or 1
    hosts = machines.hosts
    if par > len(hosts):
        raise SweepError(f"--parallel {par} with --machines needs at least {par} hosts (each running point "
                         f"gets hosts of its own); {len(hosts)} given")
    size, extra = divmod(len(hosts), par)
    groups, start = [], 0
    for i in range(par):  # consecutive hosts, group sizes differing by at most one
        end = start + size + (1 if i < extra else 0)
        groups.append(replace(machines, hosts=hosts[start:end]))
        start = end
    return Layout(par, wpp, groups)


def run_sweep(spec: Spec, *, parallel: int | None = None, workers_per_point: int | None = None,
              machines: Machines | None = None, echo: Callable[[str], None] = print, dry_run: bool = False,
              stop: threading.Event | None = None) -> dict:
    """Run every point of ``spec`` that has not completed, on this machine or with worker
    nodes on ``machines``; returns counts by status."""
    points = expand(spec)
    layout = plan(spec, parallel, workers_per_point, machines)
    # Absolute: the nodes' command lines name it, which is how a resume finds them.
    sweep_dir = spec.out.resolve()
    if dry_run:
        for p in points:
            echo(f"{p.seq:4d}  {p.id}")
        echo(f"{len(points)} points; would run {layout.describe()}, into {sweep_dir}")
        return {"points": len(points)}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = DirLock(sweep_dir, what="`fedemu sweep`")
    except DirectoryInUse as exc:
        raise SweepError(str(exc)) from None
    index = Index(sweep_dir / DB_FILE)
    try:
        index.check_compatible(points)
        index.sync(spec, points)
        (sweep_dir / "sweep.toml").write_text(spec.text)
        _recover(index, sweep_dir, spec.target, echo)
        return _run(spec, points, index, sweep_dir, layout, echo, stop or threading.Event())
    finally:
        index.close()
        lock.close()


def _recover(index: Index, sweep_dir: Path, target: float, echo) -> None:
    """Rows left "running" by a sweep that was killed: adopt a run that finished on
    its own since; refuse while its processes still run; otherwise retry it."""
    for row in index.rows().values():
        if row["status"] != "running":
            continue
        run_dir = sweep_dir / row["run_dir"]
        still = alive(json.loads(row["pids"] or "[]"), run_dir)
        if still:
            raise SweepError(f"point {row['id']} is still running from an earlier sweep that was killed "
                             f"(pids {' '.join(map(str, still))}); wait for it or stop it (kill {' '.join(map(str, still))}), "
                             "then rerun")
        summary = _read_summary(run_dir)
        status = summary.get("status") if summary else None
        if status == "completed":
            echo(f"adopted {row['id']}: it completed after the earlier sweep stopped")
            index.update(row["id"], status="completed", finished_at=_now(),
                         **summary_fields(run_dir, summary, target))
        else:
            index.update(row["id"], status="interrupted", reason="the sweep was killed while it ran")


def _read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _fetch_data(points: list[Point], echo) -> None:
    from fedemu.worker.ml import data

    for name, cache in {(p.config["data"]["dataset"], p.config["data"]["cache_dir"] or None) for p in points}:
        data.fetch(name, cache, progress=lambda line: None)


def _run(spec: Spec, points: list[Point], index: Index, sweep_dir: Path, layout: Layout,
         echo, stop: threading.Event) -> dict:
    rows = index.rows()
    todo = [p for p in points if rows[p.id]["status"] != "completed"]
    progress = Progress(total=len(points), skipped=len(points) - len(todo))
    if progress.skipped:
        echo(f"{progress.skipped} of {len(points)} points already completed; skipping them")
    if not todo:
        echo("nothing to run")
        return index.counts()
    _fetch_data(todo, echo)
    parallel = layout.parallel
    echo(f"running {len(todo)} point(s), {layout.describe()}, into {sweep_dir}")
    running: dict[str, tuple[threading.Thread, dict, Point]] = {}
    free_hosts = list(layout.host_groups or [])  # with machines: groups no running point holds
    queue = list(todo)
    last_line = 0.0
    try:
        while queue or running:
            while queue and len(running) < parallel and not stop.is_set():
                p = queue.pop(0)
                hosts = free_hosts.pop(0) if layout.host_groups else None
                running[p.id] = _start(p, rows[p.id], index, sweep_dir, layout, hosts, stop)
                echo(f"start  {p.id}  {progress.line(len(running), parallel)}")
            for pid, (thread, box, p) in list(running.items()):
                if "pids" in box and not box.get("recorded"):
                    # Into the index as soon as the processes exist, so a sweep killed
                    # with SIGKILL can tell on resume whether its points still run.
                    index.update(pid, pids=json.dumps(box["pids"]))
                    box["recorded"] = True
                if thread.is_alive():
                    continue
                del running[pid]
                if box["hosts"] is not None:
                    free_hosts.append(box["hosts"])
                _finish(p, box, index, sweep_dir, spec.target, progress, stop, echo, len(running), parallel)
            if stop.is_set() and not running:
                break
            if time.monotonic() - last_line > 60:  # a heartbeat while long points run
                last_line = time.monotonic()
                echo(f"       {progress.line(len(running), parallel)}")
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop.set()
        echo(f"stopping: interrupting {len(running)} running point(s) ...")
        previous = signal.signal(signal.SIGINT, lambda *_: echo("still stopping the running points ..."))
        try:
            for pid, (thread, box, p) in list(running.items()):
                thread.join()
                _finish(p, box, index, sweep_dir, spec.target, progress, stop, echo, 0, parallel)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise
    return index.counts()


def _start(p: Point, row: dict, index: Index, sweep_dir: Path, layout: Layout, hosts: Machines | None,
           stop: threading.Event) -> tuple[threading.Thread, dict, Point]:
    config = layout.point_config(p.config)
    run_rel = Path("runs") / p.id
    run_dir = sweep_dir / run_rel
    attempts = (row["attempts"] or 0) + 1
    if run_dir.exists():  # an earlier attempt: keep it for its logs, out of the way
        aside = sweep_dir / "attempts" / f"{p.id}.{attempts - 1}"
        aside.parent.mkdir(exist_ok=True)
        if aside.exists():
            shutil.rmtree(aside)
        run_dir.rename(aside)
    index.update(p.id, status="running", attempts=attempts, run_dir=str(run_rel), started_at=_now(),
                 finished_at=None, reason=None, pids="[]")
    box: dict = {"hosts": hosts}
    lock = threading.Lock()

    def on_start(pids: list[int]) -> None:
        with lock:
            box["pids"] = pids

    def target() -> None:
        started = time.monotonic()
        try:
            box["summary"] = run_point(config, run_dir, workers=layout.workers_per_point, stop=stop,
                                       on_start=on_start, machines=hosts)
        except Exception as exc:  # a point's failure must not take the sweep down
            box["summary"] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        box["wall"] = time.monotonic() - started

    thread = threading.Thread(target=target, name=f"point {p.id}", daemon=True)
    thread.start()
    return thread, box, p


def _finish(p: Point, box: dict, index: Index, sweep_dir: Path, target: float, progress: Progress,
            stop: threading.Event, echo, running: int, parallel: int) -> None:
    summary = box.get("summary") or {"status": "failed", "reason": "the point runner ended without a summary"}
    run_dir = sweep_dir / "runs" / p.id
    status = summary.get("status", "failed")
    if status not in ("completed", "failed") or status == "failed" and stop.is_set():
        status = "interrupted"  # stopped by the user, even if it died of the stop
    fields = summary_fields(run_dir, summary, target) if (run_dir / "config.toml").exists() else {
        "reason": summary.get("reason")}
    index.update(p.id, status=status, finished_at=_now(), **fields)
    if status == "completed":
        progress.done += 1
        progress.walls.append(box.get("wall", 0.0))
        acc = summary.get("final_accuracy")
        echo(f"done   {p.id}  acc {acc:.4f}  {box.get('wall', 0):.0f}s  {progress.line(running, parallel)}"
             if acc is not None else f"done   {p.id}  {progress.line(running, parallel)}")
    elif status == "failed":
        progress.failed += 1
        echo(f"FAILED {p.id}: {summary.get('reason')}  (logs: {run_dir / 'logs'})  {progress.line(running, parallel)}")
    else:
        echo(f"stopped {p.id}: {summary.get('reason')}")
