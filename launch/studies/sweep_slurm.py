"""`fedemu sweep SWEEP.toml --slurm`: a sweep as a Slurm job array, one array task per
grid point still to run (or per batch of them, ``--points-per-task``), each point a
`fedemu launch --slurm` inside the task's own allocation (``slurm.SlurmRun``: worker
nodes are the task's Slurm tasks).

The sweep directory must be on a file system every node shares. Only this command
writes the SQLite index (``sweep.db``): SQLite's locking is not to be trusted on
network file systems, so array tasks write only their run directories, and this
command reads their ``summary.json`` into the index (``collect``): while it waits
(``--wait``), and whenever it runs again. Running it again also re-submits only the
points that are neither completed nor still queued or running in Slurm, as a local
sweep retries what is missing.

    <sweep>/slurm/submit-N/array.sh     the batch script of the N-th submission
    <sweep>/slurm/submit-N/job          its Slurm job id
    <sweep>/slurm/submit-N/points/I.json  array task I's points: id, config, run directory
    <sweep>/slurm/submit-N/I.out        array task I's output (Slurm's --output)
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ..running.lifecycle import StopRequest
from .sweep import read_summary, new_attempt, opened
from .sweep_index import Index, now, summary_fields
from .sweep_point import run_point
from .sweep_spec import Spec, SweepError, expand

POLL_S = 5.0  # how often --wait asks squeue; a point takes minutes


def run_slurm_sweep(spec: Spec, *, workers_per_point: int | None = None, sbatch_args: list[str] = (),
                    points_per_task: int = 1, wait: bool = False, echo: Callable[[str], None] = print,
                    dry_run: bool = False) -> dict:
    """Submit the points of ``spec`` not completed nor queued as one job array, each
    task running ``points_per_task`` of them one after another; with ``wait``, follow it
    to its end. Returns the points' counts by status."""
    points = expand(spec)
    sweep_dir = spec.out.resolve()
    tasks = workers_per_point or spec.workers_per_point or 1
    resources = [f"--ntasks={tasks}"]
    if dry_run:
        for p in points:
            echo(f"{p.seq:4d}  {p.id}")
        echo(f"{len(points)} points; would submit a job array into {sweep_dir}, {points_per_task} point(s) "
             "a task, each task: " + " ".join(map(shlex.quote, [*resources, *sbatch_args])))
        return {"points": len(points)}
    with opened(spec, points) as index:
        collect(index, sweep_dir, spec.target, echo)
        rows = index.rows()
        waiting = {pid for pid, row in rows.items() if row["status"] in ("queued", "running")}
        todo = [p for p in points if rows[p.id]["status"] != "completed" and p.id not in waiting]
        done = len(points) - len(todo) - len(waiting)
        echo(f"{len(points)} points: {done} completed, {len(waiting)} still in Slurm, {len(todo)} to submit")
        if todo:
            job, tasks = _submit(todo, rows, index, sweep_dir, spec, [*resources, *sbatch_args], points_per_task)
            echo(f"submitted job array {job} ({tasks} task(s)); output in {sweep_dir / 'slurm'}")
        if wait:
            _follow(index, sweep_dir, spec.target, echo)
        elif todo or waiting:
            echo("run the same command again to collect finished points and re-submit failed ones "
                 "(or add --wait to follow the array)")
        return index.counts()


