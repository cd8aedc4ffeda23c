"""`fedemu sweep`: grid expansion, bad sweep files, resume semantics and the SQLite index.

Most tests replace the point runner (sweep.run_point, the one function every point
goes through) with a fake that writes a run directory at once; one slow test runs real
points on a tiny synthetic data set and kills the sweep half-way.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from click.testing import CliRunner

from fedemu.launch.studies import sweep
from fedemu.launch.cli import main
from fedemu.launch.studies.sweep_layout import plan
from fedemu.launch.studies.sweep_point import alive
from fedemu.launch.studies.sweep_spec import SweepError, expand, load_spec
from tests.test_report import make_run

SWEEP = """
[sweep]
target = 0.85
[base.run]
rounds = 3
[axes]
"network.dropout.per_round" = [0.0, 0.3]
"run.seed" = [1, 2]
[[zip]]
"algorithm.name" = ["fedavg", "fedsgd"]
"algorithm.lr" = [0.1, 0.11]
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def fake_accuracy(config: dict) -> float:
    base = {"fedavg": 0.9, "fedsgd": 0.8}[config["algorithm"]["name"]]
    dropout = config.get("network", {}).get("dropout", {}).get("per_round", 0.0)
    return base - dropout + 0.01 * (config["run"]["seed"] - 1)


class FakeRunner:
    """Stands in for sweep.run_point: records calls, fails the points told to."""

    def __init__(self, fail: set[str] = frozenset(), block: threading.Event | None = None):
        self.calls: list[str] = []
        self.fail = set(fail)
        self.block = block
        self._called = threading.Condition()

    def wait_for_calls(self, n: int, timeout: float = 30.0) -> bool:
        """Whether ``n`` points have started (within ``timeout`` seconds)."""
        with self._called:
            return self._called.wait_for(lambda: len(self.calls) >= n, timeout)

    def __call__(self, config, run_dir, *, workers, stop, on_start=None, machines=None):
        with self._called:
            self.calls.append(run_dir.name)
            self._called.notify_all()
        if on_start is not None:
            on_start([])
        if self.block is not None:  # a long point: runs until the sweep stops it
            stop.wait(60)
            make_run(run_dir, [0.3], config=config, status="interrupted")
            return {"status": "interrupted", "reason": "interrupted by the user"}
        if run_dir.name in self.fail:
            make_run(run_dir, [0.2], config=config, status="failed")
            return {"status": "failed", "reason": "boom"}
        final = fake_accuracy(config)
        make_run(run_dir, [final - 0.2, final - 0.05, final], config=config)
        return json.loads((run_dir / "summary.json").read_text())


def run(spec_path: Path, out: Path, runner: FakeRunner, **kw) -> dict:
    with mock.patch.object(sweep, "run_point", runner):
        return sweep.run_sweep(load_spec(spec_path, out), parallel=2, echo=lambda line: None, **kw)


def fake_sweep(tmp_path: Path) -> Path:
    """A finished 8-point sweep made with the fake runner (used by test_report too)."""
    out = tmp_path / "sw"
    run(write(tmp_path / "s.toml", SWEEP), out, FakeRunner())
    return out


def rows(out: Path) -> dict[str, dict]:
    db = sqlite3.connect(out / "sweep.db")
    db.row_factory = sqlite3.Row
    try:
        return {r["id"]: dict(r) for r in db.execute("SELECT * FROM points")}
    finally:
        db.close()


def status_of(out: Path, point: str) -> str | None:
    """A point's status while a sweep process may still be creating its index."""
    try:
        return rows(out).get(point, {}).get("status")
    except sqlite3.OperationalError:  # no file or no table yet
        return None


# --- the grid ------------------------------------------------------------------------


