"""`fedemu compare`: Nilsson et al.'s (2018) comparison of algorithms, the Bayesian
correlated t-test (Corani and Benavoli 2015) from the `baycomp` package, as the paper used.

Runs are grouped by a config key (default algorithm.name) and paired by repetition:
(run.seed, data.fold), i.e. the same k-fold split of the same cross-validation
iteration. For each pair of groups A, B the test gives a Student posterior of the mean
accuracy difference B - A, corrected for the overlap of k-fold training sets
(Nadeau-Bengio), and three probabilities: A practically better (difference < -rope),
practically equivalent (within the rope), B practically better (> rope). A region
holding at least ``decide`` of the posterior (the paper: 95%) fills the table with
+ (row better), - (row worse) or = (equivalent); otherwise "?".

Besides final and best accuracy, the metric can be what network studies ask: emulated
time, MB uploaded or rounds to a target accuracy (``TARGET_METRICS``; lower is better),
read from each run's curve. A run that never reached the target has no such figure: by
default the comparison refuses and names it; ``unreached="drop"`` leaves its pair out,
``unreached="budget"`` counts what it spent in all (a lower bound on its true figure).
"""
from __future__ import annotations

import itertools
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import config as configuration
from .labels import algorithm_label, fmt, short
from .report_figures import pyplot, save_figure
from .report_tables import markdown_table
from .results import (
    ALGORITHM_KEY, REPEAT_KEYS, VIEW_KEYS, RunRecord, default_folder, flat, is_sweep, load_record, load_run, load_sweep,
    time_to_target,
)


class CompareError(ValueError):
    """Runs that cannot be compared; the message says why and what to do."""


ACCURACY_METRICS = ("final_accuracy", "best_accuracy")
# metric -> (the curve's x attribute, what it is, its unit): lower is better.
TARGET_METRICS = {
    "time_to_target": ("emulated_s", "emulated time to {target}", "s"),
    "bytes_to_target": ("mb_up", "MB uploaded to {target}", "MB"),
    "rounds_to_target": ("rounds", "rounds to {target}", "rounds"),
}
METRICS = (*ACCURACY_METRICS, *TARGET_METRICS)
UNREACHED = ("error", "drop", "budget")


@dataclass
class Result:
    a: str
    b: str
    mean_a: float
    mean_b: float
    p_a: float      # A practically better
    p_rope: float   # practically equivalent
    p_b: float      # B practically better
    mean: float     # posterior mean of B - A
    var: float
    df: float
    n: int
    runs: int
    rope: float = 0.01  # in the metric's unit


def collect(paths: list[str | Path], where: list[str] = ()) -> list[RunRecord]:
    runs: list[RunRecord] = []
    for p in map(Path, paths):
        if is_sweep(p):
            data = load_sweep(p)
            runs += [r for r in data.runs]
        elif (p / "config.toml").exists():
            runs.append(load_run(p))
        elif p.is_file() and p.suffix == ".json":
            runs.append(load_record(p))
        else:
            raise CompareError(f"{p} is neither a run directory, a sweep directory nor a run record (.json)")
    for cond in where:
        key, sep, raw = cond.partition("=")
        if not sep:
            raise CompareError(f"--where {cond!r} must look like section.key=value")
        runs = [r for r in runs if _same(flat(r.config).get(key.strip()), raw.strip())]
        if not runs:
            raise CompareError(f"no run has {key.strip()} = {raw.strip()}")
    return runs


def _same(value, raw: str) -> bool:
    try:
        parsed = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = raw
    if isinstance(value, (int, float)) and isinstance(parsed, (int, float)):
        return float(value) == float(parsed)
    return value == parsed


