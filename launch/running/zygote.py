"""The zygote (issue 53): one process per launcher that imports torch, numpy and the
node code once, then forks each of this machine's node processes on request, instead of
each node starting a fresh interpreter that imports them again (~1.2 s of CPU each).
The launcher's own config check, which needs torch too, runs in such a child
(``Zygote.run``; launcher.resolve_config), so a local launch imports torch once.

A forked child becomes the node exactly as ``python -m fedemu.launch node ...`` would:
the launcher opens its output file as before and passes it over (stdout and stderr),
the child takes the launcher's environment and working directory, starts a session of
its own, shows the same command line in ``ps`` and ``/proc/PID/cmdline``, and then runs
``fedemu.launch`` as ``-m`` would, through the interpreter's normal exit (exit code,
atexit, threads). Its settings, random streams and torch threads are set by the node
code as in a fresh process: the zygote only imports.

Fork safety: the zygote starts no thread. The one native thread an import starts
(numpy's OpenBLAS pool) is stopped by OpenBLAS's own fork handler before each fork and
started again on first use; the zygote checks that the child's parent had one thread
when it forked (``threads`` in its reply, logged by the node).

``FEDEMU_ZYGOTE=0`` turns it off: each node starts as its own process (the old path,
and the way to compare). An SSH host's agent (agent.py) forks its worker nodes from a
zygote of its own where it runs two or more; a Slurm task runs one node, as its own process.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from .lifecycle import STOP_SIGNALS, ZYGOTE_ENV, child_env, die_with_parent

SWITCH_ENV = "FEDEMU_ZYGOTE"
# What a node process imports, loaded once here; by name, as the zygote runs none of it.
PRELOAD = ("numpy", "torch", "zmq", "msgpack", "fedemu.launch.cli", "fedemu.launch.running.nodes",
           "fedemu.server.round_engine", "fedemu.server.async_engine", "fedemu.common.algorithms",
           "fedemu.common.ml.devices", "fedemu.common.ml.exact_sum", "fedemu.worker.hosting",
           "fedemu.worker.placement")
# Bytes kept in the zygote's own argv for a child's command line (the kernel shows
# /proc/PID/cmdline from that memory, which a process may rewrite but not grow).
TITLE_ROOM = 8192
PACKET = 1 << 20  # the largest request: a node's arguments and the launcher's environment
_ZYGOTE_CODE = "from fedemu.launch.running.zygote import main; main()"


def enabled() -> bool:
    """Whether local nodes fork from a zygote: on Linux (fork after imports, prctl), unless
    FEDEMU_ZYGOTE=0."""
    return sys.platform.startswith("linux") and os.environ.get(SWITCH_ENV, "1") != "0"


class ZygoteError(RuntimeError):
    """The zygote could not start a node (its imports failed, or it died)."""


class ForkedNode:
    """A node process forked by the zygote, with the part of subprocess.Popen's interface
    the launcher uses. Its exit status comes from the zygote, its parent."""

    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.pid: int | None = None
        self.returncode: int | None = None
        self.parent_threads: int | None = None  # threads of the zygote as it forked this one
        self._started = threading.Event()
        self._done = threading.Event()
        self.error: str | None = None

    def started(self) -> None:
        """Wait until it runs (the zygote may still be importing: ~1.5 s, once); raises
        ZygoteError if the zygote could not fork it (then nothing runs)."""
        self._started.wait()
        if self.pid is None:
            raise ZygoteError(self.error or "the zygote did not start the node")

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # A request the launcher was stopped while waiting on: the zygote forks it still
        # (it may be importing); signal it once it is there.
        self._started.wait(60)
        if self.pid is None or self.returncode is not None:
            return
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass  # exited; its status is on its way from the zygote

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._started.set()
        self._done.set()


class Zygote:
    """The launcher's end: starts the zygote process and asks it for nodes."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        # Its own session (as every process of a run: LocalRun._start); no stdout: what
        # its imports print is replayed into each node's output (main).
        # The kernel's parent-death signal follows the thread that started a process: asked
        # for only from the main thread (a sweep's points start runs from threads of their
        # own). Either way the zygote ends when this process does and its socket closes.
        with_parent = "1" if threading.current_thread() is threading.main_thread() else "0"
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE_CODE, str(theirs.fileno()), with_parent,
                                      " " * TITLE_ROOM],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=child_env())
        theirs.close()
        self.failure: str | None = None  # why it cannot start nodes, once it cannot
        self.ready = threading.Event()  # its imports are done: a fork now starts a process at once
        self._lock = threading.Lock()
        self._next = 0
        self._pending: dict[int, ForkedNode] = {}
        self._by_pid: dict[int, ForkedNode] = {}
        self._reader = threading.Thread(target=self._read, name="zygote", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.failure is None

    def request(self, args: list[str], out: int) -> ForkedNode:
        """Ask for the node ``python -m fedemu.launch ARGS`` with ``out`` (a file
        descriptor: the zygote gets its own copy) as its stdout and stderr; returns at
        once, before it runs (ForkedNode.started), or raises ZygoteError."""
        node = ForkedNode([sys.executable, "-m", "fedemu.launch", *args])
        request = {"args": args, "env": child_env(), "cwd": os.getcwd()}
        with self._lock:
            if self.failure is not None:
                raise ZygoteError(self.failure)
            self._next += 1
            request["id"] = self._next
            self._pending[self._next] = node
            try:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [out])
            except OSError as exc:
                self._pending.pop(self._next, None)
                raise ZygoteError(f"the zygote is gone ({exc})") from None
        return node

    def request_piped(self, args: list[str]) -> tuple[ForkedNode, int]:
        """``request`` with a new pipe as its output; returns the node and the pipe's read
        end, which ends when the node does. Raises ZygoteError (and closes the pipe)."""
        read, write = os.pipe()
        try:
            return self.request(args, write), read
        except ZygoteError:
            os.close(read)
            raise
        finally:
            os.close(write)  # the zygote has its own copy

    def run(self, args: list[str]) -> tuple[int, bytes]:
        """Run ``python -m fedemu.launch ARGS`` forked from here, to its end; returns its
        exit code and what it printed (stdout and stderr, one pipe). Raises ZygoteError
        if it could not run."""
        process, read = self.request_piped(args)
        with open(read, "rb") as pipe:
            output = pipe.read()
        process.started()
        try:
            return process.wait(60), output
        except subprocess.TimeoutExpired:  # its output ended, its exit never came
            raise ZygoteError("the zygote did not report the process's exit") from None

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(PACKET)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._lock:
                if "exit" in message:
                    node = self._by_pid.pop(message["exit"], None)
                    if node is not None:
                        node._ended(message["code"])
                elif "id" in message:
                    node = self._pending.pop(message["id"])
                    if "pid" in message:
                        node.pid, node.parent_threads = message["pid"], message["threads"]
                        self._by_pid[node.pid] = node
                    else:
                        node.error = message["error"]
                    node._started.set()
                elif "ready" in message:
                    self.ready.set()
                elif "error" in message:  # its imports failed: it starts nothing
                    self.failure = f"the zygote could not import the node code: {message['error']}"
        self.proc.wait()
        with self._lock:
            if self.failure is None:
                self.failure = f"the zygote ended ({self.proc.returncode})"
            for node in self._pending.values():
                node.error = self.failure
                node._started.set()
            self._pending.clear()
            # Its children got SIGTERM as it died (each asks for it: die_with_parent) and,
            # stopped by it, die of it; the zygote, their parent, can no longer say.
            for node in self._by_pid.values():
                threading.Thread(target=_await_gone, args=(node,), daemon=True).start()
            self._by_pid.clear()

    def close(self) -> None:
        """End the zygote (the nodes it forked have ended: LocalRun.stop)."""
        try:
            # shutdown, not only close: the reader thread blocked in recv holds the socket open.
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _await_gone(node: ForkedNode) -> None:
    while node.pid is not None and Path(f"/proc/{node.pid}").exists():
        threading.Event().wait(0.1)
    node._ended(-signal.SIGTERM)


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def shared() -> Zygote | None:
    """This launcher's zygote, started on first use (and again if it died); None where it
    is off (``enabled``) or failed at its imports (its nodes then start as their own
    processes, which fail, if they do, saying why)."""
    global _shared
    if not enabled():
        return None
    with _shared_lock:
        if _shared is not None and _shared.failure is not None and _shared.failure.startswith("the zygote ended"):
            _shared = None  # killed, say: start another
        if _shared is None:
            _shared = Zygote()
        return _shared if _shared.alive else None


