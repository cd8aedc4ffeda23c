"""Run configuration: TOML, with the papers' symbol names (C, E, B, lr, b_l, b_u, ...).

One schema (:data:`SCHEMA`) says every section, key, type and allowed values (their
defaults are in ``default.toml``); the ``[algorithm]`` section also takes the options each
algorithm declares (``common/algorithms/base.py``: its keys, with their defaults). Loading,
``--set`` overrides and validation all read them, so an error can always name the key
and what it accepts, before anything starts.
"""
from __future__ import annotations

import copy
import math
import re
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from fedemu.node.schema import INT64, MAX_LEARNING_RATE, Key, fraction, interval, non_negative, positive, unit_interval


def is_device_setting(value: str) -> bool:
    """run.device's form (what this host has is checked where it runs: devices.torch_device)."""
    return re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) is not None


class ConfigError(ValueError):
    """A config key or value that is not allowed; the message names it."""


# Seconds, wall or emulated, a key may name: about 32 years, far beyond any run, and far
# from where adding them up loses precision (as written in an interval's notation).
MAX_SECONDS = "1e9"

SCHEMA: dict[str, dict[str, Key]] = {
    "run": {
        "seed": Key(int, "seed of every random choice in the run", check=lambda s: 0 <= s < 2**63, rule="in [0, 2**63)"),
        "rounds": Key(int, "round limit", check=positive, rule="> 0"),
        "target_accuracy": Key(float, "stop once test accuracy reaches this (0: never)", check=unit_interval, rule="in [0, 1]"),
        "eval_every": Key(int, "evaluate the global model every this many rounds", check=positive, rule="> 0"),
        "client_log": Key(str, "which round events list their clients (clients.csv always has a row per "
                          "selected client): 'events' every round's; 'csv' none, only counts; 'auto' rounds of up "
                          "to 100 selected clients", choices=("auto", "events", "csv")),
        "timeline": Key(str, "timeline.csv, every transfer, computation and device switch in emulated time "
                        "(fedemu report --timeline draws it): 'all' or 'off'", choices=("all", "off")),
        "tensorboard": Key(bool, "write TensorBoard event files (tensorboard/ in the run directory) as the run goes: "
                           "accuracy, loss, participation by outcome, round duration, bytes, and the config"),
        "out": Key(str, "folder under which run directories are made"),
        "workers": Key(int, "worker nodes (OS processes) to start; 0 = number of cores", **interval("[0, 4096]")),
        "torch_threads": Key(int, "torch threads per worker node; 0 = cores / workers (with --machines: per host)",
                             **interval("[0, 1024]")),
        "heartbeat_interval_s": Key(float, "node heartbeat period", **interval("[0.01, 60]")),
        "heartbeat_timeout_s": Key(float, "silence after which a node is declared lost (at least twice "
                                   "heartbeat_interval_s: one late beat is not a loss)", **interval("(0, 3600]")),
        "startup_timeout_s": Key(float, "how long the server waits for every worker node", **interval("(0, 86400]")),
        "clock": Key(str, "emulated time: 'virtual' (the broker's discrete-event clock: the same config and seed "
                     "give the same run on any host, load or placement) or 'wall' (the host's clock x time_scale)",
                     choices=("virtual", "wall")),
        "compute": Key(str, "virtual clock: what a client's local work costs: 'model' (training FLOPs / "
                       "device_flops x straggler factor: reproducible) or 'measured' (the training thread's CPU "
                       "time x straggler factor: not reproducible)", choices=("model", "measured")),
        "device": Key(str, "where clients train (and the server evaluates): 'auto' (a node's first CUDA GPU where "
                      "its host has one, else the CPU), 'cpu', 'cuda' or 'cuda:N' (a host without it refuses to "
                      "start); a GPU's weights differ from a CPU's in the last bits", check=is_device_setting,
                      rule="'auto', 'cpu', 'cuda' or 'cuda:N'"),
        "device_flops": Key(float, "virtual clock, compute = 'model': the emulated device's training speed in "
                            "FLOP/s (a straggler with factor f runs at device_flops / f)", **interval("[1e3, 1e18]")),
        "time_scale": Key(float, "wall clock: run emulated delays (links, stragglers, deadlines) this many times faster",
                          **interval("(0, 1e6]")),
        "max_uploads_per_client": Key(float, "stop after this many uploads per client on average (Nilsson: 100); 0 = no budget",
                                      **interval("[0, 1e9]")),
        "max_wall_s": Key(float, "stop after this many wall seconds; 0 = no limit", **interval(f"[0, {MAX_SECONDS}]")),
        "progress_timeout_s": Key(float, "the watchdog reports a run this long without aggregation",
                                  **interval(f"(0, {MAX_SECONDS}]")),
        "pool_nice": Key(int, "nice increment of the threads that train clients in worker nodes; > 0 lets "
                         "message I/O preempt training, for tighter link timing on busy cores (0: none)",
                         check=lambda v: 0 <= v <= 19, rule="in 0..19"),
        "aggregation": Key(str, "where a round's updates are summed: 'server' (each update crosses the broker to "
                           "the server, which adds them in arrival order) or 'nodes' (each worker node keeps its "
                           "clients' updates, charged on their links as if sent, and sends the server one exact "
                           "sum: a round of 1,000 clients moves a few sums instead of 1,000 models; the model "
                           "differs from 'server's in the last bits and is the same on any placement)",
                           choices=("server", "nodes")),
        "cohort": Key(str, "how a worker node trains the clients that have local work in hand at once: 'auto' "
                      "(as one batched computation, where the model and task allow, else one by one, said once "
                      "in the node's log; each client's update is bit for bit the one it would train alone) or "
                      "'off' (one by one)", choices=("auto", "off")),
        "restart_clients": Key(int, "times a worker node's supervisor restarts a crashed client (0: never)",
                               check=non_negative, rule=">= 0"),
    },
    "data": {
        "dataset": Key(str, "data set: 'mnist', 'fashion-mnist', 'cifar10' or 'shakespeare' (fedemu data list "
                       "shows them), an installed plug-in's name, or 'package.module:Class' (a fedemu Dataset)"),
        "partition": Key(str, "how the training set is split over clients: 'iid', 'shards' (McMahan's pathological "
                         "non-IID), 'dirichlet' (label skew, Hsu et al. 2019), 'lognormal' (quantity skew) or "
                         "'natural' (the data set's own clients) or 'sample' (each client draws "
                         "data.examples_per_client examples: populations larger than the data set)",
                         choices=("iid", "shards", "dirichlet", "lognormal", "natural", "sample")),
        "examples_per_client": Key(int, "partition = 'sample': examples each client draws (without replacement; "
                                   "clients may share examples)", check=positive, rule="> 0"),
        "dirichlet_alpha": Key(float, "partition = 'dirichlet': the concentration alpha (small: few classes per "
                               "client; large: close to IID)", **interval("(0, 1e6]")),
        "lognormal_sigma": Key(float, "partition = 'lognormal': the spread sigma of log client sizes (beyond 10, "
                               "exp of its draws overflows)", **interval("(0, 10]")),
        "clients": Key(int, "number of clients K", check=positive, rule="> 0"),
        "shard_order": Key(str, "partition = 'shards': the order within a label before the cut: 'stable' keeps the "
                           "data set's (or the k-fold shuffle's) order; 'pixels' sorts by the raw image bytes, as "
                           "Nilsson et al.'s fold notebook did", choices=("stable", "pixels")),
        "shards_per_client": Key(int, "shards per client for partition = 'shards'", check=positive, rule="> 0"),
        "cache_dir": Key(str, "data cache folder ('' = $FEDEMU_DATA_DIR or ~/.cache/fedemu)"),
        "folds": Key(int, "k-fold cross-validation over train + test pooled (Nilsson et al.: 5); 0 = the usual train/test split", check=lambda k: k == 0 or k >= 2, rule="0 or >= 2"),
        "fold": Key(int, "the fold held out as the test set when data.folds >= 2", check=non_negative, rule=">= 0"),
    },
    "model": {
        "name": Key(str, "model: '2nn', 'cnn' (McMahan et al.'s MNIST models), 'cifar-cnn' (their CIFAR-10 "
                    "model), 'char-lstm' (their Shakespeare model), an installed plug-in's name, or "
                    "'package.module:function' (a builder(input_shape, num_classes))"),
        "init": Key(str, "initial weights of the global model: PyTorch's per-layer defaults ('torch'), every "
                    "weight and bias from N(0, init_std^2) ('normal', Nilsson et al.), or TensorFlow's default "
                    "for dense and convolution layers ('glorot': Glorot-uniform weights, zero biases)",
                    choices=("torch", "normal", "glorot")),
        "init_std": Key(float, "standard deviation of init = 'normal'", **interval("(0, 100]")),
    },
    "algorithm": {
        "name": Key(str, "federated algorithm: a built-in's name (fedemu algorithms lists them), an installed "
                    "plug-in's, or 'package.module:Class'"),
        "C": Key(float, "fraction of clients selected per round", check=fraction, rule="in (0, 1]"),
        "E": Key(int, "local epochs", check=positive, rule="> 0"),
        "B": Key(int, "local minibatch size; 0 = the full local set (B = infinity)", check=non_negative, rule=">= 0"),
        "lr": Key(float, "learning rate eta", **interval(f"(0, {MAX_LEARNING_RATE:g}]")),
        "lr_decay": Key(float, "Keras-style decay lambda: lr / (1 + lambda * iterations)", **interval("[0, 1e6]")),
        "lr_round_decay": Key(float, "round-based algorithms: the learning rate of round t is lr * "
                              "lr_round_decay^(t - 1) (McMahan et al.'s CIFAR-10 runs: 0.99); 1 = none",
                              check=lambda g: 0 < g <= 1, rule="in (0, 1]"),
        "deadline_s": Key(float, "emulated seconds a round waits for updates; 0 = no deadline",
                          **interval(f"[0, {MAX_SECONDS}]")),
        "quorum": Key(int, "minimum updates to aggregate a round", check=positive, rule="> 0"),
        "on_quorum_missed": Key(str, "when a deadline passes below the quorum: skip the round (keep the model), "
                                "or extend the deadline once by deadline_s and skip if still short",
                                choices=("skip", "extend_once")),
        "over_select": Key(int, "extra clients selected per round beyond m; the first m updates to arrive "
                           "are aggregated, later ones discarded", check=non_negative, rule=">= 0"),
        "accept_deadlock_risk": Key(bool, "run even where a static check says the run can deadlock (CO-OP's "
                                    "Theorem A.1)"),
        "eval_every_uploads": Key(int, "asynchronous rules: evaluate every this many uploads", check=positive, rule="> 0"),
        "merge_s": Key(float, "asynchronous rules: emulated seconds the server spends on each upload or fetch "
                       "(merging, and its share of evaluation); requests queue while it is busy, age requests "
                       "are answered at once; 0 = instantaneous", **interval(f"[0, {MAX_SECONDS}]")),
        "retry_s": Key(float, "asynchronous rules: emulated seconds a client waits for a reply before it resends "
                       "its request (and the server its AsyncStart), doubling with each resend up to 8x; must "
                       "exceed a model's round trip over the slowest link plus server queueing",
                       **interval(f"(0, {MAX_SECONDS}]")),
    },
}

