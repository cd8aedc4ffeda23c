"""The report's figures: accuracy curves of runs and of a sweep's points, and a sweep's
metrics against each condition axis; with matplotlib set up for files (also used by
compare and the benchmarks). matplotlib is imported only when drawing."""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from .labels import algorithm_label, fmt, short
from .report_groups import Cell, algorithms, axis_values, combinations, condition_axes, matches, metric
from .results import REPEAT_KEYS, X_AXES, RunRecord, SweepData, differing_keys, flat, x_label


def pyplot():
    """matplotlib's pyplot, drawing into files, with the report's fonts and stable SVG ids."""
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "legend.fontsize": 9,
                         "svg.hashsalt": "fedemu", "svg.fonttype": "none"})
    return plt


def save_figure(fig, out: Path, stem: str, formats: tuple[str, ...]) -> list[Path]:
    """``out/stem.EXT`` for each format; returns their paths."""
    paths = []
    for ext in formats:
        p = out / f"{stem}.{ext}"
        # A fixed date keeps SVG/PNG bytes stable between identical reports.
        meta = {"Date": None} if ext == "svg" else {}
        fig.savefig(p, dpi=120, bbox_inches="tight", metadata=meta or None)
        paths.append(p)
    return paths


def _acc_limits(values: list[np.ndarray]) -> tuple[float, float]:
    allv = np.concatenate([v for v in values if len(v)]) * 100 if any(len(v) for v in values) else np.array([0, 100])
    return max(0.0, float(allv.min()) - 2), min(100.0, float(allv.max()) + 1.5)


def _colors(names: list[str]) -> dict[str, str]:
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


# Outcomes of a round's selected clients, as drawn (server/timeline.OUTCOMES), bottom up.
OUTCOME_COLORS = {"answered": "#2ca02c", "straggler": "#ff7f0e", "offline": "#7f7f7f",
                  "failed_transfer": "#d62728", "discarded": "#9467bd", "dropped": "#000000"}


def _integer_ticks(ax) -> None:
    """Rounds and evaluations are whole numbers: no 1.25 on their axis."""
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def run_labels(runs: list[RunRecord]) -> list[str]:
    """Legend labels naming only what differs between the runs (a key a run does not
    have is left out of its label, not shown as None); the run's folder where nothing
    does, or where that would still not tell two runs apart."""
    keys = differing_keys([r.config for r in runs])
    labels = []
    for r in runs:
        values = flat(r.config)
        parts = [f"{short(k)}={fmt(values[k])}" for k in keys if values.get(k) is not None]
        label = ", ".join(parts) if parts else r.path.name
        if len(label) > 70:  # a legend that covers the plot explains nothing: the folder, in full in the table
            label = r.path.name
        labels.append(label)
    if len(set(labels)) < len(labels):
        labels = [r.path.name for r in runs]
    return [label + (" (in progress)" if r.summary is None else "") for r, label in zip(runs, labels)]


def _legend_below(fig, ax, count: int) -> None:
    """Below the axes, outside them: it never hides a curve."""
    if count:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=1 if count > 3 else count,
                   frameon=False)


def plot_runs(runs: list[RunRecord], out: Path, formats=("png", "svg"), title: str = "") -> list[Path]:
    """One figure per x axis (one line per run, labelled by what differs; dotted while a
    run is unfinished), then the test loss, each round's emulated duration, and each
    round's participation by outcome (a panel per run)."""
    plt = pyplot()
    labels = run_labels(runs)
    colors = _colors(labels)
    lo, hi = _acc_limits([r.curve.accuracy for r in runs])
    legend = len(runs) <= 12
    paths = []
    lines = [(attr, xlabel, stem, what, "accuracy") for attr, xlabel, stem, what in X_AXES]
    if any(np.isfinite(r.curve.loss).any() for r in runs):
        lines.append(("rounds", "", "rounds", "rounds", "loss"))
    for attr, _, stem, what, y in lines:
        fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
        for r, label in zip(runs, labels):
            x = getattr(r.curve, attr)
            values = r.curve.accuracy * 100 if y == "accuracy" else r.curve.loss
            ax.plot(x, values, color=colors[label], label=label, linewidth=1.6,
                    marker="o" if len(x) < 25 else None, markersize=3,
                    linestyle="-" if r.status == "completed" else ":")
        ax.set_xlabel(x_label(attr, runs))
        if attr == "rounds":
            _integer_ticks(ax)
        if y == "accuracy":
            ax.set_ylabel("test accuracy (%)")
            ax.set_ylim(lo, hi)
        else:
            ax.set_ylabel("test loss")
        ax.grid(True, alpha=0.3)
        ax.set_title(title or f"Test {y} against {what}")
        if legend:
            _legend_below(fig, ax, len(runs))
        paths += save_figure(fig, out, f"{y}-vs-{stem}", formats)
        plt.close(fig)
    return paths + plot_round_durations(runs, labels, colors, out, formats) + plot_participation(runs, labels, out,
                                                                                               formats)


