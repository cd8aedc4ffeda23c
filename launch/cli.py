"""The ``fedemu`` command."""
from __future__ import annotations

import copy
import json
import logging
import signal
import sys
from pathlib import Path

import click

# Light on purpose (the config, numpy, zmq and torch are imported by the commands that use
# them): a launcher stopped while it starts up must already have its signal handlers.
from .running.host_options import machine_options
from .running.lifecycle import (Interrupted, exit_code_for, exit_without_teardown, raise_on_stop_signals, signal_named,
                                stop_signal_received)

# Commands that are processes of a run, or serve one, and handle stop signals their own way.
_OWN_SIGNAL_HANDLING = ("node", "broker", "host-agent", "sweep-task", "preflight")
# What a command stopped before it could stop in order has left undone, in words. A
# launch stops its run in order once the run directory exists (launcher._run_to_end).
_STOPPED_EARLY = {"launch": " before the run directory was made; nothing ran"}


def _config_error(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


class _Commands(click.Group):
    def invoke(self, ctx: click.Context):
        # A command stopped (see main) before it could stop in order says so and exits as
        # a shell reports a process killed by the signal (130, 143, 129), where click would
        # say "Aborted!" and exit with 1.
        try:
            return super().invoke(ctx)
        except Interrupted as exc:
            command = ctx.invoked_subcommand or ""
            click.echo(f"fedemu {command}: stopped by {signal.Signals(exc.signum).name}"
                       f"{_STOPPED_EARLY.get(command, '')}", err=True)
            ctx.exit(exit_code_for(exc.signum))


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fedemu", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx: click.Context) -> None:
    """fedemu: a federated-learning emulator on real processes and sockets."""
    if ctx.invoked_subcommand not in _OWN_SIGNAL_HANDLING:
        # SIGTERM and SIGHUP stop a command as Ctrl-C does, from its first moment.
        raise_on_stop_signals()


@main.command()
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config entry.")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default: run.out/<time>-<algorithm>-...).")
@click.option("--workers", type=int,
              help="Worker nodes (OS processes); default: number of cores. With --machines: per host without slots=.")
@click.option("--tensorboard", is_flag=True,
              help="Write TensorBoard event files as the run goes (run.tensorboard = true): "
                   "tensorboard --logdir RUN_DIR shows them.")
@machine_options
def launch(config_file: str | None, overrides: tuple[str, ...], out: str | None, workers: int | None,
           tensorboard: bool, machines) -> None:
    """Run CONFIG_FILE (default: MNIST, 2NN, FedAvg, 100 clients) on this machine, or
    with worker nodes on other machines (--machines / --hostfile) or on the nodes of a
    Slurm allocation (--slurm)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .running.zygote import shared as start_zygote

    start_zygote()  # first: its imports (torch: the run's critical path) go beside the launcher's own
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from fedemu.common.ml.data import DatasetError

    from . import config as configuration
    from .running.launcher import launch as run_local
    from .running.rundir import LaunchError
    from .running.slurm import Allocation

    if workers is not None and isinstance(machines, Allocation):
        raise click.UsageError("with --slurm the allocation's tasks are the worker nodes: ask Slurm for them "
                               "(--ntasks, --ntasks-per-node) instead of --workers")
    if tensorboard:
        overrides = (*overrides, "run.tensorboard=true")
    try:
        run_dir, summary = run_local(config_file, list(overrides), out, workers, machines=machines, live=True)
    except (configuration.ConfigError, LaunchError, DatasetError) as exc:
        raise _config_error(exc) from None
    click.echo(f"summary: {json.dumps(summary)}")
    click.echo(f"run directory: {run_dir}")
    if summary.get("status") == "interrupted":  # as a shell reports it, and as `fedemu sweep` exits
        sys.exit(exit_code_for(stop_signal_received() or signal_named(summary.get("reason"))))
    if summary.get("status") != "completed":
        sys.exit(1)


@main.command()
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
def check(config_file: str | None, overrides: tuple[str, ...]) -> None:
    """Validate a config without running it; print the resolved config, or every problem
    found in it (exit status 2)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from . import config as configuration

    try:
        config = configuration.load(config_file, list(overrides))
    except configuration.ConfigError as exc:  # every problem, each on its line
        error = _config_error(exc)
        error.exit_code = 2  # a bad config, as a bad command line exits
        raise error from None
    click.echo(configuration.to_toml(_as_it_runs(config)))
    for finding in configuration.findings(config):  # what is left is a risk the user accepted
        click.echo(f"warning ({finding.rule}, accepted): {finding.message}")
    click.echo("ok: the config is valid")


