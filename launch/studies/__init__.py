"""Studies: many runs and what they show. Sweeps (``fedemu sweep``: a grid of runs, here,
over SSH or as a Slurm job array), reports (``fedemu report``: tables and figures of a
run or a sweep), comparisons (``fedemu compare``: the Bayesian correlated t-test),
exports (``fedemu export``: CSV, Chrome traces) and trace-file tools (``fedemu traces``).

What lives here:

* ``sweep_spec``, ``sweep``, ``sweep_layout``, ``sweep_point``, ``sweep_index``,
  ``sweep_slurm``: a sweep's spec, its points run in parallel, their placement, one
  point's run, the sweep's SQLite index, and the Slurm job array;
* ``results``: a finished run or sweep read back (``RunRecord``, ``SweepData``);
* ``report``, ``report_figures``, ``report_tables``, ``report_groups``,
  ``report_timeline``, ``labels``: the report's figures, tables and Gantt chart;
* ``compare``: paired comparisons of algorithms;
* ``study_cli``, ``traces_cli``: the click commands (``fedemu.launch.cli`` adds them).

Who may import it: ``fedemu.launch.cli`` and ``fedemu.launch.api``, and users who script
studies, through the names below. It imports ``fedemu.launch.config`` and
``fedemu.launch.running`` (a sweep point is a run), never the reverse. The names load on
first use (PEP 562): reading results does not import a sweep's machinery, nor matplotlib.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module of this package that defines it
_EXPORTS = {
    "SweepError": "sweep_spec", "Spec": "sweep_spec", "Point": "sweep_spec", "load_spec": "sweep_spec",
    "expand": "sweep_spec",
    "run_sweep": "sweep",
    "ReportError": "results", "RunRecord": "results", "SweepData": "results", "load_run": "results",
    "load_sweep": "results", "evaluation_records": "results", "write_csv": "results",
    "time_to_target": "results",
    "CompareError": "compare",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .compare import CompareError
    from .results import (ReportError, RunRecord, SweepData, evaluation_records, load_run, load_sweep,
                          time_to_target, write_csv)
    from .sweep import run_sweep
    from .sweep_spec import Point, Spec, SweepError, expand, load_spec


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