def test_grid_expands_axes_and_zips_with_repetitions_outermost(tmp_path):
    points = expand(load_spec(write(tmp_path / "s.toml", SWEEP)))
    assert len(points) == 2 * 2 * 2  # dropout x seed x (algorithm, lr) zipped
    assert [p.params["run.seed"] for p in points] == [1, 1, 1, 1, 2, 2, 2, 2]
    pairs = {(p.config["algorithm"]["name"], p.config["algorithm"]["lr"]) for p in points}
    assert pairs == {("fedavg", 0.1), ("fedsgd", 0.11)}  # zipped, not crossed
    first = points[0]
    assert first.id == "seed=1,per_round=0,name=fedavg,lr=0.1"
    assert first.config["run"]["rounds"] == 3  # [base.run]
    assert first.config["network"]["dropout"]["per_round"] == 0.0
    assert len({p.id for p in points}) == len({p.hash for p in points}) == 8


def test_a_base_file_is_read_relative_to_the_sweep_file(tmp_path):
    (tmp_path / "cfg").mkdir()
    write(tmp_path / "cfg" / "base.toml", "[run]\nrounds = 7\n[algorithm]\nE = 3\n")
    spec = load_spec(write(tmp_path / "cfg" / "s.toml", '[sweep]\nbase = "base.toml"\n[axes]\n"algorithm.B" = [10, 20]\n'))
    points = expand(spec)
    assert [(p.config["run"]["rounds"], p.config["algorithm"]["E"], p.config["algorithm"]["B"]) for p in points] \
        == [(7, 3, 10), (7, 3, 20)]
    assert spec.out == Path("sweeps") / "s"


def test_the_example_sweeps_expand_to_valid_points():
    examples = sorted((Path(__file__).parent.parent / "examples" / "sweeps").glob("*.toml"))
    assert examples
    for path in examples:
        points = expand(load_spec(path))
        assert len(points) >= 2 and len({p.id for p in points}) == len(points), path


@pytest.mark.parametrize("text, message", [
    ('[axes]\n"algorithm.foo" = [1, 2]\n', "unknown key algorithm.foo; [algorithm] has name, C"),
    ('[axes]\n"algorithm.C" = [0.1, 2.0]\n', "point C=2: algorithm.C = 2.0 is out of range"),
    ('[axes]\n"network.dropout.per_rond" = [0.1]\n', "per_rond"),
    ('[axes]\n"seed" = [1]\n', "axis 'seed' must name a config key as \"section.key\""),
    ('[axes]\n"run.seed" = []\n', "axis run.seed must be a non-empty list"),
    ('[axes]\n"run.seed" = [1, 1]\n', "axis run.seed repeats a value"),
    ('[axes]\n"run.out" = ["a", "b"]\n', "run.out is chosen by the sweep"),
    ('[[zip]]\n"algorithm.name" = ["fedavg", "coop"]\n"algorithm.lr" = [0.1]\n',
     "zipped axes need lists of one length, got algorithm.name: 2, algorithm.lr: 1"),
    ('[sweep]\nparalel = 2\n[axes]\n"run.seed" = [1]\n', "unknown key sweep.paralel"),
    ('[sweep]\nbase = "nope.toml"\n[axes]\n"run.seed" = [1]\n', "nope.toml does not exist"),
    ('[run]\nrounds = 2\n', "unknown table [run]"),
    ('[sweep]\n', "no axes"),
    ('[axes\n', "is not valid TOML"),
])
def test_bad_sweep_files_name_the_problem(tmp_path, text, message):
    path = write(tmp_path / "bad.toml", text)
    result = CliRunner().invoke(main, ["sweep", str(path), "--dry-run"])
    assert result.exit_code != 0
    assert message in result.output


# --- resume --------------------------------------------------------------------------


def test_rerun_skips_completed_points_and_retries_failed_ones(tmp_path):
    spec = write(tmp_path / "s.toml", SWEEP)
    out = tmp_path / "sw"
    broken = "seed=2,per_round=0.3,name=fedsgd,lr=0.11"
    first = FakeRunner(fail={broken})
    assert run(spec, out, first) == {"completed": 7, "failed": 1}
    assert len(first.calls) == 8
    done_before = {k: r["finished_at"] for k, r in rows(out).items()}

    second = FakeRunner()
    assert run(spec, out, second) == {"completed": 8}
    assert second.calls == [broken]  # only the failed point ran again
    after = rows(out)
    assert after[broken]["attempts"] == 2 and after[broken]["final_accuracy"] == pytest.approx(0.51)
    for pid, finished in done_before.items():
        if pid != broken:
            assert after[pid]["finished_at"] == finished and after[pid]["attempts"] == 1
    # The failed attempt's run directory is kept aside for its logs.
    assert (out / "attempts" / f"{broken}.1" / "summary.json").exists()

    third = FakeRunner()
    assert run(spec, out, third) == {"completed": 8} and third.calls == []


