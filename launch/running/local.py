"""Start a whole run on this machine: broker, server node and worker nodes as real
OS processes; show live progress; stop every one of them at the end or on Ctrl-C."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from fedemu.node.net.profiles import LinkConfigError
from fedemu.node.security import new_token, private_ipc_endpoint, save_private
from fedemu.server.runlog import (
    RESERVE, SUMMARY, RunLogError, read_events, write_error, write_json_atomically, write_node_exit,
)

from .. import config as configuration
from .lifecycle import STOP_SIGNALS, OomKills, child_env, describe_exit, exit_cause, stop_reason
from .progress import EventTail
from .rundir import LaunchError, write_run_file
from .zygote import ForkedNode, Zygote, ZygoteError
from .zygote import shared as shared_zygote

# The nodes that may steer a run at its broker (shut it down, announce rounds, change the
# links; node/control.py's CONTROLLER_OPS): the server node, the launcher's own node
# (machines.py sets links with it), and an operator's (a script of yours that changes the
# network while the run goes: docs/network.md). Never a worker node.
CONTROLLERS = ("server", "launcher", "operator")
TOKEN_FILE = "run.token"


class LocalRun:
    """The OS processes of one run on this machine."""

    def __init__(self, config: dict, run_dir: Path, workers: int, echo: Callable[[str], None] = print,
                 on_event: Callable[[dict], None] | None = None):
        self.config = config
        self.run_dir = run_dir
        self.workers = workers
        self.echo = echo
        self.on_event = on_event  # each event as it is printed (the progress bar)
        self.procs: dict[str, subprocess.Popen | ForkedNode] = {}
        self.keys_file: Path | None = None  # the run's CURVE keys, when the broker demands them
        self.token_file: Path | None = None  # the run's token, which every node's hello carries
        self.socket_dir: Path | None = None  # where a local run's broker listens (mode 0700)
        self._events = EventTail(run_dir)
        self.broker_died: str | None = None  # how the broker process ended, if before the server
        self.interrupted_by: int | None = None  # the stop signal (or Ctrl-C) this launcher got
        self.oom_kills = OomKills()  # what the kernel's OOM killer does meanwhile: a SIGKILL's likely cause
        self._exits_recorded: set[str] = set()
        self._faults_shown = _FaultLines(echo)
        self.zygote: Zygote | None = None  # where this run's local nodes fork from (zygote.py)
        self._zygote_warned = False

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        try:
            out = open(self.run_dir / "logs" / f"{name}.out", "ab")
        except OSError as exc:
            raise LaunchError(str(write_error(self.run_dir / "logs" / f"{name}.out", exc))) from None
        try:
            proc = self._fork_node(name, args, out) if self._forks(args[0]) else None
            if proc is None:
                # A session of its own: a terminal's Ctrl-C reaches only the launcher, which stops
                # the run in order (server first, which tells the nodes and the broker to leave).
                # Were the broker hit at the same moment, the server could lose it mid-shutdown.
                # child_env names this launcher: the child asks for SIGTERM when it dies (lifecycle).
                proc = subprocess.Popen([sys.executable, "-m", "fedemu.launch", *args],
                                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=child_env())
        finally:
            out.close()
        self.procs[name] = proc
        return proc

    def _forks(self, command: str) -> bool:
        """Whether ``fedemu.launch COMMAND`` starts forked from the zygote: a node always (it
        needs torch: waiting for the zygote's imports costs it nothing); the broker only once
        the zygote is ready (a sweep's later points), as its own interpreter starts sooner
        than a zygote still importing torch."""
        if command == "node":
            return True
        zygote = self.zygote if self.zygote is not None else shared_zygote()
        return command == "broker" and zygote is not None and zygote.ready.is_set()

    def _fork_node(self, name: str, args: tuple[str, ...], out) -> ForkedNode | None:
        """The node forked from this launcher's zygote (zygote.py), which has imported
        torch and the node code once; None where there is none (FEDEMU_ZYGOTE=0, or its
        imports failed: the node then starts as its own process, which says why)."""
        zygote = self.zygote if self.zygote is not None else shared_zygote()
        try:
            if zygote is None:
                return None
            node = zygote.request(list(args), out.fileno())
            # Ours before it runs: a stop signal while the zygote still imports leaves
            # it to stop() (which signals it once forked), not running unseen.
            self.procs[name] = node
            node.started()
            return node
        except ZygoteError as exc:
            self.procs.pop(name, None)
            if not self._zygote_warned:
                self._zygote_warned = True
                self.echo(f"warning: {exc}; nodes start as their own processes")
            return None

    def start(self) -> None:
        # First: its imports (~1.5 s) overlap the broker's start.
        self.zygote = shared_zygote()
        self._network_by_machine({})  # a local run has no hosts: refuse machine entries now
        self._check_device()
        self._make_token()
        # A unix socket in a directory only this user may enter: no other user's process
        # can reach the broker; this user's without the token are refused (security.py).
        self.socket_dir, bind = private_ipc_endpoint()
        endpoint = self._start_broker(bind)
        self._start_server(endpoint)
        for i in range(self.workers):
            self._start(f"worker-{i}", "node", "worker", "--index", str(i), *self._node_args(endpoint))

    def _check_device(self) -> None:
        """A GPU in run.device that this machine lacks stops the run before anything starts
        (worker hosts of --machines and --slurm are checked by their preflight)."""
        if self.config["run"]["device"] in ("auto", "cpu"):
            return  # always available: spare the launcher torch's import
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        from fedemu.common.ml.devices import DeviceUnavailable, torch_device

        try:
            torch_device(self.config["run"]["device"])
        except DeviceUnavailable as exc:
            raise LaunchError(f"{exc}; nothing was started") from None

    def _network_by_machine(self, clients_of: dict[str, range]) -> list[tuple[str, frozenset[int]]]:
        """network.assign with its ``machine`` entries resolved to the clients each host
        runs (empty when there are none); a host the run does not have is a LaunchError."""
        spec, _ = configuration.network_parts(self.config)
        if not spec.machines:
            return []
        try:
            return spec.resolve_machines(clients_of)
        except LinkConfigError as exc:
            raise LaunchError(str(exc)) from None

    def _make_token(self) -> None:
        """The run's token, in the run directory (mode 0600): a node joins only with it."""
        self.token_file = save_private(self.run_dir / TOKEN_FILE, new_token() + "\n")

    def _keys_args(self) -> list[str]:
        return [*(["--keys", str(self.keys_file)] if self.keys_file else []),
                *(["--token-file", str(self.token_file)] if self.token_file else [])]

    def _node_args(self, endpoint: str) -> list[str]:
        return ["--broker", endpoint, "--run-dir", str(self.run_dir), "--workers", str(self.workers),
                *self._keys_args()]

    def _start_broker(self, bind: str) -> str:
        """Start the broker; returns the address it bound."""
        run = self.config["run"]
        endpoint_file = self.run_dir / "broker.endpoint"
        network_file = self.run_dir / "network.json"
        write_run_file(network_file, json.dumps(configuration.broker_network_file(self.config), indent=1))
        broker = self._start("broker", "broker", "--bind", bind, "--endpoint-file", str(endpoint_file),
                             "--heartbeat-interval", str(run["heartbeat_interval_s"]),
                             "--heartbeat-timeout", str(run["heartbeat_timeout_s"]),
                             "--network", str(network_file), *self._keys_args(),
                             *[arg for name in CONTROLLERS for arg in ("--controller", name)])
        deadline = time.monotonic() + 30  # wall
        while not endpoint_file.exists():
            if broker.poll() is not None:
                raise LaunchError(f"the broker exited with code {broker.returncode}: {self._tail('broker')}")
            if time.monotonic() > deadline:  # wall
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
            self.check_exits(reported)
            self.check_hosts()
            self.await_server(0.25)
        self._print_new_events()
        self._faults_shown.flush()
        self.check_exits(reported)
        return self.summary()

    def await_server(self, at_most_s: float) -> None:
        """A follower's tick: ends at once when the server node exits (the run's end waits on it)."""
        try:
            self.procs["server"].wait(at_most_s)
        except subprocess.TimeoutExpired:
            pass

    def check_exits(self, reported: set[str]) -> None:
        """Say which process of the run died, and how; a dead broker is the run's end."""
        for name, proc in self.procs.items():
            if (name.startswith("worker-") and name not in self._exits_recorded and proc.poll() is not None
                    and self._run_goes_on()):
                self._exits_recorded.add(name)
                self.record_exit(name, proc.returncode)
            if name != "server" and name not in reported and proc.poll() not in (None, 0):
                reported.add(name)  # the server sees its clients DOWN; the user sees why
                self.echo(f"warning: {name} {describe_exit(proc.returncode)}: {self._tail(name)}")
                if name == "broker" and self.procs["server"].poll() is None:
                    # With its last words: a broker out of memory says MemoryError there.
                    self.broker_died = exit_cause(proc.returncode, last_line(self.run_dir / "logs" / "broker.out"),
                                                  self.oom_kills.since())

    def _run_goes_on(self) -> bool:
        """Whether a worker's exit record can still matter: it is the server's to read, and
        once the summary is written the server only tells the nodes to leave (a record of
        their leaving would be there or not as a race decided)."""
        server = self.procs.get("server")
        return server is not None and server.poll() is None and not (self.run_dir / SUMMARY).exists()

    def record_exit(self, node: str, returncode: int) -> None:
        """Tell the server how a worker node's process ended (runlog.NODE_EXIT): its
        clients' faults and the summary then name the cause (a signal, the OOM killer,
        the node's own last word), not only ``noconnection``."""
        how = exit_cause(returncode, last_line(self.run_dir / "logs" / f"{node}.out"), self.oom_kills.since())
        try:
            write_node_exit(self.run_dir, node, how)
        except RunLogError as exc:
            self.echo(f"warning: {exc}")

    def check_hosts(self) -> None:
        """Report a lost host; a hook for runs with nodes on other machines."""

    def _print_new_events(self) -> None:
        for event in self._events.new():
            if self.on_event is not None:
                self.on_event(event)
            if event["event"] == "fault":
                self._faults_shown.add(event)
                continue
            self._faults_shown.flush()
            self.echo(format_event(event, self.config["run"]["rounds"]))

    def summary(self) -> dict:
        path = self.run_dir / SUMMARY
        summary = None
        if path.exists():
            try:
                summary = json.loads(path.read_text())
            except (OSError, ValueError):
                summary = None  # torn by a dying disk: replaced below
        server = self.procs.get("server")
        if summary is None:
            if server is not None and server.poll() is None:
                return {"status": "failed", "reason": "the server node did not finish"}
            # The server node died (killed, crashed) or never started: record that in the
            # run directory too, so tools that read summary.json see a failed run, or an
            # interrupted one if a stop signal (to this launcher, or to the server while it
            # started up, before its handlers) is why.
            stopped_by = self.interrupted_by
            if stopped_by is None and server is not None and -server.returncode in STOP_SIGNALS:
                stopped_by = -server.returncode
            if stopped_by is not None:
                started = any(e["event"] == "start" for e in read_events(self.run_dir))
                how = describe_exit(server.returncode) if server is not None else "it never started"
                summary = {"status": "interrupted", "reason": f"{stop_reason(stopped_by)}, before the run started"
                           if not started else f"{stop_reason(stopped_by)}; the server node ended ({how}) "
                           "without a summary"}
            else:
                # A signal with what it most often means (the OOM killer's SIGKILL, say); an
                # exit code's cause is in the output's tail.
                how = ("never started" if server is None else describe_exit(server.returncode)
                       if server.returncode >= 0 else exit_cause(server.returncode, oom_kills=self.oom_kills.since()))
                summary = {"status": "failed", "reason": f"the server node ended ({how}) without a summary: "
                           f"{self._tail('server')}"}
        elif self.broker_died and summary.get("status") == "failed":
            # The server only saw the broker go silent; this launcher saw how it died.
            summary["reason"] = f"the broker process died ({self.broker_died}); {summary.get('reason')}"
        else:
            return summary
        self._write_summary(summary)
        return summary

    def record_failure(self, reason: str) -> dict:
        """A run that could not start: its summary says why (unless the server wrote one)."""
        if (self.run_dir / SUMMARY).exists():
            return self.summary()
        summary = {"status": "failed", "reason": reason}
        self._write_summary(summary)
        return summary

    def _write_summary(self, summary: dict) -> None:
        (self.run_dir / RESERVE).unlink(missing_ok=True)  # the room kept for it, on a full disk
        try:
            write_json_atomically(self.run_dir / SUMMARY, summary)
        except RunLogError as exc:
            self.echo(f"warning: {exc}")

    def _tail(self, name: str, lines: int = 5) -> str:
        path = self.run_dir / "logs" / f"{name}.out"
        text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return " | ".join(text[-lines:]) or f"(no output{_full_disk_note(self.run_dir)})"

    def interrupt(self, signum: int = signal.SIGINT) -> None:
        """Ask the server to stop the run; it says in the summary which signal it was."""
        server = self.procs.get("server")
        if server and server.poll() is None:
            server.send_signal(signum)

    def stop(self, grace: float = 15.0) -> None:
        """Let every process exit on its own, then terminate, then kill: no strays."""
        server = self.procs.get("server")
        if self.interrupted_by is not None:
            # Stopped: the server has told the nodes to leave (a second is plenty), or died
            # of the signal while it started up, or never started: nobody will, so at once.
            told = server is not None and server.poll() is not None and server.returncode >= 0
            grace = min(grace, 1.0 if told else 0.0)
        elif server is not None and server.poll() is not None and server.returncode < 0:
            grace = min(grace, 3.0)  # the server was killed: nobody told the nodes to leave
        deadline = time.monotonic() + grace  # wall
        for name, proc in sorted(self.procs.items(), key=lambda item: item[0] == "broker"):
            # The broker goes last, and briefly: a server's shutdown has already ended it,
            # and without a server (a failed start) nothing else will.
            wait = min(2.0, grace) if name == "broker" else deadline - time.monotonic()  # wall
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
        if self.socket_dir is not None:  # the broker has gone: nothing listens there now
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def _full_disk_note(run_dir: Path) -> str:
    """Why a process that failed may have printed nothing: its output file is on the
    run directory's file system, and that is full."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return ""
    return f"; the file system of {run_dir} is full: {free:,} bytes free" if free < FULL_DISK_BYTES else ""


# A file system with less room than this holds no line of a process's output or its summary.
FULL_DISK_BYTES = 64 * 1024


def last_line(path: Path) -> str:
    """The last line a process printed (its cause of death, when it names one)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


class _FaultLines:
    """The console's fault lines: each of the first few of a burst (a lost node takes
    thousands of clients with it), then one line counting the rest by round and reason."""

    SHOWN = 5

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self.key: tuple | None = None
        self.count = 0

    def add(self, event: dict) -> None:
        key = (event.get("round"), event.get("reason"))
        if key != self.key:
            self.flush()
            self.key = key
        self.count += 1
        if self.count <= self.SHOWN:
            self.echo(format_event(event, 0))

    def flush(self) -> None:
        if self.count > self.SHOWN:
            round_, reason = self.key
            self.echo(f"fault: {self.count - self.SHOWN:,} more clients lost in round {round_} ({reason})")
        self.key, self.count = None, 0


def format_event(event: dict, rounds: int) -> str:
    kind = event["event"]
    if kind == "round":
        acc = "   -  " if event.get("accuracy") is None else f"{event['accuracy']:.4f}"
        loss = "  -   " if event.get("loss") is None else f"{event['loss']:.4f}"
        emulated = event.get("emulated_s")
        if "merges" in event:  # an asynchronous rule's evaluation: uploads, not rounds
            low, high = event.get("staleness_min"), event.get("staleness_max")
            who = (f"uploads {event['uploads']:3d}  merges {event['merges']:3d}  "
                   + (f"staleness {low}-{high}  " if low is not None else ""))
            head = f"eval  {event['round']:4d}/{rounds}"
        else:
            who = _participation(event)
            head = f"round {event['round']:4d}/{rounds}"
        duration = event.get("round_emulated_s")
        return (f"{head}  acc {acc}  loss {loss}  {who}up {event['bytes_up'] / 1e6:7.2f} MB  "
                + (f"took {duration:6.1f}s  " if duration is not None else "")
                + (f"emulated {emulated:8.1f}s  " if emulated is not None else "")
                + f"wall {event['t']:6.1f}s")
    if kind == "start":
        if "eval_every_uploads" in event:
            return (f"start: {event['clients']} clients on {len(event['placement'])} worker node(s), asynchronous "
                    f"({event.get('algorithm')}): an evaluation every {event['eval_every_uploads']} uploads, "
                    f"{event.get('clock', 'wall')} clock")
        return (f"start: {event['clients']} clients on {len(event['placement'])} worker node(s), "
                f"{event['per_round']} per round, {event.get('clock', 'wall')} clock")
    if kind == "hint":
        return f"hint: {event['message']}"
    if kind == "fault":
        if "pid" not in event:  # not lost: its update was refused (the reason says why)
            return f"fault: client {event['client']} in round {event['round']}: {event['reason']}"
        return f"fault: client {event['client']} lost in round {event['round']} ({event['reason']})"
    if kind == "end":
        done = (f"{event['evaluations']} evaluations ({event.get('uploads')} uploads)" if "evaluations" in event
                else f"{event['rounds']} rounds")
        line = f"end: {event['status']} after {done} ({event['reason']})"
        if event.get("aggregations") == 0:
            line += "\nwarning: nothing was aggregated: the final model is the initial one"
        return line
    return f"{kind}: " + ", ".join(f"{k}={v}" for k, v in event.items() if k not in ("event",))


def _participation(event: dict) -> str:
    """A round's selected clients by what happened to them (as the emulator knows it)."""
    counts = event.get("outcome_counts")
    if counts is None:  # a log written before the outcomes were recorded
        return f"clients {event['participants']:3d}  "
    text = (f"answered {counts['answered']:3d}  straggled {counts['straggler']:3d}  "
            f"offline {counts['offline']:3d}  ")
    for name, label in (("failed_transfer", "lost in transfer"), ("dropped", "dropped"), ("discarded", "discarded")):
        if counts.get(name):
            text += f"{label} {counts[name]}  "
    return text
