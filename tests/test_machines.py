"""`fedemu launch --machines`: worker nodes on other hosts over real SSH.

The hosts are network namespaces on this machine, each with its own sshd (see
testhosts.py); the launcher reaches them only through OpenSSH and their veth links.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedemu.launch.running.hosts import Host, HostError, parse_hostfile, parse_machines, ssh_argv
from fedemu.launch.running.machines import assign_workers
from fedemu.server.runlog import read_events

from .conftest import missing_prerequisite, needs
from .testhosts import TestHosts, unavailable_reason


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()

# --- host lists (no hosts needed) ------------------------------------------------------


def test_machines_list_parses_users_ports_and_keeps_order():
    hosts = parse_machines("h1, alice@h2:2222,10.0.0.7")
    assert hosts == [Host("h1"), Host("h2", "alice", 2222), Host("10.0.0.7")]
    assert str(hosts[1]) == "alice@h2:2222"


def test_hostfile_reads_slots_python_and_comments(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# lab machines\nh1 slots=2\n\nbob@h2:2200 python=/opt/venv/bin/python  # the big one\n")
    assert parse_hostfile(path) == [Host("h1", slots=2), Host("h2", "bob", 2200, None, "/opt/venv/bin/python")]


@pytest.mark.parametrize("text, message", [
    ("h1 slots=0", "slots must be a positive integer"),
    ("h1 cores=4", "unknown option 'cores=4'"),
    ("h1:99999", "port 99999 is outside"),
    ("h1\nh1", "listed twice"),
    ("bad!host", "is not [user@]host[:port]"),
    ("# nothing\n", "no hosts given"),
])
def test_a_bad_hostfile_names_the_line_and_the_problem(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(HostError, match=re.escape(message)) as info:
        parse_hostfile(path)
    assert str(path) in str(info.value)


def test_ssh_is_non_interactive_and_quotes_the_remote_command():
    argv = ssh_argv(Host("h2", "bob", 2200), ["python", "-m", "fedemu.launch", "x y"], ssh_config="cfg")
    assert argv[:3] == ["ssh", "-o", "BatchMode=yes"]
    assert argv[argv.index("-F") + 1] == "cfg" and argv[argv.index("-p") + 1] == "2200"
    assert argv[argv.index("-l") + 1] == "bob"
    assert argv[-3:] == ["h2", "--", "python -m fedemu.launch 'x y'"]


def test_workers_are_placed_by_slots_in_host_order():
    a, b, c = Host("a", slots=2), Host("b"), Host("c")
    assert assign_workers([a, b, c], {a: 8, b: 4, c: 1}, None) == {a: [0, 1], b: [2, 3, 4, 5], c: [6]}
    assert assign_workers([a, b, c], {a: 8, b: 4, c: 1}, 1) == {a: [0, 1], b: [2], c: [3]}


def test_a_hosts_nodes_split_that_hosts_cores_among_themselves():
    import tomllib

    from fedemu.launch import config as configuration
    from fedemu.launch.running.agent import host_config

    config = configuration.load(None, ["run.clock=wall"])
    config["run"]["workers"] = 64  # the run's total, over every host
    threads = tomllib.loads(host_config(configuration.to_toml(config), 1))["run"]["torch_threads"]
    assert threads == os.cpu_count()  # this host's cores for its one node, not cores / 64
    config["run"]["torch_threads"] = 3  # an explicit choice stands
    assert tomllib.loads(host_config(configuration.to_toml(config), 2))["run"]["torch_threads"] == 3
    # Virtual time: left to the node, which pins one thread whatever the host's cores.
    virtual = configuration.load(None, ["run.clock=virtual"])
    assert tomllib.loads(host_config(configuration.to_toml(virtual), 1))["run"]["torch_threads"] == 0


def test_a_local_run_refuses_a_machine_link_entry_before_starting_anything(tmp_path):
    from fedemu.launch import config as configuration
    from fedemu.launch.running.local import LocalRun
    from fedemu.launch.running.rundir import LaunchError

    config = configuration.load(None)
    config["network"]["assign"] = [{"profile": "lte", "machine": "h2"}]
    run = LocalRun(config, tmp_path, 1, echo=lambda line: None)
    with pytest.raises(LaunchError, match=r"network.assign\[0\].machine = 'h2' is not a host of this run"):
        run.start()
    assert run.procs == {}


# --- real hosts ------------------------------------------------------------------------

needs_hosts = needs(unavailable_reason())


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    made = TestHosts(tmp_path_factory.mktemp("hosts"), 2)
    try:
        made.up()
    except RuntimeError as exc:  # e.g. a container without permission for namespaces
        made.down()
        missing_prerequisite(f"cannot create test hosts: {exc}")
    yield made
    made.down()


def launch(hosts: TestHosts, run_dir: Path, *sets: str, machines: str = "h1,h2",
           extra: tuple[str, ...] = ()) -> subprocess.Popen:
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--machines", machines,
            "--ssh-config", str(hosts.ssh_config), "--workers", "1", *extra,
            "--set", "run.target_accuracy=0", "--set", "run.heartbeat_interval_s=0.2",
            "--set", "run.torch_threads=1"]
    for item in sets:
        argv += ["--set", item]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def assert_hosts_left_clean(hosts: TestHosts) -> None:
    for name in hosts.names:
        left = hosts.wait_until_empty(name)
        assert not left, f"processes left on {name}: {left}"


def local_processes_of(run_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if not line.startswith(f"{os.getpid()} ")]


@needs_hosts
@pytest.mark.mnist
@pytest.mark.slow
def test_clients_spread_over_hosts_train_like_a_local_run(hosts, tmp_path):
    spread = launch(hosts, tmp_path / "spread", "run.rounds=3")
    output, _ = spread.communicate(timeout=300)
    assert spread.returncode == 0, output
    summary = json.loads((tmp_path / "spread" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_accuracy"] >= 0.8

    placed = next(e for e in read_events(tmp_path / "spread") if e["event"] == "machines")
    assert [h["host"] for h in placed["hosts"]] == ["h1", "h2"]
    assert [h["workers"] for h in placed["hosts"]] == [[0], [1]]
    assert [h["clients"] for h in placed["hosts"]] == [[0, 49], [50, 99]]
    assert {h["address"] for h in placed["hosts"]} == {f"10.{hosts.subnet}.{i}.1" for i in (1, 2)}
    assert [h["device"] for h in placed["hosts"]] == ["cpu", "cpu"]  # run.device = "auto" on hosts without a GPU
    # The worker nodes ran on the hosts, and their logs came back.
    for i in (0, 1):
        log = (tmp_path / "spread" / "logs" / f"worker-{i}.out").read_text()
        assert "hosts clients" in log
    assert_hosts_left_clean(hosts)
    assert not local_processes_of(tmp_path / "spread")

    # The same config and seed on this machine alone gives the same model, bit for bit
    # (virtual time, the default: nothing depends on where or how fast a client ran).
    local = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(tmp_path / "local"),
                            "--workers", "2", "--set", "run.target_accuracy=0", "--set", "run.torch_threads=1",
                            "--set", "run.rounds=3"], capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr

    def accuracies(run_dir: Path) -> list[float]:
        return [(e["accuracy"], e["emulated_s"]) for e in read_events(run_dir) if e["event"] == "round"]

    assert accuracies(tmp_path / "spread") == accuracies(tmp_path / "local")
    assert summary["weights_sha256"] == json.loads((tmp_path / "local" / "summary.json").read_text())["weights_sha256"]


@needs_hosts
@pytest.mark.mnist
@pytest.mark.slow
def test_a_thousand_clients_a_round_over_two_hosts_train_the_model_one_machine_does(hosts, tmp_path):
    """Cross-device scale: 2,000 clients of one example each, 1,000 a round, spread over
    two hosts, and the same job on this machine with a single worker node: the same
    model, bit for bit (the broadcast goes to each host once; each host's node sums its
    own clients' updates exactly, run.aggregation = "nodes", which is the grouping-
    sensitive case; the server's own sum is placement-free by its fixed order, checked
    by test_clients_spread_over_hosts_train_like_a_local_run)."""
    job = ("data.clients=2000", "data.partition=sample", "algorithm.C=0.5", "run.rounds=2",
           "run.aggregation=nodes")
    spread = launch(hosts, tmp_path / "spread", *job)
    output, _ = spread.communicate(timeout=300)
    assert spread.returncode == 0, output
    local = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(tmp_path / "local"),
                            "--workers", "1", "--set", "run.target_accuracy=0", "--set", "run.torch_threads=1",
                            *(arg for item in job for arg in ("--set", item))],
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    rounds = {name: [e for e in read_events(tmp_path / name) if e["event"] == "round"] for name in ("spread", "local")}
    assert [e["participants"] for e in rounds["spread"]] == [1000, 1000]
    assert ([(e["accuracy"], e["emulated_s"], e["bytes_down"], e["bytes_up"]) for e in rounds["spread"]]
            == [(e["accuracy"], e["emulated_s"], e["bytes_down"], e["bytes_up"]) for e in rounds["local"]])
    hashes = {name: json.loads((tmp_path / name / "summary.json").read_text())["weights_sha256"]
              for name in ("spread", "local")}
    assert hashes["spread"] == hashes["local"]
    assert_hosts_left_clean(hosts)


@needs_hosts
@pytest.mark.mnist
@pytest.mark.slow
def test_killing_a_hosts_worker_node_loses_its_clients_and_the_run_goes_on(hosts, tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(hosts, run_dir, "run.rounds=6", "run.heartbeat_timeout_s=2")
    deadline = time.monotonic() + 180
    while not any(e["event"] == "round" and e["round"] >= 2 for e in read_events(run_dir)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "round 2 never finished"
        time.sleep(0.2)
    victims = [pid for pid, cmd in hosts.processes("h2").items() if "node worker" in cmd]
    assert len(victims) == 1, hosts.processes("h2")
    os.kill(victims[0], signal.SIGKILL)

    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    events = read_events(run_dir)
    faults = [e for e in events if e["event"] == "fault"]
    assert sorted(e["client"] for e in faults) == list(range(50, 100))  # exactly h2's clients
    assert {e["reason"] for e in faults} == {"noconnection: worker-1 killed by SIGKILL"}  # the host's agent saw it
    assert all(isinstance(e["t"], float) for e in faults)
    assert "worker-1 on h2 exited with code -9" in output
    rounds = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2, 3, 4, 5, 6]
    late = [e for e in rounds if e["round"] > max(f["round"] for f in faults)]
    assert late, "no round ran after the fault"
    for e in late:  # only h1's clients are selected, and all answer
        assert all(k < 50 for k in e["selected"]) and e["participants"] == 10
    assert_hosts_left_clean(hosts)


@needs_hosts
def test_preflight_names_the_host_and_problem_and_starts_nothing(hosts, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1\nh2 python=/nonexistent/bin/python3\n")
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(tmp_path / "run"),
            "--hostfile", str(hostfile), "--ssh-config", str(hosts.ssh_config)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "preflight failed" in done.stderr
    assert "h2: /nonexistent/bin/python3 not found" in done.stderr
    assert "h1:" not in done.stderr  # the good host is not blamed
    assert not local_processes_of(tmp_path / "run")
    assert_hosts_left_clean(hosts)


@needs_hosts
@pytest.mark.skipif(torch_has_cuda(), reason="checks hosts without a CUDA GPU; this machine has one")
def test_a_gpu_the_hosts_lack_fails_the_preflight_on_each_host(hosts, tmp_path):
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(tmp_path / "run"), "--machines", "h1,h2",
            "--ssh-config", str(hosts.ssh_config), "--set", "run.device=cuda:0"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "preflight failed" in done.stderr
    for host in ("h1", "h2"):
        assert f"{host}: run.device = 'cuda:0'" in done.stderr
    assert not local_processes_of(tmp_path / "run")
    assert_hosts_left_clean(hosts)


@needs_hosts
def test_an_unreachable_host_fails_the_preflight_by_name(hosts, tmp_path):
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(f"h1\nroot@10.{hosts.subnet}.1.2:2299\n")  # h1's address, a port with no sshd
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(tmp_path / "run"),
            "--hostfile", str(hosts_file), "--ssh-config", str(hosts.ssh_config)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"root@10.{hosts.subnet}.1.2:2299: unreachable over SSH" in done.stderr
    assert not local_processes_of(tmp_path / "run")


@needs_hosts
@pytest.mark.mnist
@pytest.mark.slow
def test_ctrl_c_stops_the_nodes_on_every_host(hosts, tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--machines", "h1,h2",
            "--ssh-config", str(hosts.ssh_config), "--workers", "1", "--set", "run.rounds=1000",
            "--set", "run.target_accuracy=0", "--set", "run.torch_threads=1"]  # the test hosts share 2 cores
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not any(e["event"] == "round" for e in read_events(run_dir)):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "round 1 never finished"
        time.sleep(0.2)
    assert any("node worker" in cmd for cmd in hosts.processes("h1").values())
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher's whole group
    output, _ = proc.communicate(timeout=120)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted", output
    assert_hosts_left_clean(hosts)
    assert not local_processes_of(run_dir)
    assert not (run_dir / "logs" / "worker-0.out").read_text().count("Traceback")


@needs_hosts
@pytest.mark.slow
def test_a_sweep_over_machines_runs_concurrent_points_on_hosts_of_their_own(hosts, tmp_path):
    from .test_sweep import rows, tiny_sweep

    spec = tiny_sweep(tmp_path)  # its data set in tmp_path: the hosts share this machine's file system
    out = tmp_path / "sw"
    argv = [sys.executable, "-m", "fedemu.launch", "sweep", str(spec), "--out", str(out), "--machines", "h1,h2",
            "--ssh-config", str(hosts.ssh_config), "--parallel", "2", "--workers-per-point", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {r["status"] for r in rows(out).values()} == {"completed"}
    placed = {}
    for point in ("E=1", "E=2"):
        record = json.loads((out / "runs" / point / "machines.json").read_text())
        placed[point] = [h["host"] for h in record["hosts"]]
        assert (out / "runs" / point / "logs" / "worker-0.out").exists()  # streamed back from its host
    assert sorted(placed.values()) == [["h1"], ["h2"]]  # one host each: they ran side by side
    assert_hosts_left_clean(hosts)
    assert not local_processes_of(out)


@needs_hosts
@pytest.mark.slow
def test_a_machine_link_entry_gives_that_hosts_clients_its_profile(hosts, tmp_path):
    from .test_sweep import tiny_mnist

    tiny_mnist(tmp_path / "cache")
    config = tmp_path / "cut.toml"
    config.write_text(f"""
