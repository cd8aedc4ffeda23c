"""`fedemu report`: time to target on hand-made curves, curves from event logs, and the
report's files for runs (finished and in progress) and sweeps."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedemu.launch import config as configuration
from fedemu.launch.studies import results
from fedemu.launch.cli import main


def make_run(run_dir: Path, accuracies: list[float | None], *, sets: dict | None = None, finished: bool = True,
             bytes_per_round: int = 2_000_000, seconds_per_round: float = 2.0, time_scale: float = 1.0,
             status: str = "completed", config: dict | None = None, round_fields: dict | None = None) -> Path:
    """A run directory as the server writes it: config.toml, events.jsonl, summary.json;
    ``round_fields``: more fields of every round event."""
    config = config or configuration.default()
    config["run"]["time_scale"] = time_scale
    for key, value in (sets or {}).items():
        section, _, name = key.partition(".")
        config[section][name] = value
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(configuration.to_toml(config))
    broker_start = 7.0  # the broker's clock runs before the server starts
    events = [{"event": "start", "t": 0.5, "clients": 100, "time_scale": time_scale}]
    for i, acc in enumerate(accuracies, start=1):
        t = 0.5 + i * seconds_per_round / time_scale
        events.append({"event": "round", "t": t, "round": i, "accuracy": acc, "bytes_up": bytes_per_round,
                       "emulated_s": broker_start + t * time_scale, "round_s": seconds_per_round / time_scale,
                       **(round_fields or {})})
    if finished:
        events.append({"event": "end", "t": events[-1]["t"], "status": status})
    with open(run_dir / "events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        if not finished:
            f.write('{"event": "round", "t": 99, "rou')  # a torn line: the server is mid-write
    if finished:
        seen = [a for a in accuracies if a is not None]
        (run_dir / "summary.json").write_text(json.dumps({
            "status": status, "rounds": len(accuracies), "final_accuracy": seen[-1] if seen else None,
            "best_accuracy": max(seen) if seen else None, "bytes_up": bytes_per_round * len(accuracies),
            "bytes_down": 0, "uploads": 10 * len(accuracies), "wall_s": 1.0}))
    return run_dir


# --- time to target ------------------------------------------------------------------


def test_time_to_target_interpolates_on_the_best_so_far_curve():
    x = np.array([1, 2, 3, 4, 5], dtype=float)
    acc = np.array([0.50, 0.80, 0.70, 0.90, 0.95])
    # Best so far: 0.50 0.80 0.80 0.90 0.95. 0.85 lies halfway from 0.80 (x=3) to 0.90 (x=4);
    # interpolating on the raw curve would start from the dip at 0.70 and give 3.75.
    assert results.time_to_target(x, acc, 0.85) == pytest.approx(3.5)
    # 0.65: from (1, 0.50) to (2, 0.80), half way.
    assert results.time_to_target(x, acc, 0.65) == pytest.approx(1.5)
    assert results.time_to_target(x, acc, 0.90) == pytest.approx(4.0)  # reached exactly at a point
    assert results.time_to_target(x, acc, 0.96) is None                 # never reached
    assert results.time_to_target(x, acc, 0.40) == 1.0                  # already at the first evaluation


def test_time_to_target_on_other_axes_uses_their_spacing():
    seconds = np.array([10.0, 30.0, 35.0])
    acc = np.array([0.6, 0.7, 0.9])
    assert results.time_to_target(seconds, acc, 0.8) == pytest.approx(32.5)
    assert results.time_to_target([], [], 0.5) is None


def test_curve_counts_bytes_of_every_round_and_time_from_the_start(tmp_path):
    run = results.load_run(make_run(tmp_path / "r", [0.5, None, 0.7, 0.9], time_scale=10.0))
    c = run.curve
    assert list(c.rounds) == [1, 3, 4]                      # round 2 was not evaluated ...
    assert list(c.mb_up) == pytest.approx([2.0, 6.0, 8.0])  # ... but its bytes count
    # Two emulated seconds per round, counted from the start event, not the broker's start.
    assert list(c.emulated_s) == pytest.approx([2.0, 6.0, 8.0])
    tt = results.times_to_target(c, 0.8)
    assert tt == pytest.approx({"rounds": 3.5, "emulated_s": 7.0, "mb_up": 7.0})


# --- report files --------------------------------------------------------------------


def test_report_on_runs_writes_figures_and_a_table(tmp_path):
    a = make_run(tmp_path / "a", [0.6, 0.8, 0.9], sets={"algorithm.name": "fedavg"})
    b = make_run(tmp_path / "b", [0.5, 0.6, 0.7, 0.75], sets={"algorithm.name": "fsvrg"}, finished=False)
    out = tmp_path / "rep"
    result = CliRunner().invoke(main, ["report", str(a), str(b), "--out", str(out), "--target", "0.85"])
    assert result.exit_code == 0, result.output
    for stem in ("accuracy-vs-rounds", "accuracy-vs-emulated-time", "accuracy-vs-uploaded"):
        assert (out / f"{stem}.png").stat().st_size > 5000
        assert (out / f"{stem}.svg").read_text().lstrip().startswith("<?xml")
    md = (out / "report.md").read_text()
    lines = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| a") or line.startswith("| b")}
    # Labelled by what differs; the running one is marked; time to 85%: round 2.5 for a.
    assert "| fedavg | completed | 3 | 90.00 | 90.00 |" in lines["a"]
    assert "| 3 | 2.5 | 5.0 | 5.0 |" in lines["a"]  # the first round at 85%, then the interpolated figures
    assert ("| first round at 85% | rounds to 85% (interpolated) | emulated s to 85% (interpolated) "
            "| MB up to 85% (interpolated) |") in md
    assert "| fsvrg | running | 4 | 75.00 |" in lines["b"] and lines["b"].rstrip().endswith("| – | – | – |")
    assert "![accuracy-vs-emulated-time](accuracy-vs-emulated-time.png)" in md
    svg = (out / "accuracy-vs-emulated-time.svg").read_text()
    assert "emulated time since the first round began (s)" in svg and "test accuracy (%)" in svg
    assert "algorithm=fsvrg (in progress)" in svg  # the legend says which run is still going


def test_a_report_goes_under_the_run_it_reports_on_and_says_where(tmp_path, monkeypatch):
    """Not the current folder, where the next run's report would overwrite it."""
    monkeypatch.chdir(tmp_path)
    a = make_run(tmp_path / "runs" / "a", [0.6, 0.8, 0.9])
    b = make_run(tmp_path / "runs" / "b", [0.5, 0.6])
    result = CliRunner().invoke(main, ["report", str(a), "--format", "svg"])
    assert result.exit_code == 0, result.output
    assert (a / "report" / "report.md").exists() and f"{a / 'report'}/" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    # Several runs have no one home: the command asks where, and writes nothing.
    result = CliRunner().invoke(main, ["report", str(a), str(b)])
    assert result.exit_code != 0 and "2 inputs have no one folder for the report: choose one with -o/--out" in result.output
    assert not (b / "report").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    result = CliRunner().invoke(main, ["report", str(a), str(b), "-o", str(tmp_path / "ab"), "--format", "svg"])
    assert result.exit_code == 0 and (tmp_path / "ab" / "report.md").exists()


