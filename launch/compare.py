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
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import config as configuration
from .labels import algorithm_label, fmt, short
from .report_figures import pyplot, save_figure
from .report_tables import markdown_table
from .results import ALGORITHM_KEY, REPEAT_KEYS, VIEW_KEYS, Run, flat, is_sweep, load_record, load_run, load_sweep


class CompareError(ValueError):
    """Runs that cannot be compared; the message says why and what to do."""


METRICS = ("final_accuracy", "best_accuracy")


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


def collect(paths: list[str | Path], where: list[str] = ()) -> list[Run]:
    runs: list[Run] = []
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
    import tomllib

    try:
        parsed = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = raw
    if isinstance(value, (int, float)) and isinstance(parsed, (int, float)):
        return float(value) == float(parsed)
    return value == parsed


def paired(runs: list[Run], by: str, metric: str) -> tuple[dict[str, dict[tuple, float]], int, int]:
    """{group: {(seed, fold): metric}}, repetitions, folds. Refuses groups whose runs
    differ in anything but the repetition keys, naming the key."""
    if metric not in METRICS:
        raise CompareError(f"--metric {metric!r}: choose one of {', '.join(METRICS)}")
    skipped = [r for r in runs if r.status != "completed"]
    runs = [r for r in runs if r.status == "completed"]
    if not runs:
        raise CompareError("no completed run to compare" + (f" ({len(skipped)} not completed)" if skipped else ""))
    groups: dict[str, list[Run]] = {}
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
            value = (r.summary or {}).get(metric)
            if value is None:
                raise CompareError(f"{r.path}: summary.json has no {metric}")
            cells[rep] = float(value)
        out[name] = cells
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
    from baycomp import CorrelatedTTest

    posterior = CorrelatedTTest(x, y, rope=rope, runs=runs)
    p_left, p_rope, p_right = (float(p) for p in posterior.probs())
    # baycomp's difference is y - x: left of the rope is where x is better.
    return p_left, p_rope, p_right, posterior


def compare(runs: list[Run], by: str = ALGORITHM_KEY, metric: str = "final_accuracy",
            rope: float = 0.01) -> tuple[list[Result], list[str], str]:
    """Every pair of groups; returns (results, group names, a note on the design)."""
    groups, reps, folds = paired(runs, by, metric)
    names = list(groups)
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
        results.append(Result(a, b, float(x.mean()), float(y.mean()), pa, pr, pb, float(post.mean),
                              float(post.var), float(post.df), len(order), runs_arg))
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


def probability_rows(results: list[Result], metric: str) -> tuple[list[str], list[list[str]]]:
    head = ["A", "B", f"mean {metric.replace('_', ' ')} A (%)", "B (%)", "P(A better)", "P(equivalent)",
            "P(B better)", "paired runs"]
    rows = [[_label(r.a), _label(r.b), f"{r.mean_a * 100:.2f}", f"{r.mean_b * 100:.2f}", f"{r.p_a:.3f}",
             f"{r.p_rope:.3f}", f"{r.p_b:.3f}", str(r.n)] for r in results]
    return head, rows


def plot_posteriors(results: list[Result], rope: float, out: Path, formats=("png", "svg")) -> list[Path]:
    """One panel per pair, as the paper's Figure 3: the posterior of B - A in
    percentage points, the rope between two lines, the three probabilities."""
    from scipy import stats

    plt = pyplot()
    n = len(results)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows + 0.4), squeeze=False, layout="constrained")
    for extra in axes.flat[n:]:
        extra.set_visible(False)
    for ax, r in zip(axes.flat, results):
        scale = np.sqrt(r.var)
        lo = min(r.mean - 4 * scale, -1.6 * rope) if scale else min(r.mean, -1.6 * rope) - rope
        hi = max(r.mean + 4 * scale, 1.6 * rope) if scale else max(r.mean, 1.6 * rope) + rope
        xs = np.linspace(lo, hi, 400)
        if scale:
            ys = stats.t.pdf(xs, r.df, r.mean, scale)
            ax.plot(xs * 100, ys / 100, color="#2f56e0", linewidth=1.8)
            ax.fill_between(xs * 100, ys / 100, color="#34ccff", alpha=0.5)
        else:  # every paired difference equal: the posterior is a point
            ax.axvline(r.mean * 100, color="#2f56e0", linewidth=2)
        for edge in (-rope, rope):
            ax.axvline(edge * 100, color="#ff8c00", linewidth=1.5, linestyle="--")
        ax.set_xlabel(f"accuracy difference {_label(r.b)} − {_label(r.a)} (percentage points)")
        ax.set_ylabel("posterior density (per point)")
        ax.set_title(f"{_label(r.a)} vs {_label(r.b)}")
        right = r.mean < (lo + hi) / 2  # the box goes on the side away from the posterior's mass
        ax.text(0.98 if right else 0.02, 0.97, f"P({_label(r.a)} better) = {r.p_a:.3f}\nP(equivalent) = {r.p_rope:.3f}\n"
                f"P({_label(r.b)} better) = {r.p_b:.3f}", transform=ax.transAxes, va="top",
                ha="right" if right else "left", fontsize=8.5,
                bbox=dict(boxstyle="round", facecolor="white", alpha=0.85, edgecolor="#bbbbbb"))
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Posterior of the mean accuracy difference (dashed: rope ±{rope * 100:g} point"
                 f"{'s' if rope * 100 != 1 else ''})")
    paths = save_figure(fig, out, "posteriors", formats)
    plt.close(fig)
    return paths


def render(results: list[Result], names: list[str], note: str, by: str, metric: str, rope: float,
           decide: float) -> str:
    head, rows = probability_rows(results, metric)
    thead, trows = table(results, names, decide)
    return "\n".join([
        f"Bayesian correlated t-test on {metric.replace('_', ' ')} by {short(by)}: {note}; "
        f"rope ±{rope:g} (accuracy), decided at {decide:g}.", "",
        markdown_table(head, rows), "",
        f"Row against column: + better, - worse, = practically equivalent (a region holds >= {decide:g} "
        "of the posterior), ? undecided.", "",
        markdown_table(thead, trows),
    ])


def run(paths: list[str | Path], *, by: str = ALGORITHM_KEY, metric: str = "final_accuracy", rope: float = 0.01,
        decide: float = 0.95, where: list[str] = (), out: str | Path | None = None,
        formats=("png", "svg")) -> tuple[str, Path]:
    if not 0 <= rope < 1:
        raise CompareError(f"--rope {rope} must be in [0, 1) (accuracy units: 0.01 is one point)")
    if not 0.5 < decide <= 1:
        raise CompareError(f"--decide {decide} must be in (0.5, 1]")
    results, names, note = compare(collect(paths, where), by, metric, rope)
    text = render(results, names, note, by, metric, rope, decide)
    if out is None:
        first = Path(paths[0])
        out = first / "compare" if is_sweep(first) else Path("compare")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = plot_posteriors(results, rope, out, formats)
    pngs = [f"![posteriors]({p.name})" for p in figures if p.suffix == ".png"]
    (out / "compare.md").write_text("# fedemu compare\n\n" + text + "\n\n" + "\n".join(pngs) + "\n")
    return text, out
