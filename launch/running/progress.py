"""Live progress of runs and sweeps: a tqdm bar where a terminal is attached (rounds, or
evaluations for asynchronous rules, with the accuracy, emulated time, wall time and an
ETA), plain lines where none is (a log file, CI, a pipe)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, TextIO

from fedemu.server.runlog import EVENTS


class EventTail:
    """The events a run has appended to its events.jsonl since the last look (whole
    lines only: a line still being written waits for the next look)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / EVENTS
        self._offset = 0

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        events = []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self._offset = f.tell()
                events.append(json.loads(line))
        return events


def on_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _postfix(event: dict) -> str:
    parts = []
    if event.get("accuracy") is not None:
        parts.append(f"acc {event['accuracy']:.4f}")
    if event.get("emulated_s") is not None:
        parts.append(f"emulated {event['emulated_s']:.1f}s")
    return ", ".join(parts)


class RunProgress:
    """``fedemu launch``'s live view. ``echo`` prints a line (above the bar, if any);
    ``event`` moves the bar."""

    def __init__(self, total: int, stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = total
        self._bar = None
        if bar if bar is not None else on_terminal(self.stream):
            # lazy: only a run on a terminal draws a progress bar
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="round", file=self.stream, dynamic_ncols=True, leave=False)

    def echo(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def event(self, event: dict) -> None:
        if self._bar is None:
            return
        if event.get("event") == "start" and "eval_every_uploads" in event:
            self._bar.unit = "eval"
        elif event.get("event") == "round":
            self._bar.update(max(0, event["round"] - self._bar.n))
            self._bar.set_postfix_str(_postfix(event))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class SweepProgress:
    """``fedemu sweep``'s live view of the points running now: on a terminal a bar per
    point (its rounds) under the sweep's lines; elsewhere a line per point in the
    sweep's periodic heartbeat (``lines``)."""

    def __init__(self, echo: Callable[[str], None], stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.echo_line = echo
        self.bars = bar if bar is not None else on_terminal(self.stream)
        self._points: dict[str, tuple[EventTail, int, object]] = {}  # id -> (tail, rounds, bar)
        self._done: dict[str, tuple[int, dict]] = {}  # id -> (rounds done, last round event)

    def echo(self, line: str) -> None:
        if self.bars and self._points:
            # lazy: only a run on a terminal draws a progress bar
            from tqdm import tqdm

            tqdm.write(line, file=self.stream)
        else:
            self.echo_line(line)

    def start(self, point_id: str, run_dir: Path, rounds: int) -> None:
        bar = None
        if self.bars:
            # lazy: only a run on a terminal draws a progress bar
            from tqdm import tqdm

            bar = tqdm(total=rounds, unit="round", desc=_short_id(point_id), file=self.stream, dynamic_ncols=True,
                       leave=False)
        self._points[point_id] = (EventTail(run_dir), rounds, bar)
        self._done[point_id] = (0, {})

    def poll(self) -> None:
        for point_id, (tail, rounds, bar) in self._points.items():
            for event in tail.new():
                if event.get("event") == "round":
                    self._done[point_id] = (event["round"], event)
                    if bar is not None:
                        bar.update(max(0, event["round"] - bar.n))
                        bar.set_postfix_str(_postfix(event))

    def finish(self, point_id: str) -> None:
        _, _, bar = self._points.pop(point_id, (None, 0, None))
        self._done.pop(point_id, None)
        if bar is not None:
            bar.close()

    def lines(self) -> list[str]:
        """A line per running point: its rounds done, accuracy and emulated time."""
        out = []
        for point_id, (_, rounds, _) in self._points.items():
            done, event = self._done[point_id]
            extra = _postfix(event)
            out.append(f"       {point_id}: round {done}/{rounds}" + (f", {extra}" if extra else ""))
        return out

    def close(self) -> None:
        for point_id in list(self._points):
            self.finish(point_id)


def _short_id(point_id: str, width: int = 40) -> str:
    return point_id if len(point_id) <= width else point_id[: width - 1] + "…"
