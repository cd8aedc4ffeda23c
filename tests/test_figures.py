"""Every figure fedemu draws shows all it was given: each drawn series lies inside its
axes, draws something visible (a line of no length does not), and each legend entry
names a mark the figure has. Checked on the figures themselves, as drawn, on data made
to expose what once went wrong: a slow condition's rounds cut off by a shared y axis,
CO-OP's evaluations at one instant drawn as a line of no length, a timeline's legend
listing marks it did not draw, a title explaining labels the plot did not show."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.lines import Line2D

from fedemu.launch.studies import compare, report_figures, report_timeline
from fedemu.launch.studies.results import load_run, load_sweep
from fedemu.launch.studies.traces_cli import stats_figure, summary
from fedemu.node.net import trace_files
from fedemu.server.timeline import CLIENT_COLUMNS, TIMELINE_COLUMNS
from tests.test_report import make_run
from tests.test_sweep import run as run_sweep
from tests.test_sweep import write


def _visible_marker(line: Line2D) -> bool:
    return line.get_marker() not in (None, "None", "none", "", " ")


def _inside(values: np.ndarray, limits: tuple[float, float]) -> np.ndarray:
    lo, hi = sorted(limits)
    slack = (hi - lo) * 1e-6
    return (values >= lo - slack) & (values <= hi + slack)


def problems(fig) -> list[str]:
    """What in ``fig`` hides data or explains what is not there (empty: nothing)."""
    found, colours = [], set()
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        limits = (ax.get_xlim(), ax.get_ylim())
        where = ax.get_title() or "the axes"
        for line in ax.lines:
            in_x, in_y = line.get_transform().contains_branch_seperately(ax.transData)
            xy = line.get_xydata().astype(float)
            xy = xy[np.isfinite(xy).all(axis=1)]
            if not len(xy):
                continue
            checked = [d for d, used in enumerate((in_x, in_y)) if used]
            outside = ~np.all([_inside(xy[:, d], limits[d]) for d in checked], axis=0)
            if outside.any():
                found.append(f"{where}: {line.get_label()!r} has points outside the axes, e.g. {xy[outside][0]}")
            distinct = len(np.unique(xy[~outside], axis=0))
            has_line = line.get_linestyle() not in ("None", "none", "", " ")
            if not (_visible_marker(line) and distinct) and not (has_line and distinct >= 2):
                found.append(f"{where}: {line.get_label()!r} draws nothing visible ({distinct} distinct point(s), "
                             "no marker)")
                continue
            colours.add(to_rgb(line.get_color()))
        for collection in ax.collections:
            in_x, in_y = collection.get_transform().contains_branch_seperately(ax.transData)
            for path in collection.get_paths():
                vertices = path.vertices[np.isfinite(path.vertices).all(axis=1)]
                for d, used in enumerate((in_x, in_y)):
                    if used and len(vertices) and not _inside(vertices[:, d], limits[d]).all():
                        found.append(f"{where}: a band or bar reaches {vertices[:, d].max():.3g} / "
                                     f"{vertices[:, d].min():.3g}, outside {sorted(limits[d])}")
            if any(np.ptp(p.vertices, axis=0).min() > 0 for p in collection.get_paths()):  # not of no width
                colours.update(to_rgb(c) for c in collection.get_facecolor())
                colours.update(to_rgb(c) for c in collection.get_edgecolor())
        for patch in ax.patches:
            colours.add(to_rgb(patch.get_facecolor()))
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    for legend in legends:
        for handle, text in zip(legend.legend_handles, legend.texts):
            colour = handle.get_color() if isinstance(handle, Line2D) else handle.get_facecolor()
            if to_rgb(colour) not in colours:
                found.append(f"the legend's {text.get_text()!r} names no mark drawn")
    return found


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the report code saves, by file stem (drawn to SVG: cheaper)."""
    figures = {}

    def keep(fig, out, stem, formats):
        figures[stem] = fig
        return []

    for module in (report_figures, report_timeline, compare):
        monkeypatch.setattr(module, "save_figure", keep)
    return figures


