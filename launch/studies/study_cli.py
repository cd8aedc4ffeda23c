"""The study commands: `fedemu sweep`, `fedemu report`, `fedemu compare` (registered on
the main group at the end of cli.py)."""
from __future__ import annotations

import shlex
import signal
import sys
from pathlib import Path

import click

from ..running.host_options import ssh_machine_options
from ..running.lifecycle import exit_code_for, raise_on_stop_signals


@click.command()
@click.argument("sweep_file", type=click.Path(dir_okay=False))
@click.option("--out", type=click.Path(file_okay=False), help="Sweep directory (default: sweep.out, or sweeps/<name>).")
@click.option("--parallel", type=int,
              help="Points at once (default: sweep.parallel; 0: cores / workers per point). With --slurm: "
                   "the array's task limit (0: Slurm's).")
@click.option("--workers-per-point", type=int,
              help="Worker nodes per point (default: sweep.workers_per_point, 1). With --machines: per host "
                   "without slots=. With --slurm: Slurm tasks per array task.")
@click.option("--dry-run", is_flag=True, help="List the points and exit.")
@click.option("--slurm", is_flag=True,
              help="Submit the points as a Slurm job array (the sweep directory on a shared file system).")
@click.option("--sbatch-args", default="", metavar="'OPTIONS'",
              help="With --slurm: more sbatch options for every array task, e.g. '--partition=cpu --time=2:00:00'.")
@click.option("--points-per-task", type=int, default=1, show_default=True,
              help="With --slurm: points each array task runs, one after another (small points: fewer tasks).")
@click.option("--wait", is_flag=True, help="With --slurm: follow the job array to its end, collecting results.")
@ssh_machine_options
def sweep(sweep_file: str, out: str | None, parallel: int | None, workers_per_point: int | None, dry_run: bool,
          slurm: bool, sbatch_args: str, points_per_task: int, wait: bool, machines) -> None:
    """Run every point of SWEEP_FILE's grid; rerun to resume (completed points are skipped,
    failed and interrupted ones retried). With --machines every point's worker nodes run
    on the hosts; --parallel N splits the hosts into N groups, one point on each. With
    --slurm the points are the tasks of a Slurm job array; rerun to collect results and
    re-submit what failed."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from fedemu.common.ml.data import DatasetError

    from .sweep import run_sweep
    from .sweep_spec import SweepError, load_spec

    if parallel is not None and parallel < 0 or workers_per_point is not None and workers_per_point < 1:
        raise click.ClickException("--parallel must be >= 0 and --workers-per-point >= 1")
    if slurm and machines is not None:
        raise click.UsageError("--slurm runs the points on the cluster's nodes; drop --machines/--hostfile")
    if not slurm and (sbatch_args or wait or points_per_task != 1):
        raise click.UsageError("--sbatch-args, --points-per-task and --wait go with --slurm")
    if points_per_task < 1:
        raise click.ClickException("--points-per-task must be >= 1")
    # SIGTERM and SIGHUP stop the sweep as Ctrl-C does: running points are interrupted and recorded.
    raise_on_stop_signals()
    if not (slurm or dry_run or machines is not None):
        # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
        from ..running.zygote import shared as start_zygote

        start_zygote()  # before the spec's checks import torch: the zygote's import for the points goes beside it
    try:
        spec = load_spec(sweep_file, out)
        if slurm:
            # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
            from .sweep_slurm import run_slurm_sweep

            if parallel is not None:
                spec.parallel = parallel
            counts = run_slurm_sweep(spec, workers_per_point=workers_per_point, sbatch_args=shlex.split(sbatch_args),
                                     points_per_task=points_per_task, wait=wait, echo=click.echo, dry_run=dry_run)
        else:
            counts = run_sweep(spec, parallel=parallel, workers_per_point=workers_per_point, machines=machines,
                               echo=click.echo, dry_run=dry_run, live=True)
    except (SweepError, DatasetError) as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt as exc:
        click.echo("sweep interrupted; run the same command again to resume it")
        sys.exit(exit_code_for(getattr(exc, "signum", signal.SIGINT)))
    if dry_run:
        return
    click.echo("sweep: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    click.echo(f"sweep directory: {spec.out.resolve()}  (index: sweep.db; `fedemu report {spec.out}` draws it)")
    if counts.get("failed") or counts.get("interrupted"):
        sys.exit(1)


@click.command("sweep-task", hidden=True)
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
def sweep_task(folder: Path) -> None:
    """One point of a `fedemu sweep --slurm` job array (run by Slurm as an array task)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .sweep_slurm import run_task

    sys.exit(run_task(folder))


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", type=click.Path(file_okay=False),
              help="Report folder (default: RUN/report or SWEEP/report; required for several).")
@click.option("--target", type=float, help="Accuracy for time to target, e.g. 0.9 (default: the sweep's or run's).")
@click.option("--format", "formats", default="png,svg", show_default=True, help="Figure formats, comma-separated.")
@click.option("--timeline", is_flag=True,
              help="Draw the run's timeline instead: a Gantt figure of each selected client's download, compute, "
                   "upload and offline time (one run).")
