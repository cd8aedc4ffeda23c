"""A run across machines: broker and server here, worker nodes on each host over SSH.

Order of a launch, so that a failure leaves nothing running anywhere:

1. make the run's CURVE keys (the broker accepts only nodes holding them);
2. start the broker here, listening on every interface;
3. preflight every host at once (version, code digest, Python, torch, data set, and the
   broker's port reached from there); any problem stops the broker and names the host;
4. place worker nodes on hosts (slots, in host order) and record it in ``machines.json``;
5. start the server here and one host agent per host; the agent starts and supervises
   that host's worker nodes and streams their output into ``logs/worker-N.out``.

Ending the run, Ctrl-C, or a lost SSH session stops the agents, and an agent that loses
its session stops its nodes, so no process outlives the run on any host.
"""
from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fedemu.node import Node
from fedemu.node.security import RunKeys, load_token
from fedemu.server.runlog import RunLogError, write_node_exit
from fedemu.worker.placement import placement

from .. import config as configuration
from .agent import code_digest, fedemu_version
from .hosts import Host, ssh_argv
from .lifecycle import exit_cause
from .local import LocalRun, last_line
from .rundir import LaunchError

PREFLIGHT_TIMEOUT_S = 600  # a first fetch of the data set on a host may take minutes


@dataclass
class Machines:
    """How to reach the hosts of a multi-machine run."""

    hosts: list[Host]
    ssh_config: str | None = None  # an ssh -F file; default: the user's ~/.ssh/config
    advertise: str | None = None  # the address hosts use for the broker; default: as SSH sees us
    remote_python: str | None = None  # default: this interpreter's path on every host
    bind: str = "0.0.0.0"
    ssh_options: list[str] = field(default_factory=list)

    def python_for(self, host: Host) -> str:
        return host.python or self.remote_python or sys.executable

    def ssh(self, host: Host, remote: list[str]) -> list[str]:
        argv = ssh_argv(host, remote, self.ssh_config)
        return argv[:1] + self.ssh_options + argv[1:]


def last_json_line(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (ssh may print banners first)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def preflight_host(machines: Machines, host: Host, dataset: str, cache_dir: str, broker_port: int,
                   model: str | None = None, device: str | None = None) -> dict:
    """Run the preflight on ``host``; returns its report with ``problems`` filled in."""
    python = machines.python_for(host)
    remote = [python, "-m", "fedemu.launch", "preflight", "--dataset", dataset, "--broker-port", str(broker_port)]
    if model:
        remote += ["--model", model]
    if device:
        remote += ["--device", device]
    if cache_dir:
        remote += ["--cache-dir", cache_dir]
    if machines.advertise:
        remote += ["--broker-address", machines.advertise]
    try:
        done = subprocess.run(machines.ssh(host, remote), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=PREFLIGHT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"problems": [f"the preflight did not answer within {PREFLIGHT_TIMEOUT_S}s"]}
    report = last_json_line(done.stdout)
    stderr = " | ".join(done.stderr.strip().splitlines()[-3:])
    if done.returncode == 255 and report is None:
        return {"problems": [f"unreachable over SSH: {stderr or 'ssh exited with 255'}"]}
    if report is None:
        if "No module named" in done.stderr:
            why = f"fedemu is not installed for {python} ({stderr})"
        elif done.returncode == 127:
            why = f"{python} not found ({stderr})"
        else:
            why = f"the preflight failed with exit code {done.returncode}: {stderr or done.stdout[-300:]}"
        return {"problems": [why]}
    if report.get("code") != code_digest():
        report["problems"].append(
            f"its fedemu {report.get('fedemu')} (code {report.get('code')}) differs from this machine's "
            f"{fedemu_version()} (code {code_digest()}); install the same version on every host")
    return report


def assign_workers(hosts: list[Host], cores: dict[Host, int], default_slots: int | None) -> dict[Host, list[int]]:
    """Worker node indices per host: each host's slots (its ``slots=``, else
    ``default_slots``, else its core count), numbered in host order."""
    assignment: dict[Host, list[int]] = {}
    next_index = 0
    for host in hosts:
        slots = host.slots or default_slots or cores.get(host, 1)
        assignment[host] = list(range(next_index, next_index + slots))
        next_index += slots
    return assignment


class RemoteHost:
    """The session (``via`` ssh, or srun for a Slurm step) to one host's agent, or to a
    step of agents, and the output it streams back."""

    def __init__(self, host: Host, run_dir: Path, echo: Callable[[str], None], via: str = "ssh") -> None:
        self.host = host
        self.via = via
        self.run_dir = run_dir
        self.echo = echo
        self.proc: subprocess.Popen | None = None
        self.exits: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.lost_reported = False
        self._reader: threading.Thread | None = None

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / f"{self.via}-{self.host.label}.log"

    def start(self, argv: list[str], bundle: dict, env: dict | None = None) -> None:
        ssh_log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=ssh_log,
                                     text=True, errors="replace", start_new_session=True,  # see LocalRun._start
                                     env=env)
        ssh_log.close()
        self.proc.stdin.write(json.dumps(bundle) + "\n")
        self.proc.stdin.flush()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        logs: dict[str, object] = {}
        try:
            for line in self.proc.stdout:
                kind, _, rest = line.rstrip("\n").partition(" ")
                name, _, text = rest.partition(" ")
                if kind == "out":
                    if name not in logs:
                        logs[name] = open(self.run_dir / "logs" / f"{name}.out", "a", encoding="utf-8")
                    logs[name].write(text + "\n")
                    logs[name].flush()  # a host that dies mid-run leaves its log up to then
                elif kind == "started":
                    self.pids[name] = int(text)
                elif kind == "exit":
                    self.exits[name] = int(text)
                    if name in logs:
                        logs[name].flush()
                    # How it ended, for the server's faults (runlog.NODE_EXIT); the host's OOM
                    # counter is not seen from here.
                    try:
                        write_node_exit(self.run_dir, name,
                                        exit_cause(int(text), last_line(self.run_dir / "logs" / f"{name}.out")))
                    except RunLogError as exc:
                        self.echo(f"warning: {exc}")
                    if int(text) != 0:
                        self.echo(f"warning: {name} on {self.host} exited with code {text}")
                elif kind == "error":
                    self.echo(f"warning: {self.host}: {rest}")
        finally:
            for f in logs.values():
                f.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 3) -> str:
        path = self.log_path
        text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return " | ".join(text[-lines:]) or "(no output)"

    def ended(self, timeout: float) -> bool:
        """Whether the agent (session) ends within ``timeout`` s, on its own."""
        try:
            return self.proc is None or self.proc.wait(timeout) is not None
        except subprocess.TimeoutExpired:
            return False

    def request_stop(self) -> None:
        if self.alive():
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # Ending ssh ends the session; the agent sees end of input and stops its nodes.
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)


