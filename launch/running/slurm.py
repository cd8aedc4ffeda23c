"""A run inside a Slurm allocation (`fedemu launch --slurm`, in ``salloc`` or an ``sbatch``
script): the broker and the server stay on the batch host, the worker nodes run as the
tasks of one ``srun`` step, so Slurm places them and binds their CPUs.

It is a multi-machine run (``machines.MachinesRun``) whose hosts come from the
allocation instead of a host list, and whose transport to the hosts is Slurm instead of
SSH: the preflight is one ``srun`` step with a task per node; the worker step has one
task per worker node, each a host agent for that one node (``agent.run_agent``), placed
by fedemu (``--distribution=arbitrary``), so ``machines.json`` says where each client ran
before any started. Ending the run stops the step through its standard input, as over
SSH; ``scancel`` signals every process of the job, each of which stops in order and the
run's ``summary.json`` says it was terminated.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .hosts import Host
from .machines import PREFLIGHT_TIMEOUT_S, Machines, MachinesRun, RemoteHost, last_json_line
from .rundir import LaunchError
from .slurm_task import NotInAllocation
from .agent import code_digest, fedemu_version


def tasks_per_node(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed per-node counts (tasks, or CPUs), ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise NotInAllocation(f"cannot read {variable}={text!r} (expected e.g. 2(x3),1)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm host list, as ``scontrol show hostnames`` expands them:
    ``n[1-3,7],gpu[01-02]`` -> n1 n2 n3 n7 gpu01 gpu02 (ranges keep their zero padding;
    several bracket groups in one name multiply)."""
    names: list[str] = []
    for item in _top_level_split(nodelist):
        parts = re.split(r"(\[[^\]]*\])", item)
        expanded = [""]
        for part in parts:
            choices = _range_choices(part[1:-1], nodelist) if part.startswith("[") else [part]
            expanded = [head + choice for head in expanded for choice in choices]
        names += expanded
    return names


