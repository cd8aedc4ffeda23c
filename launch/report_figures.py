"""The report's figures: accuracy curves of runs and of a sweep's points, and a sweep's
metrics against each condition axis; with matplotlib set up for files (also used by
compare and the benchmarks). matplotlib is imported only when drawing."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .labels import algorithm_label, fmt, short
from .report_groups import Cell, algorithms, axis_values, combinations, condition_axes, matches, metric
from .results import REPEAT_KEYS, X_AXES, Run, SweepData, differing_keys, flat


def pyplot():
    """matplotlib's pyplot, drawing into files, with the report's fonts and stable SVG ids."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
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


def plot_runs(runs: list[Run], out: Path, formats=("png", "svg"), title: str = "") -> list[Path]:
    """One figure per x axis, one line per run, labelled by what differs."""
    plt = pyplot()
    keys = differing_keys([r.config for r in runs])
    labels = []
    for r in runs:
        label = ", ".join(f"{short(k)}={fmt(flat(r.config).get(k))}" for k in keys) if keys else r.path.name
        if r.summary is None:
            label += " (in progress)"
        labels.append(label)
    colors = _colors(labels)
    lo, hi = _acc_limits([r.curve.accuracy for r in runs])
    paths = []
    for attr, xlabel, stem, what in X_AXES:
        fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
        for r, label in zip(runs, labels):
            x = getattr(r.curve, attr)
            ax.plot(x, r.curve.accuracy * 100, color=colors[label], label=label, linewidth=1.6,
                    marker="o" if len(x) < 25 else None, markersize=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(lo, hi)
        ax.grid(True, alpha=0.3)
        ax.set_title(title or f"Test accuracy against {what}")
        if len(runs) <= 12:
            ax.legend(loc="lower right")
        paths += save_figure(fig, out, f"accuracy-vs-{stem}", formats)
        plt.close(fig)
    return paths


def _panel_grid(plt, n: int, width: float = 4.6, height: float = 3.4, sharex: bool = False):
    cols = min(n, 3) if n != 4 else 2
    rows = math.ceil(n / cols)
    # Constrained layout keeps titles, labels and the figure legend from overlapping.
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.8), squeeze=False, sharey=True,
                             sharex=sharex, layout="constrained")
    for extra in axes.flat[n:]:
        extra.set_visible(False)
    return fig, list(axes.flat[:n])


def plot_sweep_curves(data: SweepData, out: Path, formats=("png", "svg")) -> list[Path]:
    """Accuracy curves: one panel per condition, one colour per algorithm, one thin line
    per repetition (seed, fold)."""
    plt = pyplot()
    conds = condition_axes(data)
    combos = combinations(data, conds)
    algos = algorithms(data)
    colors = _colors(algos)
    lo, hi = _acc_limits([r.curve.accuracy for r in data.runs])
    paths = []
    for attr, xlabel, stem, what in X_AXES:
        # One x scale for every panel: how far right a curve ends is the comparison.
        fig, panels = _panel_grid(plt, len(combos), sharex=True)
        for ax, combo in zip(panels, combos):
            drawn = set()
            for r in data.runs:
                if not matches(r, combo) or not len(r.curve):
                    continue
                first = r.algorithm not in drawn
                drawn.add(r.algorithm)
                ax.plot(getattr(r.curve, attr), r.curve.accuracy * 100, color=colors[r.algorithm], alpha=0.8,
                        linewidth=1.3, label=algorithm_label(r.algorithm) if first else None,
                        linestyle="-" if r.status == "completed" else ":")
            ax.set_title(", ".join(f"{short(k)} = {fmt(v)}" for k, v in combo.items()) or "all points")
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            ax.set_ylim(lo, hi)
        for ax in panels[:: min(len(panels), 3) if len(panels) != 4 else 2]:
            ax.set_ylabel("test accuracy (%)")
        _figure_legend(fig, colors, algos)
        reps = [k for k in data.axes if k in REPEAT_KEYS]
        unfinished = len(data.runs) - len(data.completed)
        fig.suptitle(f"Test accuracy against {what}"
                     + (f" (one line per {' and '.join(short(k) for k in reps)})" if reps else "")
                     + (f"\n(dotted: {unfinished} run(s) not completed)" if unfinished else ""))
        paths += save_figure(fig, out, f"accuracy-vs-{stem}", formats)
        plt.close(fig)
    return paths


def _figure_legend(fig, colors, algos):
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
            missing, top = 0, 0.0
            for ax, combo in zip(panels, others):
                for j, algo in enumerate(algos):
                    xs, ys, lo, hi = [], [], [], []
                    for i, v in enumerate(values):
                        cell = Cell([metric(r, name, data.target) for r in data.completed if r.algorithm == algo
                                     and matches(r, {**combo, axis: v})])
                        missing += len(cell.values) - len(cell.reached)
                        # Algorithms side by side, so their bars do not hide each other.
                        x = i + (j - (len(algos) - 1) / 2) * 0.06
                        if cell.values and cell.mean() is None:  # no repetition got there
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
            if missing and name.startswith("tt_"):
                note += f"{'; ' if note else ''}×: no run reached it"
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