def plot_round_durations(runs: list[RunRecord], labels: list[str], colors: dict, out: Path, formats) -> list[Path]:
    """Each round's emulated duration: where a network's effect shows when every round
    waits for its deadline."""
    drawn = [(r, label) for r, label in zip(runs, labels) if r.series is not None and np.isfinite(r.series.duration_s).any()]
    if not drawn:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
    for r, label in drawn:
        ax.plot(r.series.rounds, r.series.duration_s, color=colors[label], label=label, linewidth=1.4,
                marker="o" if len(r.series.rounds) < 25 else None, markersize=3,
                linestyle="-" if r.status == "completed" else ":")
    ax.set_xlabel(x_label("rounds", [r for r, _ in drawn]))
    _integer_ticks(ax)
    ax.set_ylabel("emulated seconds")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title("How long each round took (emulated)")
    if len(drawn) <= 12:
        _legend_below(fig, ax, len(drawn))
    paths = save_figure(fig, out, "round-duration", formats)
    plt.close(fig)
    return paths


def _stacked_outcomes(ax, rounds: np.ndarray, outcomes: dict[str, np.ndarray]) -> None:
    bottom = np.zeros(len(rounds))
    for name, color in OUTCOME_COLORS.items():
        counts = outcomes.get(name)
        if counts is None or not counts.any():
            continue
        ax.bar(rounds, counts, bottom=bottom, color=color, width=0.85, label=name.replace("_", " "), linewidth=0)
        bottom = bottom + counts


def plot_participation(runs: list[RunRecord], labels: list[str], out: Path, formats) -> list[Path]:
    """Each round's selected clients by what happened to them (stacked), a panel per
    round-based run whose log counts outcomes."""
    drawn = [(r, label) for r, label in zip(runs, labels) if r.series is not None and r.series.outcomes]
    if not drawn:
        return []
    plt = pyplot()
    fig, panels = _panel_grid(plt, len(drawn), 4.6, 3.0)
    for ax, (r, label) in zip(panels, drawn):
        _stacked_outcomes(ax, r.series.rounds, r.series.outcomes)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("round")
        _integer_ticks(ax)
        ax.grid(True, axis="y", alpha=0.3)
    panels[0].set_ylabel("selected clients")
    _outcome_legend(fig, [r.series.outcomes for r, _ in drawn])
    fig.suptitle("What happened to each round's selected clients")
    paths = save_figure(fig, out, "participation", formats)
    plt.close(fig)
    return paths


def _outcome_legend(fig, outcome_sets: list[dict]) -> None:
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    from matplotlib.patches import Patch

    seen = [n for n in OUTCOME_COLORS if any(o.get(n) is not None and o[n].any() for o in outcome_sets)]
    fig.legend(handles=[Patch(color=OUTCOME_COLORS[n], label=n.replace("_", " ")) for n in seen],
               loc="outside lower center", ncol=len(seen), frameon=False)


def _panel_grid(plt, n: int, width: float = 4.6, height: float = 3.4, sharex: bool = False, sharey: bool = True):
    cols = min(n, 3) if n != 4 else 2
    rows = math.ceil(n / cols)
    # Constrained layout keeps titles, labels and the figure legend from overlapping.
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.8), squeeze=False, sharey=sharey,
                             sharex=sharex, layout="constrained")
    for extra in axes.flat[n:]:
        extra.set_visible(False)
    return fig, list(axes.flat[:n])


