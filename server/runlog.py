"""The run directory's event log and summary: a stable contract read by other tools.

``events.jsonl`` is append-only and flushed (and fsynced) per line, so a run killed
half-way keeps every line it wrote; so are its tables, ``clients.csv`` (one row per
selected client per round), ``timeline.csv`` (server/timeline.py), each appended once
per round, and ``tasks.csv`` (a row per task of an asynchronous rule at a fixed
concurrency). ``summary.json`` is replaced atomically.

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
TASKS = "tasks.csv"  # asynchronous rules with a concurrency: one row per task
TASK_COLUMNS = ("task", "client", "start_s", "end_s", "outcome")
SUMMARY = "summary.json"
RESERVE = "summary.reserve"
RESERVE_BYTES = 4096  # a summary is well under 2 KB: one page (tmpfs) or block (ext4) holds it


# logs/<node>.exit.json: how a worker node's process ended ({"node", "exit"}), written by
# the launcher, which watches those processes, for the server, which only sees their
# clients go DOWN with ``noconnection``.
NODE_EXIT = "{node}.exit.json"


class RunLogError(OSError):
    """The run directory cannot be written; the message names the file and the error."""

    def __str__(self) -> str:
        return self.strerror  # the message alone, without OSError's "[Errno N]"


def write_error(path: Path, exc: OSError) -> RunLogError:
    return RunLogError(exc.errno, f"cannot write {path}: {exc.strerror or exc}")


def write_json_atomically(path: Path, record: dict) -> None:
    """Replace ``path`` with ``record`` as JSON, all or nothing (tmp, fsync, rename)."""
    write_text_atomically(path, json.dumps(record, indent=2, default=_jsonable) + "\n")


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, all or nothing (tmp, fsync, rename): a reader never
    sees half of it, and a write that fails (a full disk) leaves neither it nor the tmp
    file behind; RunLogError names the file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only file system: nothing was made either
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
        self._tables: dict[str, _Lines] = {}  # CSV files, each opened with its first rows
        self.listeners: list = []  # called with each event once it is written (TensorBoard)

    def _reserve(self) -> None:
        reserve = self.run_dir / RESERVE
        if not reserve.exists():
            try:
                with open(reserve, "wb") as f:
                    f.write(b"\0" * RESERVE_BYTES)  # written, not sparse: the blocks are really taken
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                reserve.unlink(missing_ok=True)  # no half-made reserve left behind
                raise

    def elapsed(self) -> float:
        return time.time() - self.started  # wall

    def event(self, name: str, *, sync: bool = True, **fields: Any) -> dict:
        """Append one event; raises RunLogError if the line cannot be written (and
        every later call, once one has failed). ``sync=False``: written, but fsynced only
        with a later line (one of a burst, such as the faults of a node's thousands of
        clients: an fsync each took minutes); a crash of the process loses nothing."""
        record = {"event": name, "t": round(self.elapsed(), 4), **fields}
        if self.failed is not None:
            raise self.failed
        try:
            self._events.append((json.dumps(record, default=_jsonable) + "\n").encode(), sync)
        except RunLogError as exc:
            self.failed = exc
            raise
        for listener in self.listeners:
            listener(record)
        return record

    def table(self, name: str, columns: tuple[str, ...], rows: list[tuple]) -> None:
        """Append rows to the CSV file ``name`` (its header ``columns`` first), as one
        write; RunLogError as for an event (the log is then closed)."""
        if self.failed is not None:
            raise self.failed
        try:
            if name not in self._tables:
                self._tables[name] = _Lines(self.run_dir / name, header=",".join(columns) + "\n")
            self._tables[name].append("".join(",".join(_csv_cell(v) for v in row) + "\n" for row in rows).encode())
        except RunLogError as exc:
            self.failed = exc
            raise

    def tasks(self, rows: list[tuple]) -> None:
        """Append rows (TASK_COLUMNS) to tasks.csv."""
        self.table(TASKS, TASK_COLUMNS, rows)

    def summary(self, **fields: Any) -> dict:
        """Write summary.json (atomically), using the space reserved for it."""
        record = {"wall_s": round(self.elapsed(), 3), **fields}
        (self.run_dir / RESERVE).unlink(missing_ok=True)
        write_json_atomically(self.run_dir / SUMMARY, record)
        return record

    def close(self) -> None:
        self._events.close()
        for table in self._tables.values():
            table.close()


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

    def append(self, data: bytes, sync: bool = True) -> None:
        try:
            self._f.write(data)
            self._f.flush()
            if sync:
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


def _csv_cell(value: Any) -> str:
    """A CSV cell: empty for None; quoted where the text holds a comma or a quote."""
    if value is None:
        return ""
    text = str(value)
    if any(c in text for c in ',"\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


def write_node_exit(run_dir: str | Path, node: str, how: str) -> None:
    """Record how ``node``'s process ended (see NODE_EXIT); RunLogError if it cannot."""
    write_json_atomically(Path(run_dir) / "logs" / NODE_EXIT.format(node=node), {"node": node, "exit": how})


def read_node_exit(run_dir: str | Path, node: str) -> str | None:
    """How ``node``'s process ended, if its launcher has said (None: not yet, or never)."""
    try:
        return json.loads((Path(run_dir) / "logs" / NODE_EXIT.format(node=node)).read_text())["exit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