def test_a_changed_base_config_is_refused_naming_the_keys(tmp_path):
    spec = write(tmp_path / "s.toml", SWEEP)
    out = tmp_path / "sw"
    run(spec, out, FakeRunner())
    write(spec, SWEEP.replace("rounds = 3", "rounds = 5"))
    with pytest.raises(SweepError, match=r"base config changed.*8 point\(s\).*run.rounds: 3 -> 5"):
        run(spec, out, FakeRunner())
    # Through the CLI the same refusal is a clear error, not a traceback.
    result = CliRunner().invoke(main, ["sweep", str(spec), "--out", str(out)])
    assert result.exit_code == 1 and "Error: the base config changed" in result.output


def test_adding_an_axis_value_runs_only_the_new_points(tmp_path):
    spec = write(tmp_path / "s.toml", SWEEP)
    out = tmp_path / "sw"
    run(spec, out, FakeRunner())
    write(spec, SWEEP.replace('"run.seed" = [1, 2]', '"run.seed" = [1, 2, 3]'))
    runner = FakeRunner()
    assert run(spec, out, runner) == {"completed": 12}
    assert sorted(runner.calls) == sorted(c for c in runner.calls if c.startswith("seed=3,")) and len(runner.calls) == 4


def test_stopping_a_sweep_records_interrupted_points_and_a_rerun_finishes_them(tmp_path):
    spec = write(tmp_path / "s.toml", SWEEP)
    out = tmp_path / "sw"
    stop = threading.Event()
    blocked = FakeRunner(block=threading.Event())

    def stop_once_two_run():  # as a user's Ctrl-C while two points run
        blocked.wait_for_calls(2)
        stop.set()

    stopper = threading.Thread(target=stop_once_two_run)
    stopper.start()
    counts = run(spec, out, blocked, stop=stop)
    stopper.join()
    assert blocked.wait_for_calls(2, timeout=0), "two points never ran at once"
    assert counts == {"interrupted": 2, "pending": 6}  # two ran at once, none started after the stop
    runner = FakeRunner()
    assert run(spec, out, runner) == {"completed": 8} and len(runner.calls) == 8


def test_a_killed_sweeps_points_are_adopted_or_retried(tmp_path):
    spec = write(tmp_path / "s.toml", SWEEP)
    out = tmp_path / "sw"
    run(spec, out, FakeRunner())
    db = sqlite3.connect(out / "sweep.db")
    ids = sorted(rows(out))
    # As a SIGKILLed sweep leaves them: rows still "running", with pids long gone; one
    # run finished on its own afterwards, the other died with no summary.
    db.execute("UPDATE points SET status = 'running', pids = '[999999]' WHERE id IN (?, ?)", ids[:2])
    db.commit()
    db.close()
    (out / "runs" / ids[1] / "summary.json").unlink()
    runner = FakeRunner()
    assert run(spec, out, runner) == {"completed": 8}
    assert runner.calls == [ids[1]]


def test_a_point_still_running_from_a_killed_sweep_is_not_started_twice(tmp_path):
    spec = write(tmp_path / "s.toml", SWEEP)
    out = tmp_path / "sw"
    run(spec, out, FakeRunner())
    pid = sorted(rows(out))[0]
    run_dir = (out / "runs" / pid).resolve()
    # A stand-in for an orphaned node: its command line names the run directory.
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "fedemu.launch", str(run_dir)])
    try:
        db = sqlite3.connect(out / "sweep.db")
        db.execute("UPDATE points SET status = 'running', pids = ? WHERE id = ?", (json.dumps([orphan.pid]), pid))
        db.commit()
        db.close()
        with pytest.raises(SweepError, match=rf"point {pid} is still running .*pids {orphan.pid}"):
            run(spec, out, FakeRunner())
    finally:
        orphan.kill()
        orphan.wait()


