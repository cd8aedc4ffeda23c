"""Algorithms: what each one declares, and the registry that finds one by its name.

An algorithm is one module with both halves: the server's rule and what its clients do.
A round-based one subclasses ``rounds.Strategy`` (the round engine calls its
``run_round`` once a round) and names the local tasks its clients run
(``tasks.LocalTask``); an asynchronous one subclasses ``asynchronous.AsyncRule`` (the
asynchronous engine calls its ``merge`` for each upload). Beside its rule, the class declares:

- ``name``, what ``algorithm.name`` says, and ``label``, what reports print;
- ``options``: the ``algorithm.*`` keys it owns, each a ``Key`` with its default, type
  and range (the keys every algorithm shares, such as lr, E and B, are in
  ``fedemu.launch`` configuration);
- ``from_config``: the instance for a validated ``[algorithm]`` section;
- ``findings``: configurations of it that can deadlock or never aggregate (``fedemu
  check``; a blocking finding refuses the run);
- ``check_config``: rules across sections (the centralised baseline needs one client);
- ``uploads``: what a client uploads when it is not a model: ``[compression]`` encodes
  models and their deltas only.

``@register`` files a class under its name; the built-in algorithms use it as a user's
would. ``get(name)`` returns a built-in, an installed plug-in (the ``fedemu.algorithms``
entry-point group) or, for a name with a colon, ``package.module:Class``, imported on the
spot: in the launcher when the config is validated and in the server node that runs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fedemu.node import plugins
from fedemu.node.schema import Key

ENTRY_POINT_GROUP = "fedemu.algorithms"
# Imported on first lookup: each registers its algorithms.
BUILT_IN_MODULES = tuple(f"fedemu.common.algorithms.{module}" for module in (
    "fedavg", "fedsgd", "fsvrg", "centralised", "coop", "fedasync", "fedbuff", "fedprox", "fedopt"))


@dataclass(frozen=True)
class Finding:
    """A static check's verdict on a configuration: it names the rule and the numbers."""

    rule: str
    message: str
    blocking: bool  # refuse the run (unless the user accepted this risk, where allowed)
    waivable_by: str | None = None  # the config key that accepts the risk


class Algorithm:
    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    title: ClassVar[str] = ""  # a longer name for messages; '' : the label
    synchronous: ClassVar[bool] = True
    options: ClassVar[dict[str, Key]] = {}
    uploads: ClassVar[str] = ""  # '' : a model or its delta; otherwise what is uploaded instead

    @classmethod
    def from_config(cls, algorithm: dict[str, Any]) -> Algorithm:
        raise NotImplementedError

    @classmethod
    def findings(cls, algorithm: dict[str, Any], clients: int) -> list[Finding]:
        return []

    @classmethod
    def check_config(cls, config: dict[str, dict[str, Any]]) -> str | None:
        """An error message if this algorithm cannot run with the rest of the config."""
        return None


class UnknownAlgorithm(plugins.PluginNotFound):
    pass


_registry = plugins.Registry("algorithm", ENTRY_POINT_GROUP, BUILT_IN_MODULES, Algorithm, "Strategy or AsyncRule")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: file ``cls`` under ``cls.name``. Another class under the same
    name, or an option another algorithm declares differently, is refused: one key has
    one meaning whichever algorithm a sweep runs."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    for key, spec in cls.options.items():
        for other in _registry.classes.values():
            if key in other.options and other.options[key] != spec and other is not cls:
                raise ValueError(f"{cls.__qualname__} declares algorithm.{key} unlike {other.__qualname__} does; "
                                 f"give the option its own name")
    _registry.file(cls, cls.name)
    return cls


def built_in() -> dict[str, type[Algorithm]]:
    """Every algorithm fedemu ships, by name, in BUILT_IN_MODULES' order."""
    return _registry.built_in()


def installed() -> list[str]:
    """The algorithms installed packages bring (the fedemu.algorithms entry points)."""
    return _registry.installed()


def get(name: str) -> type[Algorithm]:
    try:
        return _registry.find(name, register)
    except plugins.PluginNotFound as exc:
        raise UnknownAlgorithm(str(exc)) from None


def reference(cls: type[Algorithm]) -> str:
    """What names ``cls`` on another host (``get`` finds it there): a built-in's name, a
    plug-in's ``module:Class``."""
    if _registry.classes.get(cls.name) is cls and cls.__module__ in BUILT_IN_MODULES:
        return cls.name
    return f"{cls.__module__}:{cls.__qualname__}"


def all_options(extra: type[Algorithm] | None = None) -> dict[str, Key]:
    """The algorithm.* keys of every built-in algorithm (and ``extra``'s): a config may
    set any of them, so a sweep over algorithm.name can carry each one's options."""
    keys: dict[str, Key] = {}
    for cls in [*built_in().values(), *([extra] if extra else [])]:
        keys.update(cls.options)
    return keys


AGGREGATIONS = ("server", "nodes")


def aggregation_problem(aggregation: str, strategy, compression) -> str | None:
    """Why ``run.aggregation`` cannot be used with this rule, or None."""
    if aggregation not in AGGREGATIONS:
        return f"run.aggregation = {aggregation!r}; use {' or '.join(map(repr, AGGREGATIONS))}"
    if aggregation == "server":
        return None
    if not getattr(strategy, "synchronous", False):
        return (f"run.aggregation = 'nodes' sums each round's updates on the worker nodes; {strategy.name} is "
                f"asynchronous (it merges each upload as it comes): use 'server'")
    if strategy.keeps_updates:
        return (f"run.aggregation = 'nodes' gives the server only each phase's mean; {strategy.name} uses "
                f"every update: use 'server'")
    if compression:
        return ("run.aggregation = 'nodes' does not combine with compression (the server decodes each "
                "encoded update): use 'server'")
    return None
