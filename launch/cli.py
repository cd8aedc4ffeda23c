"""The ``fedemu`` command."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import config as configuration
from .host_options import machine_options


def _config_error(exc: Exception) -> click.ClickException:
    return click.ClickException(str(exc))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """fedemu: a federated-learning emulator on real processes and sockets."""


@main.command()
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config entry.")
@click.option("--out", type=click.Path(file_okay=False), help="Run directory (default: run.out/<time>-<algorithm>-...).")
@click.option("--workers", type=int,
              help="Worker nodes (OS processes); default: number of cores. With --machines: per host without slots=.")
@machine_options
def launch(config_file: str | None, overrides: tuple[str, ...], out: str | None, workers: int | None,
           machines) -> None:
    """Run CONFIG_FILE (default: MNIST, 2NN, FedAvg, 100 clients) on this machine, or
    with worker nodes on other machines (--machines / --hostfile) or on the nodes of a
    Slurm allocation (--slurm)."""
    from fedemu.worker.ml.data import DatasetError

    from .launcher import launch as run_local
    from .rundir import LaunchError
    from .slurm import Allocation

    if workers is not None and isinstance(machines, Allocation):
        raise click.UsageError("with --slurm the allocation's tasks are the worker nodes: ask Slurm for them "
                               "(--ntasks, --ntasks-per-node) instead of --workers")
    try:
        run_dir, summary = run_local(config_file, list(overrides), out, workers, machines=machines)
    except (configuration.ConfigError, LaunchError, DatasetError) as exc:
        raise _config_error(exc) from None
    click.echo(f"summary: {json.dumps(summary)}")
    click.echo(f"run directory: {run_dir}")
    if summary.get("status") != "completed":
        sys.exit(1)


@main.command()
@click.argument("config_file", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
def check(config_file: str | None, overrides: tuple[str, ...]) -> None:
    """Validate a config without running it; print the resolved config."""
    try:
        config = configuration.load(config_file, list(overrides))
    except configuration.ConfigError as exc:
        raise _config_error(exc) from None
    click.echo(configuration.to_toml(config))
    for finding in configuration.findings(config):  # what is left is a risk the user accepted
        click.echo(f"warning ({finding.rule}, accepted): {finding.message}")
    click.echo("ok: the config is valid")


@main.command()
@click.argument("name", required=False)
def algorithms(name: str | None) -> None:
    """List the algorithms (built-in, and NAME if it is a plug-in) with their own
    algorithm.* options and defaults."""
    from fedemu.server import algorithm

    try:
        classes = dict(algorithm.built_in())
        if name:
            classes = {name: algorithm.get(name)}
    except algorithm.UnknownAlgorithm as exc:
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
    from fedemu.worker.ml import data as datasets

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
    from fedemu.worker.ml import data as datasets

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
    from fedemu.worker.ml import datasets as registry, split

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
@click.option("--bind", required=True, help="tcp://HOST:PORT to listen on (port 0: any free port).")
@click.option("--endpoint-file", type=click.Path(dir_okay=False, path_type=Path), help="Write the bound address here.")
@click.option("--heartbeat-interval", type=float, default=0.5, show_default=True)
@click.option("--heartbeat-timeout", type=float, default=5.0, show_default=True)
@click.option("--max-message-bytes", type=int, default=256 * 1024 * 1024, show_default=True)
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--network", "network_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="JSON {num_clients, seed, network: <the config's [network] section>} to emulate.")
@click.option("--keys", "keys_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="The run's CURVE keys: accept only nodes that hold them.")
def broker(bind: str, endpoint_file: Path | None, heartbeat_interval: float, heartbeat_timeout: float,
           max_message_bytes: int, log_dir: Path | None, network_file: Path | None, keys_file: Path | None) -> None:
    """Run the message broker that every node connects to."""
    from .lifecycle import die_with_parent, retain_freed_memory
    from .nodes import run_broker, setup_logging

    die_with_parent()  # a launcher killed outright takes its broker with it
    retain_freed_memory()
    setup_logging(log_dir or (endpoint_file.parent if endpoint_file else None), "broker")
    try:
        run_broker(bind, endpoint_file, heartbeat_interval, heartbeat_timeout, max_message_bytes, network_file,
                   keys_file)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


@main.command(hidden=True)
@click.argument("role", type=click.Choice(["server", "worker"]))
@click.option("--broker", "broker_addr", required=True)
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--workers", type=int, required=True)
@click.option("--index", type=int, default=0)
@click.option("--keys", "keys_file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--log-stream", is_flag=True, help="Log to stderr only (a host agent streams it back).")
def node(role: str, broker_addr: str, run_dir: Path, workers: int, index: int, keys_file: Path | None,
         log_stream: bool) -> None:
    """Run one node of a run (started by `fedemu launch`)."""
    from .lifecycle import die_with_parent, retain_freed_memory
    from .nodes import run_server_node, run_worker_node, setup_logging

    die_with_parent()  # a launcher (or host agent) killed outright takes its nodes with it
    retain_freed_memory()
    name = "server" if role == "server" else f"worker-{index}"
    setup_logging(None if log_stream else run_dir, name, stream_info=log_stream)
    if role == "server":
        sys.exit(run_server_node(broker_addr, run_dir, workers, keys_file))
    sys.exit(run_worker_node(broker_addr, run_dir, index, workers, keys_file))


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
    from .agent import preflight as check_host

    click.echo(json.dumps(check_host(dataset, cache_dir, broker_port, broker_address, model, slurm_task, device)))


@main.command("host-agent", hidden=True)
@click.option("--slurm-task", is_flag=True, help="Run as a task of a Slurm step: start worker node SLURM_PROCID.")
def host_agent(slurm_task: bool) -> None:
    """Start and supervise this host's worker nodes (run over SSH by `fedemu launch
    --machines`, or as srun tasks by `fedemu launch --slurm`)."""
    from .agent import run_agent

    sys.exit(run_agent(slurm_task))


# The study commands (issue 7) live in study_cli.py.
from .study_cli import compare as _compare, export as _export, report as _report, sweep as _sweep, sweep_task as _sweep_task  # noqa: E402

from .traces_cli import traces as _traces  # noqa: E402

main.add_command(_sweep)
main.add_command(_sweep_task)
main.add_command(_report)
main.add_command(_compare)
main.add_command(_export)
main.add_command(_traces)
