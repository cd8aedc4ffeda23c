"""Run configuration: TOML, with the papers' symbol names (C, E, B, lr, b_l, b_u, ...).

One schema (:data:`SCHEMA`) says every section, key, type and allowed values (their
defaults are in ``default.toml``); the ``[algorithm]`` section also takes the options each
algorithm declares (``common/algorithms/base.py``: its keys, with their defaults). Loading,
``--set`` overrides and validation all read them, so an error can always name the key
and what it accepts, before anything starts.

What lives here, bottom up (each module imports only those above it):

* ``schema``: the keys (:data:`SCHEMA`), :class:`ConfigError` (and :class:`ConfigErrors`, every
  problem of a config at once), the algorithms' own keys;
* ``settings``: the resolved config turned into each process's typed specs (data, model,
  links, stragglers, compute, compression, the server's Settings, the broker's network),
  and each node process's settings, written once into the run directory (settings.json)
  and read back there by the node without the loading and validation code;
* ``validation``: one key at a time, then across sections;
* ``loading``: the defaults, a TOML file and ``--set`` merged, and written back as TOML;
* ``default.toml``: the embedded default run.

Configuration is the bottom of ``fedemu.launch``: it imports nothing of ``running`` or
``studies``, and any module of ``fedemu.launch`` may import it, through this surface (the
names below, as ``fedemu.launch.config`` has always had them). The layers below
(node, common, server, worker) never import it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module of this package that defines it. They load on first use (PEP 562):
# a node process reads its settings (settings.read_process_settings) without importing
# the loading and validation code.
_EXPORTS = {
    **dict.fromkeys(("ConfigError", "ConfigErrors", "SCHEMA", "NESTED_SECTIONS", "MAX_SECONDS", "is_device_setting",
                     "ineffective_keys"), "schema"),
    **dict.fromkeys(("DEFAULT_CONFIG_FILE", "default", "load", "apply_override", "absolute_trace_paths",
                     "to_toml", "toml_value"), "loading"),
    **dict.fromkeys(("validate", "findings"), "validation"),
    **dict.fromkeys(("data_spec", "model_spec", "network_parts", "straggler_spec", "compute_model",
                     "compression_spec", "server_settings", "broker_network_file", "population_record",
                     "POPULATION_FILE", "NODE_EXIT_WAIT_S", "PROCESS_SETTINGS_FILE", "process_settings",
                     "process_settings_json", "read_process_settings"), "settings"),
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .loading import (DEFAULT_CONFIG_FILE, absolute_trace_paths, apply_override, default, load, to_toml,
                          toml_value)
    from .schema import (MAX_SECONDS, NESTED_SECTIONS, SCHEMA, ConfigError, ConfigErrors, ineffective_keys,
                         is_device_setting)
    from .settings import (NODE_EXIT_WAIT_S, POPULATION_FILE, PROCESS_SETTINGS_FILE, broker_network_file,
                           compression_spec, compute_model, data_spec, model_spec, network_parts,
                           population_record, process_settings, process_settings_json, read_process_settings,
                           server_settings, straggler_spec)
    from .validation import findings, validate


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
