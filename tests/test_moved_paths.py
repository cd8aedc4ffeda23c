"""Import paths users may have used before issue 51 moved the shared code into
fedemu.common: each still imports, warns that it moved, and gives the very objects of
the new path (so a registry or a monkeypatch seen through either name is one). The same
for the modules of fedemu.launch that moved into its config, running and studies packages."""
from __future__ import annotations

import subprocess
import sys

import pytest

# old path -> (a name it had, the module that defines it now)
MOVED = {
    "fedemu.server.algorithm": ("get", "fedemu.common.algorithms.base"),
    "fedemu.server.strategies": ("FedAvg", "fedemu.common.algorithms.fedavg"),
    "fedemu.server.async_rules": ("Coop", "fedemu.common.algorithms.coop"),
    "fedemu.server.fedprox": ("FedProx", "fedemu.common.algorithms.fedprox"),
    "fedemu.server.fedopt": ("FedAdam", "fedemu.common.algorithms.fedopt"),
    "fedemu.worker.protocol": ("TrainRequest", "fedemu.common.messages"),
    "fedemu.worker.tasks": ("LocalTask", "fedemu.common.algorithms.tasks"),
    "fedemu.worker.stragglers": ("StragglerSpec", "fedemu.common.stragglers"),
    "fedemu.worker.ml": ("__path__", "fedemu.common.ml"),  # the package itself
    "fedemu.worker.ml.models": ("build", "fedemu.common.ml.models"),
    "fedemu.worker.ml.datasets": ("register", "fedemu.common.ml.datasets"),
    "fedemu.worker.ml.datasets.mnist": ("Mnist", "fedemu.common.ml.datasets.mnist"),
    # issue 51, launch/ by job: fedemu.launch.config kept its path (now a package)
    "fedemu.launch.launcher": ("open_run", "fedemu.launch.running.launcher"),
    "fedemu.launch.local": ("LocalRun", "fedemu.launch.running.local"),
    "fedemu.launch.machines": ("Machines", "fedemu.launch.running.machines"),
    "fedemu.launch.slurm": ("Allocation", "fedemu.launch.running.slurm"),
    "fedemu.launch.slurm_task": ("NotInAllocation", "fedemu.launch.running.slurm_task"),
    "fedemu.launch.agent": ("preflight", "fedemu.launch.running.agent"),
    "fedemu.launch.hosts": ("Host", "fedemu.launch.running.hosts"),
    "fedemu.launch.host_options": ("machine_options", "fedemu.launch.running.host_options"),
    "fedemu.launch.nodes": ("run_server_node", "fedemu.launch.running.nodes"),
    "fedemu.launch.lifecycle": ("DirLock", "fedemu.launch.running.lifecycle"),
    "fedemu.launch.rundir": ("LaunchError", "fedemu.launch.running.rundir"),
    "fedemu.launch.progress": ("RunProgress", "fedemu.launch.running.progress"),
    "fedemu.launch.sweep": ("run_sweep", "fedemu.launch.studies.sweep"),
    "fedemu.launch.sweep_index": ("Index", "fedemu.launch.studies.sweep_index"),
    "fedemu.launch.sweep_layout": ("plan", "fedemu.launch.studies.sweep_layout"),
    "fedemu.launch.sweep_point": ("run_point", "fedemu.launch.studies.sweep_point"),
    "fedemu.launch.sweep_slurm": ("run_task", "fedemu.launch.studies.sweep_slurm"),
    "fedemu.launch.sweep_spec": ("load_spec", "fedemu.launch.studies.sweep_spec"),
    "fedemu.launch.report": ("report", "fedemu.launch.studies.report"),
    "fedemu.launch.report_figures": ("plot_runs", "fedemu.launch.studies.report_figures"),
    "fedemu.launch.report_groups": ("Cell", "fedemu.launch.studies.report_groups"),
    "fedemu.launch.report_tables": ("markdown_table", "fedemu.launch.studies.report_tables"),
    "fedemu.launch.report_timeline": ("chrome_trace", "fedemu.launch.studies.report_timeline"),
    "fedemu.launch.compare": ("CompareError", "fedemu.launch.studies.compare"),
    "fedemu.launch.results": ("RunRecord", "fedemu.launch.studies.results"),
    "fedemu.launch.labels": ("point_id", "fedemu.launch.studies.labels"),
    "fedemu.launch.traces_cli": ("traces", "fedemu.launch.studies.traces_cli"),
    "fedemu.launch.study_cli": ("sweep", "fedemu.launch.studies.study_cli"),
}