def _round_facts(seconds: float, offline: int = 0) -> dict:
    """What the server logs of each round besides accuracy: its emulated length and
    what happened to its selected clients."""
    return {"round_emulated_s": seconds, "outcome_counts": {"answered": 10 - offline, "offline": offline}}


class ConditionsRunner:
    """Runs made up for the figures: 1 Mbit/s rounds last 8-10 s, 10 Mbit/s 2 s; CO-OP's
    evaluations all at one emulated instant; FedAvg reaches 85% at 10 Mbit/s on one seed
    of two, never at 1 Mbit/s."""

    def __call__(self, config, run_dir, *, workers, stop, on_start=None, machines=None):
        seed, name = config["run"]["seed"], config["algorithm"]["name"]
        slow = config["network"]["profiles"]["mobile"]["up"]["bandwidth"] == "1Mbit"
        if name == "coop":
            make_run(run_dir, [0.5, 0.6, 0.65, 0.7, 0.72], config=config, seconds_per_round=0.0)
        elif slow:
            make_run(run_dir, [0.5, 0.7, 0.8], config=config, seconds_per_round=8.0 + seed,
                     round_fields=_round_facts(8.0 + seed, offline=2))
        else:
            make_run(run_dir, [0.6, 0.8, 0.9 if seed == 1 else 0.84], config=config, seconds_per_round=2.0,
                     round_fields=_round_facts(2.0))
        return json.loads((run_dir / "summary.json").read_text())


SWEEP = """
[sweep]
target = 0.85
[base.network.profiles.mobile]
latency_ms = 35
[axes]
"network.profiles.mobile.up.bandwidth" = ["10Mbit", "1Mbit"]  # the fast panel first: it once fixed the y axis
"run.seed" = [1, 2]
"algorithm.name" = ["fedavg", "coop"]
"""


@pytest.fixture
def sweep(tmp_path):
    out = tmp_path / "sweep"
    run_sweep(write(tmp_path / "s.toml", SWEEP), out, ConditionsRunner())
    return load_sweep(out)


def test_the_sweep_curves_and_round_durations_show_every_series(sweep, drawn, tmp_path):
    report_figures.plot_sweep_curves(sweep, tmp_path, ("svg",))
    assert {"accuracy-vs-rounds", "accuracy-vs-emulated-time", "accuracy-vs-uploaded", "round-duration",
            "participation"} <= set(drawn)
    for stem, fig in drawn.items():
        assert problems(fig) == [], stem
    # Each panel's rounds fit its own axis: 1 Mbit/s to 10 s (seed 2), 10 Mbit/s at 2 s.
    tops = {ax.get_title(): ax.get_ylim()[1] for ax in drawn["round-duration"].axes if ax.get_visible()}
    assert tops["uplink bandwidth = 1Mbit"] >= 10.0 > tops["uplink bandwidth = 10Mbit"] >= 2.0


def test_the_metric_against_each_axis_explains_only_the_marks_it_draws(sweep, drawn, tmp_path):
    report_figures.plot_sweep_axes(sweep, tmp_path, ("svg",))
    for stem, fig in drawn.items():
        assert problems(fig) == [], stem
    tt = drawn["tt-emulated-s-vs-network-profiles-mobile-up-bandwidth"]
    labels = [t.get_text() for ax in tt.axes for t in ax.texts]
    title = tt._suptitle.get_text()
    # FedAvg: 1 of 2 seeds at 10 Mbit/s, none at 1 Mbit/s; CO-OP never.
    assert labels == ["1 of 2"] and "k of n" in title and "×: none reached it" in title
    # Seed 1 only: FedAvg reached 85% at 10 Mbit/s, not at 1 Mbit/s, nor did CO-OP; no
    # cell is part-reached, so no "k of n" is drawn, nor explained.
    drawn.clear()
    sweep.runs = [r for r in sweep.runs if r.config["run"]["seed"] == 1]
    report_figures.plot_sweep_axes(sweep, tmp_path, ("svg",))
    tt = drawn["tt-emulated-s-vs-network-profiles-mobile-up-bandwidth"]
    title = tt._suptitle.get_text()
    assert [t.get_text() for ax in tt.axes for t in ax.texts] == []
    assert "k of n" not in title and "×: none reached it" in title, title