def metric_value(run: RunRecord, metric: str, target: float | None, unreached: str = "error") -> float | None:
    """A run's figure for ``metric``: from its summary (accuracy), or its curve (to a
    target; None for a run that never reached it, with ``unreached="drop"``)."""
    if metric in ACCURACY_METRICS:
        value = (run.summary or {}).get(metric)
        if value is None:
            raise CompareError(f"{run.path}: summary.json has no {metric}")
        return float(value)
    attr = TARGET_METRICS[metric][0]
    if not len(run.curve):
        raise CompareError(f"{run.path}: no evaluations to read {metric} from (a run record keeps no curve)")
    x = getattr(run.curve, attr)
    value = time_to_target(x, run.curve.accuracy, target)
    if value is not None:
        return value
    if unreached == "budget":
        return float(x[-1])
    if unreached == "drop":
        return None
    raise CompareError(f"{run.path} never reached {target * 100:g}% accuracy (best {run.curve.accuracy.max() * 100:.2f}%), "
                       f"so it has no {metric}; lower --target, or say how to count it: --unreached drop "
                       "(leave its pair out) or --unreached budget (what it spent in all: a lower bound)")


def paired(runs: list[RunRecord], by: str, metric: str, target: float | None = None,
           unreached: str = "error") -> tuple[dict[str, dict[tuple, float]], int, int]:
    """{group: {(seed, fold): metric}}, repetitions, folds. Refuses groups whose runs
    differ in anything but the repetition keys, naming the key."""
    if metric not in METRICS:
        raise CompareError(f"--metric {metric!r}: choose one of {', '.join(METRICS)}")
    if metric in TARGET_METRICS and not (target and 0 < target <= 1):
        raise CompareError(f"--metric {metric} needs a target accuracy in (0, 1]: give --target (a sweep's "
                           "sweep.target or the runs' run.target_accuracy serve when set)")
    if unreached not in UNREACHED:
        raise CompareError(f"--unreached {unreached!r}: choose one of {', '.join(UNREACHED)}")
    skipped = [r for r in runs if r.status != "completed"]
    runs = [r for r in runs if r.status == "completed"]
    if not runs:
        raise CompareError("no completed run to compare" + (f" ({len(skipped)} not completed)" if skipped else ""))
    groups: dict[str, list[RunRecord]] = {}
    for r in runs:
        groups.setdefault(fmt(flat(r.config).get(by)), []).append(r)
    if len(groups) < 2:
        raise CompareError(f"every run has {by} = {next(iter(groups))}: nothing to compare; "
                           f"group by another key with --by")
    out: dict[str, dict[tuple, float]] = {}
    for name, members in groups.items():
        flats = [flat(r.config) for r in members]
        # What cannot change a run (another algorithm's option, an IID run's shard order).
        ineffective = set.intersection(*(configuration.ineffective_keys(r.config) for r in members))
        for key in flats[0].keys() | set().union(*flats):
            if (key in REPEAT_KEYS or key == by or key in ineffective
                    or key in ("run.out", "run.workers", "run.torch_threads", "data.cache_dir", *VIEW_KEYS)):
                continue
            values = {json.dumps(f.get(key), sort_keys=True) for f in flats}
            if len(values) > 1:
                raise CompareError(
                    f"the {name} runs differ in {key} ({', '.join(sorted(values))}), not only in seed and fold; "
                    f"compare one condition at a time with --where {key}=VALUE")
        cells: dict[tuple, float] = {}
        for r, f in zip(members, flats):
            rep = (f.get("run.seed"), f.get("data.fold", 0))
            if rep in cells:
                raise CompareError(f"two {name} runs have seed {rep[0]} and fold {rep[1]}: {r.path}")
            value = metric_value(r, metric, target, unreached)
            if value is not None:
                cells[rep] = value
        out[name] = cells
    if unreached == "drop":  # a pair counts only where every group reached the target
        common = set.intersection(*(set(c) for c in out.values()))
        out = {name: {k: v for k, v in cells.items() if k in common} for name, cells in out.items()}
    keys = [set(c) for c in out.values()]
    common = set.intersection(*keys)
    if keys and any(k != common for k in keys):
        missing = {name: sorted(set().union(*keys) - set(c)) for name, c in out.items() if set(c) != set().union(*keys)}
        raise CompareError("the groups were not run on the same (seed, fold) pairs; missing: "
                           + "; ".join(f"{n}: {m}" for n, m in missing.items()))
    if len(common) < 2:
        raise CompareError(f"the t-test needs at least 2 paired runs per group, have {len(common)}")
    seeds = {s for s, _ in common}
    folds = {f for _, f in common}
    if len(common) != len(seeds) * len(folds):
        raise CompareError(f"the (seed, fold) pairs are not a full grid: {sorted(common)}")
    return out, len(seeds), len(folds)