# Names whose module stayed but which moved to a sibling when it was split: (module, name) -> new module
MOVED_NAMES = {
    ("fedemu.node.net.links", "NetworkSpec"): "fedemu.node.net.network_spec",
    ("fedemu.node.net.links", "PRESETS"): "fedemu.node.net.network_spec",
    ("fedemu.node.net.links", "parse_ids"): "fedemu.node.net.availability",
    ("fedemu.node.net.links", "LinkConfigError"): "fedemu.node.net.profiles",
    ("fedemu.node.net.links", "parse_bandwidth"): "fedemu.node.net.profiles",
    ("fedemu.server.engine", "RoundEngine"): "fedemu.server.round_engine",
    ("fedemu.worker.client", "host_clients"): "fedemu.worker.hosting",
    ("fedemu.worker.client", "placement"): "fedemu.worker.placement",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_with_a_warning_and_gives_the_new_objects(old):
    """In a fresh interpreter, so the warning is the first import's."""
    name, new = MOVED[old]
    script = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"    value = getattr(old, {name!r})\n"
        f"new = importlib.import_module({new!r})\n"
        f"assert value is getattr(new, {name!r}), 'not the same object'\n"
        "moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
        f"assert any({old!r} in m and 'moved' in m for m in moved), moved\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("old, name", sorted(MOVED_NAMES))
def test_a_name_moved_out_of_a_split_module_imports_with_a_warning(old, name):
    new = MOVED_NAMES[old, name]
    script = (
        "import importlib, warnings\n"
        f"old = importlib.import_module({old!r})\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    value = getattr(old, {name!r})\n"
        f"assert value is getattr(importlib.import_module({new!r}), {name!r}), 'not the same object'\n"
        "moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]\n"
        f"assert any({new!r} in m and 'moved' in m for m in moved), moved\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_config_may_still_name_an_algorithm_by_its_old_path(monkeypatch):
    from fedemu.common import algorithms
    from fedemu.common.algorithms.fedavg import FedAvg

    monkeypatch.delitem(sys.modules, "fedemu.server.strategies", raising=False)  # warned at its first import
    with pytest.warns(DeprecationWarning, match="fedemu.server.strategies"):
        assert algorithms.get("fedemu.server.strategies:FedAvg") is FedAvg


# Every public name of fedemu.launch.config before it became a package (issue 51).
CONFIG_NAMES = ("ConfigError", "SCHEMA", "NESTED_SECTIONS", "MAX_SECONDS", "DEFAULT_CONFIG_FILE", "POPULATION_FILE",
                "NODE_EXIT_WAIT_S", "is_device_setting", "default", "load", "absolute_trace_paths", "apply_override",
                "validate", "data_spec", "model_spec", "ineffective_keys", "findings", "network_parts",
                "straggler_spec", "population_record", "compute_model", "compression_spec", "server_settings",
                "broker_network_file", "to_toml")


def test_the_config_package_keeps_the_config_modules_names_without_a_warning():
    script = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "from fedemu.launch import config\n"
        f"missing = [n for n in {CONFIG_NAMES!r} if not hasattr(config, n)]\n"
        "assert not missing, missing\n"
        "assert config.load(None)['run']['rounds'] > 0\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
