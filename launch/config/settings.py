"""The resolved config turned into the typed specs and settings each process of a run
takes: the data (split.DataSpec), the model (models.ModelSpec), the links and stragglers,
the compute model, compression, the server engine's Settings, and the broker's network
file. It reads a resolved (validated) config and checks nothing but what the typed specs
check themselves."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from fedemu.common.ml import datasets, models
from fedemu.common.ml.compression import CompressionSpec
from fedemu.common.ml.split import DataSpec
from fedemu.common.stragglers import stragglers_from_config
from fedemu.node.net.network_spec import NetworkSpec
from fedemu.node.net.profiles import LinkConfigError

from .schema import ConfigError


def data_spec(config: dict):
    """The run's data (split.DataSpec): the [data] section and run.seed."""
    d = config["data"]
    return DataSpec(dataset=d["dataset"], partition=d["partition"], clients=d["clients"], seed=config["run"]["seed"],
                    shards_per_client=d["shards_per_client"], shard_order=d["shard_order"],
                    dirichlet_alpha=d["dirichlet_alpha"], lognormal_sigma=d["lognormal_sigma"],
                    examples_per_client=d["examples_per_client"], folds=d["folds"],
                    fold=d["fold"], cache_dir=d["cache_dir"] or None)


def model_spec(config: dict):
    """The run's model (models.ModelSpec): model.name built for data.dataset."""
    model = config["model"]
    return models.ModelSpec(model["name"], datasets.get(config["data"]["dataset"]), model["init"], model["init_std"])


def network_parts(config: dict):
    """(NetworkSpec for the broker, StragglerSpec for the workers) of a config; a bad
    value raises ConfigError naming the key. Reads the config's trace files."""
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
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.ml.devices import ComputeModel

    run = config["run"]
    speeds = {}
    if run_dir is not None and (run_dir / POPULATION_FILE).exists():
        record = json.loads((run_dir / POPULATION_FILE).read_text())
        speeds = {int(k): v for k, v in record.get("compute", {}).items()}
    return ComputeModel(clock=run["clock"], charge=run["compute"], device_flops=run["device_flops"], speeds=speeds)


def compression_spec(config: dict):
    """The [compression] section as a CompressionSpec; errors name the key."""
    try:
        return CompressionSpec.from_dict(config.get("compression", {}), prefix="compression.")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def server_settings(config: dict, workers: int, device: str):
    """The server engine's settings (server.engine.Settings) for a resolved config run
    over ``workers`` worker nodes, evaluating on ``device``."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.server.engine import Settings

    return Settings(**_engine_fields(config), workers=workers, device=device, stragglers=network_parts(config)[1])


# The launcher records how each worker node's process ended within a fraction of a second
# (it polls them every 0.25 s); a server that sees a node lost waits this long for it.
NODE_EXIT_WAIT_S = 2.0


def broker_network_file(config: dict) -> dict:
    """What `fedemu broker --network FILE` reads: the link part of [network]."""
    section = {k: v for k, v in config.get("network", {}).items() if k != "stragglers"}
    return {"num_clients": config["data"]["clients"], "seed": config["run"]["seed"],
            "time_scale": config["run"]["time_scale"], "clock": config["run"]["clock"], "network": section}


# --- each node process's settings (issue 51) --------------------------------------------
#
# The launcher turns the resolved config into what each kind of node process takes, once,
# and writes it into the run directory as PROCESS_SETTINGS_FILE; a node process reads its
# own part back (read_process_settings) and builds its typed specs with the layers below
# (common, server), without the config's loading or validation. The broker's are its
# command line and network.json (broker_network_file), as before.

PROCESS_SETTINGS_FILE = "settings.json"


@dataclass(frozen=True)
class NodeProcessSettings:
    """What every node process of a run takes: its heartbeats, clock, torch threads and device."""

    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    clock: str  # run.clock: virtual time pins torch to one thread
    torch_threads: int  # run.torch_threads; 0: cores / workers (a host agent sets its own)
    device: str  # run.device, resolved on the host the node runs on


@dataclass(frozen=True)
class ServerNodeSettings:
    """The server node's: its data (the test set), model, algorithm, engine settings."""

    node: NodeProcessSettings
    data: dict  # split.DataSpec's fields
    model: dict  # models.ModelSpec's, with the data set by name
    algorithm: dict  # the [algorithm] table, as an algorithm's from_config takes it
    engine: dict  # server.engine.Settings' fields the config decides (not workers, device, stragglers, traces)
    stragglers: dict  # stragglers_from_config's arguments: the clients' factors, for the round events
    tensorboard: bool

    def data_spec(self):
        return DataSpec(**self.data)

    def model_spec(self):
        return _model_spec(self.model)

    def engine_settings(self, workers: int, device: str, traces: dict | None = None):
        """server.engine.Settings for a run over ``workers`` worker nodes, evaluating on ``device``."""
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        from fedemu.server.engine import Settings

        return Settings(**self.engine, workers=workers, device=device, stragglers=_stragglers(self.stragglers),
                        traces=traces)


