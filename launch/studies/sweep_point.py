"""One sweep point, run as ``fedemu launch`` runs (through ``launcher.open_run``): into
its run directory, with the launcher's output in logs/launch.out, interrupted when the
sweep stops; and, for a sweep resumed after a kill, which of a point's processes still run."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..running.launcher import open_run
from ..running.rundir import LaunchError, make_run_dir, write_run_config

if TYPE_CHECKING:
    from ..running.machines import Machines


def run_point(config: dict, run_dir: Path, *, workers: int | None, stop: threading.Event,
              on_start: Callable[[list[int]], None] | None = None, machines: Machines | None = None) -> dict:
    """Run one configuration into ``run_dir`` and return its summary: on this machine with
    ``workers`` worker nodes, or with worker nodes on ``machines`` (``workers``: slots
    of a host without ``slots=``). What the launcher would print goes to logs/launch.out."""
    _, lock = make_run_dir(config, run_dir)
    try:
        return _run_point(config, run_dir, workers=workers, stop=stop, on_start=on_start, machines=machines)
    finally:
        lock.close()


def _run_point(config: dict, run_dir: Path, *, workers: int | None, stop: threading.Event,
               on_start: Callable[[list[int]], None] | None, machines: Machines | None) -> dict:
    try:
        write_run_config(config, run_dir)
    except LaunchError as exc:
        return {"status": "failed", "reason": str(exc)}

    def echo(line: str) -> None:  # opened per line: host reader threads may outlive this call
        with open(run_dir / "logs" / "launch.out", "a", encoding="utf-8") as log:
            log.write(line + "\n")

    run = open_run(config, run_dir, workers or 1, echo, machines, default_slots=workers)
    try:
        try:
            run.start()
            if on_start is not None:
                on_start([p.pid for p in run.procs.values()])
            server, asked, last, reported = run.procs["server"], None, 0.0, set()
            while server.poll() is None:
                run.check_exits(reported)
                if stop.is_set() and time.monotonic() - last > 2:  # wall
                    # The server writes an "interrupted" summary and stops the nodes (one
                    # still starting up dies of the signal: the summary is then ours). Again
                    # every 2 s: a server still starting up may not have its handler yet.
                    run.interrupted_by = getattr(stop, "signum", signal.SIGINT)
                    run.interrupt(run.interrupted_by)
                    asked, last = asked or time.monotonic(), time.monotonic()  # wall
                if asked is not None and time.monotonic() - asked > 30:  # wall
                    break  # run.stop() below terminates what is left
                run.check_hosts()
                run.await_server(0.2)
        finally:
            # Stopping: a server killed before it could tell its nodes leaves them waiting
            # for it; do not give them the normal 15 s before terminating them.
            run.stop(grace=3.0 if stop.is_set() else 15.0)
    except LaunchError as exc:
        echo(f"failed: {exc}")
        return run.record_failure(str(exc))
    # After stop(): a server terminated there has written its summary by now.
    return run.summary()


def alive(pids: list[int], run_dir: Path) -> list[int]:
    """Which of ``pids`` still run this point: every node's command line names a file
    in its run directory (a pid may have been reused since)."""
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "fedemu.launch" in cmdline and str(run_dir) in cmdline:
            out.append(pid)
    return out
