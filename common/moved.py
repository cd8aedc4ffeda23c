"""Old import paths that still work, for now, with a DeprecationWarning (issue 51 moved
what the server and the worker share into ``fedemu.common``). Each old module is the
new one itself, not a copy: a registry, a class or a monkeypatch seen through the old
name is the same object as through the new."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} has moved to {new}; import it from there (the old path will go in a later release)",
                  DeprecationWarning, stacklevel=4)


def alias(old: str, new: str) -> ModuleType:
    """Make the module being imported as ``old`` the module ``new``: its file calls this."""
    _warn(old, new)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def forward(old: str, *new: str):
    """A module ``__getattr__`` for an old module whose names went to several new ones:
    each name is looked up in ``new``, in order."""
    _warn(old, " and ".join(new))

    def __getattr__(name: str):
        for target in new:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {', '.join(new)})")
    return __getattr__


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        pass  # the new module ran when it was imported under its own name


class _PackageAlias(importlib.abc.MetaPathFinder):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self.old + "."):
            return None
        new = self.new + fullname[len(self.old):]
        if importlib.util.find_spec(new) is None:
            return None
        _warn(fullname, new)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def alias_package(old: str, new: str) -> ModuleType:
    """``alias`` for a package and every module under it (``old.x.y`` is ``new.x.y``)."""
    if not any(isinstance(f, _PackageAlias) and f.old == old for f in sys.meta_path):
        sys.meta_path.insert(0, _PackageAlias(old, new))
    return alias(old, new)