# [network] is nested (profiles, assignments, drop-outs, stragglers): the link model in
# fedemu.node.net.links and fedemu.common.stragglers validate it, naming each key.
NESTED_SECTIONS = ("network", "compression")

DEFAULT_CONFIG_FILE = "default.toml"


def default() -> dict[str, dict[str, Any]]:
    """The embedded default run: MNIST, 2NN, IID, K=100, C=0.1, E=1, B=10 (FedAvg), with
    every built-in algorithm's options at their defaults."""
    text = resources.files("fedemu.launch").joinpath(DEFAULT_CONFIG_FILE).read_text()
    config = tomllib.loads(text)
    config["algorithm"].update({key: spec.default for key, spec in _algorithm_options(config).items()})
    return config


def _algorithm_class(config: dict):
    """The registered class of algorithm.name; ConfigError if nothing answers to it."""
    from fedemu.common.algorithms.base import UnknownAlgorithm, get

    try:
        return get(config["algorithm"]["name"])
    except UnknownAlgorithm as exc:
        raise ConfigError(f"algorithm.name: {exc}") from None


def _algorithm_options(config: dict) -> dict[str, Key]:
    """The algorithm.* keys algorithms own: every built-in's (a sweep over algorithm.name
    carries each one's options), and the chosen plug-in's."""
    from fedemu.common.algorithms.base import all_options

    try:
        chosen = _algorithm_class(config)
    except ConfigError:  # validate() reports it
        chosen = None
    return all_options(chosen)


