"""fedemu from Python (notebooks, scripts): start a run from a config, follow its events
as they come, read its history as records, stop it.

    from fedemu.launch import api

    run = api.start({"algorithm": {"name": "fedprox", "mu": 0.1}, "run": {"rounds": 50}})
    for event in run.events():                  # as the server writes them, up to "end"
        if event["event"] == "round":
            print(event["round"], event["accuracy"])
    run.summary                                 # summary.json: status, accuracies, bytes
    rows = run.history()                        # a row per evaluation (pandas.DataFrame(rows), if you use it)
    run.stop()                                  # an orderly stop: status "interrupted"

A config is a dict of sections as in a TOML file, a file, or both (the dict wins), with
``--set``-style overrides last; it is validated before anything starts, and a bad key
raises ``ConfigError`` naming it. ``start`` runs the launcher as a child process, so its
signal handlers, broker and nodes stay out of the caller's process (a notebook kernel
is never taken over), and returns at once; ``launch`` runs in this process and blocks,
as ``fedemu launch`` does (the CLI is that call). ``history`` reads any runs and sweeps,
finished or not (``results.evaluation_records``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from fedemu.server.runlog import EVENTS, SUMMARY

from . import config as configuration
from .config import ConfigError
from .running.rundir import new_run_dir
from .studies.results import evaluation_records

__all__ = ["ConfigError", "Run", "history", "launch", "resolve", "start"]  # ConfigError: what a bad config raises


class Run:
    """A run started by :func:`start`: its directory and its launcher process."""

    def __init__(self, run_dir: Path, process: subprocess.Popen) -> None:
        self.dir = run_dir
        self.process = process

    @property
    def running(self) -> bool:
        """Until the run has ended: its summary written (the launcher may still be
        stopping its nodes for a moment after that)."""
        return self.process.poll() is None and not (self.dir / SUMMARY).exists()

    @property
    def summary(self) -> dict | None:
        """summary.json once the run has ended (None before)."""
        path = self.dir / SUMMARY
        return json.loads(path.read_text()) if path.exists() else None

    def events(self, poll_s: float = 0.1) -> Iterator[dict]:
        """Every event of the run, in order, as soon as it is written; ends after the
        ``end`` event, or when the launcher exits without one (see ``logs/launch.out``)."""
        offset, pending = 0, ""
        while True:
            exited = self.process.poll() is not None  # before reading: nothing is missed
            path = self.dir / EVENTS
            if path.exists():
                with open(path, encoding="utf-8") as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    if line:
                        event = json.loads(line)
                        yield event
                        if event.get("event") == "end":
                            return
            if exited:
                return
            time.sleep(poll_s)

    def wait(self, timeout: float | None = None) -> dict | None:
        """Block until the launcher exits; the summary."""
        self.process.wait(timeout)
        return self.summary

    def stop(self, timeout: float = 60.0) -> dict | None:
        """Stop the run as Ctrl-C would (the server writes an ``interrupted`` summary and
        every node exits); the summary."""
        if self.running:
            self.process.send_signal(signal.SIGINT)
        return self.wait(timeout)

    def history(self) -> list[dict]:
        """A record per evaluation so far: ``pandas.DataFrame(run.history())``."""
        return evaluation_records([self.dir])


def resolve(config: dict | None = None, file: str | Path | None = None, overrides: list[str] = ()) -> dict:
    """The validated, complete config that ``start`` and ``launch`` would run."""
    return configuration.load(file, list(overrides), config)


def start(config: dict | None = None, *, file: str | Path | None = None, overrides: list[str] = (),
          out: str | Path | None = None, workers: int | None = None) -> Run:
    """Start a run in the background and return at once (see the module's docstring)."""
    resolved = resolve(config, file, overrides)
    if workers is not None:
        resolved["run"]["workers"] = workers
    run_dir = Path(out) if out is not None else new_run_dir(resolved)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    requested = run_dir / "logs" / "api-config.toml"
    requested.write_text(configuration.to_toml(resolved))
    log = open(run_dir / "logs" / "launch.out", "ab")
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "fedemu.launch", "launch", str(requested), "--out", str(run_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        log.close()
    return Run(run_dir, process)


def launch(config: dict | None = None, *, file: str | Path | None = None, overrides: list[str] = (),
           out: str | Path | None = None, workers: int | None = None, quiet: bool = False) -> tuple[Path, dict]:
    """Run to the end in this process, as ``fedemu launch``: (run directory, summary).
    Ctrl-C, SIGTERM and SIGHUP stop it in order; call it from the main thread."""
    # lazy: reading runs, this module's common use, needs none of the running code
    from .running.launcher import launch as run_here

    return run_here(str(file) if file is not None else None, list(overrides), None if out is None else str(out),
                    workers, echo=(lambda line: None) if quiet else print, values=config)


def history(*paths: str | Path) -> list[dict]:
    """A record per evaluation of runs and sweeps: ``pandas.DataFrame(api.history(...))``."""
    return evaluation_records(list(paths))