def _top_level_split(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise NotInAllocation(f"cannot read the Slurm host list {text!r}: unbalanced brackets")
    return [i for i in items + [current] if i]


def _range_choices(ranges: str, nodelist: str) -> list[str]:
    choices = []
    for r in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", r.strip())
        if not m:
            raise NotInAllocation(f"cannot read the Slurm host list {nodelist!r}: {r!r} is not N or N-M")
        low, high = m.group(1), m.group(2) or m.group(1)
        choices += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return choices


@dataclass
class Allocation(Machines):
    """The hosts of a Slurm allocation: its nodes, each with the tasks Slurm gave it as
    worker node slots."""

    job_id: str = ""
    # CPUs each worker node's task gets: --cpus-per-task if the job asked for it (srun
    # inherits it), else the node's CPUs shared out over its tasks (a whole-node
    # allocation, --exclusive or select/linear, would otherwise bind each task to one).
    cpus_per_worker: int = 1
    cpus_per_task_given: bool = False

    @classmethod
    def from_env(cls, env: dict | None = None, **options) -> "Allocation":
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID")
        if not job_id:
            raise NotInAllocation("--slurm runs inside a Slurm allocation (salloc, or an sbatch script); "
                                  "SLURM_JOB_ID is not set here")
        nodes = hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
        if not nodes:
            raise NotInAllocation(f"Slurm job {job_id} lists no nodes (SLURM_JOB_NODELIST is empty)")
        # Without --ntasks/--ntasks-per-node Slurm sets no task counts: one worker node per node.
        counts = tasks_per_node(env["SLURM_TASKS_PER_NODE"]) if env.get("SLURM_TASKS_PER_NODE") else [1] * len(nodes)
        if len(counts) != len(nodes):
            raise NotInAllocation(f"SLURM_TASKS_PER_NODE={env.get('SLURM_TASKS_PER_NODE')!r} does not match "
                                  f"the {len(nodes)} node(s) of SLURM_JOB_NODELIST")
        hosts = [Host(name, slots=n) for name, n in zip(nodes, counts)]
        given = env.get("SLURM_CPUS_PER_TASK")
        if given:
            cpus = int(given)
        else:
            cpus_text = env.get("SLURM_JOB_CPUS_PER_NODE")
            per_node = tasks_per_node(cpus_text, "SLURM_JOB_CPUS_PER_NODE") if cpus_text else []
            cpus = min((c // n for c, n in zip(per_node, counts)), default=1) if len(per_node) == len(nodes) else 1
        return cls(hosts=hosts, job_id=job_id, cpus_per_worker=max(1, cpus), cpus_per_task_given=bool(given),
                   **options)

    def step_env(self, hostfile: Path | None = None) -> dict:
        env = dict(os.environ)
        if hostfile is not None:  # read by srun --distribution=arbitrary: task i runs on line i's node
            env["SLURM_HOSTFILE"] = str(hostfile)
        return env


class SlurmRun(MachinesRun):
    machines: Allocation

    def placement_source(self) -> dict:
        return {"launcher": "slurm", "slurm_job": self.machines.job_id,
                "cpus_per_worker": self.machines.cpus_per_worker}

    def preflight(self, broker_port: int) -> dict[Host, dict]:
        """One srun step, a task on every node: each prints its preflight report, and
        reaches the broker at the address Slurm says the step was launched from."""
        data = self.config["data"]
        hosts = self.machines.hosts
        self.echo(f"preflight on {len(hosts)} node(s) of Slurm job {self.machines.job_id} ...")
        argv = ["srun", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                "--kill-on-bad-exit=0", "--job-name=fedemu-preflight",
                sys_python(self.machines), "-m", "fedemu.launch", "preflight", "--slurm-task",
                "--dataset", data["dataset"], "--broker-port", str(broker_port),
                "--model", self.config["model"]["name"], "--device", self.config["run"]["device"]]
        if data["cache_dir"]:
            argv += ["--cache-dir", data["cache_dir"]]
        if self.machines.advertise:
            argv += ["--broker-address", self.machines.advertise]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=PREFLIGHT_TIMEOUT_S)
        except FileNotFoundError:
            raise LaunchError("srun is not on PATH: --slurm needs Slurm's client commands here") from None
        except subprocess.TimeoutExpired:
            raise LaunchError(f"the preflight step did not end within {PREFLIGHT_TIMEOUT_S}s; nothing was started")
        by_node: dict[str, dict] = {}
        for line in done.stdout.splitlines():
            report = last_json_line(line)
            if report is not None and "node" in report:
                by_node[report["node"]] = report
        errors = done.stderr.strip().splitlines()
        reports: dict[Host, dict] = {}
        for host in hosts:
            report = by_node.get(host.name)
            if report is None:  # srun and slurmstepd name the node in their lines: show its own
                own = [line for line in errors if re.search(rf"\b{re.escape(host.name)}\b", line)] or errors
                report = {"problems": [f"no preflight report from this node (srun exit {done.returncode}: "
                                       f"{' | '.join(own[-3:]) or 'no output'})"]}
            elif report.get("code") != code_digest():
                report["problems"].append(
                    f"its fedemu {report.get('fedemu')} (code {report.get('code')}) differs from this machine's "
                    f"{fedemu_version()} (code {code_digest()}); install the same version on every node")
            reports[host] = report
        failures = [f"  {h}: {problem}" for h, r in reports.items() for problem in r["problems"]]
        if failures:
            raise LaunchError("preflight failed; nothing was started:\n" + "\n".join(failures))
        return reports

    def start_agents(self, assignment: dict[Host, list[int]], reports: dict[Host, dict], port: int,
                     bundle: dict) -> None:
        """One srun step, a task per worker node (task i is worker node i, on the node
        the assignment chose); every task reads the same bundle from the step's input."""
        order = sorted((index, host) for host, indices in assignment.items() for index in indices)
        hostfile = self.run_dir / "slurm.hosts"
        hostfile.write_text("".join(f"{host.name}\n" for _, host in order))
        addresses = {reports[h]["broker_address"] for h in assignment}
        if len(addresses) != 1:  # one step, one bundle: every node must reach the broker at one address
            raise LaunchError(f"the nodes reach the broker at different addresses ({', '.join(sorted(addresses))}); "
                              "give one with --advertise")
        cpus = [] if self.machines.cpus_per_task_given else [f"--cpus-per-task={self.machines.cpus_per_worker}"]
        argv = ["srun", f"--ntasks={len(order)}", f"--nodes={len(assignment)}", *cpus,
                "--distribution=arbitrary", "--input=all", "--kill-on-bad-exit=0", "--job-name=fedemu-workers",
                sys_python(self.machines), "-m", "fedemu.launch", "host-agent", "--slurm-task"]
        step = RemoteHost(Host(f"slurm-job-{self.machines.job_id}"), self.run_dir, self.echo, via="srun")
        step.start(argv, {**bundle, "broker": f"tcp://{addresses.pop()}:{port}",
                          "indices": [index for index, _ in order]}, env=self.machines.step_env(hostfile))
        self.remotes.append(step)


def sys_python(machines: Machines) -> str:
    """The interpreter the tasks run: --remote-python, else this one (the same install on
    every node, or a shared file system)."""
    return machines.remote_python or sys.executable


