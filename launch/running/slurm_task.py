"""What a process learns from the Slurm task it runs in: its rank and node, the address
of the host that started it. Apart from slurm.py (which starts runs on an allocation) so
the agent that runs inside a task needs none of the launching code (no import circle)."""
from __future__ import annotations

import os

from .rundir import LaunchError


class NotInAllocation(LaunchError):
    """``--slurm`` outside a Slurm allocation, or an allocation fedemu cannot read."""


def task_identity(env: dict | None = None) -> tuple[int, str]:
    """(SLURM_PROCID, node name) of the Slurm task this process runs in."""
    env = os.environ if env is None else env
    try:
        return int(env["SLURM_PROCID"]), env.get("SLURMD_NODENAME") or os.uname().nodename
    except (KeyError, ValueError):
        raise NotInAllocation("not a Slurm task (SLURM_PROCID is not set); fedemu starts this itself") from None


def launch_address(env: dict | None = None) -> str | None:
    """The address of the host whose srun started this task, as Slurm saw it."""
    env = os.environ if env is None else env
    return env.get("SLURM_LAUNCH_NODE_IPADDR")
