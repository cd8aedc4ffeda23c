"""The run directory's event log and summary: a stable contract read by other tools.

``events.jsonl`` is append-only and flushed (and fsynced) per line, so a run killed
half-way keeps every line it wrote; so is ``clients.csv`` (one row per selected client
per round), which a run writes when its rounds are too large to list their clients in
each round event (``run.client_log``), and ``tasks.csv`` (a row per task of an
asynchronous rule at a fixed concurrency). ``summary.json`` is replaced atomically.

A write that fails (a full disk, EIO, a read-only remount) raises :class:`RunLogError`
naming the file and the error, after cutting the log back to its last whole line: every
line already written stays valid JSON. The log is then closed to further events, and the
summary still gets written: a few kilobytes reserved when the run started
(``summary.reserve``) are given back first, so even a full disk has room for it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = "events.jsonl"
CLIENTS = "clients.csv"
CLIENT_COLUMNS = ("round", "client", "outcome", "num_samples", "train_loss", "compute_s", "slowdown")
TASKS = "tasks.csv"  # asynchronous rules with a concurrency: one row per task
TASK_COLUMNS = ("task", "client", "start_s", "end_s", "outcome")
SUMMARY = "summary.json"
RESERVE = "summary.reserve"
RESERVE_BYTES = 4096  # a summary is well under 2 KB: one page (tmpfs) or block (ext4) holds it


class RunLogError(OSError):
    """The run directory cannot be written; the message names the file and the error."""

    def __str__(self) -> str:
        return self.strerror  # the message alone, without OSError's "[Errno N]"


def write_error(path: Path, exc: OSError) -> RunLogError:
    return RunLogError(exc.errno, f"cannot write {path}: {exc.strerror or exc}")


def write_json_atomically(path: Path, record: dict) -> None:
    """Replace ``path`` with ``record`` as JSON, all or nothing (tmp, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=2, default=_jsonable) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from None


class RunLog:
    def __init__(self, run_dir: str | Path, started: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started = time.time() if started is None else started  # wall: each event's `t` is host seconds
        self.path = self.run_dir / EVENTS
        self.failed: RunLogError | None = None  # the write error that closed the log
        try:
            self._reserve()
        except OSError as exc:
            raise write_error(self.path, exc) from None
        self._events = _Lines(self.path)
        self._clients: _Lines | None = None  # opened with the first rows
        self._tasks: _Lines | None = None

    def _reserve(self) -> None:
        reserve = self.run_dir / RESERVE
        if not reserve.exists():
            with open(reserve, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)  # written, not sparse: the blocks are really taken
                f.flush()
                os.fsync(f.fileno())

    def elapsed(self) -> float:
        return time.time() - self.started  # wall

    def event(self, name: str, **fields: Any) -> dict:
        """Append one event; raises RunLogError if the line cannot be written (and
        every later call, once one has failed)."""
        record = {"event": name, "t": round(self.elapsed(), 4), **fields}
        if self.failed is not None:
            raise self.failed
        try:
            self._events.append((json.dumps(record, default=_jsonable) + "\n").encode())
        except RunLogError as exc:
            self.failed = exc
            raise
        return record

    def clients(self, rows: list[tuple]) -> None:
        """Append rows (CLIENT_COLUMNS) to clients.csv, as one write; RunLogError as for
        an event (the log is then closed)."""
        if self._clients is None:
            self._clients = self._csv(CLIENTS, CLIENT_COLUMNS)
        self._append_rows(self._clients, rows)

    def tasks(self, rows: list[tuple]) -> None:
        """Append rows (TASK_COLUMNS) to tasks.csv, as clients() does to clients.csv."""
        if self._tasks is None:
            self._tasks = self._csv(TASKS, TASK_COLUMNS)
        self._append_rows(self._tasks, rows)

    def _csv(self, name: str, columns: tuple[str, ...]) -> _Lines:
        if self.failed is not None:
            raise self.failed
        try:
            return _Lines(self.run_dir / name, header=",".join(columns) + "\n")
        except RunLogError as exc:
            self.failed = exc
            raise

    def _append_rows(self, lines: _Lines, rows: list[tuple]) -> None:
        if self.failed is not None:
            raise self.failed
        try:
            lines.append("".join(",".join("" if v is None else str(v) for v in row) + "\n" for row in rows).encode())
        except RunLogError as exc:
            self.failed = exc
            raise

    def summary(self, **fields: Any) -> dict:
        """Write summary.json (atomically), using the space reserved for it."""
        record = {"wall_s": round(self.elapsed(), 3), **fields}
        (self.run_dir / RESERVE).unlink(missing_ok=True)
        write_json_atomically(self.run_dir / SUMMARY, record)
        return record

    def close(self) -> None:
        self._events.close()
        for lines in (self._clients, self._tasks):
            if lines is not None:
                lines.close()


class _Lines:
    """An append-only file of whole lines, each write flushed and fsynced. A write that
    fails cuts the file back to its last whole line and closes it (RunLogError)."""

    def __init__(self, path: Path, header: str = "") -> None:
        self.path = path
        try:
            self._f = open(path, "ab")
            self._length = self._f.seek(0, os.SEEK_END)  # bytes of whole lines so far
        except OSError as exc:
            raise write_error(path, exc) from None
        if header and not self._length:
            self.append(header.encode())

    def append(self, data: bytes) -> None:
        try:
            self._f.write(data)
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as exc:
            self._cut_back()
            raise write_error(self.path, exc) from None
        self._length += len(data)

    def _cut_back(self) -> None:
        """Drop the torn write (buffered or partly on disk), so the file ends with a
        whole line; nothing more is written to it."""
        self.close()  # the unwritten buffer is what we are dropping
        try:
            os.truncate(self.path, self._length)
        except OSError:
            pass  # read-only now: a torn last line stays; readers skip it

    def close(self) -> None:
        try:
            self._f.close()
        except OSError:
            pass


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
