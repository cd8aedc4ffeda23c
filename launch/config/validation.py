"""Validation of a whole config: each key's type and range against the schema, then the
checks across sections (clock and time scale, data set and model, the algorithm's own
refusals, compression, k-fold, the static deadlock findings)."""
from __future__ import annotations

import math

from fedemu.common.ml import kfold
from fedemu.node.schema import INT64, did_you_mean

from .schema import SCHEMA, ConfigError, Problems, algorithm_class, algorithm_options, section_keys, type_name
from .settings import compression_spec, network_parts


def validate(config: dict, problems: Problems | None = None) -> None:
    """Check every key, then the checks across sections, and raise one ConfigErrors naming
    every problem found (after those already in ``problems``: loading's). A check across
    sections is skipped where a key it reads is bad: it would only restate that problem."""
    problems = Problems() if problems is None else problems
    algorithm = None
    name = config.get("algorithm", {}).get("name")
    with problems.collecting("algorithm.name"):
        if not isinstance(name, str):
            raise ConfigError(f"algorithm.name = {name!r} must be a string")
        algorithm = algorithm_class(config)
    for key, spec in algorithm_options(config).items():  # a plug-in's options, say, that default() did not know
        config["algorithm"].setdefault(key, spec.default)
    for section in SCHEMA:
        values = config.get(section, {})
        for key, spec in section_keys(section, config).items():
            if problems.clear(f"{section}.{key}"):  # algorithm.name may be found bad already
                with problems.collecting(f"{section}.{key}"):
                    _check_key(values, section, key, spec)
    run = config["run"]
    if problems.clear("run.heartbeat_timeout_s", "run.heartbeat_interval_s") \
            and run["heartbeat_timeout_s"] < 2 * run["heartbeat_interval_s"]:
        problems.add(ConfigError(
            f"run.heartbeat_timeout_s = {run['heartbeat_timeout_s']:g} must be at least twice "
            f"run.heartbeat_interval_s = {run['heartbeat_interval_s']:g}: a node is declared lost "
            "after that much silence, and one late heartbeat is not a loss"))
    if problems.clear("run.clock", "run.time_scale") and run["clock"] == "virtual" and run["time_scale"] != 1.0:
        problems.add(ConfigError(
            f"run.time_scale = {run['time_scale']:g} applies to the wall clock only; with "
            "run.clock = 'virtual' nothing waits on real time (a run takes its compute time), so "
            "leave it at 1 or set run.clock = 'wall'"))
    _check_dataset(config["data"], problems)
    if problems.clear("model.name"):
        with problems.collecting():  # nothing checked later reads model.name
            _check_model(config["model"]["name"], config["data"]["dataset"] if problems.clear("data.dataset") else None)
    if problems.clear("algorithm.lr_round_decay", "algorithm.name") \
            and config["algorithm"]["lr_round_decay"] != 1.0 and not algorithm.synchronous:
        problems.add(ConfigError(
            f"algorithm.lr_round_decay = {config['algorithm']['lr_round_decay']:g}: "
            f"{config['algorithm']['name']} has no rounds; use algorithm.lr_decay (per local step)"))
    compression = network = None
    with problems.collecting("compression."):
        compression = compression_spec(config)
    if problems.clear("data.clients", "run.seed", "run.time_scale"):
        with problems.collecting("network."):
            network, _ = network_parts(config)
    if not problems.bad:
        # These read most of the config: with a bad key they would only restate it.
        _check_algorithm(config, algorithm, compression, network, problems)
    problems.raise_any()


def _check_key(values: dict, section: str, key: str, spec) -> None:
    """One key's type and range (an integer given for a number key is stored as a float)."""
    if key not in values:
        raise ConfigError(f"{section}.{key} is missing")
    value = values[key]
    name = f"{section}.{key}"
    if spec.type is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = values[key] = float(value)
        except OverflowError:  # an integer beyond any float
            raise ConfigError(f"{name} = {value!r} must be finite") from None
    # bool is an int subclass in Python: only a bool key takes true/false.
    if isinstance(value, bool) != (spec.type is bool) or not isinstance(value, spec.type):
        raise ConfigError(f"{name} = {value!r} must be {type_name(spec.type)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} = {value!r} must be finite")
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise ConfigError(f"{name} = {value!r} is out of range; it must fit an int64 (below 2**63)")
    if spec.choices is not None and value not in spec.choices:
        raise ConfigError(f"{name} = {value!r} is not allowed{did_you_mean(value, spec.choices)}; "
                          f"choose one of {', '.join(map(repr, spec.choices))}")
    if spec.check is not None and not spec.check(value):
        raise ConfigError(f"{name} = {value!r} is out of range; it must be {spec.rule}")