def load(path: str | Path | None, overrides: list[str] = (), values: dict | None = None) -> dict[str, dict[str, Any]]:
    """The resolved config: defaults, then the file, then ``values`` (sections as in a
    file: ``{"algorithm": {"name": "fedprox"}}``), then ``--set`` overrides; validated."""
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
    if values is not None:
        _merge(config, copy.deepcopy(values), source="the config given")
    for item in overrides:
        apply_override(config, item)
    absolute_trace_paths(config)
    validate(config)
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


def _merge(config: dict, user: dict, source: str) -> None:
    for section, values in user.items():
        if section not in SCHEMA and section not in NESTED_SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; sections are {', '.join(_sections())}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        if section in NESTED_SECTIONS:
            config[section] = values
            continue
        # algorithm.name first: a plug-in's options are known once it is
        for key, value in sorted(values.items(), key=lambda item: item[0] != "name"):
            _key(section, key, config)
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
    _key(section, key, config)
    config[section][key] = value


def _sections() -> list[str]:
    return [*SCHEMA, *NESTED_SECTIONS]


def _section_keys(section: str, config: dict) -> dict[str, Key]:
    if section == "algorithm":
        return {**SCHEMA[section], **_algorithm_options(config)}
    return SCHEMA[section]


def _key(section: str, key: str, config: dict) -> Key:
    if section not in SCHEMA:
        raise ConfigError(f"unknown section {section!r}; sections are {', '.join(_sections())}")
    keys = _section_keys(section, config)
    spec = keys.get(key)
    if spec is None:
        raise ConfigError(f"unknown key {section}.{key}; [{section}] has {', '.join(keys)}")
    return spec


