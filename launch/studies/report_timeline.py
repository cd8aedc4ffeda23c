"""A run's timeline (``timeline.csv``, written by server/timeline.py) read back: a Gantt
figure of selected rounds (``fedemu report --timeline RUN``) and the Chrome trace event
format (``fedemu export --trace RUN``), which Perfetto (ui.perfetto.dev) and
chrome://tracing open with one track per client.

Times in the file are the broker's emulated clock; both views count from the run's
start (the start event's ``emulated_s``), as the report's curves do.
"""
from __future__ import annotations

import csv
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fedemu.server.runlog import CLIENTS, EVENTS, read_events
from fedemu.server.timeline import TIMELINE

from .report_figures import pyplot, save_figure
from .results import ReportError, emulated_origin

COLORS = {"download": "#1f77b4", "compute": "#2ca02c", "upload": "#ff7f0e", "offline": "#9e9e9e",
          "failed": "#d62728", "late": "#98df8a"}


@dataclass
class Span:
    kind: str  # download, compute, upload, offline
    start: float  # seconds since the run's start (emulated)
    end: float
    round: int | None
    outcome: str = ""
    bytes: int | None = None


@dataclass
class RunTimeline:
    """A run's timeline by client, in seconds since the run's start."""

    origin: float  # the broker's clock at the run's start
    spans: dict[int, list[Span]] = field(default_factory=dict)
    rounds: dict[int, tuple[float, float, str]] = field(default_factory=dict)  # round -> (start, end, outcome)
    end: float = 0.0  # the last instant the timeline knows
    deadline_s: float = 0.0  # round-based rules: the config's algorithm.deadline_s (0: none)
    factors: dict[tuple[int, int], float] = field(default_factory=dict)  # (round, client) -> straggler factor
    outcomes: dict[tuple[int, int], str] = field(default_factory=dict)  # (round, client) -> outcome
    selected: dict[int, list[int]] = field(default_factory=dict)  # round -> its selected clients


def _number(text: str) -> float | None:
    return float(text) if text not in ("", None) else None


