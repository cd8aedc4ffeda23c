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
import os
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


# --- issue 51: the house moved; every rule's run must be bit for bit as before ----------------
#
# Five rules (both kinds of engine, both halves of each algorithm: FedProx's proximal term,
# FSVRG's two phases, CO-OP's age filter, FedBuff's deltas) on both transports, each with
# loss and drop-outs, on the virtual clock. Two fingerprints per run:
#
# * ``network``: the round events' fields the network and the device model decide
#   (TIMING_FIELDS): it depends on no float kernel, so it holds on any CPU;
# * ``run``: every event but its wall-clock fields, and the final weights' hash: these
#   depend on the CPU's float kernels (docs/usage.md, "Time"), so they are pinned per
#   platform (PLATFORM below) and checked where the platform matches.
#
# The values were recorded at commit 997b94a, the last commit before issue 51's move.

PINNED_DATA = {"clients": 20, "partition": "sample", "examples_per_client": 100}
LOSSY_TCP = {
    "transport": "tcp",
    "default_profile": "lte", "server_up_bandwidth": "20Mbit", "server_down_bandwidth": "15Mbit",
    "profiles": {
        "sat": {"latency_ms": 300, "jitter_ms": 20, "jitter_distribution": "pareto",
                "up": {"bandwidth": "1Mbit", "loss": 0.02}, "down": {"bandwidth": "10Mbit", "ge_p": 0.01, "ge_r": 0.5}},
        "wifi": {"latency_ms": 10, "jitter_ms": 5, "jitter_distribution": "normal", "bandwidth": "5Mbit",
                 "loss": 0.01},
    },
    "assign": [{"profile": "sat", "clients": "0-4"}, {"profile": "wifi", "clients": "5-7"}],
    "events": [{"at_round": 2, "profile": "3g", "clients": "8-11"}, {"at_s": 5, "profile": "cable", "clients": "12-13"}],
    "dropout": RICH_NETWORK["dropout"],
    "stragglers": RICH_NETWORK["stragglers"],
}
PINNED_NETWORKS = {"message": RICH_NETWORK, "tcp": LOSSY_TCP}
PINNED_RULES = {
    "fedavg": {"name": "fedavg", "C": 0.5, "deadline_s": 20.0},
    "fedprox": {"name": "fedprox", "mu": 0.1, "C": 0.5, "deadline_s": 20.0},
    "fsvrg": {"name": "fsvrg", "deadline_s": 60.0},
    "coop": {"name": "coop", "b_l": 2, "b_u": 6, "eval_every_uploads": 5, "retry_s": 30.0},
    "fedbuff": {"name": "fedbuff", "buffer_size": 3, "eval_every_uploads": 5, "retry_s": 30.0},
}
WALL_FIELDS = {"t", "round_s", "wall_s", "placement"}  # real time, and where the clients ran


def platform_key() -> str:
    """What decides a run's float results besides fedemu: the CPU's vendor and the
    instruction set torch's kernels dispatch to, and the torch and NumPy builds."""
    import platform

    import numpy
    import torch

    vendor = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("vendor_id")), platform.processor() or "unknown") \
        if Path("/proc/cpuinfo").exists() else platform.processor() or "unknown"
    return (f"{platform.machine()} {vendor} {torch.backends.cpu.get_cpu_capability()} torch {torch.__version__} "
            f"numpy {numpy.__version__}")


def run_digest(run_dir: Path) -> tuple[str, str]:
    """(every event but its wall-clock fields, as a sha256; the final weights' sha256)."""
    events = [{k: v for k, v in e.items() if k not in WALL_FIELDS} for e in read_events(run_dir)]
    summary = json.loads((run_dir / "summary.json").read_text())
    return hashlib.sha256(json.dumps(events, sort_keys=True).encode()).hexdigest(), summary["weights_sha256"]


