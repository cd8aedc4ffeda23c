"""Heterogeneity from traces, on real runs (real broker, nodes and MNIST): a FedScale
population drives compute and availability, a Mahimahi trace an uplink's rate, and
FedBuff runs at a fixed concurrency."""
from __future__ import annotations

import csv
import hashlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from fedemu.node.net.traces import RateTrace
from fedemu.server.runlog import read_events

pytestmark = [pytest.mark.mnist, pytest.mark.slow]

TINY = ("data.partition=sample", "data.examples_per_client=20", "run.target_accuracy=0")


def launch(run_dir: Path, config_text: str, *sets: str, workers: int = 1) -> subprocess.CompletedProcess:
    path = run_dir.parent / f"{run_dir.name}.toml"
    path.write_text(config_text)
    argv = [sys.executable, "-m", "fedemu.launch", "launch", str(path), "--out", str(run_dir),
            "--workers", str(workers), *[x for item in (*TINY, *sets) for x in ("--set", item)]]
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    return done


def rounds_of(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "round"]


def test_a_fedscale_population_drives_two_clients_compute_and_availability(tmp_path):
    """Client 0 is always online; client 1 is offline from 1 s to 12 s (FedScale's
    behaviour trace, repeating every 1,000 s). Their devices take 2 and 5 ms per
    sample of inference (FedScale's capacity trace), so 20 examples train in 3 x 20 x
    2 ms = 0.12 s and 0.3 s; client 0 is also a 3x straggler, which multiplies."""
    devices, behaviour = tmp_path / "client_device_capacity", tmp_path / "client_behave_trace"
    devices.write_bytes(pickle.dumps({101: {"computation": 2.0, "communication": 5000.0},
                                      102: {"computation": 5.0, "communication": 800.0}}))
    behaviour.write_bytes(pickle.dumps({
        "a": {"active": [0], "inactive": [1000], "finish_time": 1000, "duration": 1000, "model": "Pixel"},
        "b": {"active": [0, 12], "inactive": [1, 1000], "finish_time": 1000, "duration": 1000, "model": "Moto"}}))
    run_dir = tmp_path / "run"
    launch(run_dir, f"""
[data]
clients = 2
[algorithm]
C = 1.0
deadline_s = 5.0
[run]
rounds = 6
client_log = "csv"
[network.traces.devices]
file = "{devices}"
use = ["compute"]
[network.traces.behaviour]
file = "{behaviour}"
[network.stragglers]
distribution = "fixed"
factor = 3.0
clients = "0"
""")
    rounds = rounds_of(run_dir)
    # Rounds end when both answered (client 0's 0.36 s hold), or at the 5 s deadline
    # while client 1 is offline: round 3 began at 0.72 s and client 1 went offline at
    # 1 s, before its 0.3 s of training ended; rounds 4 and 5 began while it was offline.
    assert [e["emulated_s"] for e in rounds] == pytest.approx([0.36, 0.72, 5.72, 10.72, 15.72, 16.08], abs=1e-9)
    assert [e["offline"] for e in rounds] == [[], [], [1], [1], [], []]  # back at 12 s
    with open(run_dir / "clients.csv", newline="") as f:  # client_log = "csv": a row per client and round
        rows = list(csv.DictReader(f))
    # The server saw client 1 straggle in rounds 3-5; the emulator knows it was offline.
    assert [[int(r["client"]) for r in rows if int(r["round"]) == e["round"] and r["seen"] == "straggler"]
            for e in rounds] == [[], [], [1], [1], [1], []]
    assert [[int(r["client"]) for r in rows if int(r["round"]) == e["round"] and r["outcome"] == "offline"]
            for e in rounds] == [[], [], [1], [1], [1], []]
    charged = {(int(r["round"]), int(r["client"])): r for r in rows if r["outcome"] == "answered"}
    for (round_, k), row in charged.items():
        assert float(row["compute_s"]) == pytest.approx(0.12 if k == 0 else 0.30, rel=1e-12)
        assert float(row["slowdown"]) == (3.0 if k == 0 else 1.0)
    assert sorted(charged) == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (4, 0), (5, 0), (6, 0), (6, 1)]
    start = next(e for e in read_events(run_dir) if e["event"] == "start")
    assert start["traces"]["behaviour"] == {str(behaviour): hashlib.sha256(behaviour.read_bytes()).hexdigest()}
    assert json.loads((run_dir / "population.json").read_text())["compute"]["1"] == {"example_s": pytest.approx(0.015)}


@pytest.mark.parametrize("transport", ["message", "tcp"])
def test_an_uplink_following_a_mahimahi_trace_takes_the_time_its_rate_steps_imply(tmp_path, transport):
    """One client; its uplink serves one 1500-byte packet per ms for 300 ms, then four,
    repeating each second. Its first upload (a 2NN, 800 kB) enters after 24 ms of
    training and ends at the faster rate: exactly when the trace says down the
    ``message`` pipe; under TCP no sooner, and sooner than had the rate not stepped up."""
    trace = tmp_path / "step.up"
    trace.write_text("".join(f"{t}\n" * (1 if t <= 300 else 4) for t in range(1, 1001)))
    run_dir = tmp_path / "run"
    launch(run_dir, f"""
[data]
clients = 1
[algorithm]
C = 1.0
[run]
rounds = 2
[network]
transport = "{transport}"
[network.traces.cell]
file = "{trace}"
direction = "up"
""")
    rate = RateTrace.from_mahimahi(trace.read_text().splitlines())
    first = rounds_of(run_dir)[0]
    entry = first["compute_s_max"]  # the model came down an ideal link at once; then training
    assert 0.0 < entry < 0.3
    finish = rate.finish(entry, first["bytes_up"])
    assert finish > 0.3 + 1e-3  # the rate stepped up while the upload was on the link
    if transport == "message":
        # (the broker's books round to the microsecond)
        assert first["transfer_s_up"] == pytest.approx(finish - entry, abs=1e-6)
        assert first["emulated_s"] == pytest.approx(finish, abs=1e-6)
    else:
        # TCP sends headers too, and sees a rate once per round trip (docs/network.md).
        assert finish - entry < first["transfer_s_up"] < first["wire_bytes_up"] / 1500e3
        assert first["emulated_s"] == pytest.approx(entry + first["transfer_s_up"], abs=2e-6)


