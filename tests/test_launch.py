"""`fedemu launch` end to end: real broker, server and worker processes on real MNIST."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from fedemu.server.runlog import read_events

pytestmark = [pytest.mark.mnist, pytest.mark.slow]

MODEL_BYTES = 199_210 * 4  # one 2NN as float32, the bulk of every model message


def launch(run_dir: Path, *sets: str, workers: int = 2, **popen) -> subprocess.Popen:
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", str(workers),
            "--set", "run.target_accuracy=0", "--set", "run.heartbeat_interval_s=0.2"]
    for item in sets:
        argv += ["--set", item]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def processes_of(run_dir: Path) -> list[int]:
    """Pids of live processes whose command line names this run directory."""
    out = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


def wait_for_round(run_dir: Path, round_: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["event"] == "round" and e["round"] >= round_ for e in read_events(run_dir)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"round {round_} never finished"
        time.sleep(0.2)


def node_pid(run_dir: Path, name: str) -> int:
    role, _, index = name.partition("-")
    pattern = f"node {role} " + (f"--index {index} " if index else "") + f".*--run-dir {run_dir}"
    out = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"expected one {name} process, found {out}"
    return int(out[0])


def test_short_run_trains_and_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "run.rounds=5")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert "round    5/5" in output  # live progress was shown

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["rounds"] == 5
    # Five FedAvg rounds of 10 IID clients: about 0.90 on MNIST (measured 0.896).
    assert summary["final_accuracy"] >= 0.85
    for key in ("final_accuracy", "rounds", "wall_s", "bytes_up", "bytes_down", "status"):
        assert key in summary

    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["algorithm"]["C"] == 0.1 and config["run"]["rounds"] == 5

    events = read_events(run_dir)
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2, 3, 4, 5]
    for e in events:
        assert isinstance(e["t"], float)
    for e in rounds:
        assert {"accuracy", "loss", "participants", "bytes_up", "bytes_down"} <= set(e)
        assert e["participants"] == 10
        # Ten models went up and ten came down through the broker, plus small envelopes.
        assert 10 * MODEL_BYTES <= e["bytes_up"] <= 10 * (MODEL_BYTES + 4096)
        assert 10 * MODEL_BYTES <= e["bytes_down"] <= 10 * (MODEL_BYTES + 4096)
        assert len(e["selected"]) == 10 and e["answered"] == e["selected"]
    assert sum(e["bytes_up"] for e in rounds) == summary["bytes_up"]
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"]

    for name in ("broker", "server", "worker-0", "worker-1"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
    assert processes_of(run_dir) == []


def test_same_seed_same_model(tmp_path):
    """A deterministic synchronous run: the same seed gives the same accuracies."""
    results = []
    for name in ("a", "b"):
        # One torch thread in both: thread count, not placement, changes float sums.
        proc = launch(tmp_path / name, "run.rounds=2", "run.torch_threads=1", workers=2 if name == "a" else 1)
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        results.append([(e["accuracy"], e["loss"], e["selected"]) for e in read_events(tmp_path / name)
                        if e["event"] == "round"])
    # Different worker counts, same clients, same seeds: placement must not change the model.
    assert results[0] == results[1]


def test_ctrl_c_stops_every_process_and_keeps_the_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "run.rounds=1000", "run.pool_nice=10", start_new_session=True)
    wait_for_round(run_dir, 2, proc)
    worker = node_pid(run_dir, "worker-0")
    stats = {int(tid): Path(f"/proc/{worker}/task/{tid}/stat").read_text() for tid in os.listdir(f"/proc/{worker}/task")}
    nice = {tid: int(stat.rsplit(")", 1)[1].split()[16]) for tid, stat in stats.items()}  # stat field 19
    assert nice[worker] == 0 and 10 in nice.values()  # the training thread yields; the node's own do not
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted", output
    events = read_events(run_dir)
    assert events[-1]["event"] == "end"
    assert summary["rounds"] == max(e["round"] for e in events if e["event"] == "round")
    assert processes_of(run_dir) == []


def test_killed_worker_node_is_seen_as_down_and_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "run.rounds=8", "run.heartbeat_timeout_s=2.0")
    wait_for_round(run_dir, 2, proc)
    os.kill(node_pid(run_dir, "worker-1"), signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output

    events = read_events(run_dir)
    faults = [e for e in events if e["event"] == "fault"]
    # worker-1 hosted clients 50..99 (contiguous placement over two nodes).
    assert sorted(e["client"] for e in faults) == list(range(50, 100))
    assert {e["reason"] for e in faults} == {"noconnection: worker-1 killed by SIGKILL"}  # as the launcher saw it
    rounds = [e for e in events if e["event"] == "round"]
    assert len(rounds) == 8
    late = [e for e in rounds if e["round"] > max(f["round"] for f in faults)]
    assert late, "no round ran after the fault"
    for e in late:  # only clients of the surviving node are selected, and all answer
        assert all(k < 50 for k in e["selected"]) and e["participants"] == 10
    assert json.loads((run_dir / "summary.json").read_text())["faults"] == 50
    assert processes_of(run_dir) == []


def test_a_silent_worker_makes_stragglers_not_a_hang(tmp_path):
    """A stopped (not dead) node answers nothing: rounds close at their deadline."""
    run_dir = tmp_path / "run"
    deadline_s = 8.0  # what worker-0's clients must beat, in wall time: ample on a loaded host
    # Wall clock: in virtual time a stopped node holds the clock (it never reports idle)
    # until it is declared lost, so its clients are faults there, not stragglers.
    proc = launch(run_dir, "run.clock=wall", "run.rounds=4", "run.heartbeat_timeout_s=60",
                  f"algorithm.deadline_s={deadline_s}")
    wait_for_round(run_dir, 1, proc)
    worker = node_pid(run_dir, "worker-1")
    os.kill(worker, signal.SIGSTOP)
    try:
        wait_for_round(run_dir, 3, proc)
    finally:
        os.kill(worker, signal.SIGCONT)  # its late replies must then be ignored as stale
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    rounds = [e for e in read_events(run_dir) if e["event"] == "round"]
    assert len(rounds) == 4
    stalled = [e for e in rounds[1:] if e["stragglers"]]
    assert stalled, "no round recorded stragglers"
    for e in stalled:
        assert all(k >= 50 for k in e["stragglers"])  # the stopped node's clients
        assert e["participants"] == len(e["selected"]) - len(e["stragglers"])
        assert e["aggregated"] == (e["participants"] >= 1)
        # It waited out its deadline, and then closed (not a hang): aggregation,
        # evaluation and the log take well under the margin.
        assert deadline_s <= e["round_s"] < deadline_s + 10
    deadline = time.monotonic() + 30  # the launcher has returned: its processes are ending or gone
    while processes_of(run_dir):
        assert time.monotonic() < deadline, processes_of(run_dir)
        time.sleep(0.2)


def broker_pid(run_dir: Path) -> int:
    out = subprocess.run(["pgrep", "-f", "--", f"fedemu.launch broker .*{run_dir}"], capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 1, f"expected one broker process, found {out}"
    return int(out[0])


def test_a_lost_broker_fails_the_run_and_keeps_its_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "run.rounds=1000", "run.heartbeat_timeout_s=2.0")
    wait_for_round(run_dir, 2, proc)
    os.kill(broker_pid(run_dir), signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", output
    assert "broker" in summary["reason"]
    events = read_events(run_dir)
    assert [e["round"] for e in events if e["event"] == "round"][:2] == [1, 2]  # nothing written was lost
    assert events[-1]["event"] == "end" and events[-1]["status"] == "failed"
    assert processes_of(run_dir) == []


def test_a_lost_server_fails_the_run_and_keeps_its_log(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "run.rounds=1000")
    wait_for_round(run_dir, 2, proc)
    os.kill(node_pid(run_dir, "server"), signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", output
    assert "the server node ended (killed by SIGKILL) without a summary" in summary["reason"]
    assert [e["round"] for e in read_events(run_dir) if e["event"] == "round"][:2] == [1, 2]
    assert processes_of(run_dir) == []


def crash_client(run_dir: Path, k: int) -> None:
    """Make client k crash for real: send it a model of the wrong size, as a buggy peer
    could, from a node of our own on the run's broker."""
    import numpy as np

    from fedemu.node import Node
    from fedemu.node.security import load_token
    from fedemu.common.messages import TRAIN, TrainRequest

    node = Node("crasher", (run_dir / "broker.endpoint").read_text().strip(),
                token=load_token(run_dir / "run.token")).start()  # a node of the run: it holds the token
    try:
        pid = node.whereis(f"client/{k}")
        assert pid is not None
        faults = sum(e["event"] == "fault" for e in read_events(run_dir))
        node.send(pid, TrainRequest(round=0, task=TRAIN, weights=np.zeros(3, np.float32), epochs=1,
                                    batch_size=10, lr=0.1, seed=0))
        deadline = time.monotonic() + 60  # stay connected until the crash is seen
        while sum(e["event"] == "fault" for e in read_events(run_dir)) == faults:
            assert time.monotonic() < deadline, f"client {k} did not crash"
            time.sleep(0.2)
    finally:
        node.close("done")


