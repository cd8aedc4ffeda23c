"""Nilsson et al. 2018's Table 1, reproduced: FedAvg, CO-OP, FSVRG and the centralised
baseline on MNIST (2NN), IID and pathological non-IID, repeated 5-fold cross-validation,
compared with the Bayesian correlated t-test (rope +-1 point), in virtual time.

    python bench/nilsson_table1.py                    # run what is missing, then report
    python bench/nilsson_table1.py --iterations 3     # all three repetitions of 5-fold CV
    python bench/nilsson_table1.py --report-only      # the table from what has run so far
    python bench/nilsson_table1.py --report-only --theirs PATH   # their curves too

--theirs names a checkout of their repository (FraunhoferChalmersCentre/
fl-performance-evaluation): the curves then show their cross-validation logs
(benchmark_results/*/cross_validations*/) beside fedemu's, dashed.

Resumable: each run is a directory OUT/<cell>/seed<S>-fold<F>; a completed one is kept,
an unfinished one is run again. Each completed run is also kept as a record in the
repository (bench/results/nilsson-table1/<cell>/seed<S>-fold<F>.json: its config,
summary and accuracy curve), and the report reads the records as well as OUT, so runs
made on machines that are gone still count; a run with a record is not run again. Runs go in the order seed, fold, cell, so a stopped
benchmark has covered every cell on the same folds. Configs are the examples' own
(examples/*-nilsson.toml: their initialisation, CO-OP's over-active rule, E = 5, no
deadline), with data.folds = 5, data.fold, run.seed and data.partition set per run.

The report (OUT/table1.md, printed too): fedemu's Table 1 for each partition beside the
paper's, on the metric the paper's notebook compared (the best held-out accuracy of a
run: `best_accuracy`), then the mean final and best accuracy of every cell beside the
authors' means (their notebooks/cross_validations.ipynb); with --theirs, the best accuracy
at a few upload budgets and each repetition's mean on both sides (how far one
repetition moves); and OUT/curves.png: accuracy against uploads per client, the mean
over folds with the range across them.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FOLDS = 5

# (cell name, example config, algorithm.name, partition)
CELLS = [
    ("fedavg-iid", "fedavg-noniid-nilsson.toml", "fedavg", "iid"),
    ("coop-iid", "coop-noniid-nilsson.toml", "coop", "iid"),
    ("fsvrg-iid", "fsvrg-noniid-nilsson.toml", "fsvrg", "iid"),
    ("fedavg-noniid", "fedavg-noniid-nilsson.toml", "fedavg", "shards"),
    ("coop-noniid", "coop-noniid-nilsson.toml", "coop", "shards"),
    ("fsvrg-noniid", "fsvrg-noniid-nilsson.toml", "fsvrg", "shards"),
    # Centralised training sees no partition: one run per (seed, fold) serves both tables.
    ("centralised", "centralised-nilsson.toml", "centralised", "iid"),
]

# The paper's Table 1 (row against column), the verdicts its notebook's probabilities give.
PAPER_TABLE = {
    "iid": {("fedavg", "coop"): "+", ("fedavg", "fsvrg"): "+", ("fedavg", "centralised"): "=",
            ("coop", "fsvrg"): "=", ("coop", "centralised"): "-", ("fsvrg", "centralised"): "-"},
    "shards": {("fedavg", "coop"): "+", ("fedavg", "fsvrg"): "+", ("fedavg", "centralised"): "-",
               ("coop", "fsvrg"): "+", ("coop", "centralised"): "-", ("fsvrg", "centralised"): "-"},
}
# Mean best held-out accuracy (%) over their 10 cross-validation runs (2 repetitions of
# 5 folds), recomputed from their benchmark_results/*/cross_validations*/ logs.
PAPER_MEANS = {"iid": {"fedavg": 98.08, "coop": 96.78, "fsvrg": 96.83, "centralised": 98.37},
               "shards": {"fedavg": 96.76, "coop": 90.82, "fsvrg": 83.97, "centralised": 98.37}}
ORDER = ("fedavg", "coop", "fsvrg", "centralised")
LABEL = {"fedavg": "FedAvg", "coop": "CO-OP", "fsvrg": "FSVRG", "centralised": "Centr."}
PARTITION = {"iid": "IID", "shards": "non-IID"}


def run_dir(out: Path, cell: str, seed: int, fold: int) -> Path:
    return out / cell / f"seed{seed}-fold{fold}"


def completed(path: Path) -> bool:
    try:
        return json.loads((path / "summary.json").read_text()).get("status") == "completed"
    except (OSError, ValueError):
        return False


RECORDS = ROOT / "bench" / "results" / "nilsson-table1"
# Which k-fold split a run's seed and fold name: the split is drawn from run.seed, and
# drawn differently since the named random streams (c2fe023), so "seed1-fold3" before and
# after are folds of two different repetitions. Only runs of one split pair up.
SPLIT = "named streams"


def record_path(records: Path, cell: str, run: str) -> Path:
    """Where a run of today's split is kept; a run of another split is kept beside it as
    <run>@<split>.json, so the names never collide."""
    return records / cell / f"{run}.json"


def write_record(records: Path, cell: str, path: Path) -> dict:
    """A completed run, kept: its config, summary and curve (uploads per client, accuracy)."""
    import tomllib

    x, y = _curve(path)
    record = {"cell": cell, "run": path.name, "split": SPLIT, "from": "run directory",
              "config": tomllib.loads((path / "config.toml").read_text()),
              "summary": json.loads((path / "summary.json").read_text()),
              "curve": [[round(float(a), 4), float(b)] for a, b in zip(x, y)]}
    target = record_path(records, cell, path.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_records(out: Path, records: Path) -> dict[str, dict[str, dict]]:
    """{cell: {file stem: record}}: the kept records, and OUT's completed runs (recorded
    now if they were not)."""
    found: dict[str, dict[str, dict]] = {cell: {} for cell, *_ in CELLS}
    for cell in found:
        for file in sorted((records / cell).glob("seed*-fold*.json")):
            found[cell][file.stem] = json.loads(file.read_text())
        for path in sorted((out / cell).glob("seed*-fold*")):
            if completed(path) and path.name not in found[cell]:
                found[cell][path.name] = write_record(records, cell, path)
    return found


def launch_and_record(path: Path, records: Path, cell: str, example: str, settings: dict, label: str,
                      workers: int, env: dict | None = None) -> dict:
    """Run one config from scratch into PATH (what an interrupted run left is removed) and
    keep it as a record; stop the benchmark, with the run's stderr, if it fails."""
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "fedemu.launch", "launch", str(EXAMPLES / example), "--out", str(path),
               "--workers", str(workers)]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    started = time.monotonic()
    print(f"{label} ...", end=" ", flush=True)
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    took = time.monotonic() - started
    if done.returncode != 0 or not completed(path):
        print(f"FAILED after {took:.0f} s (rc {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
        raise SystemExit(1)
    record = write_record(records, cell, path)
    summary = record["summary"]
    print(f"final {summary['final_accuracy']:.4f} best {summary['best_accuracy']:.4f} in {took:.0f} s", flush=True)
    return record


def run_missing(out: Path, seeds: list[int], folds: list[int], cells: list[tuple], workers: int,
                records: Path) -> None:
    todo = [(s, f, c) for s in seeds for f in folds for c in cells
            if not completed(run_dir(out, c[0], s, f)) and not record_path(records, c[0], f"seed{s}-fold{f}").exists()]
    print(f"{len(todo)} runs to go in {out}", flush=True)
    for i, (seed, fold, (cell, example, _, partition)) in enumerate(todo, 1):
        settings = {"data.folds": FOLDS, "data.fold": fold, "run.seed": seed, "data.partition": partition,
                    # Their fold notebook sorted (label, image bytes) before cutting shards.
                    "data.shard_order": "pixels"}
        launch_and_record(run_dir(out, cell, seed, fold), records, cell, example, settings,
                          f"[{i}/{len(todo)}] {cell} seed {seed} fold {fold}", workers)


def _runs_for(found: dict[str, dict[str, dict]], partition: str) -> dict[str, list[dict]]:
    cells = {algo: cell for cell, _, algo, part in CELLS if part == partition or algo == "centralised"}
    return {algo: [found[cell][run] for run in sorted(found[cell])] for algo, cell in cells.items()}


def _key(record: dict) -> tuple[str, str]:
    return record.get("split", SPLIT), record["run"]


def _common(runs: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], list[str]]:
    """The runs the t-test pairs: the (seed, fold) pairs every algorithm has, of the one
    split that has the most of them, cut to complete repetitions (a second repetition
    under way would otherwise pass for a 2 x 3-fold design where 5 + 1 runs are); and
    the pairs left out for that."""
    from fedemu.launch.studies.compare import complete_repetitions

    names = [set(map(_key, records)) for records in runs.values()]
    common = set.intersection(*names) if names else set()
    splits = sorted({split for split, _ in common}, key=lambda split: -sum(k[0] == split for k in common))
    common = {k for k in common if splits and k[0] == splits[0]}
    grid = complete_repetitions({_seed_fold(run) for _, run in common}, set(range(FOLDS)))
    pending = sorted((run for _, run in common if _seed_fold(run) not in grid), key=_seed_fold)
    common = {k for k in common if _seed_fold(k[1]) in grid}
    return {algo: sorted((r for r in records if _key(r) in common), key=_key) for algo, records in runs.items()}, pending