class MachinesRun(LocalRun):
    def __init__(self, config: dict, run_dir: Path, machines: Machines, echo: Callable[[str], None] = print,
                 default_slots: int | None = None) -> None:
        super().__init__(config, run_dir, 0, echo)
        self.machines = machines
        self.default_slots = default_slots
        self.remotes: list[RemoteHost] = []

    def start(self) -> None:
        hosts = self.machines.hosts
        # A machine entry naming no host fails here, before anything starts.
        self._network_by_machine({str(h): range(0) for h in hosts})
        keys = RunKeys.generate()
        self.keys_file = self.run_dir / "run.keys"
        keys.save(self.keys_file)
        self._make_token()
        endpoint = self._start_broker(f"tcp://{self.machines.bind}:0")
        # Nodes, here and on the hosts, get the keys without the broker's secret.
        self.keys_file = keys.for_nodes().save(self.run_dir / "node.keys")
        port = int(endpoint.rsplit(":", 1)[1])
        reports = self.preflight(port)
        assignment = assign_workers(self.machines.hosts, {h: r["cores"] for h, r in reports.items()},
                                    self.default_slots)
        self.workers = sum(len(indices) for indices in assignment.values())
        clients = placement(self.config["data"]["clients"], self.workers)
        record = {
            "broker_port": port,
            "server_host": "local",
            **self.placement_source(),
            "hosts": [{"host": str(h), "address": reports[h]["broker_address"], "workers": indices,
                       "clients": [clients[indices[0]].start, clients[indices[-1]].stop - 1],
                       "fedemu": reports[h]["fedemu"], "torch": reports[h].get("torch"),
                       "python": reports[h]["python"], "device": reports[h].get("device")}
                      for h, indices in assignment.items()],
        }
        by_machine = self._network_by_machine(
            {str(h): range(clients[ix[0]].start, clients[ix[-1]].stop) for h, ix in assignment.items()})
        if by_machine:
            self._set_links(port, by_machine)
            spec, _ = configuration.network_parts(self.config)
            profiles = {host: name for name, host in spec.assign if isinstance(host, str)}  # the last entry wins
            for entry in record["hosts"]:
                entry["profile"] = profiles.get(entry["host"])
        (self.run_dir / "machines.json").write_text(json.dumps(record, indent=1) + "\n")
        for entry in record["hosts"]:
            self.echo(f"host {entry['host']}: worker nodes {entry['workers']}, clients "
                      f"{entry['clients'][0]}..{entry['clients'][1]}")
        self._start_server(f"tcp://127.0.0.1:{port}")
        bundle = {"run_id": secrets.token_hex(4), "config_toml": (self.run_dir / "config.toml").read_text(),
                  "settings_json": (self.run_dir / configuration.PROCESS_SETTINGS_FILE).read_text(),
                  "keys": self.keys_file.read_text(), "token": self.token_file.read_text(), "workers": self.workers}
        population = self.run_dir / configuration.POPULATION_FILE
        if population.exists():  # each client's device speed: the hosts need not have the trace files
            bundle["population_json"] = population.read_text()
        self.start_agents(assignment, reports, port, bundle)

    def placement_source(self) -> dict:
        """What chose the hosts, for machines.json."""
        return {"launcher": "ssh"}

    def start_agents(self, assignment: dict[Host, list[int]], reports: dict[Host, dict], port: int,
                     bundle: dict) -> None:
        """One host agent per host, over SSH, each starting that host's worker nodes."""
        for host, indices in assignment.items():
            remote = RemoteHost(host, self.run_dir, self.echo)
            remote.start(self.machines.ssh(host, [self.machines.python_for(host), "-m", "fedemu.launch",
                                                  "host-agent"]),
                         {**bundle, "broker": f"tcp://{reports[host]['broker_address']}:{port}", "indices": indices})
            self.remotes.append(remote)

    def _set_links(self, port: int, by_machine: list[tuple[str, frozenset[int]]]) -> None:
        """Give each host's clients its profile on the running broker, before any client
        exists. Every assign entry is applied again in config order, so a later entry
        still wins over an earlier one, as in a local run."""
        node = Node("launcher", f"tcp://127.0.0.1:{port}", keys=RunKeys.load(self.keys_file),
                    token=load_token(self.token_file)).start()
        try:
            for profile, clients in by_machine:
                node.set_links(sorted(clients), profile=profile)
        except Exception as exc:
            raise LaunchError(f"could not give the hosts' clients their link profiles: {exc}") from None
        finally:
            node.close("links set")

    def preflight(self, broker_port: int) -> dict[Host, dict]:
        data = self.config["data"]
        hosts = self.machines.hosts
        self.echo(f"preflight on {len(hosts)} host(s) ...")
        with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
            futures = {h: pool.submit(preflight_host, self.machines, h, data["dataset"], data["cache_dir"],
                                      broker_port, self.config["model"]["name"], self.config["run"]["device"])
                       for h in hosts}
            reports = {h: f.result() for h, f in futures.items()}
        failures = [f"  {h}: {problem}" for h, r in reports.items() for problem in r["problems"]]
        if failures:
            raise LaunchError("preflight failed; nothing was started:\n" + "\n".join(failures))
        local_torch = _torch_version()
        for host, report in reports.items():
            if report.get("torch") != local_torch:  # runs, but results may differ in the last bits
                self.echo(f"warning: {host} has torch {report.get('torch')}, this machine {local_torch}")
        return reports

    def check_hosts(self) -> None:
        for remote in self.remotes:
            if remote.lost_reported or remote.alive():
                continue
            remote.lost_reported = True
            if remote._reader is not None:
                remote._reader.join(2)  # its last lines say how the nodes ended
            if not remote.pids or any(remote.exits.get(name) != 0 for name in remote.pids):
                self.echo(f"warning: the session to {remote.host} ended ({remote.via} exit {remote.proc.returncode}): "
                          f"{remote.log_tail()}; the server sees its clients DOWN")

    def stop(self, grace: float = 15.0) -> None:
        server = self.procs.get("server")
        if server is not None:
            try:  # the server's shutdown tells every worker node to leave: let it
                server.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + grace  # wall
        if server is not None and server.poll() == 0:
            # The server told the nodes to leave: give them a moment to exit on their own,
            # so a node still tearing down is not counted as killed.
            for remote in self.remotes:
                remote.ended(min(5.0, max(0.1, deadline - time.monotonic())))  # wall
        for remote in self.remotes:
            remote.request_stop()
        for remote in self.remotes:
            remote.wait(max(0.1, deadline - time.monotonic()))  # wall
        super().stop(grace)


def _torch_version() -> str | None:
    try:
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        import torch

        return torch.__version__
    except ImportError:
        return None
