"""`fedemu compare`: the Bayesian correlated t-test on synthetic accuracies with a known
answer, checked against the closed form, and the table like Nilsson et al.'s Table 1."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from scipy import stats

from fedemu.launch.studies import compare
from fedemu.launch.cli import main
from tests.test_report import make_run

SEEDS, FOLDS = (1, 2, 3), range(5)  # three repetitions of 5-fold cross-validation, as the paper


def synthetic(name: str, rep: tuple[int, int]) -> float:
    """Accuracies with a known ordering: FedAvg 5 points above FSVRG; CO-OP 0.1 point
    above FedAvg (practically equivalent with a 1-point rope). A shared fold effect
    makes the pairs correlated, as k-fold results are."""
    seed, fold = rep
    fold_effect = 0.004 * np.sin(seed * 5 + fold)
    noise = 0.0015 * np.cos(seed * 13 + fold * 7 + len(name))
    return {"fedavg": 0.95, "coop": 0.951, "fsvrg": 0.90}[name] + fold_effect + noise


def make_runs(tmp_path, names=("fedavg", "coop", "fsvrg"), extra: dict | None = None):
    dirs = []
    for name in names:
        for seed in SEEDS:
            for fold in FOLDS:
                acc = synthetic(name, (seed, fold))
                dirs.append(make_run(tmp_path / f"{name}-{seed}-{fold}", [acc - 0.1, acc], sets={
                    "algorithm.name": name, "run.seed": seed, "data.folds": 5, "data.fold": fold, **(extra or {})}))
    return dirs


def test_the_known_answer_and_the_closed_form(tmp_path):
    runs = compare.collect(make_runs(tmp_path))
    results, names, note = compare.compare(runs, rope=0.01)
    assert names == ["fedavg", "coop", "fsvrg"]
    assert note == "3 repetition(s) of 5-fold cross-validation"
    by_pair = {(r.a, r.b): r for r in results}

    fedavg_fsvrg = by_pair[("fedavg", "fsvrg")]
    assert fedavg_fsvrg.p_a > 0.99  # FedAvg practically better
    fedavg_coop = by_pair[("fedavg", "coop")]
    assert fedavg_coop.p_rope > 0.95  # practically equivalent

    # The closed form (Corani and Benavoli 2015): Student posterior of the mean
    # difference with the Nadeau-Bengio variance correction 1/n + 1/(k - 1).
    keys = [(s, f) for s in SEEDS for f in FOLDS]
    diff = np.array([synthetic("fsvrg", k) - synthetic("fedavg", k) for k in keys])
    n, k = len(diff), 5
    scale = np.sqrt(diff.var(ddof=1) * (1 / n + 1 / (k - 1)))
    p_left = stats.t.cdf(-0.01, n - 1, diff.mean(), scale)
    p_right = 1 - stats.t.cdf(0.01, n - 1, diff.mean(), scale)
    assert fedavg_fsvrg.mean == pytest.approx(diff.mean())
    assert (fedavg_fsvrg.p_a, fedavg_fsvrg.p_rope, fedavg_fsvrg.p_b) == pytest.approx(
        (p_left, 1 - p_left - p_right, p_right))


def test_the_table_reads_like_nilssons_table_1(tmp_path):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(main, ["compare", *map(str, make_runs(tmp_path)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # Row against column: FedAvg beats FSVRG, equals CO-OP; FSVRG loses to both.
    assert "| FedAvg | · | = | + |" in lines
    assert "| CO-OP | = | · | + |" in lines
    assert "| FSVRG | - | - | · |" in lines
    row = next(line for line in lines if line.startswith("| FedAvg | FSVRG |"))
    assert "| 1.000 | 0.000 | 0.000 | 15 |" in row  # P(FedAvg better), P(equivalent), P(FSVRG better), pairs
    assert (out / "posteriors.png").stat().st_size > 10_000
    svg = (out / "posteriors.svg").read_text()
    assert "accuracy difference FSVRG − FedAvg (percentage points)" in svg
    assert "| FSVRG | - | - | · |" in (out / "compare.md").read_text()


def test_a_tight_decision_threshold_leaves_a_pair_undecided(tmp_path):
    runs = compare.collect(make_runs(tmp_path, names=("fedavg", "coop")))
    results, names, _ = compare.compare(runs, rope=0.001)  # a rope narrower than the 0.1-point gap
    r = results[0]
    assert max(r.p_a, r.p_rope, r.p_b) < 0.95
    assert compare.verdict(r, "fedavg", 0.95) == "?"


def test_runs_differing_in_more_than_seed_and_fold_are_refused(tmp_path):
    dirs = make_runs(tmp_path / "a", names=("fedavg", "fsvrg"))
    dirs += make_runs(tmp_path / "b", names=("fedavg", "fsvrg"), extra={"algorithm.E": 5})
    with pytest.raises(compare.CompareError, match=r"differ in algorithm.E \(1, 5\).*--where algorithm.E=VALUE"):
        compare.compare(compare.collect(dirs))
    results, _, _ = compare.compare(compare.collect(dirs, where=["algorithm.E=5"]))
    assert results[0].p_a > 0.99


def test_a_comparison_of_several_inputs_asks_where_to_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = make_runs(tmp_path / "runs")
    result = CliRunner().invoke(main, ["compare", *map(str, runs)])
    assert result.exit_code == 1 and "choose one with -o/--out" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing written in the current folder


def test_unpaired_or_single_groups_are_refused(tmp_path):
    dirs = make_runs(tmp_path, names=("fedavg", "fsvrg"))
    with pytest.raises(compare.CompareError, match=r"not run on the same \(seed, fold\) pairs; missing: fsvrg: \[\(3, 4\)\]"):
        compare.compare(compare.collect(dirs[:-1]))
    with pytest.raises(compare.CompareError, match="every run has algorithm.name = fedavg: nothing to compare"):
        compare.compare(compare.collect(dirs[:15]))
    result = CliRunner().invoke(main, ["compare", *map(str, dirs[:15])])
    assert result.exit_code == 1 and "nothing to compare" in result.output


def test_a_run_recorded_before_a_key_existed_pairs_with_one_that_has_its_default(tmp_path):
    """Runs of one condition, one of them recorded before algorithm.merge_s existed (its
    config lacks the key): it ran at the default, so the runs pair."""
    import tomllib

    from fedemu.launch.studies import compare
    from fedemu.launch.studies.results import load_run

    runs = []
    for fold in range(3):
        for name, acc in (("fedavg", 0.9 + fold / 100), ("coop", 0.8 + fold / 100)):
            run_dir = make_run(tmp_path / f"{name}-{fold}", [acc], sets={"algorithm.name": name, "data.fold": fold})
            if fold == 0:  # as an older fedemu wrote it
                text = (run_dir / "config.toml").read_text()
                (run_dir / "config.toml").write_text("\n".join(l for l in text.splitlines() if not l.startswith("merge_s")))
                assert "merge_s" not in tomllib.loads((run_dir / "config.toml").read_text())["algorithm"]
            runs.append(load_run(run_dir))
    groups, reps, folds = compare.paired(runs, "algorithm.name", "final_accuracy")
    assert folds == 3 and sorted(groups) == ["coop", "fedavg"]


def test_runs_that_differ_only_where_it_cannot_matter_still_pair(tmp_path):
    """An IID run's shard order and another algorithm's option do not change the run:
    such runs pair; a difference that matters (the learning rate) is still refused."""
    from fedemu.launch.studies import compare
    from fedemu.launch.studies.results import load_run

    def runs(vary: dict) -> list:
        out = []
        for fold in range(2):
            for name in ("fedavg", "coop"):
                sets = {"algorithm.name": name, "data.fold": fold, **(vary if fold == 0 else {})}
                out.append(load_run(make_run(tmp_path / f"{len(vary)}-{next(iter(vary))}-{name}-{fold}", [0.9],
                                             sets=sets)))
        return out

    compare.paired(runs({"data.shard_order": "pixels"}), "algorithm.name", "final_accuracy")  # IID by default
    compare.paired(runs({"algorithm.h": 2.0}), "algorithm.name", "final_accuracy")  # FSVRG's, unused by both
    with pytest.raises(compare.CompareError, match="the fedavg runs differ in algorithm.lr"):
        compare.paired(runs({"algorithm.lr": 0.5}), "algorithm.name", "final_accuracy")
    with pytest.raises(compare.CompareError, match="the coop runs differ in algorithm.b_l"):
        compare.paired(runs({"algorithm.b_l": 5}), "algorithm.name", "final_accuracy")  # CO-OP's own


def test_complete_repetitions_leave_out_a_repetition_under_way():
    """What a benchmark pairs while its second repetition runs: five folds of seed 1 and
    one of seed 2 are one repetition of 5-fold, not two of three."""
    five = set(range(5))
    first = {(1, f) for f in five}
    assert compare.complete_repetitions(first | {(2, 0)}, five) == first
    both = first | {(2, f) for f in five}
    assert compare.complete_repetitions(both, five) == both
    # The first repetition under way: its folds so far, alone (the later seed's left out).
    assert compare.complete_repetitions({(1, 0), (1, 1), (1, 2), (2, 0)}, five) == {(1, 0), (1, 1), (1, 2)}
    assert compare.complete_repetitions({(2, 0), (3, 1)}, five) == {(2, 0)}
    assert compare.complete_repetitions(set(), five) == set()


def test_run_records_compare_as_their_run_directories(tmp_path):
    """A run kept as one JSON file (config and summary, as bench/nilsson_table1.py keeps
    Table 1's runs) pairs and tests exactly as its run directory did."""
    import json
    import tomllib

    dirs = make_runs(tmp_path / "runs", names=("fedavg", "fsvrg"))
    records = []
    for run_dir in dirs:
        record = tmp_path / "records" / f"{run_dir.name}.json"
        record.parent.mkdir(exist_ok=True)
        record.write_text(json.dumps({"cell": run_dir.name,
                                      "config": tomllib.loads((run_dir / "config.toml").read_text()),
                                      "summary": json.loads((run_dir / "summary.json").read_text())}))
        records.append(record)
    from_dirs, _, _ = compare.compare(compare.collect(dirs), metric="best_accuracy", rope=0.01)
    from_records, _, _ = compare.compare(compare.collect(records), metric="best_accuracy", rope=0.01)
    assert [(r.a, r.b, r.p_a, r.p_rope, r.p_b, r.runs) for r in from_records] == \
        [(r.a, r.b, r.p_a, r.p_rope, r.p_b, r.runs) for r in from_dirs]
    assert from_records[0].n == 15  # paired runs: 3 repetitions x 5 folds

    broken = tmp_path / "records" / "broken.json"
    broken.write_text(json.dumps({"summary": {"best_accuracy": 0.9}}))  # no config
    result = CliRunner().invoke(main, ["compare", *map(str, records), str(broken), "--out", str(tmp_path / "cmp")])
    assert result.exit_code != 0 and f"{broken}: a run record needs a 'config' and a 'summary'" in result.output


# --- time and bytes to a target, on a real sweep ----------------------------------------------

LINKS_SWEEP = """
[sweep]
parallel = 2
target = 0.75
[base.run]
rounds = 3
target_accuracy = 0.0
heartbeat_interval_s = 0.2
[base.data]
clients = 10
partition = "sample"
examples_per_client = 600
[base.algorithm]
C = 0.3
[base.network]
default_profile = "mobile"
[base.network.profiles.mobile]
latency_ms = 35
down = { bandwidth = "12Mbit" }
[axes]
"network.profiles.mobile.up.bandwidth" = ["1Mbit", "10Mbit"]
"run.seed" = [1, 2]
"""
BANDWIDTH = "network.profiles.mobile.up.bandwidth"


@pytest.fixture(scope="module")
def links_sweep(tmp_path_factory):
    from fedemu.launch.studies.sweep import run_sweep
    from fedemu.launch.studies.sweep_spec import load_spec

    folder = tmp_path_factory.mktemp("links")
    (folder / "links.toml").write_text(LINKS_SWEEP)
    counts = run_sweep(load_spec(folder / "links.toml", folder / "sweep"), echo=lambda line: None)
    assert counts == {"completed": 4}
    return folder / "sweep"


@pytest.mark.mnist
def test_time_to_target_ranks_a_fast_link_above_a_slow_one(links_sweep, tmp_path):
    """The same models reach 75% over either uplink (no deadline is missed), so the
    rounds agree; each round waits for 800 KB uploads, 10 times slower at 1 Mbit/s."""
    runs = compare.collect([links_sweep])
    results, names, _ = compare.compare(runs, by=BANDWIDTH, metric="time_to_target", rope=None, target=0.75)
    (r,) = results
    fast, slow = ("10Mbit", "1Mbit")
    means = {r.a: r.mean_a, r.b: r.mean_b}
    assert means[fast] < means[slow]
    p_fast, p_slow = (r.p_a, r.p_b) if r.a == fast else (r.p_b, r.p_a)
    assert p_fast > 0.9 > p_slow
    assert compare.ranking(results, names, "time_to_target", 0.75).startswith(
        "Ranked by mean emulated time to 75% (lower is better): 10Mbit")
    rounds, _, _ = compare.compare(runs, by=BANDWIDTH, metric="rounds_to_target", rope=None, target=0.75)
    assert rounds[0].mean_a == rounds[0].mean_b  # the link changes when, not what
    result = CliRunner().invoke(main, ["compare", str(links_sweep), "--by", BANDWIDTH, "--metric", "bytes_to_target",
                                       "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.output
    assert "MB uploaded to 75%" in result.output  # the sweep's target, by default


@pytest.mark.mnist
def test_a_run_that_never_reached_the_target_is_named_unless_told_how_to_count_it(links_sweep):
    runs = compare.collect([links_sweep])
    with pytest.raises(compare.CompareError, match="never reached 99%.*--unreached"):
        compare.compare(runs, by=BANDWIDTH, metric="time_to_target", target=0.99)
    results, _, _ = compare.compare(runs, by=BANDWIDTH, metric="time_to_target", target=0.99, unreached="budget")
    assert results[0].n == 2  # counted as the whole run's emulated time: a lower bound
    with pytest.raises(compare.CompareError, match="at least 2 paired runs"):
        compare.compare(runs, by=BANDWIDTH, metric="time_to_target", target=0.99, unreached="drop")
    with pytest.raises(compare.CompareError, match="needs a target"):
        compare.compare(runs, by=BANDWIDTH, metric="time_to_target")


def test_the_posterior_is_drawn_out_to_where_its_tails_fall_below_a_hundredth_of_its_peak():
    # Two repetitions of one fold: df = 2, tails far wider than a normal's. Drawn to ±4
    # scales, the density was still 4% of its peak where the plot ended.
    few = compare.Result(a="fedavg", b="coop", mean_a=0.80, mean_b=0.79, p_a=0.6, p_rope=0.1, p_b=0.3,
                         mean=-0.01, var=0.02 ** 2, df=2, n=3, runs=3)
    many = compare.Result(a="fedavg", b="fsvrg", mean_a=0.80, mean_b=0.70, p_a=0.99, p_rope=0.01, p_b=0.0,
                          mean=-0.1, var=0.01 ** 2, df=14, n=15, runs=3)
    fig = compare.posterior_figure([few, many], rope=0.01)
    try:
        for ax in fig.axes:
            if not ax.get_visible():
                continue
            (line,) = ax.get_lines()[:1]
            ys = np.asarray(line.get_ydata())
            assert ys[0] < 0.01 * ys.max() and ys[-1] < 0.01 * ys.max()
            # and the axes show all of it
            lo, hi = ax.get_xlim()
            xs = np.asarray(line.get_xdata())
            assert lo <= xs.min() and xs.max() <= hi
    finally:
        fig.clf()