def _check_algorithm(config: dict, algorithm, compression, network, problems: Problems) -> None:
    """The checks that read most of a config whose every key is valid: the algorithm's own
    refusals, aggregation and compression against it, k-fold, the static deadlock findings."""
    refusal = algorithm.check_config(config)
    if refusal:
        problems.add(ConfigError(refusal))
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.algorithms.base import aggregation_problem

    refusal = aggregation_problem(config["run"]["aggregation"], algorithm, compression.compresses)
    if refusal:
        problems.add(ConfigError(refusal))
    if compression.compresses and algorithm.uploads:
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        from fedemu.common.algorithms.base import built_in

        compressible = [name for name, cls in built_in().items() if not cls.uploads]
        problems.add(ConfigError(
            f"[compression] applies to model updates (algorithm.name = {', '.join(compressible)}: each sends "
            f"the delta from the model it trained from); algorithm.name = {config['algorithm']['name']!r} "
            f"uploads {algorithm.uploads}, which the update codecs do not encode"))
    try:
        kfold.check(config)
    except ValueError as exc:
        problems.add(ConfigError(str(exc)))
    refused = [f.message for f in findings(config, network) if f.blocking
               and not (f.waivable_by and config["algorithm"]["accept_deadlock_risk"])]
    problems.errors.extend(ConfigError(message) for message in refused)


def _check_dataset(data: dict, problems: Problems) -> None:
    """data.dataset exists (else it is marked bad) and holds what [data] asks of it."""
    from fedemu.common.ml import datasets  # imports no torch

    if not problems.clear("data.dataset"):
        return
    dataset = None
    with problems.collecting("data.dataset"):
        try:
            dataset = datasets.get(data["dataset"])
        except datasets.DatasetError as exc:
            raise ConfigError(f"data.dataset: {exc}") from None
    if dataset is not None and problems.clear(*(f"data.{key}" for key in SCHEMA["data"])):
        with problems.collecting():
            _fits_dataset(data, dataset)


def _fits_dataset(data: dict, dataset) -> None:
    if data["partition"] == "natural" and not dataset.natural_clients:
        raise ConfigError(f"data.partition = 'natural': {data['dataset']} has no natural clients; use 'iid', "
                          "'shards', 'dirichlet' or 'lognormal'")
    examples = (dataset.sizes or {}).get("train")
    if examples is None or data["folds"]:
        return
    if data["partition"] in ("iid", "dirichlet", "lognormal", "shards") and data["clients"] > examples:
        raise ConfigError(f"data.clients = {data['clients']} with data.partition = {data['partition']!r}: "
                          f"{data['dataset']} has {examples} training examples, fewer than one per client; "
                          "data.partition = 'sample' lets clients share examples (data.examples_per_client each)")
    if data["partition"] == "sample" and data["examples_per_client"] > examples:
        raise ConfigError(f"data.examples_per_client = {data['examples_per_client']}: {data['dataset']} has "
                          f"{examples} training examples")


def _check_model(name: str, dataset: str | None) -> None:
    """model.name exists and takes data.dataset's examples (built and run on a blank batch;
    ``dataset`` None: one found bad, so only the name is checked)."""
    from fedemu.common.ml import models  # (torch: a plug-in's builder is imported to be checked)

    try:
        models.builder(name)
    except models.UnknownModel as exc:
        raise ConfigError(f"model.name: {exc}") from None
    problem = None if dataset is None else models.fits(name, dataset)
    if problem:
        raise ConfigError(problem)


def findings(config: dict, network=None) -> list:
    """The static deadlock and liveness findings for a config (server.checks); ``network``:
    its NetworkSpec where the caller has it already (it reads the trace files)."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.server.checks import check

    if network is None:
        network, _ = network_parts(config)
    dropout = config.get("network", {}).get("dropout", {})
    return check(config["algorithm"], config["data"]["clients"], network.can_drop,
                 round_dropout=dropout.get("per_round", 0.0) if isinstance(dropout, dict) else 0.0)