def test_report_refuses_what_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, ["report", str(tmp_path / "empty")])
    assert result.exit_code != 0
    assert "neither a run directory (config.toml) nor a sweep directory (sweep.db)" in result.output


def test_report_on_a_sweep(tmp_path):
    from tests.test_sweep import fake_sweep

    sweep_dir = fake_sweep(tmp_path)
    result = CliRunner().invoke(main, ["report", str(sweep_dir), "--format", "svg"])  # svg: cheaper to draw
    assert result.exit_code == 0, result.output
    out = sweep_dir / "report"
    names = {p.name for p in out.glob("*.svg")}
    # The zipped learning rate moves with the algorithm: it is no axis of its own.
    assert names == {"accuracy-vs-rounds.svg", "accuracy-vs-emulated-time.svg", "accuracy-vs-uploaded.svg",
                     "final-accuracy-vs-network-dropout-per-round.svg",
                     "tt-emulated-s-vs-network-dropout-per-round.svg"}
    md = (out / "report.md").read_text()
    # Per (condition, algorithm), averaged over the two seeds: the fake accuracies are
    # 0.9 - dropout (fedavg) and 0.8 - dropout (fedsgd), plus 0.01 * (seed - 1).
    assert "| 0 | FedAvg | 2 | 90.50 |" in md
    assert "| 0.3 | FedSGD | 2 | 50.50 |" in md
    assert "| 0.3 | FedSGD | 2 | 50.50 | 50.50 | 0/2 | – |" in md  # never reached 85%
    assert "![accuracy-vs-uploaded](accuracy-vs-uploaded.svg)" in md
    svg = (out / "final-accuracy-vs-network-dropout-per-round.svg").read_text()
    assert "drop-out per round (probability)" in svg and "final test accuracy (%)" in svg
    assert "FedAvg" in svg and "FedSGD" in svg


