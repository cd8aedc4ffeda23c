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

import ctypes
import errno
import fcntl
import os
import signal
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PARENT_ENV = "FEDEMU_PARENT_PID"  # the launcher's pid, as its children were told
LOCK_FILE = ".lock"

_PR_SET_PDEATHSIG = 1


class Interrupted(KeyboardInterrupt):
    """A stop signal reached the launcher; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_on_stop_signals() -> dict:
    """Make SIGTERM and SIGHUP stop this launcher as Ctrl-C does (raising Interrupted);
    returns the previous handlers, for restore_signals."""
    previous = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, _raise_interrupted)
    return previous


def _raise_interrupted(signum: int, _frame) -> None:
    raise Interrupted(signum)


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


def interrupted_exit_code(reason: str | None, signum: int | None = None) -> int:
    """The exit code of a launch or sweep a stop signal ended: 128 + the signal's number,
    as a shell reports a process the signal killed (130 for Ctrl-C); the signal is
    ``signum``, else the one a summary's reason names, else SIGINT."""
    if signum is None:
        signum = next((sig for sig in STOP_SIGNALS if signal.Signals(sig).name in (reason or "")), signal.SIGINT)
    return 128 + int(signum)


def child_env() -> dict:
    """The environment for a process this launcher starts: it names the launcher, so the
    child can tell whether its launcher is still there (die_with_parent)."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


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
    deadline = time.monotonic() + settle  # wall
    while True:
        if os.getppid() != int(expected) or _state(int(expected)) in ("Z", "X", None):
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
