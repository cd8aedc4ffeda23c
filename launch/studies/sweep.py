"""`fedemu sweep SWEEP.toml`: run every point of a sweep file's grid (``sweep_spec.py``),
resumably, indexed in SQLite (``sweep_index.py``), a few points at a time
(``sweep_layout.py``), each as one launch (``sweep_point.py``).

The sweep directory holds ``sweep.toml`` (the file as last run), ``sweep.db`` (one row
per point: its axis values as columns, status, run directory, summary figures) and
``runs/<point>/`` (ordinary run directories). Rerunning the same sweep skips completed
points and retries the others; a point whose resolved config changed (the base file
was edited) is refused, naming the keys, since its old result would silently stand for
a different experiment.

With ``--machines``/``--hostfile`` every point is a multi-machine launch: its broker and
server run here, its worker nodes on the hosts. ``--parallel N`` splits the hosts into N
groups and runs N points at once, each on a group of its own.
"""
from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from fedemu.common.ml import data

from ..running.lifecycle import DirectoryInUse, DirLock, StopRequest
from ..running.progress import SweepProgress
from .sweep_index import DB_FILE, Index, now, summary_fields
from .sweep_layout import Layout, plan
from .sweep_point import alive, run_point
from .sweep_spec import Point, Spec, SweepError, expand

if TYPE_CHECKING:
    from ..running.machines import Machines


@dataclass
class Progress:
    total: int
    done: int = 0
    failed: int = 0
    skipped: int = 0
    walls: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def line(self, running: int, parallel: int) -> str:
        left = self.total - self.done - self.failed - self.skipped
        eta = ""
        if self.walls and left:
            secs = sum(self.walls) / len(self.walls) * left / max(1, min(parallel, left))
            eta = f", about {_duration(secs)} left"
        return (f"[{self.done + self.skipped}/{self.total} done, {running} running, {self.failed} failed{eta}, "
                f"{_duration(time.monotonic() - self.started)} so far]")  # wall


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def run_sweep(spec: Spec, *, parallel: int | None = None, workers_per_point: int | None = None,
              machines: Machines | None = None, echo: Callable[[str], None] = print, dry_run: bool = False,
              stop: threading.Event | None = None, live: bool = False) -> dict:
    """Run every point of ``spec`` that has not completed, on this machine or with worker
    nodes on ``machines``; returns counts by status. ``live``: a progress bar per running
    point where a terminal is attached."""
    points = expand(spec)
    layout = plan(spec, parallel, workers_per_point, machines)
    # Absolute: the nodes' command lines name it, which is how a resume finds them.
    sweep_dir = spec.out.resolve()
    if dry_run:
        for p in points:
            echo(f"{p.seq:4d}  {p.id}")
        echo(f"{len(points)} points; would run {layout.describe()}, into {sweep_dir}")
        return {"points": len(points)}
    with opened(spec, points) as index:
        _recover(index, sweep_dir, spec.target, echo)
        progress = SweepProgress(echo, bar=None if live else False)
        try:
            return _run(spec, points, index, sweep_dir, layout, progress, stop or StopRequest())
        finally:
            progress.close()


@contextmanager
def opened(spec: Spec, points: list[Point]) -> Iterator[Index]:
    """The sweep directory, locked against a second sweep, and its index in step with
    ``points`` (a point whose config changed under its name is refused)."""
    sweep_dir = spec.out.resolve()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    try:
        lock = DirLock(sweep_dir, what="`fedemu sweep`")
    except DirectoryInUse as exc:
        raise SweepError(str(exc)) from None
    index = Index(sweep_dir / DB_FILE)
    try:
        index.check_compatible(points)
        index.sync(spec, points)
        (sweep_dir / "sweep.toml").write_text(spec.text)
        yield index
    finally:
        index.close()
        lock.close()


