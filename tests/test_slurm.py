"""`fedemu launch --slurm` and `fedemu sweep --slurm` on a real Slurm cluster.

The cluster (testcluster.py) is Debian's slurmctld, slurmd and munge on this machine:
two compute nodes, each a network namespace of its own; jobs are submitted with the real
sbatch, worker nodes start through the real srun, and scancel is Slurm's own.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedemu.launch.cli import main
from fedemu.launch.running.slurm import Allocation, NotInAllocation, hostnames, tasks_per_node
from fedemu.launch.studies.sweep_index import DB_FILE
from fedemu.server.runlog import read_events

from .conftest import missing_prerequisite, needs
from .testcluster import SlurmCluster, unavailable_reason

EXAMPLE = Path(__file__).parent.parent / "examples" / "slurm" / "launch.sbatch"
# A small virtual-time job: the weights it ends with do not depend on where it runs.
JOB = ["--set", "data.clients=4", "--set", "algorithm.C=0.5", "--set", "run.target_accuracy=0", "--set", "run.rounds=1"]

# --- the allocation, read from the environment (no cluster needed) --------------------


@pytest.mark.parametrize("text, counts", [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("1,4(x2)", [1, 4, 4])])
def test_slurm_task_counts_expand_as_slurm_compresses_them(text, counts):
    assert tasks_per_node(text) == counts


HOST_LISTS = {"n1": ["n1"], "n[1-3,7],gpu[01-02]": ["n1", "n2", "n3", "n7", "gpu01", "gpu02"],
              "rack[1-2]-n[09-10]": ["rack1-n09", "rack1-n10", "rack2-n09", "rack2-n10"]}


@pytest.mark.parametrize("nodelist", HOST_LISTS)
def test_slurm_host_lists_expand_with_ranges_padding_and_several_brackets(nodelist):
    assert hostnames(nodelist) == HOST_LISTS[nodelist]


def test_a_host_list_slurm_would_not_write_is_refused_by_name():
    with pytest.raises(NotInAllocation, match=r"'n\[1-x\]'.*'1-x' is not N or N-M"):
        hostnames("n[1-x]")
    with pytest.raises(NotInAllocation, match="unbalanced brackets"):
        hostnames("n[1-2")


def test_a_task_count_slurm_would_not_write_is_refused_by_name():
    with pytest.raises(NotInAllocation, match=r"SLURM_TASKS_PER_NODE='2\(3\)'"):
        tasks_per_node("2(3)")


def test_launch_slurm_outside_an_allocation_says_where_it_must_run():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = CliRunner().invoke(main, ["launch", "--slurm", "--set", "run.rounds=1"], env=env)
    assert result.exit_code != 0
    assert "inside a Slurm allocation (salloc, or an sbatch script)" in result.output
    assert "SLURM_JOB_ID is not set" in result.output


def test_launch_slurm_refuses_workers_and_a_host_list():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}
    with_workers = CliRunner().invoke(main, ["launch", "--slurm", "--workers", "3"], env=env)
    assert with_workers.exit_code != 0 and "ask Slurm for them" in with_workers.output
    with_hosts = CliRunner().invoke(main, ["launch", "--slurm", "--machines", "h1"], env=env)
    assert with_hosts.exit_code != 0 and "give one of --machines, --hostfile and --slurm" in with_hosts.output


def test_an_allocation_whose_task_counts_and_nodes_disagree_is_refused():
    with pytest.raises(NotInAllocation, match="does not match the 2 node"):
        Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x3)"})
    allocation = Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]",
                                      "SLURM_TASKS_PER_NODE": "3,1"})
    assert [(h.name, h.slots) for h in allocation.hosts] == [("n1", 3), ("n2", 1)]
    # Without task counts (sbatch -N2 alone) each node runs one worker node.
    bare = Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert [h.slots for h in bare.hosts] == [1, 1] and bare.cpus_per_worker == 1


def test_worker_nodes_get_the_cpus_slurm_gave_their_tasks_or_their_nodes_share():
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "4,2"}
    # Whole nodes (--exclusive, select/linear): each node's CPUs over its tasks, the
    # smaller share for all (srun takes one --cpus-per-task).
    shared = Allocation.from_env({**job, "SLURM_JOB_CPUS_PER_NODE": "8(x2)"})
    assert shared.cpus_per_worker == 2 and not shared.cpus_per_task_given
    asked = Allocation.from_env({**job, "SLURM_JOB_CPUS_PER_NODE": "8(x2)", "SLURM_CPUS_PER_TASK": "3"})
    assert asked.cpus_per_worker == 3 and asked.cpus_per_task_given  # srun inherits it
    with pytest.raises(NotInAllocation, match="SLURM_JOB_CPUS_PER_NODE='8x2'"):
        Allocation.from_env({**job, "SLURM_JOB_CPUS_PER_NODE": "8x2"})


def test_sweep_slurm_options_go_together():
    result = CliRunner().invoke(main, ["sweep", "x.toml", "--wait"])
    assert result.exit_code != 0 and "--sbatch-args, --points-per-task and --wait go with --slurm" in result.output


# --- on a real cluster ---------------------------------------------------------------

needs_cluster = needs(unavailable_reason() and f"no Slurm test cluster: {unavailable_reason()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        missing_prerequisite(f"no Slurm test cluster: {reason}")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), count=2)
    try:
        c.up()
    except Exception:
        c.down()
        raise
    yield c
    c.down()


def _batch(cluster: SlurmCluster, folder: Path, command: list[str], *options: str, wait: bool,
           env: dict | None = None) -> str:
    """Submit ``command`` (a script and its arguments, or a command wrapped into one);
    returns the job id, once the job has ended if ``wait``."""
    if not command[0].endswith(".sbatch"):
        script = folder / "job.sh"
        script.write_text("#!/bin/sh\nexec " + " ".join(f"'{a}'" for a in command) + "\n")
        command = [str(script)]
    done = subprocess.run(["sbatch", "--parsable", f"--output={folder / 'job.out'}", *options, *command],
                          capture_output=True, text=True, env=env or cluster.env(), timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    if wait:  # squeue every 0.5 s: sbatch --wait polls at up to 10 s intervals
        cluster.wait_for_end(job, timeout=600)
    return job


@pytest.fixture(scope="module")
def local_weights(tmp_path_factory) -> str:
    """The final weights of JOB run on this machine alone, with one worker node."""
    out = tmp_path_factory.mktemp("local") / "run"
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", *JOB, "--workers", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())["weights_sha256"]


def _fedemu_processes(cluster: SlurmCluster, run_dir: Path) -> list[str]:
    """Processes of this run left anywhere: on the nodes, or here (broker, server)."""
    left = [cmd for node in cluster.names for cmd in cluster.processes(node).values() if "fedemu" in cmd]
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "fedemu.launch" in cmd and str(run_dir) in cmd:
                left.append(cmd)
    return left


@needs_cluster
def test_host_lists_expand_as_scontrol_expands_them(cluster):
    for nodelist, names in HOST_LISTS.items():
        done = cluster.slurm("scontrol", "show", "hostnames", nodelist)
        assert done.stdout.split() == names == hostnames(nodelist)


@needs_cluster
def test_a_run_in_an_sbatch_job_puts_a_worker_node_on_each_task_and_ends_as_a_local_run_does(
        cluster, tmp_path, local_weights):
    run_dir = tmp_path / "run"
    # The example script as a user submits it: fedemu on PATH, arguments for the launch,
    # sbatch's options over the script's (one task on each node, one CPU each).
    env = cluster.env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    _batch(cluster, tmp_path, [str(EXAMPLE), *JOB, "--out", str(run_dir)],
           "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", wait=True, env=env)
    output = (tmp_path / "job.out").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", output[-3000:]
    placement = json.loads((run_dir / "machines.json").read_text())
    assert placement["launcher"] == "slurm" and placement["slurm_job"]
    assert [(h["host"], h["workers"], h["clients"]) for h in placement["hosts"]] == [
        ("n1", [0], [0, 1]), ("n2", [1], [2, 3])]
    # The batch script ran on the allocation's first node; its address is the broker's.
    assert {h["address"] for h in placement["hosts"]} == {cluster.addresses[0]}
    for worker in ("worker-0", "worker-1"):  # each node's output streamed back through srun
        assert "hosts clients" in (run_dir / "logs" / f"{worker}.out").read_text()
    assert "exited with code" not in output  # every worker node left when the server said so
    # Virtual time: the same weights as the same job run on this machine alone.
    assert summary["weights_sha256"] == local_weights
    assert _fedemu_processes(cluster, run_dir) == []


@needs_cluster
def test_under_salloc_the_broker_and_server_stay_on_the_submitting_host(cluster, tmp_path, local_weights):
    run_dir = tmp_path / "run"
    done = cluster.slurm("salloc", "--nodes=2", "--ntasks-per-node=1", sys.executable, "-m", "fedemu.launch",
                         "launch", "--slurm", *JOB, "--out", str(run_dir), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    placement = json.loads((run_dir / "machines.json").read_text())
    # This process's host (the bridge's side) is where the nodes reach the broker.
    assert {h["address"] for h in placement["hosts"]} == {cluster.controller}
    assert [h["host"] for h in placement["hosts"]] == cluster.names
    assert json.loads((run_dir / "summary.json").read_text())["weights_sha256"] == local_weights


@needs_cluster
def test_a_preflight_problem_on_the_nodes_stops_the_run_before_it_starts_and_names_each_node(cluster, tmp_path):
    run_dir = tmp_path / "run"
    _batch(cluster, tmp_path, [sys.executable, "-m", "fedemu.launch", "launch", "--slurm", *JOB,
                               "--remote-python", "/nonexistent/python", "--out", str(run_dir)],
           "--nodes=2", "--ntasks-per-node=1", wait=True)
    output = (tmp_path / "job.out").read_text()
    assert "preflight failed; nothing was started" in output
    for node in cluster.names:
        assert f"  {node}: no preflight report from this node" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "preflight failed" in summary["reason"]
    assert not (run_dir / "machines.json").exists() and not (run_dir / "logs" / "worker-0.out").exists()
    assert _fedemu_processes(cluster, run_dir) == []


@needs_cluster
def test_a_worker_node_killed_mid_run_is_down_and_scancel_stops_every_process_and_the_run_says_so(cluster, tmp_path):
    run_dir = tmp_path / "run"
    # --exclusive: whole nodes (2 CPUs each), so each worker node's task is bound to both.
    job = _batch(cluster, tmp_path, [sys.executable, "-m", "fedemu.launch", "launch", "--slurm", *JOB,
                                     "--set", "run.rounds=500", "--out", str(run_dir)],
                 "--nodes=2", "--ntasks-per-node=1", "--exclusive", wait=False)
    deadline = time.monotonic() + 240
    while not [e for e in read_events(run_dir) if e.get("event") == "round"] if run_dir.exists() else True:
        assert time.monotonic() < deadline, f"no round within 240 s: {(tmp_path / 'job.out').read_text()[-2000:]}"
        time.sleep(0.5)
    workers = {node: [pid for pid, cmd in cluster.processes(node).items() if "node worker" in cmd]
               for node in cluster.names}
    assert [len(pids) for pids in workers.values()] == [1, 1]  # one worker node running on each node
    assert json.loads((run_dir / "machines.json").read_text())["cpus_per_worker"] == cluster.cpus
    for pids in workers.values():
        assert len(os.sched_getaffinity(pids[0])) == cluster.cpus
    # A node's worker node killed outright: the server sees its clients DOWN, as over SSH.
    os.kill(workers["n2"][0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (faults := [e for e in read_events(run_dir) if e.get("event") == "fault"]):
        assert time.monotonic() < deadline, "no fault event within 60 s of killing a worker node"
        time.sleep(0.5)
    assert sorted(e["client"] for e in faults) == [2, 3]  # exactly n2's clients
    assert cluster.slurm("scancel", job).returncode == 0
    cluster.wait_for_end(job, timeout=60)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert "SIGTERM" in summary["reason"] and f"Slurm job {job}" in summary["reason"]
    assert 1 <= summary["rounds"] < 500
    deadline = time.monotonic() + 20
    while (left := _fedemu_processes(cluster, run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []


@needs_cluster
def test_a_sweep_as_a_job_array_resubmits_only_what_is_missing_and_reports(cluster, tmp_path, local_weights):
    sweep_file = tmp_path / "seeds.toml"
    sweep_file.write_text('[sweep]\nname = "seeds"\nparallel = 1\n'
                          '[base.run]\nrounds = 1\ntarget_accuracy = 0.0\n'
                          '[base.data]\nclients = 4\n[base.algorithm]\nC = 0.5\n'
                          '[axes]\n"run.seed" = [1, 2, 3]\n')
    out = tmp_path / "sweep"
    fedemu = [sys.executable, "-m", "fedemu.launch", "sweep", str(sweep_file), "--out", str(out), "--slurm",
              "--points-per-task", "2"]
    first = subprocess.run(fedemu, capture_output=True, text=True, env=cluster.env(), timeout=120,
                           stdin=subprocess.DEVNULL)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "3 to submit" in first.stdout and "(2 task(s))" in first.stdout  # seeds 1 and 2, then seed 3
    job = (out / "slurm" / "submit-1" / "job").read_text().strip()
    # parallel = 1: the second task waits behind the first; cancel it before it starts.
    assert cluster.slurm("scancel", f"{job}_1").returncode == 0
    # A local sweep must not run points that Slurm may still be running.
    local = subprocess.run(fedemu[:-3], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert local.returncode != 0 and "was submitted to Slurm (array task" in local.stderr
    second = subprocess.run([*fedemu, "--wait"], capture_output=True, text=True, env=cluster.env(), timeout=600,
                            stdin=subprocess.DEVNULL)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "FAILED seed=3: array task" in second.stdout  # the cancelled task, found and re-submitted
    assert "1 to submit" in second.stdout
    assert sorted(p.name for p in (out / "slurm" / "submit-2" / "points").iterdir()) == ["0.json"]
    assert [p["id"] for p in json.loads((out / "slurm" / "submit-2" / "points" / "0.json").read_text())] == ["seed=3"]
    assert "sweep: 3 completed" in second.stdout
    import sqlite3

    rows = sqlite3.connect(out / DB_FILE).execute(
        "SELECT id, status, slurm_job, attempts, weights_sha256 FROM points ORDER BY seq").fetchall()
    assert [(r[0], r[1], r[3]) for r in rows] == [("seed=1", "completed", 1), ("seed=2", "completed", 1),
                                                  ("seed=3", "completed", 2)]
    assert [r[2] for r in rows[:2]] == [f"{job}_0"] * 2  # one task ran seeds 1 and 2
    assert rows[2][2].split("_")[0] != job  # seed=3 ran in the second array
    # Placement independence: the array task's run has the local run's weights.
    assert rows[0][4] == local_weights  # seed=1 is JOB's (the default seed)
    third = subprocess.run([*fedemu, "--wait"], capture_output=True, text=True, env=cluster.env(), timeout=120,
                           stdin=subprocess.DEVNULL)
    assert "0 to submit" in third.stdout and not (out / "slurm" / "submit-3").exists()
    report = subprocess.run([sys.executable, "-m", "fedemu.launch", "report", str(out)], capture_output=True,
                            text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert report.returncode == 0, report.stderr
    assert "3 points (3 completed)" in (out / "report" / "report.md").read_text()
