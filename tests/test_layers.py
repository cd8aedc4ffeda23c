"""The architecture as the imports draw it (docs/design.md): layers import downwards only
(launch -> server, worker -> common -> node), the server and the worker, two sides of one
conversation, never import each other, no two modules import each other even through a
chain or from inside a function, and the runtime (node/) needs no torch. Read from the
source with ast, so a test of the tree itself, not of what one run imported."""
from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each layer may import those of a lower rank; server and worker share one, so neither imports the other.
RANK = {"node": 0, "common": 1, "server": 2, "worker": 2, "launch": 3}
LAYERS = tuple(RANK)


def modules() -> dict[str, Path]:
    found = {}
    for layer in LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import statement, at any depth, but those under ``if TYPE_CHECKING:`` (which
    never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> fedemu modules it imports, module -> third-party top-level packages)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:  # from base import name: the submodule base.name, or a name defined in base
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}".removeprefix("fedemu.") in mods else base
                           for a in node.names]
            for target in targets:
                name = target.removeprefix("fedemu.")
                if name in mods and name != mod:
                    graph[mod].add(name)
                elif not target.startswith("fedemu") and name.split(".")[0] not in LAYERS:
                    external[mod].add(target.split(".")[0])
    return graph, external


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The checks themselves: a planted cycle and a planted upward import are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward({"node.x": {"worker.y"}, "worker.y": {"node.x"}}) == ["node.x -> worker.y"]
    assert upward({"server.x": {"worker.y", "common.z"}, "worker.y": {"common.z"}, "common.z": set()}) == [
        "server.x -> worker.y"]


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a higher layer, or of a sibling (server <-> worker)."""
    def layer(module: str) -> str:
        return module.split(".")[0]
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if RANK[layer(b)] > RANK[layer(a)] or (RANK[layer(b)] == RANK[layer(a)] and layer(b) != layer(a)))


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return import_graph()


def test_layers_import_downwards_only(graph):
    assert upward(graph[0]) == []


def test_no_module_imports_itself_through_others(graph):
    assert cycles(graph[0]) == []


def test_the_runtime_needs_no_torch(graph):
    """node/ (broker, network model, runtime) runs where torch is absent or slow to import."""
    assert {m: sorted(e) for m, e in graph[1].items() if m.startswith("node") and "torch" in e} == {}


# --- imports that say the structure ---------------------------------------------------------

# Every layer: an import inside a function says why it is there (start-up time, an optional
# dependency), and no module uses another's private names.
REASONED = ("node", "common", "server", "worker", "launch")


def _function_imports(tree: ast.Module) -> list[ast.stmt]:
    """Imports inside a function body, but those under ``if TYPE_CHECKING:``."""
    runtime = {id(n) for n in _runtime_imports(tree)}
    return [n for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) in runtime]


def unreasoned_imports(source: str, name: str) -> list[str]:
    """Function-level imports with no comment on their line or a comment line just above
    (the first of a run of imports carries it for the run, its groups split by blank lines too)."""
    lines = source.splitlines()
    found = []
    for node in sorted(_function_imports(ast.parse(source, name)), key=lambda n: n.lineno):
        i = node.lineno - 1
        while i > 0 and (lines[i - 1].strip().startswith(("import ", "from "))
                         or (not lines[i - 1].strip() and i > 1 and lines[i - 2].strip().startswith(("import ", "from ")))):
            i -= 1  # up to the first of the run
        if "#" not in lines[node.lineno - 1] and not (i > 0 and lines[i - 1].strip().startswith("#")):
            found.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(found))


def private_imports(source: str, name: str) -> list[str]:
    """``from fedemu... import _private`` and ``module._private`` of an imported fedemu module."""
    tree = ast.parse(source, name)
    found, modules = [], set()
    for node in _runtime_imports(tree) + [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]:
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fedemu")):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}:{node.lineno}: imports {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("fedemu"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{name}:{node.lineno}: uses {node.value.id}.{node.attr}")
    return sorted(set(found))


def test_the_import_checks_see_what_they_look_for():
    source = ("def f():\n    import torch\n\ndef g():\n    # torch: start-up time\n    import torch\n"
              "    import numpy\n\n    from . import models\n\ndef h():\n    import json  # stdlib\n"
              "\n    x = 1\n\n    import zmq\n")
    assert unreasoned_imports(source, "m.py") == ["m.py:16: import zmq", "m.py:2: import torch"]
    source = "from fedemu.x import _hidden, shown\nfrom . import models\nmodels._BUILDERS\nmodels.build\n"
    assert private_imports(source, "m.py") == ["m.py:1: imports _hidden", "m.py:3: uses models._BUILDERS"]


@pytest.mark.parametrize("layer", REASONED)
def test_every_import_inside_a_function_says_why(layer):
    found = [problem for path in sorted((ROOT / layer).rglob("*.py"))
             for problem in unreasoned_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("layer", REASONED)
def test_no_private_name_is_used_across_modules(layer):
    found = [problem for path in sorted((ROOT / layer).rglob("*.py"))
             for problem in private_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_an_algorithms_values_ride_in_its_payload_not_in_the_generic_messages():
    """FedProx's mu, FSVRG's full gradient, CO-OP's age filter and its over-active
    choice live in their algorithm's module; the messages and the client know none."""
    for path in ("common/messages.py", "worker/client.py", "worker/cohorts.py", "server/engine.py",
                 "server/async_engine.py", "common/ml/cohort.py", "common/ml/training.py"):
        source = (ROOT / path).read_text()
        for name in ("prox_mu", "full_gradient", "b_l", "b_u", "over_active", "uploads_delta="):
            assert name not in source, f"{path} names {name}"