def _submit(todo, rows: dict, index: Index, sweep_dir: Path, spec: Spec, options: list[str],
            points_per_task: int) -> tuple[str, int]:
    """One job array for ``todo``, in batches of ``points_per_task`` (in sweep order);
    returns the job id and the number of array tasks."""
    submits = sweep_dir / "slurm"
    submits.mkdir(exist_ok=True)
    number = 1 + max([int(d.name.split("-")[1]) for d in submits.glob("submit-*") if d.name.split("-")[1].isdigit()]
                     or [0])
    folder = submits / f"submit-{number}"
    (folder / "points").mkdir(parents=True)
    attempts, task_of = {}, {}
    batches = [todo[i:i + points_per_task] for i in range(0, len(todo), points_per_task)]
    for task, batch in enumerate(batches):
        entries = []
        for p in batch:
            run_dir, attempts[p.id] = new_attempt(sweep_dir, p.id, rows[p.id])
            config = json.loads(json.dumps(p.config))
            config["run"]["workers"] = 0  # the array task's Slurm tasks are its worker nodes
            entries.append({"id": p.id, "config": config, "run_dir": str(run_dir)})
            task_of[p.id] = task
        (folder / "points" / f"{task}.json").write_text(json.dumps(entries))
    script = folder / "array.sh"
    script.write_text("#!/bin/sh\n# Points of a fedemu sweep, a batch per array task (written by `fedemu sweep --slurm`).\n"
                      f"exec {shlex.quote(sys.executable)} -m fedemu.launch sweep-task {shlex.quote(str(folder))}\n")
    throttle = f"%{spec.parallel}" if spec.parallel else ""
    argv = ["sbatch", "--parsable", f"--array=0-{len(batches) - 1}{throttle}", f"--job-name=fedemu-{spec.name}",
            f"--output={folder}/%a.out", *options, str(script)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    except FileNotFoundError:
        raise SweepError("sbatch is not on PATH: --slurm submits the sweep with Slurm's client commands") from None
    if done.returncode != 0:
        raise SweepError(f"sbatch refused the job array: {done.stderr.strip() or done.stdout.strip()} "
                         f"(command: {shlex.join(argv)})")
    job = done.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;cluster"
    (folder / "job").write_text(job + "\n")
    for p in todo:
        index.update(p.id, status="queued", attempts=attempts[p.id], slurm_job=f"{job}_{task_of[p.id]}",
                     run_dir=str(Path("runs") / p.id), started_at=None, finished_at=None, reason=None, pids="[]")
    return job, len(batches)


def _job_of(folder: Path) -> str | None:
    try:
        return (folder / "job").read_text().strip()
    except OSError:
        return None


def in_slurm(jobs: set[str]) -> dict[str, str]:
    """Array tasks (``JOB_I``) of ``jobs`` still known to Slurm's queue: id -> state."""
    if not jobs:
        return {}
    done = subprocess.run(["squeue", "--noheader", "--array", "--jobs", ",".join(sorted(jobs)),
                           "--format=%i %T"], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:  # every one has left the queue
            return {}
        raise SweepError(f"squeue failed: {done.stderr.strip()}")
    return dict(line.split(None, 1) for line in done.stdout.splitlines() if line.strip())


def collect(index: Index, sweep_dir: Path, target: float, echo) -> dict[str, str]:
    """Bring the index up to date with Slurm: a point whose array task has left the
    queue takes its run directory's outcome; one still queued or running stays so.
    Returns the array tasks still in Slurm (id -> state)."""
    rows = [r for r in index.rows().values() if r["status"] in ("queued", "running") and r["slurm_job"]]
    alive = in_slurm({r["slurm_job"].split("_")[0] for r in rows})
    for row in rows:
        state = alive.get(row["slurm_job"])
        if state is not None:
            if state == "RUNNING" and row["status"] == "queued":
                index.update(row["id"], status="running", started_at=now())
            continue
        run_dir = sweep_dir / row["run_dir"]
        summary = read_summary(run_dir)
        job, task = row["slurm_job"].split("_")
        if summary is None:
            folder = next((f for f in (sweep_dir / "slurm").glob("submit-*") if _job_of(f) == job), None)
            output = folder / f"{task}.out" if folder else sweep_dir / "slurm"
            index.update(row["id"], status="failed", finished_at=now(),
                         reason=f"Slurm array task {row['slurm_job']} ended without a summary (see {output})")
            echo(f"FAILED {row['id']}: array task {row['slurm_job']} left no summary")
            continue
        status = summary.get("status", "failed")
        if status not in ("completed", "failed"):
            status = "interrupted"
        index.update(row["id"], status=status, finished_at=now(), **summary_fields(run_dir, summary, target))
        acc = summary.get("final_accuracy")
        echo(f"{'done  ' if status == 'completed' else status.upper()} {row['id']}"
             + (f"  acc {acc:.4f}" if acc is not None else "") + f"  (array task {row['slurm_job']})")
    return alive


def _follow(index: Index, sweep_dir: Path, target: float, echo) -> None:
    last = ""
    while True:
        alive = collect(index, sweep_dir, target, echo)
        if not alive:
            return
        states = {}
        for state in alive.values():
            states[state] = states.get(state, 0) + 1
        line = ", ".join(f"{n} {state.lower()}" for state, n in sorted(states.items()))
        if line != last:
            echo(f"in Slurm: {line}")
            last = line
        time.sleep(POLL_S)


def run_task(folder: Path, env: dict | None = None) -> int:
    """One array task: its batch of points, one after another, each as `fedemu launch
    --slurm` inside this task's allocation. Stopped (scancel, the time limit), it
    interrupts the running point and starts no other; the next `fedemu sweep --slurm`
    re-submits what is left."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from ..running.slurm import Allocation

    env = os.environ if env is None else env
    task = env.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        print("sweep-task runs as a Slurm array task (SLURM_ARRAY_TASK_ID is not set)", file=sys.stderr)
        return 2
    batch = json.loads((folder / "points" / f"{task}.json").read_text())
    stop = StopRequest()
    for sig in (signal.SIGTERM, signal.SIGINT):  # scancel, a time limit: the point stops in order
        signal.signal(sig, lambda signum, _: stop.request(signum))
    completed = 0
    for point in batch:
        if stop.is_set():
            break
        print(f"point {point['id']} into {point['run_dir']}", flush=True)
        summary = run_point(point["config"], Path(point["run_dir"]), workers=None, stop=stop,
                            machines=Allocation.from_env())
        print(f"point {point['id']}: {summary.get('status')} ({summary.get('reason')})", flush=True)
        completed += summary.get("status") == "completed"
    return 0 if completed == len(batch) else 1
