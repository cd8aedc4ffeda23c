"""How the OS processes of a run live and end: signals, parent death, the run directory's lock.

* SIGINT, SIGTERM and SIGHUP all stop a run the same way (the server writes an
  ``interrupted`` summary; every node exits). Scripts, ``timeout``, systemd, CI cancels
  and Slurm's ``scancel`` send SIGTERM; a closed terminal sends SIGHUP.
* Every process a launcher starts asks the kernel for SIGTERM when the launcher dies
  (``PR_SET_PDEATHSIG``), so even a launcher killed with SIGKILL leaves nothing running.
* A run directory is locked (``flock``) for the life of its run: a second launch into it
  fails at once, naming the holder's pid.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PARENT_ENV = "FEDEMU_PARENT_PID"  # the launcher's pid, as its children were told
ZYGOTE_ENV = "FEDEMU_ZYGOTE_PID"  # a node forked by the zygote (zygote.py): its parent's pid
LOCK_FILE = ".lock"

_PR_SET_PDEATHSIG = 1


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the launcher; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest(threading.Event):
    """Set when the processes this one runs (a sweep's points) must stop; ``signum`` is
    the signal that asked, which they are stopped with and their summaries name."""

    signum: int = signal.SIGINT

    def request(self, signum: int) -> None:
        self.signum = signum
        self.set()


def raise_on_stop_signals() -> dict:
    """Make SIGTERM and SIGHUP stop this launcher as Ctrl-C does (raising Interrupted);
    returns the previous handlers, for restore_signals."""
    previous = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, _raise_interrupted)
    return previous


_received: list[int] = []  # the stop signals this process was sent, in order


def _raise_interrupted(signum: int, _frame) -> None:
    _received.append(signum)
    raise Interrupted(signum)


def stop_signal_received() -> int | None:
    """The first stop signal this process got through raise_on_stop_signals, if any."""
    return _received[0] if _received else None


def exit_code_for(signum: int) -> int:
    """The exit code of a command stopped by ``signum``, as a shell reports a process
    killed by it: 130 for SIGINT (Ctrl-C), 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + signum


def restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def stop_reason(signum: int) -> str:
    """What a run's summary says when the server is stopped by ``signum``."""
    if signum == signal.SIGTERM and parent_died(settle=0.3):
        return f"terminated: its launcher (pid {os.environ.get(PARENT_ENV)}) died"
    name = signal.Signals(signum).name
    job = os.environ.get("SLURM_JOB_ID")
    # In a Slurm job, SIGTERM is how Slurm ends it: scancel, the time limit, preemption.
    in_slurm = f" in Slurm job {job}: scancel, the job's time limit or preemption" if job else ""
    return {signal.SIGINT: "interrupted by the user (SIGINT)",
            signal.SIGTERM: f"terminated (SIGTERM{in_slurm})",
            signal.SIGHUP: "hung up (SIGHUP: the terminal or session closed)"}.get(signum, f"stopped by {name}")


def signal_named(reason: str | None) -> int:
    """The stop signal a summary's reason names (SIGINT if none): what stopped a run whose
    launcher did not get the signal itself."""
    return next((sig for sig in STOP_SIGNALS if signal.Signals(sig).name in (reason or "")), signal.SIGINT)


def child_env() -> dict:
    """The environment for a process this launcher starts: it names the launcher, so the
    child can tell whether its launcher is still there (die_with_parent)."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def exit_without_teardown(code: int) -> NoReturn:
    """End this process as a normal exit would, less the interpreter's teardown of
    every module, which with torch loaded takes 0.3-0.5 s of each process's end (strace:
    from a node's last write to its exit): non-daemon threads joined and the hooks
    registered for that run first (threading._shutdown, what the interpreter's own exit
    calls first: private, CPython 3.8-3.13), then the atexit handlers (logging's flush
    among them), then the standard streams flushed; then the process exits with ``code``."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to lose
            pass
    os._exit(code)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel for ``sig`` when our parent dies, even by SIGKILL (Linux). If the
    parent named in the environment is already gone, send it now: the death came before
    this call could ask for it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return  # not Linux: the broker's loss still stops every node
    if parent_died():
        os.kill(os.getpid(), sig)


# glibc's mallopt parameters; see mallopt(3).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def retain_freed_memory() -> None:
    """Keep freed memory in the process for reuse instead of handing it back to the OS
    (glibc). Nodes allocate and free model-sized buffers (about 800 KB for the 2NN)
    thousands of times a round; by default each one above 128 KB, or each heap top
    freed, goes back to the kernel and comes back as fresh pages it must zero: with
    1,000 clients per round that page clearing was over a third of a worker node's time
    (perf: clear_page_erms). The cost is that a node's resident memory stays at its peak."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return  # not glibc: its allocator keeps its own policy
    mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)  # glibc's maximum; fixing it stops the dynamic threshold
    mallopt(_M_TRIM_THRESHOLD, 1024 * 1024 * 1024)


def parent_died(settle: float = 0.0) -> bool:
    """Whether the launcher named in the environment is gone or going. A launcher killed
    outright sends its parent-death signal as each of its threads exits, the first while
    the process still stands: its main thread already a zombie, or about to be (``settle``
    seconds are allowed for that)."""
    expected = os.environ.get(PARENT_ENV)
    if expected is None or not expected.isdigit():
        return False
    # A node forked by the zygote has it for parent, which ends when the launcher does.
    parent = os.environ.get(ZYGOTE_ENV, expected)
    deadline = time.monotonic() + settle  # wall
    while True:
        if (os.getppid() != int(parent) or _state(int(parent)) in ("Z", "X", None)
                or _state(int(expected)) in ("Z", "X", None)):
            return True
        if time.monotonic() >= deadline:  # wall
            return False
        time.sleep(0.01)


def _state(pid: int) -> str | None:
    """A process's state letter from /proc (R, S, Z, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def describe_exit(returncode: int | None) -> str:
    """A Popen return code in words: 'exit code 3', 'killed by SIGKILL'."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


# What the signals that end a process without its asking mean, most often, for a node.
_SIGNAL_CAUSES = {
    signal.SIGBUS: "a memory-mapped file, such as the data cache, was cut short under it",
    signal.SIGABRT: "aborted in native code, most often out of memory",
    signal.SIGSEGV: "a crash in native code",
}


def exit_cause(returncode: int, last_line: str = "", oom_kills: int = 0) -> str:
    """How a node process ended, for its clients' ``fault`` events and the summary:
    the signal and what it most often means, or the exit code and the last line it
    printed (``last_line``); a SIGKILL while the kernel's OOM killer killed
    (``oom_kills`` > 0, see OomKills) is put down to it."""
    how = describe_exit(returncode)
    if returncode == -signal.SIGKILL and oom_kills:
        return f"{how} (the kernel's OOM killer: {oom_kills} OOM kill(s) meanwhile)"
    if returncode < 0 and -returncode in _SIGNAL_CAUSES:
        return f"{how} ({_SIGNAL_CAUSES[-returncode]})"
    if returncode > 0 and last_line:
        return f"{how}: {last_line}"
    return how


class OomKills:
    """The kernel's count of processes its OOM killer killed, read when made and again
    at ``since()``: in this process's memory cgroup (v2 ``memory.events``, v1
    ``memory.oom_control``), where the kernel keeps one, else the whole system's
    (``/proc/vmstat``). Its children share the cgroup unless moved."""

    def __init__(self) -> None:
        self.path = _oom_counter_path()
        self.start = self._read()

    def _read(self) -> int | None:
        if self.path is None:
            return None
        try:
            for line in Path(self.path).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return None

    def since(self) -> int:
        """OOM kills since this object was made (0 where the count cannot be read)."""
        now = self._read()
        return now - self.start if now is not None and self.start is not None else 0


def _oom_counter_path() -> str | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2, the unified hierarchy
            candidate = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            candidate = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.oom_control"
        else:
            continue
        if candidate.exists():
            return str(candidate)
    return "/proc/vmstat" if Path("/proc/vmstat").exists() else None


class DirectoryInUse(RuntimeError):
    """Another process holds the run directory's lock."""


class DirLock:
    """An exclusive ``flock`` on ``folder/.lock`` holding the owner's pid; released when
    closed or when the owner dies (the kernel drops it), so a stale lock cannot block."""

    def __init__(self, folder: Path, what: str = "run") -> None:
        self.path = Path(folder) / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DirectoryInUse(f"{folder} is in use by another {what} (pid {holder})") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
