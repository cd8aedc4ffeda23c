"""The config's schema: every section, key, type and allowed values (:data:`SCHEMA`; their
defaults are in ``default.toml``), the ``[algorithm]`` keys each algorithm declares
(``common/algorithms/base.py``: its keys, with their defaults), and :class:`ConfigError`,
which names the key and what it accepts."""
from __future__ import annotations

import contextlib
import re

from fedemu.node.schema import (MAX_LEARNING_RATE, Key, did_you_mean, did_you_mean_key, fraction, interval,
                                non_negative, positive, unit_interval)


def is_device_setting(value: str) -> bool:
    """run.device's form (what this host has is checked where it runs: devices.torch_device)."""
    return re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) is not None


class ConfigError(ValueError):
    """A config key or value that is not allowed; the message names it."""


class ConfigErrors(ConfigError):
    """Every problem found in a config, each a :class:`ConfigError` naming its key (in
    :attr:`errors`): a config with three mistakes is refused once, naming all three."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        if len(self.errors) == 1:
            text = str(self.errors[0])
        else:
            text = f"{len(self.errors)} problems in the config:\n" + "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(text)

    def __reduce__(self):  # as built: from its errors (an exception pickles its message only)
        return type(self), (self.errors,)


class Problems:
    """A config's errors, collected as the checks find them (``with problems.collecting(key):``
    records a ConfigError the block raises, marks ``key`` bad and goes on), then raised all
    at once (:meth:`raise_any`)."""

    def __init__(self):
        self.errors: list[ConfigError] = []
        self.bad: set[str] = set()  # "section.key" (or "section." for a whole section) found bad

    def add(self, error: ConfigError) -> None:
        self.errors.extend(error.errors if isinstance(error, ConfigErrors) else [error])

    @contextlib.contextmanager
    def collecting(self, *keys: str):
        try:
            yield
        except ConfigError as exc:
            self.add(exc)
            self.bad.update(keys)

    def clear(self, *keys: str) -> bool:
        """None of ``keys`` is bad: a check that reads them is worth running."""
        return not any(key in self.bad or f"{key.partition('.')[0]}." in self.bad for key in keys)

    def raise_any(self) -> None:
        if self.errors:
            raise ConfigErrors(self.errors)


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


def algorithm_class(config: dict):
    """The registered class of algorithm.name; ConfigError if nothing answers to it."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.algorithms.base import UnknownAlgorithm, get

    try:
        return get(config["algorithm"]["name"])
    except UnknownAlgorithm as exc:
        raise ConfigError(f"algorithm.name: {exc}") from None


def algorithm_options(config: dict) -> dict[str, Key]:
    """The algorithm.* keys algorithms own: every built-in's (a sweep over algorithm.name
    carries each one's options), and the chosen plug-in's."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.algorithms.base import all_options

    try:
        chosen = algorithm_class(config) if isinstance(config["algorithm"].get("name"), str) else None
    except ConfigError:  # validate() reports it
        chosen = None
    return all_options(chosen)


def section_names() -> list[str]:
    return [*SCHEMA, *NESTED_SECTIONS]


def section_keys(section: str, config: dict) -> dict[str, Key]:
    if section == "algorithm":
        return {**SCHEMA[section], **algorithm_options(config)}
    return SCHEMA[section]


def key_spec(section: str, key: str, config: dict) -> Key:
    if section not in SCHEMA:
        raise ConfigError(f"unknown section {section!r}{did_you_mean(section, section_names())}; "
                          f"sections are {', '.join(section_names())}")
    keys = section_keys(section, config)
    spec = keys.get(key)
    if spec is None:
        raise ConfigError(f"unknown key {section}.{key}{did_you_mean_key(section, key, keys)}; "
                          f"[{section}] has {', '.join(keys)}")
    return spec


def type_name(t: type | tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    if isinstance(t, tuple):
        return " or ".join(names.get(x, x.__name__) for x in t)
    return names.get(t, t.__name__)


def ineffective_keys(config: dict) -> set[str]:
    """Keys (``section.key``) whose value cannot change this run: the options of algorithms
    other than the one it runs, and the shard keys of an IID partition. Two runs that
    differ only in these ran the same condition."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
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