def validate(config: dict) -> None:
    if not isinstance(config.get("algorithm", {}).get("name"), str):
        raise ConfigError(f"algorithm.name = {config.get('algorithm', {}).get('name')!r} must be a string")
    algorithm = _algorithm_class(config)
    options = _algorithm_options(config)
    for key, spec in options.items():  # a plug-in's options, say, that default() did not know
        config["algorithm"].setdefault(key, spec.default)
    for section in SCHEMA:
        values = config.get(section, {})
        for key, spec in _section_keys(section, config).items():
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
                raise ConfigError(f"{name} = {value!r} must be {_type_name(spec.type)}")
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
    from fedemu.common.algorithms.base import aggregation_problem

    refusal = aggregation_problem(config["run"]["aggregation"], algorithm, compression.compresses)
    if refusal:
        raise ConfigError(refusal)
    if compression.compresses and algorithm.uploads:
        from fedemu.common.algorithms.base import built_in

        compressible = [name for name, cls in built_in().items() if not cls.uploads]
        raise ConfigError(
            f"[compression] applies to model updates (algorithm.name = {', '.join(compressible)}: each sends "
            f"the delta from the model it trained from); algorithm.name = {config['algorithm']['name']!r} "
            f"uploads {algorithm.uploads}, which the update codecs do not encode")
    from fedemu.common.ml import kfold

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