def tasks_of(run_dir: Path) -> list[dict]:
    with open(run_dir / "tasks.csv", newline="") as f:
        return list(csv.DictReader(f))


def most_at_once(tasks: list[dict], end: float) -> int:
    """The most tasks running at any instant (a task holds [start, end))."""
    edges = sorted([(float(t["start_s"]), 1) for t in tasks] +
                   [(float(t["end_s"]) if t["end_s"] else end, -1) for t in tasks], key=lambda e: (e[0], e[1]))
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


def test_fedbuff_with_concurrency_10_keeps_at_most_10_clients_training(tmp_path):
    """30 clients of varied speed (per-update lognormal stragglers), at most 10 training
    at once: every upload ends a task and starts another; no instant has more than 10."""
    run_dir = tmp_path / "run"
    launch(run_dir, """
[data]
clients = 30
[algorithm]
name = "fedbuff"
concurrency = 10
buffer_size = 5
eval_every_uploads = 10
[run]
rounds = 6
[network.stragglers]
distribution = "lognormal"
sigma = 1.0
per_round = true
""", workers=2)
    tasks, rounds = tasks_of(run_dir), rounds_of(run_dir)
    end = rounds[-1]["emulated_s"]
    assert most_at_once(tasks, end) == 10
    assert sum(1 for t in tasks if float(t["start_s"]) == 0.0) == 10  # ten start, not all 30
    assert all(e["training"] <= 10 for e in rounds)
    uploaded = [t for t in tasks if t["outcome"] == "uploaded"]
    assert len(uploaded) == sum(e["uploads"] for e in rounds) == 60
    assert len({t["client"] for t in tasks}) > 10  # places went to other clients as tasks ended
    starts = sorted(float(t["start_s"]) for t in tasks)
    assert len(set(starts)) > 10  # started as others ended, not all at once


def test_a_timed_out_task_goes_to_another_client_and_its_own_waits_for_its_check_in(tmp_path):
    """Clients 0-4 are offline for the first 50 s. A task sent to one of them times out
    after 5 s; the server starts another client instead, and does not choose that one
    again until its device is back online and checks in."""
    run_dir = tmp_path / "run"
    launch(run_dir, """
[data]
clients = 10
[algorithm]
name = "fedbuff"
concurrency = 5
client_timeout_s = 5.0
buffer_size = 5
eval_every_uploads = 10
[run]
rounds = 4
[network.dropout]
windows = [{ clients = "0-4", start_s = 0, end_s = 50 }]
""")
    tasks = tasks_of(run_dir)
    timed_out = [t for t in tasks if t["outcome"] == "timeout"]
    assert timed_out and all(int(t["client"]) < 5 for t in timed_out)
    assert all(float(t["end_s"]) == pytest.approx(float(t["start_s"]) + 5.0) for t in timed_out)
    for t in timed_out:
        later = [float(u["start_s"]) for u in tasks if u["client"] == t["client"] and int(u["task"]) > int(t["task"])]
        assert all(start >= 50.0 for start in later)  # chosen again only once back online
    # Each timeout freed its place at once: another task started at that instant.
    assert all(any(float(u["start_s"]) == float(t["end_s"]) for u in tasks) for t in timed_out)
    assert most_at_once(tasks, rounds_of(run_dir)[-1]["emulated_s"]) <= 5


def test_fedasync_clients_arrive_as_a_poisson_process_up_to_the_concurrency(tmp_path):
    """FLSim's arrivals, capped at 4 at once; the same run on one worker node and on two
    (and beside whatever else loads the host) starts the same tasks at the same times
    and ends with the same weights."""
    run_dir, again = tmp_path / "run", tmp_path / "again"
    config = """
[data]
clients = 20
[algorithm]
name = "fedasync"
concurrency = 4
arrival_rate = 20.0
eval_every_uploads = 10
[run]
rounds = 3
"""
    launch(run_dir, config)
    launch(again, config, workers=2)
    tasks = tasks_of(run_dir)
    assert tasks_of(again) == tasks
    summaries = [json.loads((d / "summary.json").read_text()) for d in (run_dir, again)]
    assert summaries[0]["weights_sha256"] == summaries[1]["weights_sha256"]
    starts = sorted(float(t["start_s"]) for t in tasks)
    assert starts[0] > 0.0 and len(set(starts)) == len(starts)  # one at a time, from the first arrival on
    assert most_at_once(tasks, rounds_of(run_dir)[-1]["emulated_s"]) <= 4
    assert sum(t["outcome"] == "uploaded" for t in tasks) == 30
