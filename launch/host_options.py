"""The command-line options that put worker nodes on other machines, shared by
`fedemu launch` and `fedemu sweep`."""
from __future__ import annotations

import functools
from typing import Callable

import click


def machine_options(command: Callable) -> Callable:
    """Add --machines, --hostfile, --ssh-config, --advertise and --remote-python; the
    command receives them as one ``machines`` argument (a Machines, or None)."""

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
                advertise: str | None, remote_python: str | None, **kwargs):
        kwargs["machines"] = machines_from(machine_list, hostfile, ssh_config, advertise, remote_python)
        return command(*args, **kwargs)

    return wrapper


def machines_from(machine_list: str | None, hostfile: str | None, ssh_config: str | None = None,
                  advertise: str | None = None, remote_python: str | None = None):
    """The Machines the options name, or None for a run on this machine alone."""
    from .hosts import HostError, parse_hostfile, parse_machines

    if machine_list and hostfile:
        raise click.UsageError("give either --machines or --hostfile, not both")
    if not (machine_list or hostfile):
        if ssh_config or advertise or remote_python:
            raise click.UsageError("--ssh-config, --advertise and --remote-python need --machines or --hostfile")
        return None
    from .machines import Machines

    try:
        hosts = parse_machines(machine_list) if machine_list else parse_hostfile(hostfile)
    except HostError as exc:
        raise click.ClickException(str(exc)) from None
    return Machines(hosts, ssh_config=ssh_config, advertise=advertise, remote_python=remote_python)