def forked_from() -> str | None:
    """In a node process: the zygote's pid if it forked this one, else None."""
    return os.environ.get(ZYGOTE_ENV)


# The zygote process.

def main() -> None:
    """Import the node code, then fork a node per request. In the parent this returns
    when the launcher's end closes (it exited, or was killed: the kernel closes it);
    in a child it runs ``fedemu.launch`` with the request's arguments."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    # A stop signal is the launcher's to act on (scancel, say, signals every process of a
    # job): the zygote ends with the launcher, not before it, or its children would think
    # their launcher gone (lifecycle.parent_died). Hence SIGKILL for its parent's death.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if sys.argv[2] == "1":
        die_with_parent(signal.SIGKILL)  # at once, even mid-import: a launcher that stopped early leaves none
    _set_title([sys.executable, "-c", _ZYGOTE_CODE])
    # No collection while importing: each full one walks every object torch made so far
    # (~0.1 s; 4 of them, a quarter of the imports' time). Their garbage (a few thousand
    # objects) is frozen with the rest, as Python's gc.freeze documentation advises.
    gc.disable()
    try:
        imported = _preload(sock)
    except Exception as exc:  # any import failure: each node then starts on its own, and says it
        _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
        return
    # The imports' objects live as long as every process forked from here: out of the
    # cyclic collector's sight, so no child's collection walks torch's hundreds of
    # thousands of them, nor unshares their pages. Children collect as usual from here.
    gc.freeze()
    gc.enable()
    _send(sock, {"ready": os.getpid()})
    request = _serve(sock, imported)
    if request is None:
        return
    # The child: from here on the process is `python -m fedemu.launch ARGS`.
    import runpy  # stdlib; only the child runs a module

    sys.argv = ["-m", *request["args"]]
    runpy.run_module("fedemu.launch", run_name="__main__", alter_sys=True)


def _preload(sock: socket.socket) -> bytes:
    """Import PRELOAD; returns what the imports printed, which a fresh node prints too."""
    import importlib  # stdlib; the zygote imports the node code by name (PRELOAD)

    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            for name in PRELOAD:
                if _closed(sock):  # the launcher has gone already (a bad config, a stop): so do we
                    sys.exit(0)
                importlib.import_module(name)
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read()


def _closed(sock: socket.socket) -> bool:
    """Whether the launcher's end has closed (a request waiting is not read)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the launcher has gone: the loop sees its end closed