def complete_repetitions(pairs: set[tuple[int, int]], folds: set[int]) -> set[tuple[int, int]]:
    """The (seed, fold) pairs that form a full grid, as the correlated t-test's correction
    assumes (every repetition on the same k folds): the seeds that have all of ``folds``
    (the design's), or, while none has, the one seed with the most folds (ties: the
    lowest), a partial repetition whose posterior baycomp widens (it takes its folds for
    k). A later repetition under way is left out until it is complete."""
    by_seed: dict[int, set[int]] = {}
    for seed, fold in pairs:
        by_seed.setdefault(seed, set()).add(fold)
    complete = [seed for seed, have in by_seed.items() if have >= folds]
    if complete:
        return {(seed, fold) for seed in complete for fold in folds}
    if not by_seed:
        return set()
    seed = min(by_seed, key=lambda s: (-len(by_seed[s]), s))
    return {(seed, fold) for fold in by_seed[seed]}


def test(x: np.ndarray, y: np.ndarray, rope: float, runs: int) -> tuple[float, float, float, object]:
    """baycomp's correlated t-test on paired scores; (P(x better), P(rope), P(y better), posterior)."""
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    from baycomp import CorrelatedTTest

    posterior = CorrelatedTTest(x, y, rope=rope, runs=runs)
    p_left, p_rope, p_right = (float(p) for p in posterior.probs())
    # baycomp's difference is y - x: left of the rope is where x is better.
    return p_left, p_rope, p_right, posterior


def compare(runs: list[RunRecord], by: str = ALGORITHM_KEY, metric: str = "final_accuracy",
            rope: float | None = 0.01, target: float | None = None,
            unreached: str = "error") -> tuple[list[Result], list[str], str]:
    """Every pair of groups; returns (results, group names, a note on the design).
    ``rope`` is in the metric's unit; None: 0.01 for accuracy, else 1% of the mean."""
    groups, reps, folds = paired(runs, by, metric, target, unreached)
    names = list(groups)
    if rope is None:
        values = [v for cells in groups.values() for v in cells.values()]
        rope = 0.01 if metric in ACCURACY_METRICS else 0.01 * abs(float(np.mean(values)))
    if folds >= 2:
        runs_arg = reps
        note = f"{reps} repetition(s) of {folds}-fold cross-validation"
    else:
        # No folds: every run used the same split. Treating the seeds as folds of one
        # repetition keeps baycomp's correction finite and errs on the wide side.
        runs_arg = 1
        note = (f"{reps} seeds on one train/test split (no k-fold): seeds treated as folds of one "
                "repetition, which widens the posterior")
    order = sorted(groups[names[0]])
    results = []
    for a, b in itertools.combinations(names, 2):
        x = np.array([groups[a][k] for k in order])
        y = np.array([groups[b][k] for k in order])
        pa, pr, pb, post = test(x, y, rope, runs_arg)
        if metric in TARGET_METRICS:  # lower is better: left of the rope is where B is better
            pa, pb = pb, pa
        results.append(Result(a, b, float(x.mean()), float(y.mean()), pa, pr, pb, float(post.mean),
                              float(post.var), float(post.df), len(order), runs_arg, rope))
    return results, names, note


def verdict(result: Result, row: str, decide: float) -> str:
    """+, - or = for ``row`` against the other group of ``result``; ? if undecided."""
    p_row, p_other = (result.p_a, result.p_b) if row == result.a else (result.p_b, result.p_a)
    if p_row >= decide:
        return "+"
    if p_other >= decide:
        return "-"
    if result.p_rope >= decide:
        return "="
    return "?"


def table(results: list[Result], names: list[str], decide: float) -> tuple[list[str], list[list[str]]]:
    lookup = {frozenset((r.a, r.b)): r for r in results}
    head = [""] + [_label(n) for n in names]
    rows = [[_label(row)] + ["·" if row == col else verdict(lookup[frozenset((row, col))], row, decide)
                             for col in names] for row in names]
    return head, rows