def _seed_fold(run: str) -> tuple[int, int]:
    """'seed2-fold0' -> (2, 0)."""
    seed, fold = run.split("-")
    return int(seed.removeprefix("seed")), int(fold.removeprefix("fold"))


def _split_mark(record: dict) -> str:
    return "" if record.get("split", SPLIT) == SPLIT else f", {record['split']}"


def _record_curve(record: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """A record's (uploads per client, accuracy), or None for a run kept without its curve."""
    if not record.get("curve"):
        return None
    points = np.array(record["curve"], dtype=float)
    return points[:, 0], points[:, 1]


def _curve(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uploads per client, accuracy) at each evaluation."""
    from fedemu.server.runlog import read_events

    events = read_events(path)
    clients = next(e["clients"] for e in events if e.get("event") == "start")
    xs, ys, uploads = [], [], 0
    for e in events:
        if e.get("event") != "round":
            continue
        uploads += e.get("uploads", 0)
        if e.get("accuracy") is not None:
            xs.append(uploads / clients)
            ys.append(e["accuracy"])
    return np.array(xs), np.array(ys)


def report(out: Path, metric: str, theirs: Path | None = None, records: Path = RECORDS) -> str:
    from fedemu.launch.studies import compare

    found = load_records(out, records)
    lines = [f"# Nilsson et al. 2018, Table 1, in fedemu ({out} and {records})", ""]
    for partition in ("iid", "shards"):
        every = _runs_for(found, partition)
        runs, pending = _common(every)
        n = min(len(r) for r in runs.values())
        lines.append(f"## {PARTITION[partition]}")
        lines.append("")
        means = [["algorithm", "runs", "mean final (%)", "mean best (%)", "best of each run (%)",
                  "paper's mean best (%)"]]
        for algo in ORDER:
            summaries = [r["summary"] for r in every[algo]]
            finals = [s["final_accuracy"] for s in summaries if s.get("final_accuracy") is not None]
            final = np.mean(finals) * 100 if finals else math.nan
            best = np.mean([s["best_accuracy"] for s in summaries]) * 100 if summaries else math.nan
            each = ", ".join(f"{r['summary']['best_accuracy'] * 100:.2f} ({r['run']}{_split_mark(r)})"
                             for r in every[algo])
            # Runs kept from docs/results.md have their best accuracy only: the mean final
            # says over how many runs it is taken.
            final_text = "-" if not finals else f"{final:.2f}" + (f" ({len(finals)})" if len(finals) < len(summaries)
                                                                  else "")
            means.append([LABEL[algo], str(len(summaries)), final_text,
                          f"{best:.2f}", each or "-", f"{PAPER_MEANS[partition][algo]:.2f}"])
        lines += _markdown(means) + [""]
        if theirs is not None:
            lines += _at_budgets(every, theirs, partition) + [""]
            lines += _by_repetition(every, theirs, partition) + [""]
        split = runs["fedavg"][0].get("split", SPLIT) if n else ""
        lines += [f"{n} (seed, fold) pairs in the t-test, of one split, run for every algorithm ({split}): "
                  f"{', '.join(r['run'] for r in runs['fedavg']) or 'none yet'}"
                  + (f"; not in the t-test until their repetition is complete: {', '.join(pending)}" if pending else "")
                  + ".", ""]
        if n < 2:
            lines += ["(the t-test needs at least 2 paired runs per algorithm)", ""]
            continue
        seeds = len({_seed_fold(r["run"])[0] for r in runs["fedavg"]})
        folds = len({_seed_fold(r["run"])[1] for r in runs["fedavg"]})
        rows = [["row vs column", "fedemu", "paper", "P(row better)", "P(equivalent)", "P(column better)"]]
        for (a, b), paper in PAPER_TABLE[partition].items():
            x = np.array([r["summary"][metric] for r in runs[a]])
            y = np.array([r["summary"][metric] for r in runs[b]])
            p_a, p_rope, p_b, post = compare.test(x, y, 0.01, seeds)
            result = compare.Result(a, b, float(x.mean()), float(y.mean()), p_a, p_rope, p_b, float(post.mean),
                                    float(post.var), float(post.df), len(x), seeds)
            rows.append([f"{LABEL[a]} vs {LABEL[b]}", compare.verdict(result, a, 0.95), paper, f"{p_a:.3f}",
                         f"{p_rope:.3f}", f"{p_b:.3f}"])
        design = (f"{seeds} repetition(s) of {folds}-fold cross-validation" if folds == FOLDS else
                  f"{folds} of the {FOLDS} folds of one repetition (baycomp takes them for {folds}-fold, "
                  f"which widens its posterior)")
        lines += [f"Bayesian correlated t-test on {metric.replace('_', ' ')}: {design}; rope ±0.01, decided at 0.95.",
                  ""] + _markdown(rows) + [""]
    text = "\n".join(lines)
    (out / "table1.md").write_text(text + "\n\n![curves](curves.png)\n")
    _plot(out, found, theirs)
    return text


# Their logs: one (loss, accuracy) row per evaluation. Row i is after i rounds for FedAvg
# (10 uploads a round, K = 100) and FSVRG (2 uploads per client a round), the first row
# being the initial model; CO-OP evaluated every 10th upload from the 10th; the
# centralised logs have one row per epoch from the first.
THEIR_LOGS = {
    ("fedavg", "iid"): ("fedavg/cross_validations_iid", lambda i: i / 10),
    ("fedavg", "shards"): ("fedavg/cross_validations", lambda i: i / 10),
    ("coop", "iid"): ("coop/cross_validations_iid", lambda i: (i + 1) / 10),
    ("coop", "shards"): ("coop/cross_validations", lambda i: (i + 1) / 10),
    ("fsvrg", "iid"): ("fsvrg/cross_validations_iid", lambda i: 2 * i),
    ("fsvrg", "shards"): ("fsvrg/cross_validations", lambda i: 2 * i),
}
BUDGET = 100  # uploads per client


def their_curves(theirs: Path, algo: str, partition: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(uploads per client, accuracy) of each of their cross-validation logs, cut at the budget."""
    results = theirs / "benchmark_results"
    if algo == "centralised":
        tag = "iid" if partition == "iid" else "noniid"
        files, x_of = sorted(results.glob(f"centralised/score_log_CL_{tag}_*.csv")), (lambda i: i + 1)
    else:
        folder, x_of = THEIR_LOGS[(algo, partition)]
        files = sorted(f for f in (results / folder).glob("*.csv") if not f.name.startswith("x_old"))
    curves = []
    for f in files:
        accuracy = np.loadtxt(f, delimiter=",", ndmin=2)[:, 1]
        x = np.array([x_of(i) for i in range(len(accuracy))], dtype=float)
        keep = x <= (50 if algo == "centralised" else BUDGET)
        curves.append((x[keep], accuracy[keep]))
    return curves


def _band(ax, curves, color, label, dashed=False) -> None:
    length = min(len(x) for x, _ in curves)
    x = curves[0][0][:length]
    ys = np.array([y[:length] for _, y in curves]) * 100
    ax.plot(x, ys.mean(axis=0), color=color, linestyle="--" if dashed else "-", linewidth=1.2 if dashed else 1.6,
            label=label)
    ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.1 if dashed else 0.22, linewidth=0)