def _serve(sock: socket.socket, imported: bytes) -> dict | None:
    """Fork a child per request and report each one's exit; returns None in the zygote
    (the launcher has gone), the request in a child."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select (the wakeup fd)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(sock, children)
        if sock not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, PACKET, 1)
        except OSError:
            data, fds = b"", []
        if not data:
            return None  # the launcher has gone; each child's parent-death signal stops it
        request = json.loads(data)
        if not fds:
            _send(sock, {"id": request["id"], "error": "no output file came with the request"})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if threading.active_count() != 1:  # never: the zygote starts no thread
            _send(sock, {"id": request["id"], "error": "the zygote has threads: it cannot fork safely"})
            os.close(fds[0])
            continue
        # The launcher may signal the child the moment it learns its pid, before the child
        # has its own handlers: blocked across the fork, such a signal waits (pending) instead
        # of meeting the zygote's SIG_IGN and being lost (a server that never stopped).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            # As a fresh interpreter has them.
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one sent meanwhile is delivered now
            os.close(wake_r)
            os.close(wake_w)
            sock.close()
            _become(request, fds[0], imported)
            return request
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # ignored here, as before
        # After the fork its handlers have run: the threads left are those that ran on
        # across it (OpenBLAS's pool stops itself first).
        threads = len(os.listdir("/proc/self/task"))
        os.close(fds[0])
        children.add(pid)
        _send(sock, {"id": request["id"], "pid": pid, "threads": threads})


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict, out: int, imported: bytes) -> None:
    """Make this child what `python -m fedemu.launch ARGS` started by the launcher is."""
    os.setsid()  # a session of its own, as start_new_session gave it (LocalRun._start)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    if imported:
        os.write(2, imported)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[ZYGOTE_ENV] = str(os.getppid())  # lifecycle.parent_died: its parent is the zygote
    _set_title([sys.executable, "-m", "fedemu.launch", *request["args"]])


def _set_title(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (ps, pgrep, /proc/PID/cmdline) by
    rewriting the memory the kernel reads it from: the original arguments, with the
    room the zygote's command line kept (TITLE_ROOM). What does not fit is cut."""
    import ctypes  # stdlib; only the zygote writes its argv memory

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: stat fields 48 and 49
    except (OSError, IndexError, ValueError):
        return
    title = b"\0".join(os.fsencode(a) for a in argv)[:end - start - 1]
    ctypes.memmove(start, title + b"\0" * (end - start - len(title)), end - start)
