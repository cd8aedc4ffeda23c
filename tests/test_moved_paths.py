"""Import paths users may have used before issue 51 moved the shared code into
fedemu.common: each still imports, warns that it moved, and gives the very objects of
the new path (so a registry or a monkeypatch seen through either name is one)."""
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


def test_a_config_may_still_name_an_algorithm_by_its_old_path(monkeypatch):
    from fedemu.common import algorithms
    from fedemu.common.algorithms.fedavg import FedAvg

    monkeypatch.delitem(sys.modules, "fedemu.server.strategies", raising=False)  # warned at its first import
    with pytest.warns(DeprecationWarning, match="fedemu.server.strategies"):
        assert algorithms.get("fedemu.server.strategies:FedAvg") is FedAvg