@dataclass(frozen=True)
class WorkerNodeSettings:
    """A worker node's: its data and model, how its clients are charged and supervised."""

    node: NodeProcessSettings
    pool_nice: int
    data: dict  # split.DataSpec's fields
    model: dict  # models.ModelSpec's, with the data set by name
    clients: int  # K, which placement() spreads over the worker nodes
    startup_timeout_s: float
    stragglers: dict  # stragglers_from_config's arguments
    compute: dict  # devices.ComputeModel's, but the speeds (population.json in the run directory)
    restart_clients: int
    cohorts: bool

    def data_spec(self):
        return DataSpec(**self.data)

    def model_spec(self):
        return _model_spec(self.model)

    def straggler_spec(self):
        return _stragglers(self.stragglers)

    def compute_model(self, run_dir: Path | None = None):
        """devices.ComputeModel, with each client's own device speed from the run
        directory's population.json, if it has one."""
        # lazy: imports torch (~1.2 s), which the module's other paths do without
        from fedemu.common.ml.devices import ComputeModel

        speeds = {}
        if run_dir is not None and (run_dir / POPULATION_FILE).exists():
            record = json.loads((run_dir / POPULATION_FILE).read_text())
            speeds = {int(k): v for k, v in record.get("compute", {}).items()}
        return ComputeModel(**self.compute, speeds=speeds)


def _model_spec(model: dict):
    return models.ModelSpec(model["name"], datasets.get(model["dataset"]), model["init"], model["init_std"])


def _stragglers(arguments: dict):
    return stragglers_from_config(arguments["section"], arguments["clients"], arguments["seed"])


def _engine_fields(config: dict) -> dict:
    """server.engine.Settings' fields that the config decides."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common import algorithms

    run, algo = config["run"], config["algorithm"]
    compression = compression_spec(config)
    asynchronous = not algorithms.get(algo["name"]).synchronous
    return dict(
        clients=config["data"]["clients"], seed=run["seed"], rounds=run["rounds"], epochs=algo["E"],
        batch_size=algo["B"], C=algo["C"], deadline_s=algo["deadline_s"], quorum=algo["quorum"],
        eval_every=algo["eval_every_uploads"] if asynchronous else run["eval_every"],
        target_accuracy=run["target_accuracy"], max_uploads_per_client=run["max_uploads_per_client"],
        max_wall_s=run["max_wall_s"], progress_timeout_s=run["progress_timeout_s"],
        startup_timeout_s=run["startup_timeout_s"], time_scale=run["time_scale"], clock=run["clock"],
        compression=compression.to_dict() if compression.compresses else None,
        over_select=algo["over_select"], on_quorum_missed=algo["on_quorum_missed"], retry_s=algo["retry_s"],
        merge_s=algo["merge_s"], client_log=run["client_log"], aggregation=run["aggregation"],
        timeline=run["timeline"], node_exit_wait_s=NODE_EXIT_WAIT_S,
    )


def process_settings(config: dict) -> dict[str, ServerNodeSettings | WorkerNodeSettings]:
    """The resolved config as each kind of node process's settings: {"server": ..., "worker": ...}."""
    run, model = config["run"], config["model"]
    node = NodeProcessSettings(heartbeat_interval_s=run["heartbeat_interval_s"],
                               heartbeat_timeout_s=run["heartbeat_timeout_s"], clock=run["clock"],
                               torch_threads=run["torch_threads"], device=run["device"])
    data = dataclasses.asdict(data_spec(config))
    model = {"name": model["name"], "dataset": config["data"]["dataset"], "init": model["init"],
             "init_std": model["init_std"]}
    straggler_spec(config)  # a bad section names its key here, in the launcher
    stragglers = {"section": config.get("network", {}).get("stragglers", {}), "clients": config["data"]["clients"],
                  "seed": run["seed"]}
    return {
        "server": ServerNodeSettings(node=node, data=data, model=model, algorithm=config["algorithm"],
                                     engine=_engine_fields(config), stragglers=stragglers,
                                     tensorboard=run["tensorboard"]),
        "worker": WorkerNodeSettings(node=node, pool_nice=run["pool_nice"], data=data, model=model,
                                     clients=config["data"]["clients"], startup_timeout_s=run["startup_timeout_s"],
                                     stragglers=stragglers,
                                     compute={"clock": run["clock"], "charge": run["compute"],
                                              "device_flops": run["device_flops"]},
                                     restart_clients=run["restart_clients"], cohorts=run["cohort"] == "auto"),
    }


def process_settings_json(config: dict) -> str:
    """What the run directory's settings.json holds."""
    return json.dumps({kind: dataclasses.asdict(s) for kind, s in process_settings(config).items()}, indent=1)


def read_process_settings(run_dir: Path, kind: str) -> ServerNodeSettings | WorkerNodeSettings:
    """A node process's settings (``kind``: "server" or "worker"), from its run directory."""
    record = json.loads((run_dir / PROCESS_SETTINGS_FILE).read_text())[kind]
    node = NodeProcessSettings(**record.pop("node"))
    return (ServerNodeSettings if kind == "server" else WorkerNodeSettings)(node=node, **record)