def _label(name: str) -> str:
    return algorithm_label(name)


def describe(metric: str, target: float | None = None) -> tuple[str, str, float]:
    """(what the metric is, in words; its unit in tables; the factor from its values to that unit)."""
    if metric in TARGET_METRICS:
        _, what, unit = TARGET_METRICS[metric]
        return what.format(target=f"{target * 100:g}%"), unit, 1.0
    return metric.replace("_", " "), "%", 100.0


def probability_rows(results: list[Result], metric: str, target: float | None = None) -> tuple[list[str], list[list[str]]]:
    what, unit, scale = describe(metric, target)
    head = ["A", "B", f"mean {what} A ({unit})", f"B ({unit})", "P(A better)", "P(equivalent)",
            "P(B better)", "paired runs"]
    rows = [[_label(r.a), _label(r.b), f"{r.mean_a * scale:.2f}", f"{r.mean_b * scale:.2f}", f"{r.p_a:.3f}",
             f"{r.p_rope:.3f}", f"{r.p_b:.3f}", str(r.n)] for r in results]
    return head, rows


def ranking(results: list[Result], names: list[str], metric: str, target: float | None = None) -> str:
    """The groups by their mean, best first."""
    means = {}
    for r in results:
        means[r.a], means[r.b] = r.mean_a, r.mean_b
    what, unit, scale = describe(metric, target)
    lower = metric in TARGET_METRICS
    order = sorted(names, key=lambda n: means[n] if lower else -means[n])
    return (f"Ranked by mean {what} ({'lower' if lower else 'higher'} is better): "
            + ", ".join(f"{_label(n)} {means[n] * scale:.2f} {unit}" for n in order) + ".")


TAIL = 0.01  # the posterior is drawn out to where its density falls below this share of its peak


def tail_halfwidth(df: float, scale: float, share: float = TAIL) -> float:
    """How far from its mean a Student t density (df, scale) falls to ``share`` of its
    peak: (1 + z²/df)^(-(df+1)/2) = share, solved for z. A few degrees of freedom
    (few repetitions) give tails far wider than a normal's ±4 scales."""
    return scale * math.sqrt(df * (share ** (-2.0 / (df + 1.0)) - 1.0))


def plot_posteriors(results: list[Result], rope: float, out: Path, formats=("png", "svg"),
                    metric: str = "final_accuracy", target: float | None = None) -> list[Path]:
    """``posteriors.EXT`` in ``out`` (see posterior_figure); returns their paths."""
    plt = pyplot()
    fig = posterior_figure(results, rope, metric, target)
    paths = save_figure(fig, out, "posteriors", formats)
    plt.close(fig)
    return paths


def posterior_figure(results: list[Result], rope: float, metric: str = "final_accuracy",
                     target: float | None = None):
    """One panel per pair, as the paper's Figure 3: the posterior of B - A in
    percentage points, the rope between two lines, the three probabilities; each
    density drawn out to where it falls below 1% of its peak. Returns the Figure."""
    # lazy: matplotlib and scipy take ~0.5 s to import; only drawing and testing need them
    from scipy import stats

    plt = pyplot()
    what, unit, factor = describe(metric, target)
    unit_words = "percentage points" if unit == "%" else unit
    n = len(results)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows + 0.4), squeeze=False, layout="constrained")
    for extra in axes.flat[n:]:
        extra.set_visible(False)
    for ax, r in zip(axes.flat, results):
        scale = np.sqrt(r.var)
        # Half the share: the ends then lie below 1% of the peak as drawn, not on it.
        reach = tail_halfwidth(r.df, scale, TAIL / 2) if scale else 0.0
        lo = min(r.mean - reach, -1.6 * rope) if scale else min(r.mean, -1.6 * rope) - rope
        hi = max(r.mean + reach, 1.6 * rope) if scale else max(r.mean, 1.6 * rope) + rope
        xs = np.linspace(lo, hi, 400)
        if scale:
            ys = stats.t.pdf(xs, r.df, r.mean, scale)
            ax.plot(xs * factor, ys / factor, color="#2f56e0", linewidth=1.8)
            ax.fill_between(xs * factor, ys / factor, color="#34ccff", alpha=0.5)
        else:  # every paired difference equal: the posterior is a point
            ax.axvline(r.mean * factor, color="#2f56e0", linewidth=2)
        for edge in (-rope, rope):
            ax.axvline(edge * factor, color="#ff8c00", linewidth=1.5, linestyle="--")
        ax.set_xlabel(f"{what} difference {_label(r.b)} − {_label(r.a)} ({unit_words})")
        ax.set_ylabel(f"posterior density (per {'point' if unit == '%' else unit})")
        ax.set_title(f"{_label(r.a)} vs {_label(r.b)}")
        # A lower time is better: B better lies left of the rope; the box goes away from the mass.
        right = r.mean < (lo + hi) / 2
        ax.text(0.98 if right else 0.02, 0.97, f"P({_label(r.a)} better) = {r.p_a:.3f}\nP(equivalent) = {r.p_rope:.3f}\n"
                f"P({_label(r.b)} better) = {r.p_b:.3f}", transform=ax.transAxes, va="top",
                ha="right" if right else "left", fontsize=8.5,
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.85, edgecolor="#bbbbbb"))
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Posterior of the mean difference in {what} (dashed: rope ±{rope * factor:.3g} "
                 f"{'point' + ('s' if rope * factor != 1 else '') if unit == '%' else unit})")
    return fig


