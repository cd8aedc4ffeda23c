"""`fedemu report`: figures and Markdown tables (curves, time to accuracy, final and best
accuracy per condition) from run directories and sweeps, as ``results.py`` reads them.
matplotlib is imported only when drawing.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .labels import algorithm_label, fmt, short
from .results import (ALGORITHM_KEY, REPEAT_KEYS, X_AXES, ReportError, Run, SweepData, differing_keys, flat,
                      is_sweep, load_run, load_sweep, time_to_target, times_to_target)



# --- sweeps -----------------------------------------------------------------------------


# --- figures ----------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "legend.fontsize": 9,
                         "svg.hashsalt": "fedemu", "svg.fonttype": "none"})
    return plt


def _save(fig, out: Path, stem: str, formats: tuple[str, ...]) -> list[Path]:
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
    plt = _pyplot()
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
        paths += _save(fig, out, f"accuracy-vs-{stem}", formats)
        plt.close(fig)
    return paths


def _conditions(data: SweepData) -> list[str]:
    """The axes that are conditions: not the algorithm, not repetitions, and of zipped
    axes only the first (the others move with it, e.g. a learning rate per algorithm)."""
    return [g[0] for g in data.groups
            if ALGORITHM_KEY not in g and g[0] not in REPEAT_KEYS]


def _value_key(v) -> str:
    return json.dumps(v, sort_keys=True)


def _axis_values(data: SweepData, key: str) -> list:
    seen = {}
    for r in data.runs:
        if key in r.params:
            seen.setdefault(_value_key(r.params[key]), r.params[key])
    return list(seen.values())


def _panel_grid(plt, n: int, width: float = 4.6, height: float = 3.4, sharex: bool = False):
    cols = min(n, 3) if n != 4 else 2
    rows = math.ceil(n / cols)
    # Constrained layout keeps titles, labels and the figure legend from overlapping.
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.8), squeeze=False, sharey=True,
                             sharex=sharex, layout="constrained")
    for extra in axes.flat[n:]:
        extra.set_visible(False)
    return fig, list(axes.flat[:n])


def _combos(data: SweepData, keys: list[str]) -> list[dict]:
    combos = [{}]
    for k in keys:
        combos = [{**c, k: v} for c in combos for v in _axis_values(data, k)]
    return combos


def _matches(run: Run, combo: dict) -> bool:
    return all(_value_key(run.params.get(k)) == _value_key(v) for k, v in combo.items())


def _algorithms(data: SweepData) -> list[str]:
    return list(dict.fromkeys(r.algorithm for r in data.runs))


def plot_sweep_curves(data: SweepData, out: Path, formats=("png", "svg")) -> list[Path]:
    """Accuracy curves: one panel per condition, one colour per algorithm, one thin line
    per repetition (seed, fold)."""
    plt = _pyplot()
    conds = _conditions(data)
    combos = _combos(data, conds)
    algos = _algorithms(data)
    colors = _colors(algos)
    lo, hi = _acc_limits([r.curve.accuracy for r in data.runs])
    paths = []
    for attr, xlabel, stem, what in X_AXES:
        # One x scale for every panel: how far right a curve ends is the comparison.
        fig, panels = _panel_grid(plt, len(combos), sharex=True)
        for ax, combo in zip(panels, combos):
            drawn = set()
            for r in data.runs:
                if not _matches(r, combo) or not len(r.curve):
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
        _figure_legend(fig, panels, colors, algos, plt)
        reps = [k for k in data.axes if k in REPEAT_KEYS]
        unfinished = len(data.runs) - len(data.completed)
        fig.suptitle(f"Test accuracy against {what}"
                     + (f" (one line per {' and '.join(short(k) for k in reps)})" if reps else "")
                     + (f"\n(dotted: {unfinished} run(s) not completed)" if unfinished else ""))
        paths += _save(fig, out, f"accuracy-vs-{stem}", formats)
        plt.close(fig)
    return paths


def _figure_legend(fig, panels, colors, algos, plt):
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=colors[a], linewidth=2, label=algorithm_label(a)) for a in algos]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)


@dataclass
class Cell:
    """The repetitions of one (condition, algorithm): mean, min and max of a metric."""

    values: list[float | None]

    @property
    def reached(self) -> list[float]:
        return [v for v in self.values if v is not None]

    def mean(self) -> float | None:
        return float(np.mean(self.reached)) if self.reached else None


def metric(run: Run, name: str, target: float) -> float | None:
    if name == "final_accuracy":
        v = run.final_accuracy()
        return None if v is None else v * 100
    if name == "best_accuracy":
        v = run.best_accuracy()
        return None if v is None else v * 100
    attr = name.removeprefix("tt_")
    return time_to_target(getattr(run.curve, attr), run.curve.accuracy, target)


METRICS = {
    "final_accuracy": ("final test accuracy (%)", "final accuracy"),
    "tt_emulated_s": ("emulated time to reach {target:g}% accuracy (s)", "time to {target:g}%"),
}


def plot_sweep_axes(data: SweepData, out: Path, formats=("png", "svg")) -> list[Path]:
    """For each condition axis and metric: the metric against the axis, one line per
    algorithm (mean over repetitions, bars from min to max), one panel per value of the
    other conditions."""
    plt = _pyplot()
    conds = _conditions(data)
    algos = _algorithms(data)
    colors = _colors(algos)
    paths = []
    for axis in conds:
        values = _axis_values(data, axis)
        others = _combos(data, [c for c in conds if c != axis])
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
                                     and _matches(r, {**combo, axis: v})])
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
            _figure_legend(fig, panels, colors, algos, plt)
            reps = [k for k in data.axes if k in REPEAT_KEYS]
            note = f"mean of {', '.join(short(k) + 's' for k in reps)}; bars: min to max" if reps else ""
            if missing and name.startswith("tt_"):
                note += f"{'; ' if note else ''}×: no run reached it"
            fig.suptitle(f"{what.format(target=data.target * 100).capitalize()} against {short(axis)}"
                         + (f"\n({note})" if note else ""))
            paths += _save(fig, out, f"{name.replace('_', '-')}-vs-{_slug(axis)}", formats)
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


# --- tables -----------------------------------------------------------------------------


def _cell(v, digits: int = 2) -> str:
    if v is None:
        return "–"
    return f"{v:.{digits}f}"


def run_rows(runs: list[Run], target: float, keys: list[str]) -> list[list[str]]:
    rows = []
    for r in runs:
        tt = times_to_target(r.curve, target) if target else {}
        final, best = r.final_accuracy(), r.best_accuracy()
        rows.append([*(fmt(r.params.get(k, flat(r.config).get(k))) for k in keys), r.status,
                     str(int(r.curve.rounds[-1])) if len(r.curve) else "0",
                     _cell(final * 100 if final is not None else None), _cell(best * 100 if best is not None else None),
                     _cell(r.curve.mb_up[-1] if len(r.curve) else None, 1),
                     _cell(r.curve.emulated_s[-1] if len(r.curve) else None, 1),
                     *([_cell(tt["rounds"], 1), _cell(tt["emulated_s"], 1), _cell(tt["mb_up"], 1)] if target else [])])
    return rows


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _run_head(keys: list[str], target: float) -> list[str]:
    head = [short(k) for k in keys] + ["status", "rounds", "final acc (%)", "best acc (%)", "MB up", "emulated s"]
    if target:
        t = f"{target * 100:g}%"
        head += [f"rounds to {t}", f"emulated s to {t}", f"MB up to {t}"]
    return head


def summary_rows(data: SweepData) -> tuple[list[str], list[list[str]]]:
    """One row per (condition, algorithm): means over repetitions."""
    conds = _conditions(data)
    head = [short(k) for k in conds] + ["algorithm", "runs", "final acc (%)", "best acc (%)"]
    if data.target:
        head += [f"reached {data.target * 100:g}%", f"emulated s to {data.target * 100:g}%"]
    rows = []
    for combo in _combos(data, conds):
        for algo in _algorithms(data):
            runs = [r for r in data.completed if r.algorithm == algo and _matches(r, combo)]
            if not runs:
                continue
            row = [*(fmt(v) for v in combo.values()), algorithm_label(algo), str(len(runs)),
                   _cell(Cell([metric(r, "final_accuracy", 0) for r in runs]).mean()),
                   _cell(Cell([metric(r, "best_accuracy", 0) for r in runs]).mean())]
            if data.target:
                cell = Cell([metric(r, "tt_emulated_s", data.target) for r in runs])
                row += [f"{len(cell.reached)}/{len(runs)}", _cell(cell.mean(), 1)]
            rows.append(row)
    return head, rows


# --- the command ------------------------------------------------------------------------


def report(paths: list[str | Path], out: str | Path | None = None, target: float | None = None,
           formats: tuple[str, ...] = ("png", "svg")) -> Path:
    """Write figures and report.md for runs and/or sweeps; returns the report folder."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ReportError("give at least one run directory or sweep directory")
    for p in paths:
        if not p.is_dir():
            raise ReportError(f"{p} does not exist or is not a directory")
        if not is_sweep(p) and not (p / "config.toml").exists():
            raise ReportError(f"{p} is neither a run directory (config.toml) nor a sweep directory (sweep.db)")
    if out is None:
        out = paths[0] / "report" if len(paths) == 1 and is_sweep(paths[0]) else Path("report")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# fedemu report", ""]
    sweeps = [p for p in paths if is_sweep(p)]
    runs = [load_run(p) for p in paths if not is_sweep(p)]
    for s in sweeps:
        data = load_sweep(s)
        if target is not None:
            data.target = target
        sub = out if len(sweeps) == 1 and not runs else out / s.name
        sub.mkdir(parents=True, exist_ok=True)
        md += _sweep_section(data, sub, out, formats)
    if runs:
        tgt = target if target is not None else max((r.config.get("run", {}).get("target_accuracy", 0) for r in runs),
                                                     default=0)
        sub = out if not sweeps else out / "runs"
        sub.mkdir(parents=True, exist_ok=True)
        md += _runs_section(runs, tgt, sub, out, formats)
    (out / "report.md").write_text("\n".join(md) + "\n")
    return out