def spread(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, min, max) over repetitions' curves, each interpolated linearly onto
    every x any of them has, within its own range (a curve that ended earlier is not
    extended)."""
    grid = np.unique(np.concatenate([x for x, _ in curves]))
    stacked = np.full((len(curves), len(grid)), np.nan)
    for i, (x, y) in enumerate(curves):
        inside = (grid >= x[0]) & (grid <= x[-1])
        stacked[i, inside] = np.interp(grid[inside], x, y)
    with np.errstate(all="ignore"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return grid, np.nanmean(stacked, axis=0), np.nanmin(stacked, axis=0), np.nanmax(stacked, axis=0)


def plot_sweep_curves(data: SweepData, out: Path, formats=("png", "svg")) -> list[Path]:
    """Accuracy (and loss) curves: one panel per condition, one colour per algorithm;
    across repetitions (seed, fold), the mean as a line and the min-max as a band. Then
    each round's duration and participation."""
    plt = pyplot()
    conds = condition_axes(data)
    combos = combinations(data, conds)
    algos = algorithms(data)
    colors = _colors(algos)
    lo, hi = _acc_limits([r.curve.accuracy for r in data.runs])
    reps = [k for k in data.axes if k in REPEAT_KEYS]
    unfinished = len(data.runs) - len(data.completed)
    paths = []
    lines = [(attr, stem, what, "accuracy") for attr, _, stem, what in X_AXES]
    if any(np.isfinite(r.curve.loss).any() for r in data.runs):
        lines.append(("rounds", "rounds", "rounds", "loss"))
    for attr, stem, what, y in lines:
        # Rounds share one scale: how far right a curve ends is the comparison. Time and
        # bytes get each panel its own: a fast link's curve is not squashed against the
        # left edge by a slow one's.
        fig, panels = _panel_grid(plt, len(combos), sharex=attr == "rounds")
        for ax, combo in zip(panels, combos):
            for algo in algos:
                runs = [r for r in data.runs if r.algorithm == algo and matches(r, combo) and len(r.curve)]
                if not runs:
                    continue
                curves = [(getattr(r.curve, attr), (r.curve.accuracy * 100 if y == "accuracy" else r.curve.loss))
                          for r in runs]
                x, mean, low, high = spread(curves)
                # Markers where points are few: evaluations at one instant (CO-OP's, on a
                # clock that stood still) make a line of no length, which draws nothing.
                ax.plot(x, mean, color=colors[algo], linewidth=1.6, marker="o" if len(x) < 25 else None,
                        markersize=3, linestyle="-" if all(r.status == "completed" for r in runs) else ":")
                if len(runs) > 1:
                    ax.fill_between(x, low, high, color=colors[algo], alpha=0.2, linewidth=0)
            ax.set_title(", ".join(f"{short(k)} = {fmt(v)}" for k, v in combo.items()) or "all points")
            ax.set_xlabel(x_label(attr, data.runs))
            if attr == "rounds":
                _integer_ticks(ax)
            ax.grid(True, alpha=0.3)
            if y == "accuracy":
                ax.set_ylim(lo, hi)
        for ax in panels[:: min(len(panels), 3) if len(panels) != 4 else 2]:
            ax.set_ylabel("test accuracy (%)" if y == "accuracy" else "test loss")
        _figure_legend(fig, colors, algos)
        fig.suptitle(f"Test {y} against {what}"
                     + (f" (line: mean of {' and '.join(short(k) + 's' for k in reps)}; band: min to max)"
                        if reps else "")
                     + (f"\n(dotted: {unfinished} run(s) not completed)" if unfinished else ""))
        paths += save_figure(fig, out, f"{y}-vs-{stem}", formats)
        plt.close(fig)
    return paths + plot_sweep_rounds(data, out, formats)


