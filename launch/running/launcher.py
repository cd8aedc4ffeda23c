"""Start one run and see it to its end: on this machine (``local.LocalRun``) or with
worker nodes on other hosts (``machines.MachinesRun``). ``open_run`` is the one place
that chooses between them; ``fedemu launch`` and each sweep point come through it."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Callable

from fedemu.common.ml import data
from fedemu.common.ml.data import DatasetError

from .. import config as configuration
from .lifecycle import STOP_SIGNALS, raise_on_stop_signals, restore_signals
from .local import LocalRun
from .progress import RunProgress
from .rundir import LaunchError, make_run_dir, write_run_config
from .zygote import shared as shared_zygote


def open_run(config: dict, run_dir: Path, workers: int, echo: Callable[[str], None], machines=None,
             default_slots: int | None = None) -> LocalRun:
    """The processes of one run, not started yet: all on this machine, or worker nodes on
    ``machines`` (a :class:`fedemu.launch.running.machines.Machines`; ``default_slots``: worker
    nodes on a host without ``slots=``)."""
    if machines is None:
        return LocalRun(config, run_dir, workers, echo)
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from .machines import MachinesRun  # SSH (or srun) and the preflight: only for runs that use them
    from .slurm import Allocation, SlurmRun

    if isinstance(machines, Allocation):
        return SlurmRun(config, run_dir, machines, echo)
    return MachinesRun(config, run_dir, machines, echo, default_slots=default_slots)


def launch(config_path: str | None, overrides: list[str], out: str | None, workers: int | None,
           echo: Callable[[str], None] = print, machines=None, values: dict | None = None,
           live: bool = False) -> tuple[Path, dict]:
    """Run one configuration, on this machine or with worker nodes on ``machines``
    (a :class:`fedemu.launch.running.machines.Machines`); returns (run directory, summary).
    ``live``: a progress bar on a terminal (progress.RunProgress), the lines above it."""
    # Before the config: its validation imports the algorithms, and with them torch
    # (~1.2 s); the zygote's own imports for the nodes then run beside it.
    shared_zygote()
    config = configuration.load(config_path, overrides, values)
    progress = None
    if live:
        progress = RunProgress(config["run"]["rounds"])
        echo = progress.echo
    if workers is not None:
        config["run"]["workers"] = workers
    workers = config["run"]["workers"] or os.cpu_count() or 1
    # SIGTERM and SIGHUP stop the run as Ctrl-C does, from here on.
    previous = raise_on_stop_signals()
    try:
        run_dir, lock = make_run_dir(config, out)
        try:
            run = open_run(config, run_dir, workers, echo, machines,
                           default_slots=workers if config["run"]["workers"] else None)
            if progress is not None:
                run.on_event = progress.event

            def prepare() -> None:
                write_run_config(config, run_dir)
                data.fetch(config["data"]["dataset"], config["data"]["cache_dir"] or None, progress=echo)
                echo(f"run directory: {run_dir}")

            return run_dir, _run_to_end(run, echo, prepare)
        finally:
            lock.close()
    finally:
        if progress is not None:
            progress.close()
        restore_signals(previous)


def _run_to_end(run: LocalRun, echo: Callable[[str], None], prepare: Callable[[], None]) -> dict:
    """Prepare, start and follow the run; any stop signal (or Ctrl-C) interrupts it in
    order. Whatever ends it, its summary.json says how."""
    try:
        prepare()
        run.start()
        summary = run.follow()
    except (LaunchError, DatasetError) as exc:  # nothing ran: the run directory still says why
        run.record_failure(str(exc))
        raise
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        run.interrupted_by = signum
        echo(f"{signal.Signals(signum).name}: stopping the run ...")
        for sig in STOP_SIGNALS:  # a second signal must not cut the orderly stop short
            signal.signal(sig, lambda *_: echo("still stopping the run ..."))
        run.interrupt(signum)
        try:
            run.procs["server"].wait(30)
        except (KeyError, subprocess.TimeoutExpired):
            pass
        summary = run.summary()
    finally:
        run.stop()
    return summary
