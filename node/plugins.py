"""Finding what a config names from outside fedemu: ``package.module:attr``, imported on
the spot, or the name of an installed package's entry point in ``group``. Algorithms
(``server/algorithm.py``) and models (``worker/ml/models.py``) are found this way; each
error names the thing, the name and what to do."""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any


class PluginNotFound(ValueError):
    pass


def load(name: str, what: str, group: str, form: str, built_in: list[str]) -> Any:
    """The object ``name`` names: ``what`` is "algorithm" or "model", ``form`` how a
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
        raise PluginNotFound(f"unknown {what} {name!r}: fedemu has {', '.join(built_in)}; a plug-in is named "
                             f"'package.module:{form}' or installed under the {group!r} entry points")
    try:
        return found[0].load()
    except Exception as exc:
        raise PluginNotFound(f"{what} {name!r} (entry point {found[0].value!r}) failed to load: "
                             f"{type(exc).__name__}: {exc}") from None