def test_export_writes_a_tidy_row_per_evaluation_with_the_swept_keys(tmp_path):
    """A sweep of 8 points of 3 evaluations each, plus a loose run: 27 rows; the sweep's
    axes are columns (the algorithm has its own), a loose run fills them from its config."""
    import csv

    from tests.test_sweep import fake_sweep

    sweep_dir = fake_sweep(tmp_path)
    loose = make_run(tmp_path / "loose", [0.5, 0.6, None], sets={"algorithm.lr": 0.3})
    out = tmp_path / "table.csv"
    result = CliRunner().invoke(main, ["export", str(sweep_dir), str(loose), "-o", str(out)])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 8 * 3 + 2  # the loose run's unevaluated round is no row
    assert list(rows[0])[:3] == ["run", "status", "algorithm"]
    assert set(list(rows[0])[3:6]) == {"network.dropout.per_round", "run.seed", "algorithm.lr"}
    by_run = {}
    for row in rows:
        by_run.setdefault(row["run"], []).append(row)
    point = next(r for r in by_run.values() if r[0]["algorithm"] == "fedsgd" and r[0]["run.seed"] == "2")
    assert [row["round"] for row in point] == ["1", "2", "3"] and point[0]["algorithm.lr"] == "0.11"
    assert float(point[-1]["accuracy"]) == pytest.approx(0.8, abs=0.06)  # fake_accuracy's fedsgd level
    assert [row["accuracy"] for row in by_run[str(loose)]] == ["0.5", "0.6"]
    assert by_run[str(loose)][0]["algorithm.lr"] == "0.3" and by_run[str(loose)][0]["status"] == "completed"
    # Emulated time counts from the run's start, as report's curves do.
    assert float(by_run[str(loose)][0]["emulated_s"]) == pytest.approx(2.0)
    assert CliRunner().invoke(main, ["export", str(tmp_path / "nothing-here")]).exit_code != 0


def test_figures_for_straggler_and_dropout_studies(tmp_path):
    """Loss, each round's duration and participation by outcome are drawn when the log has
    them; a sweep's repetitions become a mean and a band; labels name only what differs
    (a key one run lacks is not "None"); round axes have whole ticks."""
    from fedemu.launch.studies.report_figures import run_labels, spread

    runs = []
    for i, (sets, offline) in enumerate((({}, 0), ({"network.dropout": {"per_round": 0.3}}, 3))):
        run_dir = make_run(tmp_path / f"r{i}", [0.5, 0.7, 0.8], sets=sets)
        lines = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        for e in lines:
            if e["event"] == "round":
                e.update(loss=1.0 / e["round"], round_emulated_s=10.0,
                         outcome_counts={"answered": 10 - offline, "straggler": 0, "offline": offline})
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
        runs.append(run_dir)
    # The first run has no drop-out section: its label is its folder, not "per_round=None".
    assert run_labels([results.load_run(r) for r in runs]) == ["r0", "drop-out per round=0.3"]
    out = tmp_path / "report"
    assert CliRunner().invoke(main, ["report", *map(str, runs), "--out", str(out), "--format", "svg"]).exit_code == 0
    for stem in ("loss-vs-rounds", "round-duration", "participation", "accuracy-vs-rounds"):
        assert (out / f"{stem}.svg").exists(), stem
    rounds_axis = (out / "accuracy-vs-rounds.svg").read_text()
    assert ">1.5<" not in rounds_axis and ">2<" in rounds_axis  # whole rounds only
    x, mean, low, high = spread([(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0])),
                                 (np.array([1.0, 3.0]), np.array([3.0, 5.0]))])
    assert list(x) == [1, 2, 3] and list(mean) == [2, 3, 4] and list(low) == [1, 2, 3] and list(high) == [3, 4, 5]