def _recover(index: Index, sweep_dir: Path, target: float, echo) -> None:
    """Rows left "running" by a sweep that was killed: adopt a run that finished on
    its own since; refuse while its processes still run; otherwise retry it."""
    for row in index.rows().values():
        if row["status"] in ("queued", "running") and row["slurm_job"]:
            raise SweepError(f"point {row['id']} was submitted to Slurm (array task {row['slurm_job']}) and is not "
                             "collected yet; run `fedemu sweep --slurm` on this sweep to collect or re-submit it")
        if row["status"] != "running":
            continue
        run_dir = sweep_dir / row["run_dir"]
        still = alive(json.loads(row["pids"] or "[]"), run_dir)
        if still:
            raise SweepError(f"point {row['id']} is still running from an earlier sweep that was killed "
                             f"(pids {' '.join(map(str, still))}); wait for it or stop it (kill {' '.join(map(str, still))}), "
                             "then rerun")
        summary = read_summary(run_dir)
        status = summary.get("status") if summary else None
        if status == "completed":
            echo(f"adopted {row['id']}: it completed after the earlier sweep stopped")
            index.update(row["id"], status="completed", finished_at=now(),
                         **summary_fields(run_dir, summary, target))
        else:
            index.update(row["id"], status="interrupted", reason="the sweep was killed while it ran")


def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _fetch_data(points: list[Point]) -> None:
    for name, cache in {(p.config["data"]["dataset"], p.config["data"]["cache_dir"] or None) for p in points}:
        data.fetch(name, cache, progress=lambda line: None)


def _run(spec: Spec, points: list[Point], index: Index, sweep_dir: Path, layout: Layout,
         progress_view: SweepProgress, stop: threading.Event) -> dict:
    echo = progress_view.echo
    rows = index.rows()
    todo = [p for p in points if rows[p.id]["status"] != "completed"]
    progress = Progress(total=len(points), skipped=len(points) - len(todo))
    if progress.skipped:
        echo(f"{progress.skipped} of {len(points)} points already completed; skipping them")
    if not todo:
        echo("nothing to run")
        return index.counts()
    _fetch_data(todo)
    parallel = layout.parallel
    echo(f"running {len(todo)} point(s), {layout.describe()}, into {sweep_dir}")
    running: dict[str, tuple[threading.Thread, dict, Point]] = {}
    changed = threading.Event()  # a point's processes started, or it ended: look at once
    free_hosts = list(layout.host_groups or [])  # with machines: groups no running point holds
    queue = list(todo)
    last_line = 0.0
    try:
        while queue or running:
            while queue and len(running) < parallel and not stop.is_set():
                p = queue.pop(0)
                hosts = free_hosts.pop(0) if layout.host_groups else None
                _start(p, rows[p.id], index, sweep_dir, layout, hosts, stop, running, changed)
                echo(f"start  {p.id}  {progress.line(len(running), parallel)}")
                progress_view.start(p.id, sweep_dir / "runs" / p.id, p.config["run"]["rounds"])
            progress_view.poll()
            for pid, (thread, box, p) in list(running.items()):
                if "pids" in box and not box.get("recorded"):
                    # Into the index as soon as the processes exist, so a sweep killed
                    # with SIGKILL can tell on resume whether its points still run.
                    index.update(pid, pids=json.dumps(box["pids"]))
                    box["recorded"] = True
                if not box.get("done") and thread.is_alive():
                    continue
                del running[pid]
                changed.set()  # its slot is free: the next point starts without waiting for a tick
                progress_view.finish(pid)
                if box["hosts"] is not None:
                    free_hosts.append(box["hosts"])
                _finish(p, box, index, sweep_dir, spec.target, progress, echo, len(running), parallel)
            if stop.is_set() and not running:
                break
            if time.monotonic() - last_line > 60:  # wall: a heartbeat while long points run
                last_line = time.monotonic()  # wall
                echo(f"       {progress.line(len(running), parallel)}")
                if not progress_view.bars:
                    for line in progress_view.lines():
                        echo(line)
            changed.wait(0.2)  # wall: the progress bars' tick, cut short by a point's news
            changed.clear()
    except KeyboardInterrupt as exc:
        if isinstance(stop, StopRequest):  # the points are stopped by the same signal, and say so
            stop.request(getattr(exc, "signum", signal.SIGINT))
        stop.set()
        echo(f"stopping: interrupting {len(running)} running point(s) ...")
        previous = signal.signal(signal.SIGINT, lambda *_: echo("still stopping the running points ..."))
        try:
            for pid, (thread, box, p) in list(running.items()):
                if thread.ident is not None:  # else stopped before its thread started
                    thread.join()
                _finish(p, box, index, sweep_dir, spec.target, progress, echo, 0, parallel)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise
    return index.counts()


