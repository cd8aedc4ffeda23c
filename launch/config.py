"""Run configuration: TOML, with the papers' symbol names (C, E, B, lr, b_l, b_u, ...).

One schema (:data:`SCHEMA`) says every section, key, type, allowed values and default;
loading, ``--set`` overrides and validation all read it, so an error can always name
the key and what it accepts, before anything starts.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from fedemu.server.strategies import selected_per_round


class ConfigError(ValueError):
    """A config key or value that is not allowed; the message names it."""


@dataclass(frozen=True)
class Key:
    type: type | tuple[type, ...]
    doc: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""  # says what `check` requires, for the error message


def _positive(x: Any) -> bool:
    return x > 0


def _non_negative(x: Any) -> bool:
    return x >= 0


def _fraction(x: Any) -> bool:
    return 0 < x <= 1


def _unit_interval(x: Any) -> bool:
    return 0 <= x <= 1


SCHEMA: dict[str, dict[str, Key]] = {
    "run": {
        "seed": Key(int, "seed of every random choice in the run"),
        "rounds": Key(int, "round limit", check=_positive, rule="> 0"),
        "target_accuracy": Key(float, "stop once test accuracy reaches this (0: never)", check=_unit_interval, rule="in [0, 1]"),
        "eval_every": Key(int, "evaluate the global model every this many rounds", check=_positive, rule="> 0"),
        "out": Key(str, "folder under which run directories are made"),
        "workers": Key(int, "worker nodes (OS processes) to start; 0 = number of cores", check=_non_negative, rule=">= 0"),
        "torch_threads": Key(int, "torch threads per worker node; 0 = cores / workers", check=_non_negative, rule=">= 0"),
        "heartbeat_interval_s": Key(float, "node heartbeat period", check=_positive, rule="> 0"),
        "heartbeat_timeout_s": Key(float, "silence after which a node is declared lost", check=_positive, rule="> 0"),
        "startup_timeout_s": Key(float, "how long the server waits for every worker node", check=_positive, rule="> 0"),
    },
    "data": {
        "dataset": Key(str, "data set", choices=("mnist", "fashion-mnist")),
        "partition": Key(str, "how the training set is split over clients", choices=("iid", "shards")),
        "clients": Key(int, "number of clients K", check=_positive, rule="> 0"),
        "shards_per_client": Key(int, "shards per client for partition = 'shards'", check=_positive, rule="> 0"),
        "cache_dir": Key(str, "data cache folder ('' = $FEDEMU_DATA_DIR or ~/.cache/fedemu)"),
    },
    "model": {
        "name": Key(str, "model", choices=("2nn", "cnn")),
    },
    "algorithm": {
        "name": Key(str, "federated algorithm", choices=("fedavg", "fedsgd")),
        "C": Key(float, "fraction of clients selected per round", check=_fraction, rule="in (0, 1]"),
        "E": Key(int, "local epochs", check=_positive, rule="> 0"),
        "B": Key(int, "local minibatch size; 0 = the full local set (B = infinity)", check=_non_negative, rule=">= 0"),
        "lr": Key(float, "learning rate eta", check=_positive, rule="> 0"),
        "lr_decay": Key(float, "Keras-style decay lambda: lr / (1 + lambda * round)", check=_non_negative, rule=">= 0"),
        "deadline_s": Key(float, "seconds a round waits for updates", check=_positive, rule="> 0"),
        "quorum": Key(int, "minimum updates to aggregate a round", check=_positive, rule="> 0"),
    },
}

DEFAULT_CONFIG_FILE = "default.toml"


def default() -> dict[str, dict[str, Any]]:
    """The embedded default run: MNIST, 2NN, IID, K=100, C=0.1, E=1, B=10 (FedAvg)."""
    text = resources.files("fedemu.launch").joinpath(DEFAULT_CONFIG_FILE).read_text()
    return tomllib.loads(text)


def load(path: str | Path | None, overrides: list[str] = ()) -> dict[str, dict[str, Any]]:
    """The resolved config: defaults, then the file, then ``--set`` overrides; validated."""
    config = default()
    if path is not None:
        path = Path(path)
        try:
            user = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        _merge(config, user, source=str(path))
    for item in overrides:
        apply_override(config, item)
    validate(config)
    return config


def _merge(config: dict, user: dict, source: str) -> None:
    for section, values in user.items():
        if section not in SCHEMA:
            raise ConfigError(f"{source}: unknown section [{section}]; sections are {', '.join(SCHEMA)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        for key, value in values.items():
            _key(section, key)
            config[section][key] = value


def apply_override(config: dict, item: str) -> None:
    """Apply ``section.key=value``; the value is read as TOML (``0.2``, ``"cnn"``,
    ``true``), falling back to a bare string so ``--set model.name=cnn`` works."""
    target, sep, raw = item.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    _key(section, key)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    config[section][key] = value


def _key(section: str, key: str) -> Key:
    if section not in SCHEMA:
        raise ConfigError(f"unknown section {section!r}; sections are {', '.join(SCHEMA)}")
    spec = SCHEMA[section].get(key)
    if spec is None:
        raise ConfigError(f"unknown key {section}.{key}; [{section}] has {', '.join(SCHEMA[section])}")
    return spec


def validate(config: dict) -> None:
    for section, keys in SCHEMA.items():
        values = config.get(section, {})
        for key, spec in keys.items():
            if key not in values:
                raise ConfigError(f"{section}.{key} is missing")
            value = values[key]
            name = f"{section}.{key}"
            if spec.type is float and isinstance(value, int) and not isinstance(value, bool):
                value = values[key] = float(value)
            if isinstance(value, bool) or not isinstance(value, spec.type):
                raise ConfigError(f"{name} = {value!r} must be {_type_name(spec.type)}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name} = {value!r} must be finite")
            if spec.choices is not None and value not in spec.choices:
                raise ConfigError(f"{name} = {value!r} is not allowed; choose one of {', '.join(map(repr, spec.choices))}")
            if spec.check is not None and not spec.check(value):
                raise ConfigError(f"{name} = {value!r} is out of range; it must be {spec.rule}")
    algo, data = config["algorithm"], config["data"]
    m = selected_per_round(algo["C"], data["clients"])
    if algo["quorum"] > m:
        raise ConfigError(
            f"algorithm.quorum = {algo['quorum']} exceeds the m = max(C*K, 1) = {m} clients "
            f"selected per round (C = {algo['C']}, K = {data['clients']}): no round could aggregate"
        )


def _type_name(t: type | tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if isinstance(t, tuple):
        return " or ".join(names.get(x, x.__name__) for x in t)
    return names.get(t, t.__name__)


def to_toml(config: dict[str, dict[str, Any]]) -> str:
    """Write the resolved config back (flat sections of scalars, as SCHEMA allows)."""
    lines: list[str] = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")

