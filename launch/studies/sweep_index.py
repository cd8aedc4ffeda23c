"""``sweep.db``, a sweep's SQLite index: one row per point (its axis values as columns,
status, attempts, run directory, summary figures) and the sweep's meta data; readers
(``fedemu report``, users' SQL) may read it while the sweep runs."""
from __future__ import annotations

import json
import sqlite3
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

from fedemu.server.runlog import read_events

from .labels import fmt
from .results import curve, flat, times_to_target
from .sweep_spec import VOLATILE, Point, Spec, SweepError

DB_FILE = "sweep.db"

COLUMNS = {
    "id": "TEXT PRIMARY KEY", "seq": "INTEGER", "current": "INTEGER DEFAULT 1", "status": "TEXT",
    "params": "TEXT", "config_hash": "TEXT", "config": "TEXT", "run_dir": "TEXT", "attempts": "INTEGER DEFAULT 0",
    "reason": "TEXT", "started_at": "TEXT", "finished_at": "TEXT", "wall_s": "REAL", "rounds": "INTEGER",
    "uploads": "INTEGER", "final_accuracy": "REAL", "best_accuracy": "REAL", "bytes_up": "INTEGER",
    "bytes_down": "INTEGER", "emulated_s": "REAL", "target": "REAL", "tt_rounds": "REAL",
    "tt_emulated_s": "REAL", "tt_mb_up": "REAL", "pids": "TEXT", "weights_sha256": "TEXT",
    "slurm_job": "TEXT",  # JOB_TASK of the array task that runs it (`fedemu sweep --slurm`)
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
        self.db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('created', ?)", (now(),))
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


def now() -> str:
    return datetime.now().isoformat(timespec="seconds")


def summary_fields(run_dir: Path, summary: dict, target: float) -> dict:
    """The row's figures from a finished (or stopped) run."""
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