def _images(paths: list[Path], root: Path) -> list[str]:
    """Markdown image links: the PNG of each figure, or its first format if no PNG."""
    first: dict[str, Path] = {}
    for p in paths:
        if p.stem not in first or p.suffix == ".png":
            first[p.stem] = p
    return [f"![{p.stem}]({p.relative_to(root)})" for p in first.values()]


def _runs_section(runs: list[Run], target: float, sub: Path, root: Path, formats) -> list[str]:
    keys = differing_keys([r.config for r in runs])
    md = [f"## {len(runs)} run(s)", ""]
    figures = plot_runs(runs, sub, formats) if any(len(r.curve) for r in runs) else []
    head = ["run", *_run_head(keys, target)]
    rows = [[r.path.name, *row] for r, row in zip(runs, run_rows(runs, target, keys))]
    md += [markdown_table(head, rows), ""]
    if target:
        md += [f"Time to {target * 100:g}% accuracy: on the best-so-far curve, interpolated linearly "
               "between evaluations; – where it was never reached.", ""]
    return md + _images(figures, root) + [""]


def _sweep_section(data: SweepData, sub: Path, root: Path, formats) -> list[str]:
    counts: dict[str, int] = {}
    for row in data.rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    md = [f"## Sweep {data.path.name}", "",
          f"{len(data.rows)} points ({', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}); "
          f"axes: {', '.join(f'`{a}`' for a in data.axes)}.", ""]
    if not data.runs:
        return md + ["No point has a run directory yet.", ""]
    figures = plot_sweep_curves(data, sub, formats) + plot_sweep_axes(data, sub, formats)
    head, rows = summary_rows(data)
    reps = [k for k in data.axes if k in REPEAT_KEYS]
    md += [f"### Per condition and algorithm{' (mean over ' + ', '.join(short(k) + 's' for k in reps) + ')' if reps else ''}"
           + ", completed runs only",
           "", markdown_table(head, rows), ""]
    md += _images(figures, root) + [""]
    md += ["### Every point", "", markdown_table(_run_head(data.axes, data.target),
                                                 run_rows(data.runs, data.target, data.axes)), ""]
    if data.target:
        md += [f"Time to {data.target * 100:g}% accuracy: on the best-so-far curve, interpolated linearly "
               "between evaluations; – where it was never reached.", ""]
    return md
