"""A Slurm test cluster on this machine: a controller (slurmctld) and ``count`` compute
nodes, each slurmd in a network namespace of its own on a shared bridge, with a munge
daemon of the cluster's own for authentication.

Each node has its own network stack, address and host name (a UTS namespace), so Slurm
and fedemu reach it only over the bridge, as they would reach another machine; the file
system is shared, as a cluster's is, so one Python and fedemu install serve every node.
Everything (configuration, state, logs, the munge key) lives in one folder, and every
command of the cluster reads ``SLURM_CONF`` (:meth:`env`), so the test cluster leaves the
machine's own Slurm and munge configuration untouched.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from .testhosts import _run, subnet_reserved

DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
COMMANDS = ("srun", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "nsenter", "unshare")


def unavailable_reason() -> str | None:
    """Why a test cluster cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and run slurmd as root"
    if not shutil.which("ip"):
        return "needs iproute2 (ip netns) for the cluster's nodes"
    missing = [d for d in DAEMONS if not os.path.exists(d)] + [c for c in COMMANDS if not shutil.which(c)]
    if missing:
        return ("needs Slurm and munge (apt-get install slurmctld slurmd slurm-client munge): missing "
                + ", ".join(missing))
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """Nodes n1..nN of partition ``test``; :meth:`env` is the environment in which
    Slurm's commands (sbatch, srun, squeue, ...) talk to this cluster."""

    __test__ = False

    def __init__(self, workdir: Path, count: int = 2, cpus: int = 2) -> None:
        self.dir = workdir
        self.count = count
        self.cpus = cpus
        tag = os.getpid() % 10000  # concurrent test sessions must not share names
        self.bridge = f"fes{tag}br"
        self.namespaces = [f"fedemu-{tag}-n{i}" for i in range(1, count + 1)]
        self.veths = [f"fes{tag}n{i}" for i in range(1, count + 1)]
        self.addresses: list[str] = []  # on a free subnet, chosen in up()
        self.controller = ""
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []

    @property
    def names(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.count + 1)]

    def env(self) -> dict:
        env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[key]  # a test run inside a real allocation must not leak into this one
        return env

    def up(self) -> "SlurmCluster":
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)  # munged refuses a socket folder others cannot traverse
        (self.dir / "state").mkdir(exist_ok=True)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        with subnet_reserved(range(200, 250)) as subnet:
            self.controller = f"10.{subnet}.0.1"
            self.addresses = [f"10.{subnet}.0.{i + 1}" for i in range(1, self.count + 1)]
            _run("ip", "addr", "add", f"{self.controller}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for ns, veth, address in zip(self.namespaces, self.veths, self.addresses):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = self.dir / "munge.sock"
        self._start("munged", ["/usr/sbin/munged", "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--pid-file={self.dir / 'munged.pid'}",
                               f"--log-file={self.dir / 'munged.log'}", f"--seed-file={self.dir / 'munged.seed'}"])
        self._wait(lambda: socket_path.exists(), "munged did not create its socket", "munged")
        self.conf.write_text(self._config(socket_path))
        # The controller checks that its host name is the configured one: give it a UTS
        # namespace named so (the network is the machine's, bridge included).
        self._start("slurmctld", ["unshare", "--uts", "sh", "-c", "hostname fedemuctl && exec slurmctld -D -i"])
        for name, ns in zip(self.names, self.namespaces):
            # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mounts slurmd reads.
            self._start(f"slurmd-{name}", ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "sh", "-c",
                                           f"hostname {name} && exec slurmd -D -N {name}"])
        self._wait(self._nodes_idle, "the nodes did not come up idle", "slurmctld")
        return self

    def _config(self, socket_path: Path) -> str:
        d = self.dir
        nodes = [f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN" for n, a in zip(self.names, self.addresses)]
        return "\n".join([
            "ClusterName=fedemutest", f"SlurmctldHost=fedemuctl({self.controller})",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={socket_path}",
            "CredType=cred/munge", f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool-%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd-%n.log'}",
            # Processes tracked by parentage, CPUs bound by sched_setaffinity: no cgroups
            # needed, so the cluster runs in a container too.
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/affinity",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            "MpiDefault=none", "MailProg=/bin/true", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "ReturnToService=2",
            "KillWait=15",  # seconds from scancel's SIGTERM to SIGKILL: a run's orderly stop fits
            "SlurmdParameters=config_overrides", "MinJobAge=600",
            *nodes, f"PartitionName=test Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP", ""])

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=self.env()))
        log.close()

    def _nodes_idle(self) -> bool:
        done = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], capture_output=True, text=True,
                              env=self.env())
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return done.returncode == 0 and all(states.get(n) == "idle" for n in self.names)

    def _wait(self, ready, what: str, log: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                text = (self.dir / f"{log}.out").read_text(errors="replace")[-800:]
                raise RuntimeError(f"test cluster: {what} within {timeout:.0f}s: {text}")
            time.sleep(0.2)

    def slurm(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run one of Slurm's commands against this cluster."""
        return subprocess.run(argv, capture_output=True, text=True, env=self.env(), timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def queue(self, job: str) -> list[str]:
        """States of ``job``'s parts still in the queue (empty: it has ended)."""
        done = self.slurm("squeue", "--noheader", "--array", f"--jobs={job}", "--format=%T")
        return done.stdout.split() if done.returncode == 0 else []

    def wait_for_end(self, job: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.queue(job):
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm job {job} still in the queue after {timeout:.0f}s: {self.queue(job)}")
            time.sleep(0.5)

    def processes(self, node: str) -> dict[int, str]:
        """Processes in ``node``'s namespace other than its slurmd: pid -> command line."""
        slurmd = {p.pid for p in self.procs}
        found = {}
        for pid in _run("ip", "netns", "pids", self.namespaces[self.names.index(node)]).split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if int(pid) in slurmd:
                continue
            found[int(pid)] = cmdline
        return found

    def down(self) -> None:
        for job in self.slurm("squeue", "--noheader", "--format=%i").stdout.split():
            self.slurm("scancel", job)
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in self.namespaces:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:  # a leftover is a test failure, reported by the test; not left running
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
