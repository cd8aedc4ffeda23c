"""The run directory: made and locked for one run, and the files the launcher writes
into it. Every error names the path and what went wrong, before anything starts."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from fedemu.server.runlog import EVENTS, RunLogError, write_text_atomically

from .. import config as configuration
from .lifecycle import DirectoryInUse, DirLock


class LaunchError(RuntimeError):
    pass


def make_run_dir(config: dict, out: str | Path | None) -> tuple[Path, DirLock]:
    """Create the run directory and lock it for this run: a second launch into the same
    directory fails at once, naming the holder; one into a finished run's is refused."""
    run_dir = Path(out) if out is not None else new_run_dir(config)
    try:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        lock = DirLock(run_dir)
    except DirectoryInUse as exc:
        raise LaunchError(str(exc)) from None
    except OSError as exc:
        raise LaunchError(str(RunLogError(exc.errno, f"cannot write {run_dir}: {exc.strerror or exc}"))) from None
    if (run_dir / EVENTS).exists():
        lock.close()
        raise LaunchError(f"{run_dir} already holds a run ({EVENTS}); choose another --out")
    return run_dir, lock


def new_run_dir(config: dict) -> Path:
    """``run.out``/<time>-<algorithm>-<data set>-<model>, with a suffix if that exists."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    algorithm = config["algorithm"]["name"].replace(":", "-")  # a plug-in's package.module:Class
    name = f"{stamp}-{algorithm}-{config['data']['dataset']}-{config['model']['name']}"
    run_dir = Path(config["run"]["out"]) / name
    suffix = 1
    while run_dir.exists():
        suffix += 1
        run_dir = Path(config["run"]["out"]) / f"{name}-{suffix}"
    return run_dir


def write_run_file(path: Path, text: str) -> None:
    """A file the launcher writes into the run directory, whole or not at all (a full disk
    leaves no half-written file); a write error names it."""
    try:
        write_text_atomically(path, text)
    except RunLogError as exc:
        raise LaunchError(str(exc)) from None


def write_run_config(config: dict, run_dir: Path, settings: str | None = None) -> None:
    """The files every run directory starts with: the resolved config.toml, settings.json
    (each node process's settings, which the nodes read instead of the config; made here
    unless ``settings`` has it already), and with traces or device classes,
    population.json (the trace files' sha256 and each client's device speed: worker
    nodes read their speeds there)."""
    write_run_file(run_dir / "config.toml", configuration.to_toml(config))
    if settings is None:
        try:
            settings = configuration.process_settings_json(config)
        except configuration.ConfigError as exc:
            raise LaunchError(str(exc)) from None
    write_run_file(run_dir / configuration.PROCESS_SETTINGS_FILE, settings)
    try:
        population = configuration.population_record(config)
    except configuration.ConfigError as exc:  # a trace file changed since the config was checked
        raise LaunchError(str(exc)) from None
    if population is not None:
        write_run_file(run_dir / configuration.POPULATION_FILE, json.dumps(population, indent=1))