def test_a_crashed_client_is_restarted_by_its_supervisor_up_to_the_limit(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "run.rounds=1000", "data.clients=10", "algorithm.C=1.0", "run.restart_clients=1")
    wait_for_round(run_dir, 1, proc)
    crash_client(run_dir, 3)
    deadline = time.monotonic() + 120
    while not any(e["event"] == "restart" for e in read_events(run_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, "no restart event"
        time.sleep(0.2)
    restart = next(e for e in read_events(run_dir) if e["event"] == "restart")
    wait_for_round(run_dir, restart["round"] + 1, proc)  # a full round after the restart
    crash_client(run_dir, 3)  # the second crash is over the limit of one restart
    after = max(e["round"] for e in read_events(run_dir) if e["event"] == "round")
    wait_for_round(run_dir, after + 2, proc)  # after + 1 may have begun before the crash
    os.kill(node_pid(run_dir, "server"), signal.SIGINT)
    output, _ = proc.communicate(timeout=120)

    events = read_events(run_dir)
    faults = [e for e in events if e["event"] == "fault"]
    assert [e["client"] for e in faults] == [3, 3], output
    assert all(e["reason"].startswith("crash: ValueError") for e in faults)
    assert [e["client"] for e in events if e["event"] == "restart"] == [3]  # once, not after the second crash
    rounds = {e["round"]: e for e in events if e["event"] == "round"}
    assert 3 in rounds[restart["round"] + 1]["answered"]  # the restarted client trains again
    assert 3 not in rounds[max(rounds)]["selected"]  # over the limit it stays down
    assert processes_of(run_dir) == []


def test_k_fold_runs_hold_out_one_fifth_of_all_70000_images(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, "run.rounds=1", "data.folds=5", "data.fold=2", workers=1)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    assert start["dataset"] == "mnist fold 2 of 5" and start["test_samples"] == 14_000
    assert json.loads((run_dir / "summary.json").read_text())["final_accuracy"] > 0.5


def test_a_server_stopped_by_the_signal_before_its_handler_leaves_an_interrupted_summary(tmp_path):
    """A sweep stopped while a point's server still starts up: the server dies of the
    SIGINT it was sent (its handler not installed yet). Its summary says interrupted, as
    the sweep's index does, not "failed ... killed by SIGINT"."""
    from fedemu.launch import config as configuration
    from fedemu.launch.running.local import LocalRun

    (tmp_path / "logs").mkdir()
    run = LocalRun(configuration.default(), tmp_path, 1, echo=lambda line: None)
    starting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    run.procs["server"] = starting
    run.interrupted_by = signal.SIGINT
    run.interrupt()
    starting.wait(30)
    summary = run.summary()
    assert summary["status"] == "interrupted" and "SIGINT" in summary["reason"], summary
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
