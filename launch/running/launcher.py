"""Start one run and see it to its end: on this machine (``local.LocalRun``) or with
worker nodes on other hosts (``machines.MachinesRun``). ``open_run`` is the one place
that chooses between them; ``fedemu launch`` and each sweep point come through it."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from fedemu.common.ml import data
from fedemu.common.ml.data import DatasetError

from .. import config as configuration
from .lifecycle import STOP_SIGNALS, raise_on_stop_signals, restore_signals
from .local import LocalRun
from .progress import RunProgress
from .rundir import LaunchError, make_run_dir, write_run_config
from .zygote import ZygoteError
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
    config, settings = resolve_config(config_path, overrides, values)
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
                write_run_config(config, run_dir, settings)
                data.fetch(config["data"]["dataset"], config["data"]["cache_dir"] or None, progress=echo)
                echo(f"run directory: {run_dir}")

            return run_dir, _run_to_end(run, echo, prepare)
        finally:
            lock.close()
    finally:
        if progress is not None:
            progress.close()
        restore_signals(previous)


# What comes before the pickled outcome in the output of `fedemu.launch resolve-config`.
RESOLVED = b"\0fedemu: the resolved config follows\0"


def resolve_config(config_path: str | None, overrides: list[str],
                   values: dict | None = None) -> tuple[dict, str | None]:
    """The config, loaded and checked, and its nodes' settings.json (None: for
    write_run_config to make). Both import torch (the algorithms, the model against the
    data: 1.2-2 s), which a local run's nodes import in the zygote anyway: so where this
    process has no torch yet, they are made in a process forked from the zygote (started
    here, first), and this one imports none for a local run. Anything that keeps that
    from working loads the config here instead: the same config, the same errors."""
    zygote = shared_zygote()
    if zygote is not None and values is None and "torch" not in sys.modules:
        args = ["resolve-config", *(f"--set={override}" for override in overrides),
                *(["--", config_path] if config_path is not None else [])]
        try:
            code, output = zygote.run(args)
        except ZygoteError:
            code, output = 1, b""
        text, resolved, data = output.rpartition(RESOLVED)
        config = error = None
        if code == 0 and resolved:
            try:
                config, settings, error = pickle.loads(data)
            except Exception:  # whatever it was, it did not arrive: loaded here instead
                config = error = None
        if config is not None or error is not None:
            if text:  # what loading it printed (warnings), as it would have here
                sys.stderr.buffer.write(text)
                sys.stderr.flush()
            if error is not None:
                raise error
            return config, settings
    return configuration.load(config_path, overrides, values), None


def write_resolved_config(config_path: str | None, overrides: list[str]) -> int:
    """`fedemu.launch resolve-config`, forked from the zygote for resolve_config: the
    config and its settings.json (None where making it fails: the launcher then says why,
    as it would), or the error that refuses the config, pickled after RESOLVED on stdout;
    exit status 0. Not 0 where the outcome would not arrive as it is (resolve_config then
    loads the config itself)."""
    try:
        config = configuration.load(config_path, overrides)
    except (configuration.ConfigError, DatasetError) as exc:
        outcome = (None, None, exc)
    else:
        try:
            settings = configuration.process_settings_json(config)
        except configuration.ConfigError:
            settings = None
        outcome = (config, settings, None)
    data = pickle.dumps(outcome)
    error = pickle.loads(data)[2]
    if error is not None and (type(error) is not type(outcome[2]) or str(error) != str(outcome[2])):
        return 3
    sys.stdout.flush()
    sys.stdout.buffer.write(RESOLVED + data)
    sys.stdout.flush()
    return 0


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
