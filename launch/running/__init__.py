"""Starting runs and seeing them through: ``fedemu launch`` on this machine, over SSH
(``--machines``) or in a Slurm allocation (``--slurm``), and each process of a run.

What lives here:

* ``launcher``: one run, whichever way it is placed (``launch``, ``open_run``);
* ``local``: the broker, server and worker node processes on this machine (``LocalRun``);
* ``machines``, ``hosts``, ``host_options``, ``agent``: worker nodes on other hosts over
  SSH, the preflight and the host agent that supervises them there;
* ``slurm``, ``slurm_task``: the same inside a Slurm allocation (srun tasks);
* ``nodes``: what one process of a run does (``fedemu broker``, ``fedemu node ROLE``);
* ``lifecycle``: signals, exit codes, parent death and the run directory's lock;
* ``rundir``: the run directory and the files the launcher writes into it;
* ``progress``: the live views of a run and of a sweep, read from the run's events. It is
  here, not in ``studies``, because a run's own launcher reads its events as it goes
  (``local`` follows them to report faults): ``studies`` may import ``running``, never
  the reverse.

Who may import it: ``fedemu.launch.cli``, ``fedemu.launch.api`` and ``studies`` (a sweep
point is a run), and users who script launches, through the names below. It imports
``fedemu.launch.config`` and the layers below, never ``studies``. The names load on first
use (PEP 562), so ``fedemu broker`` and ``fedemu node`` import only the modules they run
(most of these import torch through the worker).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module of this package that defines it
_EXPORTS = {
    "launch": "launcher", "open_run": "launcher",
    "LocalRun": "local",
    "Machines": "machines", "MachinesRun": "machines",
    "Host": "hosts", "HostError": "hosts", "parse_hostfile": "hosts", "parse_machines": "hosts",
    "machine_options": "host_options", "ssh_machine_options": "host_options",
    "Allocation": "slurm", "SlurmRun": "slurm", "NotInAllocation": "slurm_task",
    "preflight": "agent", "run_agent": "agent",
    "run_broker": "nodes", "run_server_node": "nodes", "run_worker_node": "nodes",
    "Interrupted": "lifecycle", "StopRequest": "lifecycle", "DirLock": "lifecycle",
    "DirectoryInUse": "lifecycle", "exit_code_for": "lifecycle",
    "LaunchError": "rundir", "make_run_dir": "rundir", "new_run_dir": "rundir", "write_run_config": "rundir",
    "RunProgress": "progress", "SweepProgress": "progress",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .agent import preflight, run_agent
    from .host_options import machine_options, ssh_machine_options
    from .hosts import Host, HostError, parse_hostfile, parse_machines
    from .launcher import launch, open_run
    from .lifecycle import DirectoryInUse, DirLock, Interrupted, StopRequest, exit_code_for
    from .local import LocalRun
    from .machines import Machines, MachinesRun
    from .nodes import run_broker, run_server_node, run_worker_node
    from .progress import RunProgress, SweepProgress
    from .rundir import LaunchError, make_run_dir, new_run_dir, write_run_config
    from .slurm import Allocation, SlurmRun
    from .slurm_task import NotInAllocation


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