def render(results: list[Result], names: list[str], note: str, by: str, metric: str, rope: float,
           decide: float, target: float | None = None) -> str:
    head, rows = probability_rows(results, metric, target)
    thead, trows = table(results, names, decide)
    what, unit, _ = describe(metric, target)
    return "\n".join([
        f"Bayesian correlated t-test on {what} by {short(by)}: {note}; "
        f"rope ±{rope:.4g} ({'accuracy' if unit == '%' else unit}), decided at {decide:g}.", "",
        markdown_table(head, rows), "",
        f"Row against column: + better, - worse, = practically equivalent (a region holds >= {decide:g} "
        "of the posterior), ? undecided.", "",
        markdown_table(thead, trows), "",
        ranking(results, names, metric, target),
    ])


def run(paths: list[str | Path], *, by: str = ALGORITHM_KEY, metric: str = "final_accuracy",
        rope: float | None = None, decide: float = 0.95, where: list[str] = (), out: str | Path | None = None,
        formats=("png", "svg"), target: float | None = None, unreached: str = "error") -> tuple[str, Path]:
    """compare.md and the posterior plots for the runs in ``paths``; returns (text, folder).
    ``rope`` in the metric's unit (None: 0.01 accuracy, or 1% of the mean time or bytes);
    ``target``: the accuracy of a *_to_target metric (None: the sweep's, or the runs'
    run.target_accuracy)."""
    if rope is not None and (rope < 0 or metric in ACCURACY_METRICS and rope >= 1):
        raise CompareError(f"--rope {rope} must be >= 0 (in the metric's unit; accuracy: below 1, 0.01 is one point)")
    if not 0.5 < decide <= 1:
        raise CompareError(f"--decide {decide} must be in (0.5, 1]")
    if target is None and metric in TARGET_METRICS:
        target = _default_target(paths)
    results, names, note = compare(collect(paths, where), by, metric, rope, target, unreached)
    rope = results[0].rope
    text = render(results, names, note, by, metric, rope, decide, target)
    out = Path(out) if out is not None else default_folder(paths, "compare")
    out.mkdir(parents=True, exist_ok=True)
    figures = plot_posteriors(results, rope, out, formats, metric, target)
    pngs = [f"![posteriors]({p.name})" for p in figures if p.suffix == ".png"]
    (out / "compare.md").write_text("# fedemu compare\n\n" + text + "\n\n" + "\n".join(pngs) + "\n")
    return text, out


def _default_target(paths: list[str | Path]) -> float | None:
    """The first sweep's target, else the first run's run.target_accuracy (0: none)."""
    for p in map(Path, paths):
        if is_sweep(p):
            target = load_sweep(p).target
        elif (p / "config.toml").exists():
            target = load_run(p).config.get("run", {}).get("target_accuracy", 0.0)
        else:
            continue
        if target:
            return float(target)
    return None
