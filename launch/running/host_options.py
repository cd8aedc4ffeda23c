"""The command-line options that put worker nodes on other machines, shared by
`fedemu launch` and `fedemu sweep` (whose --slurm is its own: a job array)."""
from __future__ import annotations

import functools
from typing import Callable

import click


def machine_options(command: Callable) -> Callable:
    """Add --machines, --hostfile, --slurm, --ssh-config, --advertise and --remote-python;
    the command receives them as one ``machines`` argument (a Machines, or None; with
    --slurm, the allocation it runs in)."""
    return _machine_options(command, slurm_allocation=True)


def ssh_machine_options(command: Callable) -> Callable:
    """machine_options without --slurm, for a command that uses Slurm its own way
    (`fedemu sweep --slurm` submits a job array rather than running in an allocation)."""
    return _machine_options(command, slurm_allocation=False)


def _machine_options(command: Callable, slurm_allocation: bool) -> Callable:
    @click.option("--machines", "machine_list",
                  help="Worker hosts over SSH: [user@]host[:port],... (broker and server stay here).")
    @click.option("--hostfile", type=click.Path(dir_okay=False),
                  help="Worker hosts, one per line: [user@]host[:port] [slots=N] [python=PATH].")
    @click.option("--ssh-config", type=click.Path(dir_okay=False, exists=True),
                  help="An ssh_config file for the hosts (ssh -F); default: your ~/.ssh/config.")
    @click.option("--advertise", help="Address the hosts use to reach the broker; default: this machine as SSH sees it.")
    @click.option("--remote-python", help="Python with fedemu on the hosts; default: this interpreter's path.")
    @functools.wraps(command)
    def wrapper(*args, machine_list: str | None, hostfile: str | None, ssh_config: str | None,
                advertise: str | None, remote_python: str | None, in_allocation: bool = False, **kwargs):
        kwargs["machines"] = machines_from(machine_list, hostfile, ssh_config, advertise, remote_python,
                                           in_allocation)
        return command(*args, **kwargs)

    if slurm_allocation:
        wrapper = click.option("--slurm", "in_allocation", is_flag=True, help="Inside a Slurm allocation (salloc, sbatch): the "
                               "worker nodes are its tasks, started with srun; broker and server stay here.")(wrapper)
    return wrapper


def machines_from(machine_list: str | None, hostfile: str | None, ssh_config: str | None = None,
                  advertise: str | None = None, remote_python: str | None = None, slurm: bool = False):
    """The Machines the options name, or None for a run on this machine alone."""
    # lazy: the CLI starts light, so its signal handlers are set before the heavy imports
    from .hosts import HostError, parse_hostfile, parse_machines

    if sum(map(bool, (machine_list, hostfile, slurm))) > 1:
        raise click.UsageError("give one of --machines, --hostfile and --slurm")
    if slurm:
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        from .slurm import Allocation, NotInAllocation

        if ssh_config:
            raise click.UsageError("--ssh-config is for --machines/--hostfile; with --slurm, srun reaches the nodes")
        try:
            return Allocation.from_env(advertise=advertise, remote_python=remote_python)
        except NotInAllocation as exc:
            raise click.ClickException(str(exc)) from None
    if not (machine_list or hostfile):
        if ssh_config or advertise or remote_python:
            raise click.UsageError("--ssh-config, --advertise and --remote-python need --machines, --hostfile or --slurm")
        return None
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from .machines import Machines

    try:
        hosts = parse_machines(machine_list) if machine_list else parse_hostfile(hostfile)
    except HostError as exc:
        raise click.ClickException(str(exc)) from None
    return Machines(hosts, ssh_config=ssh_config, advertise=advertise, remote_python=remote_python)