def test_the_index_answers_plain_sql(tmp_path):
    out = fake_sweep(tmp_path)
    db = sqlite3.connect(out / "sweep.db")
    got = db.execute('SELECT "algorithm.name", avg(final_accuracy), count(*) FROM points '
                     'WHERE "network.dropout.per_round" = 0.3 AND status = \'completed\' '
                     'GROUP BY "algorithm.name" ORDER BY 1').fetchall()
    assert [(a, round(acc, 3), n) for a, acc, n in got] == [("fedavg", 0.605, 2), ("fedsgd", 0.505, 2)]
    # Time to 85% on the fake curves [f - 0.2, f - 0.05, f]: fedavg at dropout 0, seed 1
    # (f = 0.9) reaches it half way from round 2 (0.85 - 0.05 ... exactly at 0.85).
    tt = db.execute('SELECT tt_rounds FROM points WHERE id = ?', ("seed=1,per_round=0,name=fedavg,lr=0.1",)).fetchone()
    assert tt[0] == pytest.approx(2.0)
    db.close()


def test_with_machines_concurrent_points_get_disjoint_groups_of_hosts(tmp_path):
    from fedemu.launch.running.hosts import Host
    from fedemu.launch.running.machines import Machines

    spec = load_spec(write(tmp_path / "s.toml", SWEEP), tmp_path / "sw")
    a, b, c = Host("a"), Host("b"), Host("c", slots=4)
    machines = Machines([a, b, c], ssh_config="cfg")
    layout = plan(spec, 2, None, machines)
    assert [g.hosts for g in layout.host_groups] == [[a, b], [c]]
    assert all(g.ssh_config == "cfg" for g in layout.host_groups)
    assert layout.workers_per_point is None  # each host's slots=, else its cores, as `launch` does
    whole = plan(spec, None, 2, machines)  # by default a point spans every host
    assert whole.parallel == 1 and whole.host_groups[0].hosts == [a, b, c] and whole.workers_per_point == 2
    with pytest.raises(SweepError, match="--parallel 4 with --machines needs at least 4 hosts"):
        plan(spec, 4, None, machines)


def test_a_machines_sweep_hands_each_running_point_a_free_host_group(tmp_path):
    from fedemu.launch.running.hosts import Host
    from fedemu.launch.running.machines import Machines

    held: dict[str, list] = {}
    overlaps: list[tuple] = []
    most_at_once, gave_up = 0, False
    changed = threading.Condition()
    runner = FakeRunner()

    def on_hosts(config, run_dir, *, workers, stop, on_start=None, machines=None):
        nonlocal most_at_once, gave_up
        with changed:
            mine = {h.name for h in machines.hosts}
            overlaps.extend((run_dir.name, other) for other, hs in held.items() if mine & set(hs))
            held[run_dir.name] = list(mine)
            most_at_once = max(most_at_once, len(held))
            changed.notify_all()
            # Until two points have run at once, each waits for a second: a sweep that ran
            # them one at a time would never have two held (and would pass "no overlap").
            # Waited for once at most: such a sweep then fails at once.
            if not changed.wait_for(lambda: most_at_once >= 2 or gave_up, timeout=30):
                gave_up = True
        try:
            return runner(config, run_dir, workers=workers, stop=stop, on_start=on_start)
        finally:
            with changed:
                del held[run_dir.name]

    machines = Machines([Host("a"), Host("b"), Host("c")])
    counts = run(write(tmp_path / "s.toml", SWEEP), tmp_path / "sw", on_hosts, machines=machines)
    assert counts == {"completed": 8} and len(runner.calls) == 8
    assert most_at_once == 2  # --parallel 2: two points ran at once
    assert overlaps == []  # and never shared a host


# --- real points ---------------------------------------------------------------------