def _plot(out: Path, found: dict[str, dict[str, dict]], theirs: Path | None = None) -> None:
    from fedemu.launch.studies.report_figures import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4), layout="constrained")
    colors = {"fedavg": "#2f56e0", "coop": "#e0562f", "fsvrg": "#2fa84f", "centralised": "#777777"}
    for ax, partition in zip(axes, ("iid", "shards")):
        for algo, records in _runs_for(found, partition).items():
            curves = [c for c in map(_record_curve, records) if c is not None]
            if curves:
                _band(ax, curves, colors[algo], f"{LABEL[algo]}, fedemu ({len(curves)} run{'s' * (len(curves) != 1)})")
            published = their_curves(theirs, algo, partition) if theirs else []
            if published:
                _band(ax, published, colors[algo], f"{LABEL[algo]}, Nilsson et al. ({len(published)} run{'s' * (len(published) != 1)})",
                      dashed=True)
        ax.set_title(f"{PARTITION[partition]} MNIST, 2NN: mean over runs, range shaded")
        ax.set_xlabel("uploads per client (centralised: epochs)")
        ax.set_ylim(85 if partition == "iid" else 70, 100)
        ax.grid(True, alpha=0.3)
        # Below the axes: inside, it hid non-IID FSVRG's curves (they end near 80%).
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=7.5, frameon=False)
        ax.set_ylabel("held-out accuracy (%)")
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