def data_spec(config: dict):
    """The run's data (split.DataSpec): the [data] section and run.seed."""
    from fedemu.common.ml.split import DataSpec

    d = config["data"]
    return DataSpec(dataset=d["dataset"], partition=d["partition"], clients=d["clients"], seed=config["run"]["seed"],
                    shards_per_client=d["shards_per_client"], shard_order=d["shard_order"],
                    dirichlet_alpha=d["dirichlet_alpha"], lognormal_sigma=d["lognormal_sigma"],
                    examples_per_client=d["examples_per_client"], folds=d["folds"],
                    fold=d["fold"], cache_dir=d["cache_dir"] or None)


def model_spec(config: dict):
    """The run's model (models.ModelSpec): model.name built for data.dataset."""
    from fedemu.common.ml import datasets, models

    model = config["model"]
    return models.ModelSpec(model["name"], datasets.get(config["data"]["dataset"]), model["init"], model["init_std"])


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


def ineffective_keys(config: dict) -> set[str]:
    """Keys (``section.key``) whose value cannot change this run: the options of algorithms
    other than the one it runs, and the shard keys of an IID partition. Two runs that
    differ only in these ran the same condition."""
    from fedemu.common.algorithms.base import UnknownAlgorithm, all_options, get

    try:
        own = set(get(config["algorithm"]["name"]).options)
    except UnknownAlgorithm:  # a plug-in this machine cannot import: assume every option matters
        own = set(all_options())
    keys = {f"algorithm.{key}" for key in all_options() if key not in own}
    partition = config.get("data", {}).get("partition")
    if partition != "shards":
        keys |= {"data.shards_per_client", "data.shard_order"}
    if partition != "dirichlet":
        keys.add("data.dirichlet_alpha")
    if partition != "lognormal":
        keys.add("data.lognormal_sigma")
    if partition != "sample":
        keys.add("data.examples_per_client")
    return keys


def findings(config: dict) -> list:
    """The static deadlock and liveness findings for a config (server.checks)."""
    from fedemu.server.checks import check

    network, _ = network_parts(config)
    dropout = config.get("network", {}).get("dropout", {})
    return check(config["algorithm"], config["data"]["clients"], network.can_drop,
                 round_dropout=dropout.get("per_round", 0.0) if isinstance(dropout, dict) else 0.0)


def network_parts(config: dict):
    """(NetworkSpec for the broker, StragglerSpec for the workers) of a config; a bad
    value raises ConfigError naming the key. Reads the config's trace files."""
    from fedemu.node.net.links import LinkConfigError, NetworkSpec

    section = dict(config.get("network", {}))
    section.pop("stragglers", None)
    K, seed = config["data"]["clients"], config["run"]["seed"]
    try:
        return NetworkSpec.from_config(section, K, seed, config["run"]["time_scale"]), straggler_spec(config)
    except LinkConfigError as exc:
        raise ConfigError(str(exc)) from None


def straggler_spec(config: dict):
    """network.stragglers alone (what a worker node needs: it may run where the trace
    files are not)."""
    from fedemu.node.net.links import LinkConfigError
    from fedemu.common.stragglers import stragglers_from_config

    try:
        return stragglers_from_config(config.get("network", {}).get("stragglers", {}), config["data"]["clients"],
                                      config["run"]["seed"])
    except LinkConfigError as exc:
        raise ConfigError(str(exc)) from None


POPULATION_FILE = "population.json"


def population_record(config: dict) -> dict | None:
    """What the run directory records of a run's population (its ``population.json``):
    each trace's files with their sha256, and each client's own device speed (JSON keys
    are strings), or None when the config has neither traces nor device classes.
    Worker nodes read their speeds from it, so a host without the trace files can run them."""
    network = config.get("network", {})
    if not network.get("traces") and not network.get("devices"):
        return None
    population = network_parts(config)[0].population
    return {"traces": population.digests(),
            "compute": {str(k): speed for k, speed in sorted(population.compute().items())}}