def _start(p: Point, row: dict, index: Index, sweep_dir: Path, layout: Layout, hosts: Machines | None,
           stop: threading.Event, running: dict, changed: threading.Event) -> None:
    """Start point ``p`` in a thread, entered in ``running`` before the index calls it
    running: a stop at any instant of this finds it there and ends it in the index.
    The thread sets ``changed`` when the point's processes exist and when it ends."""
    config = layout.point_config(p.config)
    run_dir, attempts = new_attempt(sweep_dir, p.id, row)
    box: dict = {"hosts": hosts}
    lock = threading.Lock()

    def on_start(pids: list[int]) -> None:
        with lock:
            box["pids"] = pids
        changed.set()

    def target() -> None:
        started = time.monotonic()  # wall
        try:
            box["summary"] = run_point(config, run_dir, workers=layout.workers_per_point, stop=stop,
                                       on_start=on_start, machines=hosts)
        except Exception as exc:  # a point's failure must not take the sweep down
            box["summary"] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        box["wall"] = time.monotonic() - started  # wall
        box["done"] = True
        changed.set()

    thread = threading.Thread(target=target, name=f"point {p.id}", daemon=True)
    running[p.id] = (thread, box, p)
    index.update(p.id, status="running", attempts=attempts, run_dir=str(run_dir.relative_to(sweep_dir)),
                 started_at=now(), finished_at=None, reason=None, pids="[]")
    thread.start()


def new_attempt(sweep_dir: Path, point_id: str, row: dict) -> tuple[Path, int]:
    """The run directory of a point's next attempt, and that attempt's number; an
    earlier attempt's directory is kept for its logs, out of the way, in attempts/."""
    run_dir = sweep_dir / "runs" / point_id
    attempts = (row["attempts"] or 0) + 1
    if run_dir.exists():
        aside = sweep_dir / "attempts" / f"{point_id}.{attempts - 1}"
        aside.parent.mkdir(exist_ok=True)
        if aside.exists():
            shutil.rmtree(aside)
        run_dir.rename(aside)
    return run_dir, attempts


def _finish(p: Point, box: dict, index: Index, sweep_dir: Path, target: float, progress: Progress,
            echo, running: int, parallel: int) -> None:
    summary = box.get("summary") or {"status": "failed", "reason": "the point runner ended without a summary"}
    run_dir = sweep_dir / "runs" / p.id
    # As its summary.json says (a point stopped while it started up says "interrupted" there
    # too, launcher.LocalRun.summary): the index and the run directory agree.
    status = summary.get("status", "failed")
    if status not in ("completed", "failed", "interrupted"):
        status = "failed"
    fields = summary_fields(run_dir, summary, target) if (run_dir / "config.toml").exists() else {
        "reason": summary.get("reason")}
    index.update(p.id, status=status, finished_at=now(), **fields)
    if status == "completed":
        progress.done += 1
        progress.walls.append(box.get("wall", 0.0))
        acc = summary.get("final_accuracy")
        echo(f"done   {p.id}  acc {acc:.4f}  {box.get('wall', 0):.0f}s  {progress.line(running, parallel)}"
             if acc is not None else f"done   {p.id}  {progress.line(running, parallel)}")
    elif status == "failed":
        progress.failed += 1
        echo(f"FAILED {p.id}: {summary.get('reason')}  (logs: {run_dir / 'logs'})  {progress.line(running, parallel)}")
    else:
        echo(f"stopped {p.id}: {summary.get('reason')}")