AT_UPLOADS = (10, 25, 50, 100)


def _best_at(curves, uploads: float) -> list[float]:
    """Each curve's best accuracy (%) among its evaluations up to ``uploads`` per client."""
    return [float(np.max(y[x <= uploads + 1e-9])) * 100 for x, y in curves if np.any(x <= uploads + 1e-9)]


def _at_budgets(every: dict[str, list[dict]], theirs: Path, partition: str) -> list[str]:
    """Best accuracy so far at a few upload budgets: fedemu's mean beside their mean and range."""
    rows = [["algorithm"] + [f"{u} uploads per client: fedemu / theirs (min-max)" for u in AT_UPLOADS]]
    for algo in ORDER[:3]:
        mine = [c for c in map(_record_curve, every[algo]) if c is not None]
        published = their_curves(theirs, algo, partition)
        cells = []
        for u in AT_UPLOADS:
            a, b = _best_at(mine, u), _best_at(published, u)
            cells.append(f"{np.mean(a):.2f} / {np.mean(b):.2f} ({min(b):.2f}-{max(b):.2f})" if a and b else "-")
        rows.append([LABEL[algo]] + cells)
    return ["Best accuracy so far (%) at an upload budget, fedemu's runs against their "
            "cross-validation logs:", ""] + _markdown(rows)