def load(run_dir: str | Path) -> RunTimeline:
    """The timeline of a run directory; ReportError if it has none (a run of an older
    fedemu, or ``run.timeline = "off"``)."""
    run_dir = Path(run_dir)
    path = run_dir / TIMELINE
    if not path.exists():
        raise ReportError(f"{run_dir} has no {TIMELINE} (a run with run.timeline = \"off\", or from a fedemu "
                          "before timelines)")
    events = read_events(run_dir) if (run_dir / EVENTS).exists() else []
    origin = emulated_origin(events)
    config_text = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").exists() else ""
    timeline = RunTimeline(origin)
    if config_text:
        algorithm = tomllib.loads(config_text).get("algorithm", {})
        timeline.deadline_s = float(algorithm.get("deadline_s", 0.0) or 0.0)
    off_since: dict[int, float] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row.get("kind") is None or row.get("outcome") is None:
                continue  # a torn last line
            kind, round_ = row["kind"], int(row["round"]) if row["round"] else None
            start, end = _number(row["start_s"]), _number(row["end_s"])
            start = None if start is None else start - origin
            end = None if end is None else end - origin
            timeline.end = max(timeline.end, *(t for t in (start, end) if t is not None))
            if kind == "round":
                timeline.rounds[round_] = (start, end, row["outcome"])
                continue
            client = int(row["client"])
            if kind == "offline":
                off_since.setdefault(client, start)
            elif kind == "online":
                if client in off_since:
                    timeline.spans.setdefault(client, []).append(
                        Span("offline", off_since.pop(client), start, round_))
            else:
                size = int(row["bytes"]) if row["bytes"] else None
                timeline.spans.setdefault(client, []).append(Span(kind, start, end, round_, row["outcome"], size))
    for client, since in off_since.items():  # still offline when the timeline ends
        timeline.spans.setdefault(client, []).append(Span("offline", since, math.inf, None))
    if (run_dir / CLIENTS).exists():
        with open(run_dir / CLIENTS, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                if row.get("upload_s") is None:
                    continue  # a torn last line
                key = (int(row["round"]), int(row["client"]))
                timeline.factors[key] = float(row["slowdown"] or 1.0)
                timeline.outcomes[key] = row["outcome"]
                timeline.selected.setdefault(key[0], []).append(key[1])
    return timeline


def parse_rounds(text: str | None, available: list[int]) -> list[int]:
    """``--rounds``: "3", "2-5" or "1,4"; default the first three rounds."""
    if not available:
        raise ReportError("the timeline has no round yet")
    if not text:
        return available[:3]
    chosen: list[int] = []
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ReportError(f"--rounds {text!r}: give rounds as 3, 2-5 or 1,4") from None
        chosen += [r for r in available if first <= r <= last]
    if not chosen:
        raise ReportError(f"--rounds {text!r}: the timeline has rounds {available[0]}..{available[-1]}")
    return sorted(set(chosen))


def plot_gantt(run_dir: str | Path, out: str | Path, rounds: str | None = None, max_clients: int = 40,
               formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """A Gantt figure of the chosen rounds: a row per selected client (download, compute,
    upload; offline shaded; a lost transfer marked ×), the rounds' bounds and deadlines
    marked. Returns the files written (``timeline.EXT`` in ``out``)."""
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    timeline = load(run_dir)
    chosen = parse_rounds(rounds, sorted(timeline.rounds))
    lo = min(timeline.rounds[r][0] for r in chosen)
    hi = max(timeline.rounds[r][1] for r in chosen)
    clients = sorted({k for r in chosen for k in timeline.selected.get(r, [])})
    rounds_word = "round"
    if not clients:  # an asynchronous run: whoever worked in these evaluations
        rounds_word = "evaluation"
        clients = sorted(k for k, spans in timeline.spans.items()
                         if any(s.kind != "offline" and s.start < hi and s.end > lo for s in spans))
    shown = clients[:max_clients]
    # In a round-based run a row shows a client only in the rounds it was selected for:
    # outside them it was not asked to do anything, so offline there is not its story.
    windows = {k: [timeline.rounds[r][:2] for r in chosen if k in timeline.selected.get(r, [])] for k in shown}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.28 * max(len(shown), 3)), layout="constrained")
    pad = (hi - lo) * 0.02 or 1.0
    drawn: set[str] = set()  # what the legend lists: only marks the figure has
    for row, k in enumerate(shown):
        for span in timeline.spans.get(k, []):
            # Cut to the window drawn, so that nothing lies outside the axes.
            start, end = max(span.start, lo - pad), min(span.end, hi + pad)
            if end < lo - pad or span.start >= hi:  # the next round's first instant is not these rounds'
                continue
            if span.kind == "offline":
                pieces = [(start, end)] if rounds_word != "round" else [
                    (max(start, a), min(end, b)) for a, b in windows[k] if start < b and end > a]
                for a, b in pieces:
                    ax.broken_barh([(a, b - a)], (row - 0.45, 0.9), facecolors=COLORS["offline"],
                                   alpha=0.35, hatch="//", edgecolor="#666666", linewidth=0)
                    drawn.add("offline")
                continue
            if rounds_word == "round" and not any(k in timeline.selected.get(r, []) for r in chosen
                                                  if r == span.round):
                continue  # another round's work (one not drawn, or one this client sat out)
            failed = span.kind in ("download", "upload") and span.outcome not in ("delivered", "")
            kind = "failed" if failed else "late" if span.outcome == "late" else span.kind
            height = 0.5 if span.kind == "compute" else 0.7
            ax.broken_barh([(start, max(end - start, 0.0))], (row - height / 2, height), facecolors=COLORS[kind])
            if end - start > (hi - lo) * 0.002:  # a transfer refused at once is only its ×
                drawn.add(kind)
            if failed and span.end <= hi + pad:
                ax.plot([span.end], [row], marker="x", color=COLORS["failed"], markersize=7, mew=2)
                drawn.add("failed at")
    for r in chosen:
        start, end, _ = timeline.rounds[r]
        ax.axvline(start, color="black", linewidth=0.8)
        ax.text(start, 1.0, f" {rounds_word} {r}", transform=ax.get_xaxis_transform(), va="bottom", fontsize=8)
        if timeline.deadline_s and timeline.selected.get(r) and start + timeline.deadline_s <= hi + pad:
            ax.axvline(start + timeline.deadline_s, color="#d62728", linewidth=1, linestyle="--")
            drawn.add("deadline")  # not when every round ended before it (outside the window)
    ax.axvline(hi, color="black", linewidth=0.8)
    labels = []
    for k in shown:
        factors = {timeline.factors.get((r, k), 1.0) for r in chosen if (r, k) in timeline.factors}
        factor = max(factors, default=1.0)
        labels.append(f"client {k}" + (f" (×{factor:g})" if factor != 1.0 else ""))
    ax.set_yticks(range(len(shown)), labels, fontsize=8)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel("emulated time since the run started (s)")
    legend = {"download": Patch(color=COLORS["download"], label="download"),
              "compute": Patch(color=COLORS["compute"], label="compute"),
              "late": Patch(color=COLORS["late"], label="compute (reply after its round)"),
              "upload": Patch(color=COLORS["upload"], label="upload"),
              "offline": Patch(facecolor=COLORS["offline"], alpha=0.35, hatch="//", edgecolor="#666666",
                               label="offline"),
              "failed": Patch(color=COLORS["failed"], label="failed transfer"),
              "failed at": Line2D([], [], marker="x", color=COLORS["failed"], markersize=7, mew=2, linestyle="none",
                                  label="where it failed (lost, or its device went offline)")}
    handles = [handle for kind, handle in legend.items() if kind in drawn]
    if "deadline" in drawn:
        handles.append(Line2D([], [], color="#d62728", linestyle="--", label="deadline"))
    fig.legend(handles=handles, loc="outside lower center", ncol=4, frameon=False, fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    what = f"{rounds_word} {chosen[0]}" if len(chosen) == 1 else f"{rounds_word}s {chosen[0]}-{chosen[-1]}"
    more = f"; {len(clients) - len(shown)} more clients not shown" if len(clients) > len(shown) else ""
    who = "Each selected client's" if rounds_word == "round" else "Each client in"
    ax.set_title(f"{who} {what} (white: idle{more})", pad=14)
    paths = save_figure(fig, Path(out), "timeline", formats)
    plt.close(fig)
    return paths


def chrome_trace(run_dir: str | Path) -> dict:
    """The run's timeline in the Chrome trace event format (a JSON object with
    ``traceEvents``): one track (thread) per client, a "server" track with the rounds;
    microseconds of emulated time since the run's start."""
    timeline = load(run_dir)

    def us(seconds: float) -> float:
        return round(seconds * 1e6, 3)

    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "server"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rounds"}},
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "clients"}},
    ]
    for r, (start, end, outcome) in sorted(timeline.rounds.items()):
        events.append({"name": f"round {r}", "cat": "round", "ph": "X", "pid": 0, "tid": 0, "ts": us(start),
                       "dur": us(end - start), "args": {"round": r, "outcome": outcome}})
    for k in sorted(timeline.spans):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": k, "args": {"name": f"client {k}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": k, "args": {"sort_index": k}})
        for span in timeline.spans[k]:
            end = timeline.end if span.end == math.inf else span.end
            args = {"round": span.round}
            if span.outcome:
                args["outcome"] = span.outcome
            if span.bytes is not None:
                args["bytes"] = span.bytes
            factor = timeline.factors.get((span.round, k)) if span.round is not None else None
            if span.kind == "compute" and factor is not None:
                args["straggler_factor"] = factor
            events.append({"name": span.kind, "cat": span.kind, "ph": "X", "pid": 1, "tid": k, "ts": us(span.start),
                           "dur": us(max(end - span.start, 0.0)), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "emulated seconds since the run started, as microseconds",
                          "run": str(Path(run_dir).resolve())}}


def write_trace(run_dir: str | Path, out) -> int:
    """Write the Chrome trace JSON into a text stream; returns the number of events."""
    trace = chrome_trace(run_dir)
    json.dump(trace, out, separators=(",", ":"))
    out.write("\n")
    return len(trace["traceEvents"])