@main.command("resolve-config", hidden=True)
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
def resolve_config(config_file: str | None, overrides: tuple[str, ...]) -> None:
    """Load and check a config for a launcher without torch (launcher.resolve_config)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .running.launcher import write_resolved_config
    from .running.lifecycle import die_with_parent

    die_with_parent()  # its launcher's zygote, gone: no one waits for the config
    sys.exit(write_resolved_config(config_file, list(overrides)))


def _as_it_runs(config: dict) -> dict:
    """The resolved config as this run uses it: without the options of other algorithms
    (a config may carry them, for a sweep over algorithm.name) and with the network's
    default profile said, not left implicit."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from . import config as configuration

    shown = copy.deepcopy(config)
    for key in configuration.ineffective_keys(config):
        section, _, name = key.partition(".")
        if section == "algorithm":
            shown["algorithm"].pop(name, None)
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common import algorithms
    try:
        synchronous = algorithms.get(config["algorithm"]["name"]).synchronous
    except algorithms.UnknownAlgorithm:
        synchronous = None
    other_engine = {True: ASYNC_ONLY, False: ROUNDS_ONLY}.get(synchronous, ())
    for name in other_engine:
        shown["algorithm"].pop(name, None)
    network = shown.setdefault("network", {})
    network.setdefault("default_profile", "ideal")
    return shown


# Shared algorithm.* keys that only one engine reads.
ASYNC_ONLY = ("eval_every_uploads", "merge_s", "retry_s")
ROUNDS_ONLY = ("lr_round_decay", "deadline_s", "quorum", "on_quorum_missed", "over_select")


@main.command()
@click.argument("name", required=False)
def algorithms(name: str | None) -> None:
    """List the algorithms (built-in, and those installed packages bring; or NAME, a
    plug-in too) with their own algorithm.* options and defaults."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common import algorithms
    try:
        if name:
            classes = {name: algorithms.get(name)}
        else:
            classes = dict(algorithms.built_in())
            for plugin in algorithms.installed():
                if plugin not in classes:
                    classes[plugin] = algorithms.get(plugin)
    except algorithms.UnknownAlgorithm as exc:
        raise _config_error(exc) from None
    for key, cls in classes.items():
        kind = "round-based" if cls.synchronous else "asynchronous"
        click.echo(f"{key}  ({cls.label or key}, {kind}; {cls.__module__}.{cls.__qualname__})")
        for option, spec in cls.options.items():
            click.echo(f"    {option} = {spec.default!r}: {spec.doc}")


@main.group()
def data() -> None:
    """Fetch and list data sets."""


@data.command("fetch")
@click.argument("name")
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Cache folder (default: $FEDEMU_DATA_DIR or ~/.cache/fedemu).")
@click.option("--force", is_flag=True, help="Fetch again even if a verified copy is cached.")
def data_fetch(name: str, cache_dir: str | None, force: bool) -> None:
    """Fetch data set NAME (fedemu data list shows them; a plug-in by its entry point or
    package.module:Class), verify it, and cache a converted copy. A cached copy is
    checked (sizes and sha256 recorded when it was made) and fetched again if damaged."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from fedemu.common.ml import data as datasets

    try:
        path = datasets.fetch(name, cache_dir, force=force)
    except datasets.DatasetError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name}: {path}")


@data.command("list")
@click.option("--cache-dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object per data set.")
def data_list(cache_dir: str | None, as_json: bool) -> None:
    """List the data sets fedemu has and installed plug-ins bring: what each is, and
    whether it is cached."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from fedemu.common.ml import data as datasets

    for entry in datasets.list_datasets(cache_dir):
        if as_json:
            click.echo(json.dumps(entry, default=str))
            continue
        sizes = entry["sizes"]
        cached = (f"cached, {sizes['train']:,} train / {sizes['test']:,} test examples in {entry['path']}"
                  if sizes else "not cached")
        click.echo(f"{entry['name']:<16} {entry['about']}\n{'':<16} {cached}")


@data.command("stats")
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config entry.")
@click.option("--clients", "shown", type=int, default=10, show_default=True,
              help="Clients listed one by one (the summary covers all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per client.")
def data_stats(config_file: str | None, overrides: tuple[str, ...], shown: int, as_json: bool) -> None:
    """How a run's config splits its data over the clients: examples and labels per client,
    exactly as the worker nodes will cut it (same seed, same partition)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from fedemu.common.ml import datasets as registry
    from fedemu.common.ml import split

    from . import config as configuration

    try:
        config = configuration.load(config_file, list(overrides))
        spec = configuration.data_spec(config)
        run_data, shares = split.run_data(spec, progress=lambda line: click.echo(line, err=True))
    except (configuration.ConfigError, registry.DatasetError, ValueError) as exc:
        raise _config_error(exc) from None
    stats = split.share_stats(run_data, shares)
    if as_json:
        for row in stats:
            click.echo(json.dumps(row))
        return
    click.echo(split.describe_shares(spec, run_data, stats, shown))