def compute_model(config: dict, run_dir: Path | None = None):
    """How the run's clients are charged for their local work (common.ml.devices): each
    client's own device speed from the run directory's population.json, if it has one."""
    import json

    from fedemu.common.ml.devices import ComputeModel

    run = config["run"]
    speeds = {}
    if run_dir is not None and (run_dir / POPULATION_FILE).exists():
        record = json.loads((run_dir / POPULATION_FILE).read_text())
        speeds = {int(k): v for k, v in record.get("compute", {}).items()}
    return ComputeModel(clock=run["clock"], charge=run["compute"], device_flops=run["device_flops"], speeds=speeds)


def compression_spec(config: dict):
    """The [compression] section as a CompressionSpec; errors name the key."""
    from fedemu.common.ml.compression import CompressionSpec

    try:
        return CompressionSpec.from_dict(config.get("compression", {}), prefix="compression.")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def server_settings(config: dict, workers: int, device: str):
    """The server engine's settings (server.engine.Settings) for a resolved config run
    over ``workers`` worker nodes, evaluating on ``device``."""
    from fedemu.common import algorithms
    from fedemu.server.engine import Settings

    run, algo = config["run"], config["algorithm"]
    compression = compression_spec(config)
    asynchronous = not algorithms.get(algo["name"]).synchronous
    return Settings(
        clients=config["data"]["clients"], seed=run["seed"], rounds=run["rounds"], epochs=algo["E"],
        batch_size=algo["B"], C=algo["C"], deadline_s=algo["deadline_s"], quorum=algo["quorum"],
        eval_every=algo["eval_every_uploads"] if asynchronous else run["eval_every"],
        target_accuracy=run["target_accuracy"], max_uploads_per_client=run["max_uploads_per_client"],
        max_wall_s=run["max_wall_s"], progress_timeout_s=run["progress_timeout_s"], workers=workers,
        startup_timeout_s=run["startup_timeout_s"], time_scale=run["time_scale"], clock=run["clock"],
        compression=compression.to_dict() if compression.compresses else None,
        over_select=algo["over_select"], on_quorum_missed=algo["on_quorum_missed"], retry_s=algo["retry_s"],
        merge_s=algo["merge_s"], client_log=run["client_log"], device=device, aggregation=run["aggregation"],
        timeline=run["timeline"], stragglers=network_parts(config)[1], node_exit_wait_s=NODE_EXIT_WAIT_S,
    )


# The launcher records how each worker node's process ended within a fraction of a second
# (it polls them every 0.25 s); a server that sees a node lost waits this long for it.
NODE_EXIT_WAIT_S = 2.0


def broker_network_file(config: dict) -> dict:
    """What `fedemu broker --network FILE` reads: the link part of [network]."""
    section = {k: v for k, v in config.get("network", {}).items() if k != "stragglers"}
    return {"num_clients": config["data"]["clients"], "seed": config["run"]["seed"],
            "time_scale": config["run"]["time_scale"], "clock": config["run"]["clock"], "network": section}


def _type_name(t: type | tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if isinstance(t, tuple):
        return " or ".join(names.get(x, x.__name__) for x in t)
    return names.get(t, t.__name__)


def to_toml(config: dict[str, dict[str, Any]]) -> str:
    """Write the resolved config back as TOML (tables, arrays of tables, scalars)."""
    lines: list[str] = []

    def table(path: str, values: dict) -> None:
        scalars = {k: v for k, v in values.items() if not _is_table(v) and not _is_table_array(v)}
        if scalars or not values:
            lines.append(f"[{path}]")
            lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items())
            lines.append("")
        for k, v in values.items():
            if _is_table(v):
                table(f"{path}.{_toml_key(k)}", v)
            elif _is_table_array(v):
                for item in v:
                    lines.append(f"[[{path}.{_toml_key(k)}]]")
                    lines.extend(f"{_toml_key(ik)} = {_toml_value(iv)}" for ik, iv in item.items())
                    lines.append("")

    for section, values in config.items():
        table(_toml_key(section), values)
    return "\n".join(lines)


def _is_table(v: Any) -> bool:
    return isinstance(v, dict)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else _toml_value(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table inside an array
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")

