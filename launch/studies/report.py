"""`fedemu report`: figures and Markdown tables (curves, time to accuracy, final and best
accuracy per condition) from run directories and sweeps, as ``results.py`` reads them,
into a folder with report.md. The figures are drawn in ``report_figures.py``, the tables
made in ``report_tables.py``.
"""
from __future__ import annotations

from pathlib import Path

from .labels import short
from .report_figures import plot_runs, plot_sweep_axes, plot_sweep_curves
from .report_tables import markdown_table, run_head, run_rows, summary_rows
from .results import (REPEAT_KEYS, ReportError, RunRecord, SweepData, default_folder, differing_keys, is_sweep,
                      load_run, load_sweep)


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
    out = Path(out) if out is not None else default_folder(paths, "report")
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


def _runs_section(runs: list[RunRecord], target: float, sub: Path, root: Path, formats) -> list[str]:
    keys = differing_keys([r.config for r in runs])
    md = [f"## {len(runs)} run(s)", ""]
    figures = plot_runs(runs, sub, formats) if any(len(r.curve) for r in runs) else []
    head = ["run", *run_head(keys, target)]
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
    md += ["### Every point", "", markdown_table(run_head(data.axes, data.target),
                                                 run_rows(data.runs, data.target, data.axes)), ""]
    if data.target:
        md += [f"Time to {data.target * 100:g}% accuracy: on the best-so-far curve, interpolated linearly "
               "between evaluations; – where it was never reached.", ""]
    return md
