"""What fedemu runs on a remote host, over SSH: the preflight and the host agent.

The **preflight** answers, as one JSON line, everything the launcher must know before it
starts anything there: the fedemu version and code digest, Python and torch, the data
set, the core count, and whether the broker's port is reachable from that host.

The **host agent** starts this host's worker nodes and supervises them. Its stdin is the
SSH session: the first line is the launch bundle (JSON), a later ``stop`` line or the end
of stdin (the launcher or its link is gone) stops every worker node, so no process
outlives the run. Its stdout streams the nodes' output back, one line per record::

    started NAME PID | out NAME TEXT | exit NAME CODE | error TEXT
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from importlib import metadata
from pathlib import Path

from .. import config as configuration
from .lifecycle import STOP_SIGNALS, child_env
from .slurm_task import launch_address, task_identity
from .zygote import ForkedNode, Zygote, ZygoteError
from .zygote import shared as shared_zygote

PACKAGES = ("fedemu.node", "fedemu.common", "fedemu.server", "fedemu.worker", "fedemu.launch")


def fedemu_version() -> str:
    try:
        return metadata.version("fedemu")
    except metadata.PackageNotFoundError:
        return "unknown"


def code_digest() -> str:
    """A digest of fedemu's source, so two installs of one version number but different
    code (an edited checkout) are caught before they exchange messages."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.rglob("*.py")) + sorted(folder.rglob("*.toml")):  # subpackages too
            digest.update(f"{package}/{path.relative_to(folder).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _launcher_address(slurm_task: bool = False) -> str | None:
    """The address this host sees the launcher's SSH connection (or Slurm step) come
    from: an address of the launcher's machine that is routable from here."""
    if slurm_task:
        return launch_address()
    words = os.environ.get("SSH_CONNECTION", "").split()
    return words[0] if words else None


def _reachable(address: str, port: int, timeout: float = 5.0) -> str | None:
    """None if a TCP connection to address:port succeeds, else the reason."""
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def preflight(dataset: str, cache_dir: str | None, broker_port: int | None, broker_address: str | None,
              model: str | None = None, slurm_task: bool = False, device: str | None = None) -> dict:
    report: dict = {"fedemu": fedemu_version(), "code": code_digest(), "python": sys.version.split()[0],
                    "executable": sys.executable, "cores": usable_cores(), "problems": []}
    if slurm_task:  # one report per node of the step: say which
        report["node"] = task_identity()[1]
    try:
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        import torch

        report["torch"] = torch.__version__
    except ImportError as exc:
        report["problems"].append(f"torch cannot be imported ({exc})")
    # Worker nodes import it on their first exact-sum addition (aggregation on the nodes):
    # a missing or broken install is found here, not halfway through a run.
    try:
        import numba  # noqa: F401
    except Exception as exc:  # ImportError, or a mismatched llvmlite or NumPy
        report["problems"].append(f"numba cannot be imported ({exc})")
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.ml import data, datasets, devices, models

    if device is not None:  # the worker nodes here train on it
        try:
            report["device"] = devices.use_device(devices.torch_device(device))
        except devices.DeviceUnavailable as exc:
            report["problems"].append(str(exc))

    # Worker nodes load the data set and build the model: a plug-in must import here too.
    try:
        declared = datasets.get(dataset)
    except datasets.DatasetError as exc:
        report["problems"].append(f"cannot use data set {dataset!r} here: {exc}")
        declared = None
    if model is not None and declared is not None:
        try:
            models.build(model, declared.input_shape, declared.num_classes, seed=0)
        except Exception as exc:
            report["problems"].append(f"cannot build model {model!r} here: {exc}")
    if declared is not None:
        try:
            # Quiet: the preflight's stdout is one JSON line; fetching shows nothing.
            report["dataset"] = str(data.fetch(dataset, cache_dir or None, progress=lambda _: None))
        except data.DatasetError as exc:
            report["problems"].append(f"data set {dataset!r} is neither cached nor fetchable: {exc}")
    address = broker_address or _launcher_address(slurm_task)
    report["broker_address"] = address
    if broker_port is not None:
        if address is None:
            source = "SLURM_LAUNCH_NODE_IPADDR" if slurm_task else "SSH_CONNECTION"
            report["problems"].append(f"cannot tell the launcher's address (no {source}); pass --advertise")
        else:
            reason = _reachable(address, broker_port)
            if reason:
                report["problems"].append(f"the broker at {address}:{broker_port} is unreachable from here ({reason})")
    return report


# --- the host agent ------------------------------------------------------------------


def usable_cores() -> int:
    """The CPUs this process may run on: all of the host's, or those Slurm (or taskset)
    bound it to."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_config(config_toml: str, local_workers: int) -> str:
    """The run's config as this host's nodes read it: torch_threads = 0 means this
    host's cores (this task's, under Slurm) over this host's worker nodes, not over the
    run's total."""
    config = tomllib.loads(config_toml)
    if not config["run"]["torch_threads"] and config["run"]["clock"] == "wall":  # virtual time pins it to 1
        config["run"]["torch_threads"] = max(1, usable_cores() // max(1, local_workers))
    return configuration.to_toml(config)


def host_settings(settings_json: str, local_workers: int) -> str:
    """The run's settings.json as this host's worker nodes read it: torch_threads as
    :func:`host_config` sets it."""
    settings = json.loads(settings_json)
    node = settings["worker"]["node"]
    if not node["torch_threads"] and node["clock"] == "wall":  # virtual time pins it to 1
        node["torch_threads"] = max(1, usable_cores() // max(1, local_workers))
    return json.dumps(settings, indent=1)


class HostAgent:
    def __init__(self, bundle: dict, out=sys.stdout) -> None:
        self.bundle = bundle
        self.out = out
        self._lock = threading.Lock()
        self.procs: dict[str, subprocess.Popen] = {}
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"fedemu-{bundle['run_id']}-"))
        self.stopping = threading.Event()

    def emit(self, kind: str, *words: object) -> None:
        with self._lock:
            self.out.write(" ".join([kind, *map(str, words)]) + "\n")
            self.out.flush()

    def start(self) -> None:
        b = self.bundle
        (self.run_dir / "config.toml").write_text(host_config(b["config_toml"], len(b["indices"])))
        # What this host's worker nodes read: the launcher's settings, with this host's torch threads.
        (self.run_dir / configuration.PROCESS_SETTINGS_FILE).write_text(
            host_settings(b["settings_json"], len(b["indices"])))
        if "population_json" in b:
            (self.run_dir / configuration.POPULATION_FILE).write_text(b["population_json"])
        credentials = []
        for option, field, name in (("--keys", "keys", "run.keys"), ("--token-file", "token", "run.token")):
            path = self.run_dir / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(b[field])
            credentials += [option, str(path)]
        # Two or more nodes here: they fork from a zygote that imported torch once (zygote.py).
        zygote = shared_zygote() if len(b["indices"]) > 1 else None
        started = []
        for index in b["indices"]:
            name = f"worker-{index}"
            args = ["node", "worker", "--index", str(index), "--broker", b["broker"], "--run-dir", str(self.run_dir),
                    "--workers", str(b["workers"]), *credentials, "--log-stream"]
            started.append((name, args, *self._start_node(zygote, args)))
        for name, args, proc, output in started:
            if isinstance(proc, ForkedNode):
                try:
                    proc.started()
                except ZygoteError:  # the zygote could not fork it: the node starts as its own process
                    output.close()
                    proc, output = self._start_node(None, args)
            self.procs[name] = proc
            self.emit("started", name, proc.pid)
            threading.Thread(target=self._forward, args=(name, proc, output), daemon=True).start()

    @staticmethod
    def _start_node(zygote: Zygote | None, args: list[str]) -> tuple:
        """``python -m fedemu.launch ARGS``, forked from ``zygote`` (not yet running, maybe:
        ForkedNode.started) or its own process; returns it and its output (text)."""
        if zygote is not None:
            try:
                proc, read = zygote.request_piped(args)
            except ZygoteError:
                pass
            else:
                return proc, open(read, encoding="utf-8", errors="replace")
        # child_env names this agent: the node asks for SIGTERM when the agent dies.
        proc = subprocess.Popen([sys.executable, "-m", "fedemu.launch", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env(), text=True,
                                errors="replace")
        return proc, proc.stdout

    def _forward(self, name: str, proc, output) -> None:
        for line in output:
            self.emit("out", name, line.rstrip("\n"))
        self.emit("exit", name, proc.wait())

    def stop(self, grace: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace  # wall
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))  # wall
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def cleanup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)  # it holds the run's keys and token

    def serve(self, commands) -> int:
        """Run until every node exits, or ``stop`` / end of input / a signal arrives."""
        stopping = self.stopping

        def read_commands() -> None:
            for line in commands:
                if line.strip() == "stop":
                    break
            stopping.set()

        threading.Thread(target=read_commands, daemon=True).start()
        try:
            self.start()
            while not stopping.is_set() and any(p.poll() is None for p in self.procs.values()):
                stopping.wait(0.2)
        finally:
            self.stop()
            self.cleanup()
        return 0


def run_agent(slurm_task: bool = False) -> int:
    """The host agent; as a task of a Slurm step (``slurm_task``) it starts only the
    worker node whose index is its task number (every task reads the same bundle)."""
    line = sys.stdin.readline()
    try:
        bundle = json.loads(line)
    except json.JSONDecodeError:
        print(f"error the first line is not a launch bundle: {line[:80]!r}", flush=True)
        return 2
    if slurm_task:
        bundle["indices"] = [bundle["indices"][task_identity()[0]]]
    agent = HostAgent(bundle)
    # SIGHUP/SIGTERM from sshd mean the session is gone: stop the nodes, as on EOF.
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: agent.stopping.set())
    return agent.serve(sys.stdin)
