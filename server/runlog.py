"""The run directory's event log and summary: a stable contract read by other tools.

``events.jsonl`` is append-only and flushed (and fsynced) per line, so a run killed
half-way keeps every line it wrote. ``summary.json`` is replaced atomically.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"
SUMMARY = "summary.json"


class RunLog:
    def __init__(self, run_dir: str | Path, started: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.time() if started is None else started
        self._events = open(self.run_dir / EVENTS, "a", encoding="utf-8")

    def elapsed(self) -> float:
        return time.time() - self.started

    def event(self, name: str, **fields: Any) -> dict:
        record = {"event": name, "t": round(self.elapsed(), 4), **fields}
        self._events.write(json.dumps(record, default=_jsonable) + "\n")
        self._events.flush()
        os.fsync(self._events.fileno())
        return record

    def summary(self, **fields: Any) -> dict:
        record = {"wall_s": round(self.elapsed(), 3), **fields}
        tmp = self.run_dir / (SUMMARY + ".tmp")
        tmp.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
        os.replace(tmp, self.run_dir / SUMMARY)
        return record

    def close(self) -> None:
        self._events.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def read_events(run_dir: str | Path) -> list[dict]:
    """Every complete line of a run's event log (a torn last line is skipped)."""
    events = []
    path = Path(run_dir) / EVENTS
    if not path.exists():
        return events
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                events.append(json.loads(line))
    return events
