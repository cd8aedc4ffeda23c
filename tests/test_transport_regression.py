"""The ``message`` transport runs as it did before link emulation got its own home.

Issue 42 moved link emulation out of the broker's mixins into one object and added the
``tcp`` transport; ``transport = "message"`` must reproduce earlier runs exactly. A
run's timing (every round's emulated time, bytes, losses, transfer times, who answered
and who straggled) depends only on the link model, the device model and the seed, not
on the CPU's float kernels (unlike the weights, whose last bits differ between CPU
kinds), so it can be pinned. The digests below were computed at commit 97fee91, the
last commit before the move, with ``network_digest`` on the same runs.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedemu.server.runlog import read_events

pytestmark = [pytest.mark.mnist, pytest.mark.slow]

# Every link feature of the message transport at once: per-message loss and
# Gilbert-Elliott, jitter of two distributions, a message queue, per-message overhead,
# the server's shared links, scripted events by round and by time, per-round, window
# and on/off drop-outs, straggler classes.
RICH_NETWORK = {
    "transport": "message",
    "default_profile": "lte", "server_up_bandwidth": "20Mbit", "server_down_bandwidth": "15Mbit",
    "profiles": {
        "sat": {"latency_ms": 300, "jitter_ms": 20, "jitter_distribution": "pareto",
                "up": {"bandwidth": "1Mbit", "loss": 0.05}, "down": {"bandwidth": "10Mbit", "ge_p": 0.1, "ge_r": 0.5}},
        "q": {"latency_ms": 10, "jitter_ms": 5, "jitter_distribution": "normal", "bandwidth": "5Mbit",
              "queue_messages": 3, "overhead_bytes": 40},
    },
    "assign": [{"profile": "sat", "clients": "0-4"}, {"profile": "q", "clients": "5-7"}],
    "events": [{"at_round": 2, "profile": "3g", "clients": "8-11"}, {"at_s": 5, "profile": "cable", "clients": "12-13"}],
    "dropout": {"per_round": 0.1, "windows": [{"clients": "14-15", "start_s": 2, "end_s": 6}],
                "on_off": {"clients": "16-17", "mean_up_s": 5, "mean_down_s": 2}},
    "stragglers": {"distribution": "classes", "classes": [[0.6, 1.0], [0.3, 2.0], [0.1, 5.0]]},
}

# Round events' fields that the network and the device model decide.
TIMING_FIELDS = ("round", "emulated_s", "bytes_up", "bytes_down", "msgs_up", "msgs_down", "lost_up", "lost_down",
                 "transfer_s_up", "transfer_s_down", "selected", "answered", "stragglers", "dropped", "offline",
                 "uploads", "merges", "quorum_missed")


def network_digest(run_dir: Path) -> str:
    rows = [{k: e.get(k) for k in TIMING_FIELDS} for e in read_events(run_dir) if e["event"] == "round"]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def run(tmp_path: Path, name: str, config: dict, *sets: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(_toml(config))
    run_dir = tmp_path / name
    argv = [sys.executable, "-m", "fedemu.launch", "launch", str(path), "--out", str(run_dir), "--workers", "2",
            "--set", "run.target_accuracy=0", *[x for item in sets for x in ("--set", item)]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return run_dir


def _toml(config: dict) -> str:
    """The few shapes these configs use, as TOML (tomllib reads, nothing in the stdlib writes)."""
    def value(v):
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    return "\n".join(f"[{section}]\n" + "\n".join(f"{k} = {value(v)}" for k, v in keys.items())
                     for section, keys in config.items()) + "\n"


# Re-pinned (issue 43) when replies began to carry their local work's span (TrainReply and
# Upload: started_s, ended_s, for the timeline): each reply is a few bytes longer, which
# moves the bytes counted and, with them, the transfer and arrival times.
@pytest.mark.parametrize("algorithm, sets, digest", [
    ("fedavg", ("algorithm.C=0.5", "algorithm.deadline_s=20.0"),
     "43a30683bff463385ee580a08468e4dfff113559077fd12ea562cbe38f72b247"),
    ("fedbuff", (), "5a2e8e1fdd1a37a2abbeeb489a3718c219b984876e1338b9ede08e6db091d499"),
])
def test_the_message_transport_times_runs_as_before(tmp_path, algorithm, sets, digest):
    config = {"run": {"rounds": 3}, "data": {"clients": 20, "partition": "shards"},
              "algorithm": {"name": algorithm}, "network": dict(RICH_NETWORK)}
    if algorithm == "fedbuff":  # asynchronous: no rounds, so no per-round drop-outs
        config["network"] = {**config["network"], "dropout": {k: v for k, v in RICH_NETWORK["dropout"].items()
                                                              if k != "per_round"}}
    run_dir = run(tmp_path, algorithm, config, *sets)
    assert network_digest(run_dir) == digest