def tiny_mnist(cache: Path, n_train: int = 400, n_test: int = 100) -> None:
    """A learnable stand-in for MNIST in a cache folder: class c lights up rows 2c+2..2c+3."""
    from fedemu.common.ml import data

    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.permutation(np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            images[i, 2 + 2 * c: 4 + 2 * c, :] = 220
        arrays[f"{split}_x"], arrays[f"{split}_y"] = images, labels
    data.publish("mnist", arrays, {"source": "synthetic, for tests"}, cache)  # with the sizes and hashes fetch checks


def tiny_sweep(tmp_path: Path) -> Path:
    """A two-point sweep (E = 1, 2) of two-round runs on tiny_mnist; returns its file."""
    tiny_mnist(tmp_path / "cache")
    return write(tmp_path / "s.toml", f"""
[base.run]
rounds = 2
target_accuracy = 0.0
heartbeat_interval_s = 0.2
torch_threads = 1
[base.data]
clients = 4
cache_dir = "{tmp_path / 'cache'}"
[base.algorithm]
C = 0.5
[axes]
"algorithm.E" = [1, 2]
""")


@pytest.mark.slow
def test_a_real_sweep_killed_half_way_resumes_without_redoing_finished_points(tmp_path):
    spec = tiny_sweep(tmp_path)
    # Rounds of half a second of wall time or more: the second point is still running when
    # the test sees it start (a tiny point on the virtual clock can end within a poll).
    text = spec.read_text().replace("[base.run]\n", '[base.run]\nclock = "wall"\n')
    spec.write_text(text + '[base.network]\ndefault_profile = "far"\n[base.network.profiles.far]\nlatency_ms = 250\n')
    out = tmp_path / "sw"
    argv = [sys.executable, "-m", "fedemu.launch", "sweep", str(spec), "--out", str(out), "--parallel", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while status_of(out, "E=2") != "running":
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the second point never started"
        time.sleep(0.2)
    first_events = (out / "runs" / "E=1" / "events.jsonl").read_text()
    os.kill(proc.pid, signal.SIGTERM)  # stop the sweep as a scheduler or Ctrl-C would
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output  # as a shell reports it: 143
    assert "run the same command again to resume" in output
    state = rows(out)
    assert state["E=1"]["status"] == "completed" and state["E=1"]["final_accuracy"] > 0.1
    assert state["E=2"]["status"] == "interrupted"
    assert alive(json.loads(state["E=2"]["pids"]), (out / "runs" / "E=2").resolve()) == []

    result = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 2 points already completed; skipping them" in result.stdout
    state = rows(out)
    assert {r["status"] for r in state.values()} == {"completed"}
    assert state["E=1"]["attempts"] == 1 and state["E=2"]["attempts"] == 2
    assert (out / "runs" / "E=1" / "events.jsonl").read_text() == first_events  # not redone
    assert len([json.loads(x) for x in (out / "runs" / "E=2" / "events.jsonl").read_text().splitlines()
                if '"round"' in x]) == 2


@pytest.mark.slow
def test_in_virtual_time_a_sweep_gives_the_same_table_one_point_at_a_time_or_two(tmp_path):
    """Points side by side share the cores; on the virtual clock that changes nothing:
    --parallel 1 and --parallel 2 give the same figures and the same final weights."""
    spec = tiny_sweep(tmp_path)
    tables = []
    for parallel in (1, 2):
        out = tmp_path / f"p{parallel}"
        done = subprocess.run([sys.executable, "-m", "fedemu.launch", "sweep", str(spec), "--out", str(out),
                               "--parallel", str(parallel)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        figures = ("status", "rounds", "uploads", "final_accuracy", "best_accuracy", "bytes_up", "bytes_down",
                   "emulated_s", "weights_sha256")
        tables.append({pid: {k: row[k] for k in figures} for pid, row in rows(out).items()})
        if parallel == 1:
            # The second point's broker forks from the zygote its first point's nodes
            # readied (LocalRun._forks); the figures are still those of --parallel 2.
            assert "broker forked from the zygote" in (out / "runs" / "E=2" / "logs" / "broker.log").read_text()
    assert tables[0] == tables[1]
    assert {row["status"] for row in tables[0].values()} == {"completed"}
    hashes = {row["weights_sha256"] for row in tables[0].values()}
    assert len(hashes) == 2 and None not in hashes  # E = 1 and E = 2 train differently