def test_the_runs_figures_show_every_run(tmp_path, drawn):
    runs = [load_run(make_run(tmp_path / "a", [0.6, 0.8, 0.9], sets={"algorithm.name": "fedavg"})),
            load_run(make_run(tmp_path / "b", [0.5, 0.6, 0.7], sets={"algorithm.name": "coop"},
                              seconds_per_round=0.0))]
    report_figures.plot_runs(runs, tmp_path, ("svg",))
    assert drawn
    for stem, fig in drawn.items():
        assert problems(fig) == [], stem


def _timeline_run(run_dir: Path) -> Path:
    """Two rounds of 10 s: client 1 in both; client 2 only in round 2, offline through
    round 1 (which it was not asked to work in); client 1's round-1 upload lost."""
    make_run(run_dir, [0.5, 0.6], sets={"algorithm.deadline_s": 8.0}, seconds_per_round=10.0)
    origin = 7.5  # make_run's start event
    rows = [dict(round=1, kind="round", start_s=origin, end_s=origin + 10, outcome="aggregated"),
            dict(round=2, kind="round", start_s=origin + 10, end_s=origin + 20, outcome="aggregated"),
            dict(round=1, client=1, kind="download", start_s=origin, end_s=origin + 1, outcome="delivered"),
            dict(round=1, client=1, kind="compute", start_s=origin + 1, end_s=origin + 3, outcome="on time"),
            dict(round=1, client=1, kind="upload", start_s=origin + 3, end_s=origin + 4, outcome="loss"),
            dict(round=None, client=2, kind="offline", start_s=origin + 0.5, end_s=None, outcome=""),
            dict(round=None, client=2, kind="online", start_s=origin + 12, end_s=None, outcome=""),
            *(dict(round=2, client=k, kind=kind, start_s=origin + 12 + i, end_s=origin + 13 + i, outcome=outcome)
              for k in (1, 2) for i, (kind, outcome) in enumerate([("download", "delivered"), ("compute", "on time"),
                                                                   ("upload", "delivered")]))]
    with open(run_dir / "timeline.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, TIMELINE_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in row.items()} for row in rows)
    with open(run_dir / "clients.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, CLIENT_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(dict(round=r, client=k, outcome="answered", slowdown=1.0, upload_s=1.0)
                         for r, k in ((1, 1), (2, 1), (2, 2)))
    return run_dir


def test_the_timeline_draws_only_selected_clients_and_a_legend_of_what_it_drew(tmp_path, drawn):
    run_dir = _timeline_run(tmp_path / "run")
    report_timeline.plot_gantt(run_dir, tmp_path, "1-2", formats=("svg",))
    fig = drawn["timeline"]
    assert problems(fig) == []
    (ax,) = fig.axes
    offline = [c for c in ax.collections if to_rgb(c.get_facecolor()[0]) == to_rgb(report_timeline.COLORS["offline"])]
    # Client 2 (row 1) was offline from 0.5 s to 12 s; of that only 10-12 s, in round 2, is drawn.
    (bar,) = offline
    assert bar.get_paths()[0].vertices[:, 0].min() == pytest.approx(10.0)
    legend = [t.get_text() for t in fig.legends[0].texts]
    assert "where it failed (lost, or its device went offline)" in legend and "deadline" in legend
    assert "compute (reply after its round)" not in legend  # no late reply drawn


def test_the_posteriors_and_a_traces_summary_show_their_data(tmp_path):
    from tests.test_compare import make_runs

    runs = compare.collect(make_runs(tmp_path / "runs"))
    results, _, _ = compare.compare(runs, rope=0.01)
    assert problems(compare.posterior_figure(results, 0.01)) == []
    trace = tmp_path / "step.up"
    trace.write_text("".join(f"{t}\n" for t in range(0, 2000, 1)) + "".join(f"{t}\n" for t in range(2000, 4000, 4)))
    assert problems(stats_figure(summary(trace_files.read(trace, "mahimahi")))) == []