@click.option("--rounds", metavar="R", help="With --timeline: the rounds to draw, e.g. 3, 2-5 or 1,4 (default: the first three).")
@click.option("--clients", "max_clients", type=int, default=40, show_default=True,
              help="With --timeline: at most this many clients (rows).")
def report(paths: tuple[str, ...], out: str | None, target: float | None, formats: str, timeline: bool,
           rounds: str | None, max_clients: int) -> None:
    """Plots and a Markdown table for runs (finished or not) and sweeps; with --timeline,
    a run's Gantt figure."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .report import report as make_report
    from .results import ReportError

    if target is not None and not 0 < target <= 1:
        raise click.ClickException(f"--target {target} must be an accuracy in (0, 1]")
    kinds = tuple(f.strip() for f in formats.split(",") if f.strip())
    bad = set(kinds) - {"png", "svg", "pdf"}
    if bad or not kinds:
        raise click.ClickException(f"--format: choose among png, svg, pdf (got {formats!r})")
    if not timeline and (rounds or max_clients != 40):
        raise click.UsageError("--rounds and --clients go with --timeline")
    try:
        if timeline:
            # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
            from .report_timeline import plot_gantt

            if len(paths) != 1:
                raise click.UsageError("--timeline draws one run: give one run directory")
            folder = Path(out) if out else Path(paths[0]) / "report"
            folder.mkdir(parents=True, exist_ok=True)
            figures = plot_gantt(paths[0], folder, rounds, max_clients, kinds)
            click.echo("timeline written to " + ", ".join(str(p) for p in figures))
            return
        folder = make_report(list(paths), out, target, kinds)
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"report written to {folder}/: report.md and its figures")


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--by", default="algorithm.name", show_default=True, help="Config key whose values are compared.")
@click.option("--metric", default="final_accuracy", show_default=True,
              type=click.Choice(["final_accuracy", "best_accuracy", "time_to_target", "bytes_to_target",
                                 "rounds_to_target"]),
              help="What is compared; *_to_target: emulated seconds, MB uploaded or rounds to --target accuracy "
                   "(lower is better).")
@click.option("--target", type=float, help="Accuracy for *_to_target (default: the sweep's target, or run.target_accuracy).")
@click.option("--unreached", default="error", show_default=True, type=click.Choice(["error", "drop", "budget"]),
              help="A run that never reached --target: refuse, naming it (error); leave its pair out (drop); or "
                   "count what it spent in all, a lower bound (budget).")
@click.option("--rope", type=float,
              help="Region of practical equivalence, in the metric's unit (default: 0.01 = 1 point of accuracy; "
                   "1% of the mean for *_to_target).")
@click.option("--decide", default=0.95, show_default=True, help="Posterior mass a region needs for +, - or =.")
@click.option("--where", multiple=True, metavar="SECTION.KEY=VALUE", help="Only runs with this config value.")
@click.option("-o", "--out", type=click.Path(file_okay=False),
              help="Folder for compare.md and the posterior plots (default: SWEEP/compare; required for several).")
def compare(paths: tuple[str, ...], by: str, metric: str, target: float | None, unreached: str, rope: float | None,
            decide: float, where: tuple[str, ...], out: str | None) -> None:
    """Bayesian correlated t-test (baycomp) between the groups of runs in PATHS (sweeps,
    run directories or run records: the .json files bench/nilsson_table1.py keeps), paired
    by seed and fold, as Nilsson et al. 2018 did."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .compare import CompareError, run
    from .results import ReportError

    try:
        text, folder = run(list(paths), by=by, metric=metric, rope=rope, decide=decide, where=list(where), out=out,
                           target=target, unreached=unreached)
    except (CompareError, ReportError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(text)
    click.echo(f"\nposterior plots and compare.md: {folder}")


@click.command(short_help="A CSV row per evaluation of runs and sweeps; --trace: a run's timeline for Perfetto.")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True),
              help="File to write, '-' for standard output (default: standard output; with --trace RUN/trace.json).")
@click.option("--trace", is_flag=True,
              help="Write one run's timeline as Chrome trace JSON instead (Perfetto, chrome://tracing): a track "
                   "per client.")
def export(paths: tuple[str, ...], output: str | None, trace: bool) -> None:
    """One tidy table of runs and sweeps: a CSV row per evaluation, with each run's path,
    status, algorithm and the keys that vary between runs (a sweep's axes). With
    --trace, one run's timeline in the Chrome trace event format."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .results import ReportError, evaluation_records, write_csv

    if trace:
        # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
        from .report_timeline import write_trace

        if len(paths) != 1:
            raise click.UsageError("--trace exports one run: give one run directory")
        output = output or str(Path(paths[0]) / "trace.json")
        try:
            with click.open_file(output, "w", encoding="utf-8") as out:
                count = write_trace(paths[0], out)
        except ReportError as exc:
            raise click.ClickException(str(exc)) from None
        if output != "-":
            click.echo(f"{count} trace events -> {output} (open it in ui.perfetto.dev or chrome://tracing)", err=True)
        return
    output = output or "-"
    try:
        records = evaluation_records(list(paths))
    except ReportError as exc:
        raise click.ClickException(str(exc)) from None
    with click.open_file(output, "w", encoding="utf-8") as out:
        write_csv(records, out)
    if output != "-":
        click.echo(f"{len(records)} evaluations -> {output}", err=True)
