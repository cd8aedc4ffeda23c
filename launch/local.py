"""Start a whole run on this machine: broker, server node and worker nodes as real
OS processes; show live progress; stop every one of them at the end or on Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

from fedemu.server.runlog import EVENTS, SUMMARY

from . import config as configuration


class LaunchError(RuntimeError):
    pass


def make_run_dir(config: dict, out: str | Path | None) -> Path:
    if out is not None:
        run_dir = Path(out)
        if (run_dir / EVENTS).exists():
            raise LaunchError(f"{run_dir} already holds a run ({EVENTS}); choose another --out")
    else:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{stamp}-{config['algorithm']['name']}-{config['data']['dataset']}-{config['model']['name']}"
        run_dir = Path(config["run"]["out"]) / name
        suffix = 1
        while run_dir.exists():
            suffix += 1
            run_dir = Path(config["run"]["out"]) / f"{name}-{suffix}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return run_dir


class LocalRun:
    """The OS processes of one run on this machine."""

    def __init__(self, config: dict, run_dir: Path, workers: int, echo: Callable[[str], None] = print):
        self.config = config
        self.run_dir = run_dir
        self.workers = workers
        self.echo = echo
        self.procs: dict[str, subprocess.Popen] = {}
        self.keys_file: Path | None = None  # the run's CURVE keys, when the broker demands them
        self._events_offset = 0

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.run_dir / "logs" / f"{name}.out", "ab")
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which stops
        # the run in order (server first, which tells the nodes and the broker to leave).
        # Were the broker hit at the same moment, the server could lose it mid-shutdown.
        proc = subprocess.Popen([sys.executable, "-m", "fedemu.launch", *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        out.close()
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        self._network_by_machine({})  # a local run has no hosts: refuse machine entries now
        endpoint = self._start_broker("tcp://127.0.0.1:0")
        self._start_server(endpoint)
        for i in range(self.workers):
            self._start(f"worker-{i}", "node", "worker", "--index", str(i), *self._node_args(endpoint))

    def _network_by_machine(self, clients_of: dict[str, range]) -> list[tuple[str, frozenset[int]]]:
        """network.assign with its ``machine`` entries resolved to the clients each host
        runs (empty when there are none); a host the run does not have is a LaunchError."""
        from fedemu.node.links import LinkConfigError

        spec, _ = configuration.network_parts(self.config)
        if not spec.machines:
            return []
        try:
            return spec.resolve_machines(clients_of)
        except LinkConfigError as exc:
            raise LaunchError(str(exc)) from None

    def _keys_args(self) -> list[str]:
        return ["--keys", str(self.keys_file)] if self.keys_file else []

    def _node_args(self, endpoint: str) -> list[str]:
        return ["--broker", endpoint, "--run-dir", str(self.run_dir), "--workers", str(self.workers),
                *self._keys_args()]

    def _start_broker(self, bind: str) -> str:
        """Start the broker; returns the address it bound."""
        run = self.config["run"]
        endpoint_file = self.run_dir / "broker.endpoint"
        network_file = self.run_dir / "network.json"
        network_file.write_text(json.dumps(configuration.broker_network_file(self.config), indent=1))
        broker = self._start("broker", "broker", "--bind", bind, "--endpoint-file", str(endpoint_file),
                             "--heartbeat-interval", str(run["heartbeat_interval_s"]),
                             "--heartbeat-timeout", str(run["heartbeat_timeout_s"]),
                             "--network", str(network_file), *self._keys_args())
        deadline = time.monotonic() + 30
        while not endpoint_file.exists():
            if broker.poll() is not None:
                raise LaunchError(f"the broker exited with code {broker.returncode}: {self._tail('broker')}")
            if time.monotonic() > deadline:
                raise LaunchError("the broker did not start within 30s")
            time.sleep(0.05)
        return endpoint_file.read_text().strip()

    def _start_server(self, endpoint: str) -> None:
        self._start("server", "node", "server", *self._node_args(endpoint))

    def follow(self) -> dict:
        """Print progress until the server node exits; returns the summary."""
        server = self.procs["server"]
        reported: set[str] = set()
        while server.poll() is None:
            self._print_new_events()
            for name, proc in self.procs.items():
                if name != "server" and name not in reported and proc.poll() not in (None, 0):
                    reported.add(name)  # the server sees its clients DOWN; the user sees why
                    self.echo(f"warning: {name} exited with code {proc.returncode}: {self._tail(name)}")
            self.check_hosts()
            time.sleep(0.25)
        self._print_new_events()
        return self.summary()

    def check_hosts(self) -> None:
        """Report a lost host; a hook for runs with nodes on other machines."""

    def _print_new_events(self) -> None:
        path = self.run_dir / EVENTS
        if not path.exists():
            return
        with open(path, encoding="utf-8") as f:
            f.seek(self._events_offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self._events_offset = f.tell()
                self.echo(format_event(json.loads(line), self.config["run"]["rounds"]))

    def summary(self) -> dict:
        path = self.run_dir / SUMMARY
        if path.exists():
            return json.loads(path.read_text())
        server = self.procs.get("server")
        if server is None or server.poll() is None:
            return {"status": "failed", "reason": "the server node did not finish"}
        # The server node died (killed, crashed): record that in the run directory too, so
        # tools that read summary.json see a failed run, not a missing one.
        summary = {"status": "failed", "reason": f"the server node exited ({server.returncode}) "
                   f"without a summary: {self._tail('server')}"}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, path)
        return summary

    def _tail(self, name: str, lines: int = 5) -> str:
        path = self.run_dir / "logs" / f"{name}.out"
        text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return " | ".join(text[-lines:]) or "(no output)"

    def interrupt(self) -> None:
        server = self.procs.get("server")
        if server and server.poll() is None:
            server.send_signal(signal.SIGINT)

    def stop(self, grace: float = 15.0) -> None:
        """Let every process exit on its own, then terminate, then kill: no strays."""
        deadline = time.monotonic() + grace
        for name, proc in sorted(self.procs.items(), key=lambda item: item[0] == "broker"):
            # The broker goes last, and briefly: a server's shutdown has already ended it,
            # and without a server (a failed start) nothing else will.
            wait = min(2.0, grace) if name == "broker" else deadline - time.monotonic()
            try:
                proc.wait(max(0.1, wait))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def format_event(event: dict, rounds: int) -> str:
    kind = event["event"]
    if kind == "round":
        acc = "   -  " if event.get("accuracy") is None else f"{event['accuracy']:.4f}"
        loss = "  -   " if event.get("loss") is None else f"{event['loss']:.4f}"
        return (f"round {event['round']:4d}/{rounds}  acc {acc}  loss {loss}  "
                f"clients {event['participants']:3d}  up {event['bytes_up'] / 1e6:7.2f} MB  "
                f"elapsed {event['t']:7.1f}s")
    if kind == "start":
        return f"start: {event['clients']} clients on {len(event['placement'])} worker node(s), {event['per_round']} per round"
    if kind == "fault":
        return f"fault: client {event['client']} lost in round {event['round']} ({event['reason']})"
    if kind == "end":
        return f"end: {event['status']} after {event['rounds']} rounds ({event['reason']})"
    return f"{kind}: " + ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("event",))


def launch(config_path: str | None, overrides: list[str], out: str | None, workers: int | None,
           echo: Callable[[str], None] = print, machines=None) -> tuple[Path, dict]:
    """Run one configuration, on this machine or with worker nodes on ``machines``
    (a :class:`fedemu.launch.machines.Machines`); returns (run directory, summary)."""
    from fedemu.worker import data

    config = configuration.load(config_path, overrides)
    if workers is not None:
        config["run"]["workers"] = workers
    workers = config["run"]["workers"] or os.cpu_count() or 1
    run_dir = make_run_dir(config, out)
    (run_dir / "config.toml").write_text(configuration.to_toml(config))
    data.fetch(config["data"]["dataset"], config["data"]["cache_dir"] or None, progress=echo)
    echo(f"run directory: {run_dir}")
    if machines is None:
        run = LocalRun(config, run_dir, workers, echo)
    else:
        from .machines import MachinesRun

        run = MachinesRun(config, run_dir, machines, echo, default_slots=workers if config["run"]["workers"] else None)
    try:
        run.start()
        summary = run.follow()
    except KeyboardInterrupt:
        echo("interrupted: stopping the run ...")
        run.interrupt()
        try:
            run.procs["server"].wait(30)
        except (KeyError, subprocess.TimeoutExpired):
            pass
        summary = run.summary()
    finally:
        run.stop()
    return run_dir, summary
