"""Validation of a whole config: each key's type and range against the schema, then the
checks across sections (clock and time scale, data set and model, the algorithm's own
refusals, compression, k-fold, the static deadlock findings)."""
from __future__ import annotations

import math

from fedemu.common.ml import kfold
from fedemu.node.schema import INT64

from .schema import SCHEMA, ConfigError, algorithm_class, algorithm_options, section_keys, type_name
from .settings import compression_spec, network_parts


def validate(config: dict) -> None:
    if not isinstance(config.get("algorithm", {}).get("name"), str):
        raise ConfigError(f"algorithm.name = {config.get('algorithm', {}).get('name')!r} must be a string")
    algorithm = algorithm_class(config)
    options = algorithm_options(config)
    for key, spec in options.items():  # a plug-in's options, say, that default() did not know
        config["algorithm"].setdefault(key, spec.default)
    for section in SCHEMA:
        values = config.get(section, {})
        for key, spec in section_keys(section, config).items():
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
                raise ConfigError(f"{name} = {value!r} is not allowed; choose one of {', '.join(map(repr, spec.choices))}")
            if spec.check is not None and not spec.check(value):
                raise ConfigError(f"{name} = {value!r} is out of range; it must be {spec.rule}")
    run = config["run"]
    if run["heartbeat_timeout_s"] < 2 * run["heartbeat_interval_s"]:
        raise ConfigError(f"run.heartbeat_timeout_s = {run['heartbeat_timeout_s']:g} must be at least twice "
                          f"run.heartbeat_interval_s = {run['heartbeat_interval_s']:g}: a node is declared lost "
                          "after that much silence, and one late heartbeat is not a loss")
    if config["run"]["clock"] == "virtual" and config["run"]["time_scale"] != 1.0:
        raise ConfigError(f"run.time_scale = {config['run']['time_scale']:g} applies to the wall clock only; with "
                          "run.clock = 'virtual' nothing waits on real time (a run takes its compute time), so "
                          "leave it at 1 or set run.clock = 'wall'")
    _check_dataset(config["data"])
    _check_model(config["model"]["name"], config["data"]["dataset"])
    if config["algorithm"]["lr_round_decay"] != 1.0 and not algorithm.synchronous:
        raise ConfigError(f"algorithm.lr_round_decay = {config['algorithm']['lr_round_decay']:g}: "
                          f"{config['algorithm']['name']} has no rounds; use algorithm.lr_decay (per local step)")
    refusal = algorithm.check_config(config)
    if refusal:
        raise ConfigError(refusal)
    compression = compression_spec(config)
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.algorithms.base import aggregation_problem

    refusal = aggregation_problem(config["run"]["aggregation"], algorithm, compression.compresses)
    if refusal:
        raise ConfigError(refusal)
    if compression.compresses and algorithm.uploads:
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        from fedemu.common.algorithms.base import built_in

        compressible = [name for name, cls in built_in().items() if not cls.uploads]
        raise ConfigError(
            f"[compression] applies to model updates (algorithm.name = {', '.join(compressible)}: each sends "
            f"the delta from the model it trained from); algorithm.name = {config['algorithm']['name']!r} "
            f"uploads {algorithm.uploads}, which the update codecs do not encode")
    try:
        kfold.check(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    refused = [f.message for f in findings(config) if f.blocking
               and not (f.waivable_by and config["algorithm"]["accept_deadlock_risk"])]
    if refused:
        raise ConfigError("; ".join(refused))


def _check_dataset(data: dict) -> None:
    from fedemu.common.ml import datasets  # imports no torch

    try:
        dataset = datasets.get(data["dataset"])
    except datasets.DatasetError as exc:
        raise ConfigError(f"data.dataset: {exc}") from None
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


def _check_model(name: str, dataset: str) -> None:
    """model.name exists and takes data.dataset's examples (built and run on a blank batch)."""
    from fedemu.common.ml import models  # (torch: a plug-in's builder is imported to be checked)

    try:
        models.builder(name)
    except models.UnknownModel as exc:
        raise ConfigError(f"model.name: {exc}") from None
    problem = models.fits(name, dataset)
    if problem:
        raise ConfigError(problem)


def findings(config: dict) -> list:
    """The static deadlock and liveness findings for a config (server.checks)."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.server.checks import check

    network, _ = network_parts(config)
    dropout = config.get("network", {}).get("dropout", {})
    return check(config["algorithm"], config["data"]["clients"], network.can_drop,
                 round_dropout=dropout.get("per_round", 0.0) if isinstance(dropout, dict) else 0.0)
