"""The config as TOML: the embedded defaults (``default.toml``), a file merged over them,
``--set`` overrides, and the resolved config written back as TOML."""
from __future__ import annotations

import copy
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from fedemu.node.schema import did_you_mean

from .schema import NESTED_SECTIONS, SCHEMA, ConfigError, Problems, algorithm_options, key_spec, section_names
from .validation import validate


DEFAULT_CONFIG_FILE = "default.toml"


def default() -> dict[str, dict[str, Any]]:
    """The embedded default run: MNIST, 2NN, IID, K=100, C=0.1, E=1, B=10 (FedAvg), with
    every built-in algorithm's options at their defaults."""
    text = resources.files("fedemu.launch.config").joinpath(DEFAULT_CONFIG_FILE).read_text()
    config = tomllib.loads(text)
    config["algorithm"].update({key: spec.default for key, spec in algorithm_options(config).items()})
    return config


def load(path: str | Path | None, overrides: list[str] = (), values: dict | None = None) -> dict[str, dict[str, Any]]:
    """The resolved config: defaults, then the file, then ``values`` (sections as in a
    file: ``{"algorithm": {"name": "fedprox"}}``), then ``--set`` overrides; validated.
    ConfigErrors names every problem found (an unknown key is left at its default and the
    rest checked); a file that is missing or not TOML stops at once."""
    config = default()
    problems = Problems()
    if path is not None:
        path = Path(path)
        try:
            user = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        _merge(config, user, str(path), problems)
    if values is not None:
        _merge(config, copy.deepcopy(values), "the config given", problems)
    for item in overrides:
        with problems.collecting():
            apply_override(config, item)
    absolute_trace_paths(config)
    validate(config, problems)
    return config


def absolute_trace_paths(config: dict) -> None:
    """Trace files named relative to the current directory, made absolute: the run's
    processes, its config.toml and a sweep's points then all name the same files."""
    traces = config.get("network", {}).get("traces")
    if not isinstance(traces, dict):
        return  # validation names the problem
    for entry in traces.values():
        files = entry.get("file") if isinstance(entry, dict) else None
        if isinstance(files, str) and files:
            entry["file"] = str(Path(files).resolve())
        elif isinstance(files, list) and all(isinstance(f, str) and f for f in files):
            entry["file"] = [str(Path(f).resolve()) for f in files]


def _merge(config: dict, user: dict, source: str, problems: Problems) -> None:
    """``user`` over ``config``; an unknown section or key goes to ``problems`` (and its
    value nowhere)."""
    for section, values in user.items():
        if section not in SCHEMA and section not in NESTED_SECTIONS:
            hint = did_you_mean(section, section_names(), show=lambda s: f"[{s}]")
            problems.add(ConfigError(f"{source}: unknown section [{section}]{hint}; "
                                     f"sections are {', '.join(section_names())}"))
            continue
        if not isinstance(values, dict):
            problems.add(ConfigError(f"{source}: [{section}] must be a table"))
            continue
        if section in NESTED_SECTIONS:
            config[section] = values
            continue
        # algorithm.name first: a plug-in's options are known once it is
        for key, value in sorted(values.items(), key=lambda item: item[0] != "name"):
            with problems.collecting():
                key_spec(section, key, config)
                config[section][key] = value


def apply_override(config: dict, item: str) -> None:
    """Apply ``section.key=value``; the value is read as TOML (``0.2``, ``"cnn"``,
    ``true``), falling back to a bare string so ``--set model.name=cnn`` works."""
    target, sep, raw = item.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    if section in NESTED_SECTIONS:  # network.dropout.per_round=0.1: make the tables on the way
        table = config.setdefault(section, {})
        *path, last = key.split(".")
        for part in path:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override {item!r}: {section}.{part} is not a table")
        table[last] = value
        return
    key_spec(section, key, config)
    config[section][key] = value


def to_toml(config: dict[str, dict[str, Any]]) -> str:
    """Write the resolved config back as TOML (tables, arrays of tables, scalars)."""
    lines: list[str] = []

    def table(path: str, values: dict) -> None:
        scalars = {k: v for k, v in values.items() if not _is_table(v) and not _is_table_array(v)}
        if scalars or not values:
            lines.append(f"[{path}]")
            lines.extend(f"{_toml_key(k)} = {toml_value(v)}" for k, v in scalars.items())
            lines.append("")
        for k, v in values.items():
            if _is_table(v):
                table(f"{path}.{_toml_key(k)}", v)
            elif _is_table_array(v):
                for item in v:
                    lines.append(f"[[{path}.{_toml_key(k)}]]")
                    lines.extend(f"{_toml_key(ik)} = {toml_value(iv)}" for ik, iv in item.items())
                    lines.append("")

    for section, values in config.items():
        table(_toml_key(section), values)
    return "\n".join(lines)


def _is_table(v: Any) -> bool:
    return isinstance(v, dict)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else toml_value(key)


def toml_value(value: Any) -> str:
    """One value as TOML writes it (a sweep's axis value becomes a --set override so)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table inside an array
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