# launch/ by job (issue 51): configuration at the bottom, then running runs, then studies of many.
LAUNCH_RANK = {"config": 0, "running": 1, "studies": 2}
# What stays at launch/'s top level besides the old paths' shims: the `fedemu` command and the API.
LAUNCH_TOP = {"launch", "launch.__main__", "launch.cli", "launch.api"}


def _shims() -> set[str]:
    """Old import paths kept for now (common/moved.py): each module is one moved.alias call."""
    return {m for m, path in modules().items() if "moved.alias(__name__" in path.read_text()}


def test_launch_has_a_sub_package_per_job():
    for job in LAUNCH_RANK:
        init = ROOT / "launch" / job / "__init__.py"
        assert init.exists(), f"launch/{job}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"launch/{job}/__init__.py says nothing of what lives there"
    top = {m for m in modules() if m.startswith("launch") and m.count(".") <= 1} - {f"launch.{j}" for j in LAUNCH_RANK}
    assert top - _shims() == LAUNCH_TOP


def test_nothing_outside_launch_imports_it(graph):
    """The layers below take typed settings; none reaches back into the launcher."""
    assert sorted(f"{a} -> {b}" for a, targets in graph[0].items() for b in targets
                  if not a.startswith("launch") and b.startswith("launch")) == []


def test_launch_jobs_import_downwards_only(graph):
    """config imports nothing of running or studies; running nothing of studies."""
    def job(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == "launch" and len(parts) > 1 and parts[1] in LAUNCH_RANK else None
    assert sorted(f"{a} -> {b}" for a, targets in graph[0].items() for b in targets
                  if job(a) and job(b) and LAUNCH_RANK[job(b)] > LAUNCH_RANK[job(a)]) == []


def test_no_module_imports_an_old_path(graph):
    """The old paths are for users' code: fedemu's own, its tests and benchmarks import the new ones."""
    shims = _shims()
    assert shims, "no shim found: the check would see nothing"
    used = sorted(f"{a} -> {b}" for a, targets in graph[0].items() for b in targets if b in shims)
    for folder in ("tests", "bench", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "test_moved_paths.py":
                continue
            for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names])
                used += [f"{path.relative_to(ROOT)} -> {n}" for n in names if n.removeprefix("fedemu.") in shims]
    assert used == []


def test_a_node_process_reads_its_settings_without_the_config_code(graph):
    """The launcher writes each node process's settings (config/settings.py); the nodes
    read them back without importing the config's loading and validation."""
    seen, todo = set(), ["launch.running.nodes"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(t for t in graph[0][module] if t.startswith("launch"))
    assert "launch.config.settings" in seen
    assert sorted(m for m in seen if m.startswith("launch.config.") and m not in ("launch.config.settings",
                                                                                "launch.config.schema")) == []


def test_no_module_reaches_for_another_modules_private_names():
    """``module._name`` of a fedemu module imported under a name: what a split can break
    unseen (the import itself still works)."""
    mods = modules()
    found = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        aliases = {}
        for node in _runtime_imports(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}".removeprefix("fedemu.") in mods:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
            else:
                for a in node.names:
                    if a.asname and a.name.removeprefix("fedemu.") in mods:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{mod}: {node.value.id}.{node.attr}")
    assert found == []


@pytest.mark.parametrize("clock", ["wall", "virtual"])
def test_each_broker_collaborator_is_given_what_it_declares_and_the_broker_has_it(clock):
    """The broker's collaborators name what they use of it in a Protocol (no import of
    the Broker); a real broker must offer every member of each, with either timebase."""
    from fedemu.node.broker import control_ops, membership, network_changes, routing, timebase
    from fedemu.node.broker.broker import Broker

    protocols = [membership.MembershipHost, routing.RouterHost, timebase.TimebaseHost,
                 network_changes.NetworkChangesHost, control_ops.ControlHost]
    for module in (control_ops, membership, network_changes, routing, timebase):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for alias in node.names}
        assert "Broker" not in imported, f"{module.__name__} imports the Broker"
    broker = Broker("tcp://127.0.0.1:0", clock=clock)
    serving = threading.Thread(target=broker.serve_forever, daemon=True)
    serving.start()  # serving, so that stop() closes its sockets
    try:
        for protocol in protocols:
            members = set(protocol.__annotations__) | {n for n, v in vars(protocol).items()
                                                      if callable(v) and not n.startswith("_")}
            assert members, protocol
            assert [m for m in sorted(members) if not hasattr(broker, m)] == [], protocol.__name__
    finally:
        broker.stop()
        serving.join(timeout=30)


def test_every_package_in_the_tree_is_one_pyproject_installs():
    """An explicit package list misses a new sub-package silently: an editable install
    still finds it, a wheel does not (node/net/tcp/ was missing until this test)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    folders = project["tool"]["setuptools"]["package-dir"]
    in_tree = set()
    for package, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            in_tree.add(".".join([package, *relative.parts]))
    assert sorted(in_tree - listed) == []
    assert sorted(listed - in_tree) == []