@main.command()
@click.option("--bind", required=True, help="tcp://HOST:PORT (port 0: any free port) or ipc://PATH to listen on.")
@click.option("--endpoint-file", type=click.Path(dir_okay=False, path_type=Path), help="Write the bound address here.")
@click.option("--heartbeat-interval", type=float, default=0.5, show_default=True)
@click.option("--heartbeat-timeout", type=float, default=5.0, show_default=True)
@click.option("--max-message-bytes", type=int, default=256 * 1024 * 1024, show_default=True)
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--network", "network_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="JSON {num_clients, seed, network: <the config's [network] section>} to emulate.")
@click.option("--keys", "keys_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="The run's CURVE keys: accept only nodes that hold them.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="The run's token: a node joins only if its hello carries it.")
@click.option("--controller", "controllers", multiple=True, metavar="NODE",
              help="A node that may steer the run (shutdown, rounds, links); repeatable. Default: any node.")
def broker(bind: str, endpoint_file: Path | None, heartbeat_interval: float, heartbeat_timeout: float,
           max_message_bytes: int, log_dir: Path | None, network_file: Path | None, keys_file: Path | None,
           token_file: Path | None, controllers: tuple[str, ...]) -> None:
    """Run the message broker that every node connects to."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .running.lifecycle import die_with_parent, retain_freed_memory
    from .running.nodes import run_broker, setup_logging

    from .running.zygote import forked_from

    die_with_parent()  # a launcher killed outright takes its broker with it
    retain_freed_memory()
    setup_logging(log_dir or (endpoint_file.parent if endpoint_file else None), "broker")
    if forked_from():  # a sweep's later points: the zygote was ready (LocalRun._forks)
        logging.getLogger("fedemu.launch").info("broker forked from the zygote (pid %s)", forked_from())
    try:
        run_broker(bind, endpoint_file, heartbeat_interval, heartbeat_timeout, max_message_bytes, network_file,
                   keys_file, token_file, controllers or None)
    except (ValueError, OSError) as exc:  # a bad network file; its address that cannot be written
        raise click.ClickException(str(exc)) from None


@main.command(hidden=True)
@click.argument("role", type=click.Choice(["server", "worker"]))
@click.option("--broker", "broker_addr", required=True)
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--workers", type=int, required=True)
@click.option("--index", type=int, default=0)
@click.option("--keys", "keys_file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--log-stream", is_flag=True, help="Log to stderr only (a host agent streams it back).")
def node(role: str, broker_addr: str, run_dir: Path, workers: int, index: int, keys_file: Path | None,
         token_file: Path | None, log_stream: bool) -> None:
    """Run one node of a run (started by `fedemu launch`)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .running.lifecycle import die_with_parent, retain_freed_memory
    from .running.nodes import run_server_node, run_worker_node, setup_logging
    from .running.zygote import forked_from

    die_with_parent()  # a launcher (or host agent) killed outright takes its nodes with it
    retain_freed_memory()
    name = "server" if role == "server" else f"worker-{index}"
    setup_logging(None if log_stream else run_dir, name, stream_info=log_stream)
    if forked_from():  # which way it started, for the reader of its log (and the tests)
        logging.getLogger("fedemu.launch").info("%s forked from the zygote (pid %s)", name, forked_from())
    if role == "server":
        sys.exit(run_server_node(broker_addr, run_dir, workers, keys_file, token_file))
    sys.exit(run_worker_node(broker_addr, run_dir, index, workers, keys_file, token_file))


@main.command(hidden=True)
@click.option("--dataset", required=True)
@click.option("--cache-dir")
@click.option("--broker-port", type=int)
@click.option("--broker-address")
@click.option("--model", help="model.name: this host must be able to build it (a plug-in must be importable).")
@click.option("--slurm-task", is_flag=True, help="Run as a task of a Slurm step (`fedemu launch --slurm`).")
@click.option("--device", help="run.device: this host must have it (a GPU it names).")
def preflight(dataset: str, cache_dir: str | None, broker_port: int | None, broker_address: str | None,
              model: str | None, slurm_task: bool, device: str | None) -> None:
    """Check this host for a multi-machine run; print one JSON line (run over SSH or srun)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .running.agent import preflight as check_host

    click.echo(json.dumps(check_host(dataset, cache_dir, broker_port, broker_address, model, slurm_task, device)))


@main.command("host-agent", hidden=True)
@click.option("--slurm-task", is_flag=True, help="Run as a task of a Slurm step: start worker node SLURM_PROCID.")
def host_agent(slurm_task: bool) -> None:
    """Start and supervise this host's worker nodes (run over SSH by `fedemu launch
    --machines`, or as srun tasks by `fedemu launch --slurm`)."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .running.agent import run_agent

    sys.exit(run_agent(slurm_task))


# The study commands (issue 7) live in study_cli.py.
from .studies.study_cli import compare as _compare  # noqa: E402
from .studies.study_cli import export as _export
from .studies.study_cli import report as _report
from .studies.study_cli import sweep as _sweep
from .studies.study_cli import sweep_task as _sweep_task
from .studies.traces_cli import traces as _traces  # noqa: E402

main.add_command(_sweep)
main.add_command(_sweep_task)
main.add_command(_report)
main.add_command(_compare)
main.add_command(_export)
main.add_command(_traces)


def entry() -> None:
    """`fedemu` (and `python -m fedemu.launch`) as a process: the commands, then an end
    without the interpreter's teardown of every module (exit_without_teardown), which
    with torch loaded is 0.3-0.5 s of each node's and each launcher's end."""
    try:
        main()
        code = 0
    except SystemExit as exc:  # click ends every command this way; read it as the interpreter would
        code = _exit_status(exc.code)
    exit_without_teardown(code)


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