[data]
clients = 4
cache_dir = "{tmp_path / 'cache'}"
[algorithm]
C = 1.0
deadline_s = 10.0
[network.profiles.cut]
up = {{ loss = 1.0 }}
[[network.assign]]
profile = "cut"
machine = "h2"
""")
    run_dir = tmp_path / "run"
    proc = launch(hosts, run_dir, "run.rounds=2", extra=(str(config),))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    record = json.loads((run_dir / "machines.json").read_text())
    assert {h["host"]: (h["clients"], h["profile"]) for h in record["hosts"]} == {
        "h1": ([0, 1], None), "h2": ([2, 3], "cut")}
    rounds = [e for e in read_events(run_dir) if e["event"] == "round"]
    assert len(rounds) == 2
    for e in rounds:  # every upload from h2 is lost on its link; h1's arrive
        assert e["selected"] == [0, 1, 2, 3] and e["answered"] == [0, 1]
        assert e["stragglers"] + e["dropped"] and sorted(e["stragglers"] + e["dropped"]) == [2, 3]
    assert_hosts_left_clean(hosts)


@needs_hosts
def test_a_hosts_worker_nodes_fork_from_a_zygote_there_and_train_as_a_local_run(hosts, tmp_path):
    """Two worker nodes on one host: its agent forks them from a zygote of its own (one
    import of torch), and the model is the one a local run of the same config makes."""
    from .test_sweep import tiny_mnist

    tiny_mnist(tmp_path / "cache")
    job = (f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}", "data.clients=4", "algorithm.C=1.0",
           "run.rounds=2")
    proc = launch(hosts, tmp_path / "spread", *job, machines="h1", extra=("--workers", "2"))
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    for i in (0, 1):
        assert "forked from the zygote" in (tmp_path / "spread" / "logs" / f"worker-{i}.out").read_text()
    local = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(tmp_path / "local"),
                            "--workers", "2", "--set", "run.target_accuracy=0", "--set", "run.torch_threads=1",
                            *(arg for item in job for arg in ("--set", item))],
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    hashes = {name: json.loads((tmp_path / name / "summary.json").read_text())["weights_sha256"]
              for name in ("spread", "local")}
    assert hashes["spread"] == hashes["local"]
    assert_hosts_left_clean(hosts)
