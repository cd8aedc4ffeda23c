"""Each node process's settings (issue 51): written once into the run directory from the
resolved config (settings.json), and read back by the node into the very specs the
config code builds."""
from __future__ import annotations

import json

import pytest

from fedemu.launch import config as configuration
from fedemu.launch.config.settings import PROCESS_SETTINGS_FILE, process_settings_json, read_process_settings

CONFIGS = {
    "default": [],
    "async, stragglers, compression": ["algorithm.name=fedbuff", "network.stragglers.distribution=lognormal",
                                       "compression.structured=random_mask", "run.clock=wall",
                                       "run.torch_threads=3", "run.cohort=off"],
    "shards, k-fold": ["data.partition=shards", "data.folds=5", "data.fold=2", "run.pool_nice=5",
                       "run.device=cpu", "run.tensorboard=true"],
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_settings_a_node_reads_are_those_the_config_gives(tmp_path, name):
    config = configuration.load(None, CONFIGS[name])
    (tmp_path / PROCESS_SETTINGS_FILE).write_text(process_settings_json(config))
    server, worker = read_process_settings(tmp_path, "server"), read_process_settings(tmp_path, "worker")
    assert server.engine_settings(3, "cpu") == configuration.server_settings(config, 3, "cpu")
    assert server.data_spec() == worker.data_spec() == configuration.data_spec(config)
    assert server.model_spec() == worker.model_spec() == configuration.model_spec(config)
    assert server.algorithm == config["algorithm"] and server.tensorboard == config["run"]["tensorboard"]
    assert worker.straggler_spec() == configuration.straggler_spec(config)
    assert worker.compute_model(tmp_path) == configuration.compute_model(config, tmp_path)
    run = config["run"]
    for node in (server.node, worker.node):
        assert (node.heartbeat_interval_s, node.heartbeat_timeout_s, node.clock, node.torch_threads, node.device) == (
            run["heartbeat_interval_s"], run["heartbeat_timeout_s"], run["clock"], run["torch_threads"], run["device"])
    assert (worker.pool_nice, worker.clients, worker.startup_timeout_s, worker.restart_clients, worker.cohorts) == (
        run["pool_nice"], config["data"]["clients"], run["startup_timeout_s"], run["restart_clients"],
        run["cohort"] == "auto")


def test_a_host_agent_gives_its_worker_nodes_their_own_torch_threads():
    from fedemu.launch.running.agent import host_settings, usable_cores

    wall = json.loads(host_settings(process_settings_json(configuration.load(None, ["run.clock=wall"])), 1))
    assert wall["worker"]["node"]["torch_threads"] == max(1, usable_cores())
    virtual = json.loads(host_settings(process_settings_json(configuration.load(None)), 1))
    assert virtual["worker"]["node"]["torch_threads"] == 0  # virtual time pins it to 1 on any host