# (rule, transport) -> network digest, on any platform
NETWORK_PINS: dict[tuple[str, str], str] = {
    ("fedavg", "message"): "1006e8c7b72edff3f2d1c071c501c0af8cc09cfc904b05a2ed56f30027274a15",
    ("fedavg", "tcp"): "f4b6be87e5debcbcabbb1e1cb738568d84f0df3cb3621233cac2763464ba57db",
    ("fedprox", "message"): "1006e8c7b72edff3f2d1c071c501c0af8cc09cfc904b05a2ed56f30027274a15",
    ("fedprox", "tcp"): "f4b6be87e5debcbcabbb1e1cb738568d84f0df3cb3621233cac2763464ba57db",
    ("fsvrg", "message"): "8f696a994179969e6f64ca2bd8355d0693473fd8769518677e3504b4d4989bba",
    ("fsvrg", "tcp"): "ea95152061684b7dc9fb591ec3493012c4938024318eaf23f5d416e529e055f0",
    ("coop", "message"): "2188b1d0f6defca9d3e7ee72492922e7b43813f32eb7fdc8fb307345f463aaee",
    ("coop", "tcp"): "ed2651c12d59e4a8cd9ef9df10949983653df2c5b6f5d8252547d782e0623196",
    ("fedbuff", "message"): "55577b7d00c34758762e06ad1933fc29d78a87712311f8c4b0e7f007e591b3fa",
    ("fedbuff", "tcp"): "1bb423970b15f8dbc62d2b9cc3f299910100a44728cad1ab71fce9df43280cc8",
}
# platform -> (rule, transport) -> (events digest, weights_sha256)
RUN_PINS: dict[str, dict[tuple[str, str], tuple[str, str]]] = {
    "x86_64 GenuineIntel AVX512 torch 2.13.0+cpu numpy 2.4.6": {
        ("fedavg", "message"): ("7a62a6cb47342d45636c6405a246baab4ef57f2e14fda992bc996c633e291f8e",
         "94dcb39314b6751cf29cd63a745e45333330b4ba0bc16d1210f0fa2252650ec3"),
        ("fedavg", "tcp"): ("63a85cbf6a332a34b12ce7a72b18732c8bcd5acf728859862f06611d66bdf518",
         "3ba0c12159e2e8d789e42464e928fbddbcb3cb79ab09e134273d85d6c9d8d038"),
        ("fedprox", "message"): ("7c805de132f3ddc795678d9ecbd98da5a709c19f264a8f084b2b436cc482549c",
         "90039fcd58d4b98db100b954c9833e61ccfa00250ac403c083dcdde54ff39356"),
        ("fedprox", "tcp"): ("f5c0c4008e0defb863c6e7c70962c2042c471376a610eb6fffeb7e1d365d8387",
         "86ea79bb6b39d2e34702ce91c27fadefec6b6be4febafa8bdcd5c5d8b758ea82"),
        ("fsvrg", "message"): ("9314609b669b3ddfe1e5671323030574b2fe9e958b0a86bcd3fc870c5b41466b",
         "0239e3f85b3b5ac736d1fd41f48ade9e67180d4108e9cbae03641c0168696f0d"),
        ("fsvrg", "tcp"): ("514dc3c2cf0bc6526f5a8279b16e1f65ee3f45c7e0b0d8fca4a45ec6e8247889",
         "83ca1212715cf8fc8df712917a5f4cf7af7ab67448eef7183b44c66a3ff77d13"),
        ("coop", "message"): ("fc9b88311350315f51b9a126ae6d89a5e7b48bd7b1822ccb7422dab1378da07c",
         "d0dcebd45ad1645e2a894e69da68a51c51c4872fde31568aac3548364ece5a5f"),
        ("coop", "tcp"): ("661db102cd94a7cef0da9a3ea84480a596b968f80e1acce0c60ac461b8fced42",
         "f8a13c7c7e1f8505d1371b8c813d98ae65475e8cb94ef56397d6e71cacc12634"),
        ("fedbuff", "message"): ("93a4055a1d9ecbea54e1dceef7f4f7cf8bb3d225cbd481618b9fc1c0e642a57c",
         "7dc2c4b2684b5ba1416bb3fac47957c277f35adfa8e3b0ae012db53f7ab8c5f6"),
        ("fedbuff", "tcp"): ("01220e485d2a5afefc62c9f167f100dbd639965a8cb2d00d40c8cd6803fc1295",
         "5dcc927f833b71766ac4f539924368349364fc9d209f8af219ec4446198c42b8"),
    },
}


@pytest.mark.parametrize("transport", ["message", "tcp"])
@pytest.mark.parametrize("rule", list(PINNED_RULES))
def test_every_rule_runs_bit_for_bit_as_before_the_move(tmp_path, rule, transport):
    network = dict(PINNED_NETWORKS[transport])
    if not PINNED_RULES[rule]["name"] in ("fedavg", "fedprox", "fsvrg"):  # asynchronous: no per-round drop-outs
        network["dropout"] = {k: v for k, v in network["dropout"].items() if k != "per_round"}
    config = {"run": {"rounds": 3}, "data": PINNED_DATA, "model": {"name": "2nn"},
              "algorithm": {"E": 1, "B": 20, **PINNED_RULES[rule]}, "network": network}
    run_dir = run(tmp_path, rule, config)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    rounds = [e for e in read_events(run_dir) if e["event"] == "round"]
    assert len(rounds) == 3
    # The network did bite: something lost, and (tcp) some bytes resent.
    assert sum(e["lost_up"] + e["lost_down"] for e in rounds) > 0
    if transport == "tcp":
        assert sum(e["retransmitted_bytes_up"] + e["retransmitted_bytes_down"] for e in rounds) > 0
    observed = (network_digest(run_dir), *run_digest(run_dir))
    if os.environ.get("FEDEMU_PIN_OUT"):  # recording pins (a new platform): the observed values, appended
        with open(os.environ["FEDEMU_PIN_OUT"], "a") as out:
            out.write(json.dumps({"rule": rule, "transport": transport, "platform": platform_key(),
                                  "network": observed[0], "events": observed[1], "weights": observed[2]}) + "\n")
    pinned_network = NETWORK_PINS[(rule, transport)]
    pinned_run = RUN_PINS.get(platform_key(), {}).get((rule, transport))
    assert observed[0] == pinned_network, f"network digest of {rule}/{transport}: {observed}"
    if pinned_run is None:
        pytest.skip(f"the network digest matches; no events or weights pinned for platform {platform_key()!r} "
                    f"(observed {observed[1:]})")
    assert observed[1:] == pinned_run, f"{rule}/{transport} on {platform_key()}: {observed}"