def plot_sweep_rounds(data: SweepData, out: Path, formats) -> list[Path]:
    """Each round's emulated duration (mean over repetitions, a line per algorithm), and
    the round-based algorithms' participation by outcome (mean counts, stacked), a panel
    per condition (and algorithm)."""
    plt = pyplot()
    combos = combinations(data, condition_axes(data))
    algos = algorithms(data)
    colors = _colors(algos)
    paths = []
    timed = [r for r in data.runs if r.series is not None and np.isfinite(r.series.duration_s).any()]
    if timed:
        # Each panel its own y: a slow link's rounds would otherwise squash a fast one's,
        # and each axis is fitted to its whole band (a limit fixed while panels were still
        # being drawn once cut off the slowest).
        fig, panels = _panel_grid(plt, len(combos), sharex=True, sharey=False)
        shown = set()  # asynchronous rules have no rounds to time: the legend names the rest
        for ax, combo in zip(panels, combos):
            top = 0.0
            for algo in algos:
                runs = [r for r in timed if r.algorithm == algo and matches(r, combo)]
                if runs:
                    shown.add(algo)
                    x, mean, low, high = spread([(r.series.rounds, r.series.duration_s) for r in runs])
                    ax.plot(x, mean, color=colors[algo], linewidth=1.4, marker="o" if len(x) < 25 else None,
                            markersize=3)
                    if len(runs) > 1:
                        ax.fill_between(x, low, high, color=colors[algo], alpha=0.2, linewidth=0)
                    top = max(top, float(np.nanmax(high)))
            ax.set_title(", ".join(f"{short(k)} = {fmt(v)}" for k, v in combo.items()) or "all points")
            ax.set_xlabel(x_label("rounds", timed))
            _integer_ticks(ax)
            ax.set_ylim(0, top * 1.05 or 1.0)
            ax.grid(True, alpha=0.3)
            ax.set_ylabel("emulated seconds")
        _figure_legend(fig, colors, [a for a in algos if a in shown])
        fig.suptitle("How long each round took (emulated; mean, band: min to max)")
        paths += save_figure(fig, out, "round-duration", formats)
        plt.close(fig)
    counted = [r for r in data.runs if r.series is not None and r.series.outcomes]
    cells = [(combo, algo) for combo in combos for algo in algos
             if any(r.algorithm == algo and matches(r, combo) for r in counted)]
    if cells:
        fig, panels = _panel_grid(plt, len(cells), 4.6, 3.0)
        sets = []
        for ax, (combo, algo) in zip(panels, cells):
            runs = [r for r in counted if r.algorithm == algo and matches(r, combo)]
            rounds = np.unique(np.concatenate([r.series.rounds for r in runs]))
            means = {}
            for name in OUTCOME_COLORS:
                table = np.full((len(runs), len(rounds)), np.nan)
                for i, r in enumerate(runs):
                    if name in r.series.outcomes:
                        table[i, np.searchsorted(rounds, r.series.rounds)] = r.series.outcomes[name]
                with np.errstate(all="ignore"):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        means[name] = np.nan_to_num(np.nanmean(table, axis=0))
            sets.append(means)
            _stacked_outcomes(ax, rounds, means)
            title = ", ".join(f"{short(k)} = {fmt(v)}" for k, v in combo.items())
            ax.set_title((title + "; " if title else "") + algorithm_label(algo), fontsize=9)
            ax.set_xlabel("round")
            _integer_ticks(ax)
            ax.grid(True, axis="y", alpha=0.3)
        panels[0].set_ylabel("selected clients (mean)")
        _outcome_legend(fig, sets)
        fig.suptitle("What happened to each round's selected clients (mean over repetitions)")
        paths += save_figure(fig, out, "participation", formats)
        plt.close(fig)
    return paths


def _figure_legend(fig, colors, algos):
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[a], linewidth=2, label=algorithm_label(a)) for a in algos]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)


METRICS = {
    "final_accuracy": ("final test accuracy (%)", "final accuracy"),
    "tt_emulated_s": ("emulated time to reach {target:g}% accuracy (s)", "time to {target:g}%"),
}