def _by_repetition(every: dict[str, list[dict]], theirs: Path, partition: str) -> list[str]:
    """Mean best accuracy within the budget, repetition by repetition: how far one
    repetition's mean moves, on both sides. Their logs sort by start time, five folds a
    repetition (their notebook's table took the first ten)."""
    rows = [["algorithm", "fedemu, each repetition (runs)", "theirs, each repetition (runs)"]]
    for algo in ORDER[:3]:
        mine: dict[int, list[float]] = {}
        for record in every[algo]:
            curve = _record_curve(record)
            if curve is not None:
                mine.setdefault(_seed_fold(record["run"])[0], []).extend(_best_at([curve], BUDGET))
        published = [_best_at([c], BUDGET)[0] for c in their_curves(theirs, algo, partition)]
        repetitions = [published[i:i + FOLDS] for i in range(0, len(published), FOLDS)]
        rows.append([LABEL[algo],
                     " / ".join(f"{np.mean(v):.2f} ({len(v)})" for _, v in sorted(mine.items())) or "-",
                     " / ".join(f"{np.mean(v):.2f} ({len(v)})" for v in repetitions) or "-"])
    return [f"Mean best accuracy (%) within {BUDGET} uploads per client, one repetition of the "
            "cross-validation at a time:", ""] + _markdown(rows)


def _markdown(rows: list[list[str]]) -> list[str]:
    head, *body = rows
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "sweeps" / "nilsson-table1")
    parser.add_argument("--iterations", type=int, default=1, choices=(1, 2, 3),
                        help="repetitions of 5-fold cross-validation (run.seed 1..N)")
    parser.add_argument("--folds", type=int, nargs="*", default=list(range(FOLDS)), help="folds to run (0-4)")
    parser.add_argument("--cells", nargs="*", default=[c[0] for c in CELLS], choices=[c[0] for c in CELLS])
    parser.add_argument("--workers", type=int, default=2, help="worker nodes per run")
    parser.add_argument("--metric", default="best_accuracy", choices=("best_accuracy", "final_accuracy"),
                        help="what the t-test compares (the paper's notebook: the best)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--theirs", type=Path, help="a checkout of their repository: plot their logs too")
    parser.add_argument("--records", type=Path, default=RECORDS, help="where completed runs are kept")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        cells = [c for c in CELLS if c[0] in args.cells]
        run_missing(args.out, list(range(1, args.iterations + 1)), args.folds, cells, args.workers, args.records)
    print(report(args.out, args.metric, args.theirs, args.records))


if __name__ == "__main__":
    main()
