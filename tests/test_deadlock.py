"""Deadlock and liveness on real runs: Theorem A.1's construction, its counterpart, and
the progress watchdog."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from fedemu.server.runlog import read_events

from .test_launch import launch, node_pid, processes_of, wait_for_round

pytestmark = [pytest.mark.mnist, pytest.mark.slow]

# b_l = 3, b_u = 5 < 2 b_l, K = 20 >= b_u - b_l + 1 (Theorem A.1). Clients 3..19 are
# devices behind a slow uplink: whatever they send takes SLOW_UP_S (emulated, so the
# same on any host) to reach the server, while clients 0, 1, 2 ask and upload at once.
# So the first b_u - b_l + 1 = 3 uploads come from distinct clients 0, 1, 2 (a fast
# client cannot upload twice before a = 7): they need a few trainings of worker-0's
# clients one after another and one evaluation, a small part of SLOW_UP_S even on a slow,
# loaded host. The slow ones first ask the age when a = b_u + 1, find themselves
# outdated, fetch, and are over-active like everyone else. retry_s (120 emulated s) is
# far above their round trip, so nothing is resent. The ``message`` pipe: every message
# takes SLOW_UP_S whatever its size (TCP's windows would make a model's upload take
# several such round trips).
SLOW_UP_S = 8
CONSTRUCTION = ["data.clients=20", "algorithm.name=coop", "algorithm.b_l=3", "algorithm.E=1", "algorithm.B=50",
                "algorithm.eval_every_uploads=2", "run.rounds=6", "algorithm.retry_s=120", "network.transport=message",
                f"network.profiles.slow.up.latency_ms={SLOW_UP_S * 1000}",
                "network.assign=[{profile='slow', clients='3-19'}]"]


def test_theorem_a1_construction_is_detected_as_a_deadlock(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *CONSTRUCTION, "algorithm.b_u=5", "algorithm.accept_deadlock_risk=true")
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, output
    events = read_events(run_dir)
    deadlock = [e for e in events if e["event"] == "deadlock"]
    assert len(deadlock) == 1, output
    assert "every live client is over-active" in deadlock[0]["cause"]
    assert deadlock[0]["age"] == 6  # a = b_u + 1 after b_u - b_l + 1 = 3 uploads
    assert sorted(deadlock[0]["ages"].values()) == [4, 5] + [6] * 18  # three uploaders, 17 fetchers
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"].startswith("deadlock")
    assert summary["uploads"] == 3
    assert processes_of(run_dir) == []


def test_the_same_load_with_b_u_at_least_2_b_l_runs_to_completion(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *CONSTRUCTION, "algorithm.b_u=6")  # b_u = 2 b_l: no risk to accept
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    events = read_events(run_dir)
    assert not [e for e in events if e["event"] == "deadlock"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["uploads"] == 12  # 6 evaluations x 2 uploads


def test_recovery_instead_of_stopping(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(run_dir, *CONSTRUCTION, "algorithm.b_u=5", "algorithm.accept_deadlock_risk=true",
                  "algorithm.on_deadlock=recover")
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    events = read_events(run_dir)
    recovered = [e for e in events if e["event"] == "recovered"]
    assert recovered and recovered[0]["age_after"] > recovered[0]["age_before"]
    assert json.loads((run_dir / "summary.json").read_text())["uploads"] == 12


def test_watchdog_reports_a_round_waiting_without_a_deadline(tmp_path):
    run_dir = tmp_path / "run"
    progress_timeout_s = 10  # wall seconds: far beyond how long an answering client takes, even on a loaded host
    # Wall clock: in virtual time every reply of a round waits for the stopped node's
    # instant, so the stall would name every client still to answer, not only its own.
    proc = launch(run_dir, "run.clock=wall", "run.rounds=3", "algorithm.deadline_s=0",
                  f"run.progress_timeout_s={progress_timeout_s}", "run.heartbeat_timeout_s=60")
    wait_for_round(run_dir, 1, proc)
    worker = node_pid(run_dir, "worker-1")
    os.kill(worker, signal.SIGSTOP)

    def stalls() -> list:  # after round 1: while worker-1 is stopped
        return [e for e in read_events(run_dir) if e["event"] == "stall" and e["round"] >= 2]

    try:
        deadline = time.monotonic() + progress_timeout_s + 60
        while not stalls():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no stall event"
            time.sleep(0.2)
    finally:
        os.kill(worker, signal.SIGCONT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    found = stalls()
    # The stopped node's clients, and only they, kept a round waiting.
    assert any(e["waiting_for"] and all(k >= 50 for k in e["waiting_for"]) for e in found), found
    assert all("no deadline" in e["cause"] for e in found)