def plot_sweep_axes(data: SweepData, out: Path, formats=("png", "svg")) -> list[Path]:
    """For each condition axis and metric: the metric against the axis, one line per
    algorithm (mean over repetitions, bars from min to max), one panel per value of the
    other conditions."""
    plt = pyplot()
    conds = condition_axes(data)
    algos = algorithms(data)
    colors = _colors(algos)
    paths = []
    for axis in conds:
        values = axis_values(data, axis)
        others = combinations(data, [c for c in conds if c != axis])
        for name, (ylabel, what) in METRICS.items():
            if name.startswith("tt_") and not data.target:
                continue
            ylabel = ylabel.format(target=data.target * 100)
            fig, panels = _panel_grid(plt, len(others), 4.2, 3.4)
            partial, none_reached, top = 0, 0, 0.0  # cells labelled "k of n"; cells marked ×
            for ax, combo in zip(panels, others):
                for j, algo in enumerate(algos):
                    xs, ys, lo, hi = [], [], [], []
                    for i, v in enumerate(values):
                        cell = Cell([metric(r, name, data.target) for r in data.completed if r.algorithm == algo
                                     and matches(r, {**combo, axis: v})])
                        # Algorithms side by side, so their bars do not hide each other.
                        x = i + (j - (len(algos) - 1) / 2) * 0.06
                        if cell.values and cell.mean() is None:  # no repetition got there
                            none_reached += 1
                            ax.plot([x], [0.96], marker="x", markersize=8, color=colors[algo], linestyle="none",
                                    transform=ax.get_xaxis_transform(), clip_on=False)
                            continue
                        if cell.mean() is None:
                            continue
                        xs.append(x)
                        top = max(top, *cell.reached)
                        ys.append(cell.mean())
                        lo.append(cell.mean() - min(cell.reached))
                        hi.append(max(cell.reached) - cell.mean())
                        if name.startswith("tt_") and len(cell.reached) < len(cell.values):
                            # The mean is of the repetitions that got there: say how many did.
                            partial += 1
                            ax.annotate(f"{len(cell.reached)} of {len(cell.values)}", (x, cell.mean()),
                                        textcoords="offset points", xytext=(6, 4), fontsize=8, color=colors[algo])
                    ax.errorbar(xs, ys, yerr=[lo, hi], color=colors[algo], marker="o", capsize=3, linewidth=1.6,
                                label=algorithm_label(algo))
                ax.set_xticks(range(len(values)), [fmt(v) for v in values])
                ax.set_xlim(-0.5, len(values) - 0.5)
                ax.set_xlabel(short(axis) + _unit(axis, values))
                ax.set_title(", ".join(f"{short(k)} = {fmt(v)}" for k, v in combo.items()) or "")
                ax.grid(True, alpha=0.3)
            if name.startswith("tt_"):
                # A duration reads against zero; headroom keeps the × marks above the data.
                panels[0].set_ylim(0, top * 1.2 or 1.0)
            for ax in panels[:: min(len(panels), 3) if len(panels) != 4 else 2]:
                ax.set_ylabel(ylabel)
            _figure_legend(fig, colors, algos)
            reps = [k for k in data.axes if k in REPEAT_KEYS]
            note = f"mean of {', '.join(short(k) + 's' for k in reps)}; bars: min to max" if reps else ""
            # Explain only the marks drawn.
            if partial:
                note += f"{'; ' if note else ''}k of n: of the repetitions that reached it (the mean is of those)"
            if none_reached:
                note += f"{'; ' if note else ''}×: none reached it"
            fig.suptitle(f"{what.format(target=data.target * 100).capitalize()} against {short(axis)}"
                         + (f"\n({note})" if note else ""))
            paths += save_figure(fig, out, f"{name.replace('_', '-')}-vs-{_slug(axis)}", formats)
            plt.close(fig)
    return paths


def _unit(key: str, values: list) -> str:
    if key.endswith("bandwidth"):
        # "10Mbit" carries its unit; a bare number is bytes/s in the config.
        return " (bytes/s)" if all(isinstance(v, (int, float)) for v in values) else ""
    if key.endswith("per_round"):
        return " (probability)"
    return ""


def _slug(key: str) -> str:
    return key.replace(".", "-").replace("_", "-")
