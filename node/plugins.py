"""Finding what a config names from outside fedemu: ``package.module:attr``, imported on
the spot, or the name of an installed package's entry point in ``group``. Algorithms
(``common/algorithms/base.py``), models (``common/ml/models.py``) and data sets
(``common/ml/datasets``) are found this way; each error names the thing, the name and
what to do. :class:`Registry` files classes by name, the built-ins and the plug-ins alike."""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any, Callable

from .schema import did_you_mean


class PluginNotFound(ValueError):
    pass


def load(name: str, what: str, group: str, form: str, built_in: list[str]) -> Any:
    """The object ``name`` names: ``what`` is "algorithm", "model", ..., ``form`` how a
    plug-in is written ("Class", "function"), ``built_in`` the names fedemu has (for the
    error when nothing answers)."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginNotFound(f"{what} {name!r}: cannot import {module_name!r} ({exc}); is the package "
                                 f"installed, or on PYTHONPATH, on this host?") from None
        try:
            return getattr(module, attr)
        except AttributeError:
            raise PluginNotFound(f"{what} {name!r}: module {module_name!r} has no {attr!r}") from None
    found = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
    if not found:
        others = installed(group)
        raise PluginNotFound(f"unknown {what} {name!r}{did_you_mean(name, [*built_in, *others])}: "
                             f"fedemu has {', '.join(built_in)}"
                             + (f"; installed plug-ins: {', '.join(others)}" if others else "")
                             + f"; a plug-in is named 'package.module:{form}' or installed under the {group!r} "
                             "entry points")
    try:
        return found[0].load()
    except Exception as exc:
        raise PluginNotFound(f"{what} {name!r} (entry point {found[0].value!r}) failed to load: "
                             f"{type(exc).__name__}: {exc}") from None


def installed(group: str) -> list[str]:
    """The names installed packages give under the entry-point ``group``."""
    return sorted({ep.name for ep in metadata.entry_points(group=group)})


class Registry:
    """Classes filed under their names: the built-ins, whose modules are imported on first
    use and file themselves, and the plug-ins a config names, found by :func:`load`."""

    def __init__(self, what: str, group: str, built_in_modules: tuple[str, ...], base: type, base_name: str):
        self.what, self.group, self.built_in_modules = what, group, built_in_modules
        self.base, self.base_name = base, base_name
        self.classes: dict[str, type] = {}
        self._built_ins_loaded = False

    def file(self, cls: type, name: str) -> None:
        """File ``cls`` under ``name``; another class already under it is refused (ValueError)."""
        known = self.classes.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"{self.what} {name!r} is registered already, by {known.__module__}.{known.__qualname__}")
        self.classes[name] = cls

    def _load_built_ins(self) -> None:
        if not self._built_ins_loaded:
            self._built_ins_loaded = True
            for module in self.built_in_modules:
                importlib.import_module(module)

    def built_in(self) -> dict[str, type]:
        """Every class fedemu ships, by name: module by module in ``built_in_modules``'
        order, each module's in the order it files them (whatever imported what first)."""
        self._load_built_ins()
        ours = [(name, cls) for name, cls in self.classes.items()
                if cls.__module__ in self.built_in_modules and cls.name == name]
        return dict(sorted(ours, key=lambda item: self.built_in_modules.index(item[1].__module__)))

    def installed(self) -> list[str]:
        """The plug-ins installed under this registry's entry points, by name."""
        return installed(self.group)

    def find(self, name: str, register: Callable[[type], Any]) -> type:
        """The class ``name`` names, a built-in or a plug-in; a plug-in found the first time
        goes through ``register`` (its checks) and is filed under ``name`` too.
        PluginNotFound says why not."""
        self._load_built_ins()
        if name in self.classes:
            return self.classes[name]
        cls = load(name, self.what, self.group, "Class", list(self.built_in()))
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise PluginNotFound(f"{self.what} {name!r} is {cls!r}, not a subclass of fedemu's {self.base_name}")
        try:
            register(cls)
        except ValueError as exc:
            raise PluginNotFound(str(exc)) from None
        self.classes[name] = cls  # also under the name the config used
        return cls
