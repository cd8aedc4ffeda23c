"""The Python API (fedemu.launch.api): a run started from a dict, followed event by
event, read as records and stopped, with real broker, server and worker processes."""
from __future__ import annotations

import time

import pytest

from fedemu.launch import api
from fedemu.server.runlog import read_events

from .test_launch import processes_of

SMALL = {"data": {"clients": 10}, "algorithm": {"C": 0.5, "B": 50},
         "run": {"target_accuracy": 0.0, "heartbeat_interval_s": 0.2}}


def test_a_bad_config_raises_at_once_and_starts_nothing(tmp_path):
    with pytest.raises(api.ConfigError, match=r"algorithm.C = 2.0 is out of range"):
        api.start({"algorithm": {"C": 2}}, out=tmp_path / "run")
    with pytest.raises(api.ConfigError, match="unknown key algorithm.mue"):
        api.resolve({"algorithm": {"name": "fedprox", "mue": 0.1}})
    assert not (tmp_path / "run").exists()
    # The dict sits between the file and the overrides.
    resolved = api.resolve({"algorithm": {"name": "fedprox", "mu": 0.1}}, overrides=["algorithm.mu=0.2"])
    assert resolved["algorithm"]["mu"] == 0.2 and resolved["algorithm"]["name"] == "fedprox"


@pytest.mark.mnist
@pytest.mark.slow
def test_start_follow_and_read_a_run(tmp_path):
    run = api.start({**SMALL, "run": {**SMALL["run"], "rounds": 3}, "algorithm": {**SMALL["algorithm"],
                     "name": "fedprox", "mu": 0.1}}, out=tmp_path / "run")
    try:
        events = list(run.events())
    finally:
        run.stop()
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert [e["round"] for e in events if e["event"] == "round"] == [1, 2, 3]
    assert events == read_events(run.dir)  # every event, in the order written
    summary = run.summary
    assert summary["status"] == "completed" and summary["algorithm"] == "fedprox"
    history = run.history()
    assert [r["round"] for r in history] == [1, 2, 3]
    assert history[-1]["accuracy"] == summary["final_accuracy"] and history[0]["algorithm"] == "fedprox"
    assert api.history(run.dir) == history
    assert 'mu = 0.1' in (run.dir / "config.toml").read_text()


@pytest.mark.mnist
@pytest.mark.slow
def test_stop_ends_a_run_in_order_and_leaves_no_process(tmp_path):
    run = api.start({**SMALL, "run": {**SMALL["run"], "rounds": 10_000}}, out=tmp_path / "run")
    try:
        for event in run.events():
            if event["event"] == "round" and event["round"] >= 2:
                break
        summary = run.stop()
    finally:
        if run.running:
            run.process.kill()
    assert summary["status"] == "interrupted"
    assert read_events(run.dir)[-1]["event"] == "end"
    deadline = time.monotonic() + 10
    while processes_of(run.dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(run.dir) == []
