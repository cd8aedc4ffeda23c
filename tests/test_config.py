import re
import subprocess
import sys
import tomllib

import pytest

from fedemu.launch import config
from fedemu.launch.config import ConfigError


def test_default_is_the_papers_setting():
    c = config.load(None)
    assert (c["data"]["dataset"], c["data"]["partition"], c["data"]["clients"]) == ("mnist", "iid", 100)
    assert (c["model"]["name"], c["algorithm"]["name"]) == ("2nn", "fedavg")
    assert (c["algorithm"]["C"], c["algorithm"]["E"], c["algorithm"]["B"]) == (0.1, 1, 10)


def test_the_runs_liveness_defaults_are_the_runtimes():
    """Stated twice on purpose (the config file a user reads, the runtime's own defaults):
    they must agree."""
    from fedemu.node.control import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S

    run = config.load(None)["run"]
    assert (run["heartbeat_interval_s"], run["heartbeat_timeout_s"]) == (HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S)


def test_fedemu_check_prints_the_config_as_the_run_uses_it():
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "check", "--set", "algorithm.name=coop"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = tomllib.loads(done.stdout[:done.stdout.index("ok: the config is valid")])
    assert shown["algorithm"]["name"] == "coop" and "deadline_s" not in shown["algorithm"]  # a round-based key
    assert shown["network"]["default_profile"] == "ideal"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[algorithm]\nE = 5\n[model]\nname = "cnn"\n')
    c = config.load(path, ["algorithm.C=0.2", "model.name=2nn", "run.out=elsewhere"])
    assert c["algorithm"]["E"] == 5 and c["algorithm"]["C"] == 0.2
    assert c["model"]["name"] == "2nn"  # a bare word works without TOML quotes
    assert c["run"]["out"] == "elsewhere"


def test_integer_for_a_float_key_is_accepted():
    assert config.load(None, ["algorithm.lr=1"])["algorithm"]["lr"] == 1.0


@pytest.mark.parametrize("override, message", [
    ("algorithm.X=1", "unknown key algorithm.X; [algorithm] has name, C, E, B"),
    ("algo.C=1", "unknown section 'algo' (did you mean 'algorithm'?); sections are run, data, model, algorithm"),
    ("network.default_profile=6g", "network.default_profile = '6g' is not a profile; profiles are ideal, lan"),
    ("network.profiles.x.loss=2", "network.profiles.x.loss = 2 must be a probability in [0, 1]"),
    ("network.profiles.x.bandwidth=fast", "network.profiles.x.bandwidth = 'fast': use bytes/s or a number with a unit"),
    ("network.dropout.per_round=1.5", "network.dropout.per_round = 1.5 must be a probability in [0, 1]"),
    ("network.stragglers.distribution=gamma", "network.stragglers.distribution = 'gamma': choose one of none, fixed"),
    ("network.latency=5", "unknown key network.latency; [network] has seed, transport, default_profile"),
    ("run.time_scale=0", "run.time_scale = 0.0 is out of range; it must be in (0, 1e6]"),
    ("model.name=resnet", "model.name: unknown model 'resnet': fedemu has 2nn, cnn, cifar-cnn, char-lstm"),
    ("algorithm.C=0", "algorithm.C = 0.0 is out of range; it must be in (0, 1]"),
    ("algorithm.E=one", "algorithm.E = 'one' must be an integer"),
    ("algorithm.E=true", "algorithm.E = True must be an integer"),
    ("run.rounds=-3", "run.rounds = -3 is out of range; it must be > 0"),
    ("algorithm.lr=nan", "algorithm.lr = nan must be finite"),
    ("algorithm.quorum=11", "algorithm.quorum = 11 exceeds the 10 clients selected per round (m = max(C*K, 1)"),
    ("algorithmC=1", "must look like section.key=value"),
])
def test_bad_values_name_the_key_and_what_it_accepts(override, message):
    with pytest.raises(ConfigError) as err:
        config.load(None, [override])
    assert message in str(err.value)


def test_bad_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nseed = 1")
    with pytest.raises(ConfigError, match=f"{bad} is not valid TOML"):
        config.load(bad)
    bad.write_text("[netwerk]\nlatency_ms = 5")
    with pytest.raises(ConfigError, match=r"unknown section \[netwerk\] \(did you mean \[network\]\?\); sections are run, data, model, algorithm"):
        config.load(bad)


def test_resolved_config_round_trips_through_toml(tmp_path):
    path = tmp_path / "net.toml"
    path.write_text("""
[network]
default_profile = "lte"
[network.profiles.sat]
latency_ms = 300
up = { bandwidth = "1Mbit" }
[[network.assign]]
profile = "sat"
clients = "0-9"
[network.dropout]
per_round = 0.1
windows = [{ clients = "20-29", start_s = 10, end_s = 20 }]
""")
    c = config.load(path, ['run.out=a "quoted" path', "algorithm.lr=0.05"])
    assert tomllib.loads(config.to_toml(c)) == c


def test_m_is_floor_of_C_times_K_at_least_one():
    from fedemu.common.algorithms.rounds import selected_per_round

    assert selected_per_round(0.1, 100) == 10
    assert selected_per_round(0.0001, 100) == 1
    assert selected_per_round(0.15, 10) == 1
    assert selected_per_round(0.3, 10) == 3  # 0.3 * 10 is 2.9999999999999996 in floats
    assert selected_per_round(1.0, 7) == 7


@pytest.mark.parametrize("name", ["coop", "fedasync", "fedbuff"])
def test_per_round_dropout_is_refused_for_rules_without_rounds(name):
    sets = [f"algorithm.name={name}", "network.dropout.per_round=0.2", "algorithm.b_l=2", "algorithm.b_u=5"]
    with pytest.raises(ConfigError, match=rf"network.dropout.per_round = 0.2 .* {name!r} is asynchronous"):
        config.load(None, sets)
    config.load(None, sets[:1] + ["network.dropout.on_off.mean_up_s=60", "network.dropout.on_off.mean_down_s=5"] + sets[2:])


def test_centralised_needs_one_client_holding_all_the_data():
    with pytest.raises(config.ConfigError, match=r"'centralised'.*data\.clients = 1.*got 100 clients"):
        config.load(None, ["algorithm.name=centralised"])
    with pytest.raises(config.ConfigError, match=r"partition 'shards'"):
        config.load(None, ["algorithm.name=centralised", "data.clients=1", "data.partition=shards"])
    assert config.load(None, ["algorithm.name=centralised", "data.clients=1"])["algorithm"]["name"] == "centralised"


def test_server_settings_follow_the_config():
    c = config.load(None, ["algorithm.E=5", "algorithm.B=50", "run.eval_every=3", "algorithm.eval_every_uploads=7",
                           "data.clients=20", "run.seed=4"])
    s = config.server_settings(c, workers=2, device="cpu")
    assert (s.clients, s.seed, s.epochs, s.batch_size, s.workers, s.device) == (20, 4, 5, 50, 2, "cpu")
    assert s.eval_every == 3 and s.compression is None  # rounds: run.eval_every; nothing compressed
    asynchronous = config.load(None, ["algorithm.name=coop", "algorithm.b_l=2", "algorithm.b_u=5",
                                      "algorithm.eval_every_uploads=7", "compression.structured=random_mask",
                                      "compression.keep_fraction=0.5"])
    s = config.server_settings(asynchronous, workers=1, device="cpu")
    assert s.eval_every == 7  # uploads, for a rule without rounds
    assert s.compression == config.compression_spec(asynchronous).to_dict()


# Issue 41's configs: each was accepted, and the run then failed in its nodes, trained
# nothing or misjudged its nodes' liveness.
REFUSED_BEFORE_ANYTHING_STARTS = [
    (["algorithm.lr=1e308"], "algorithm.lr = 1e+308 is out of range; it must be in (0, 1000]"),
    (["run.rounds=99999999999999999999999"], "run.rounds = 99999999999999999999999 is out of range; it must fit an int64"),
    (["run.heartbeat_interval_s=10", "run.heartbeat_timeout_s=5"],
     "run.heartbeat_timeout_s = 5 must be at least twice run.heartbeat_interval_s = 10"),
    (["data.dataset=shakespeare"], "model.name = '2nn' does not fit data.dataset = 'shakespeare', whose examples are "
                                   "80 token ids (int64): RuntimeError: mat1 and mat2 must have the same dtype"),
    (["model.name=char-lstm"], "model.name = 'char-lstm' does not fit data.dataset = 'mnist', whose examples are "
                               "1x28x28 floats: ValueError: the char LSTM takes sequences of token ids"),
]


@pytest.mark.parametrize("sets, message", REFUSED_BEFORE_ANYTHING_STARTS,
                         ids=[s[0].split("=")[0] for s, _ in REFUSED_BEFORE_ANYTHING_STARTS])
def test_a_bad_config_is_refused_before_a_run_directory_is_made(tmp_path, sets, message):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stdout + done.stderr
    assert not run_dir.exists()
    assert message in str(pytest.raises(ConfigError, config.load, None, sets).value)  # `fedemu check`'s path too


def test_the_model_check_suggests_the_model_made_for_the_data_set():
    with pytest.raises(ConfigError, match=r"use model.name = 'char-lstm', made for shakespeare$"):
        config.load(None, ["data.dataset=shakespeare", "model.name=cnn"])
    config.load(None, ["data.dataset=shakespeare", "model.name=char-lstm"])
    config.load(None, ["data.dataset=cifar10", "model.name=2nn"])  # it flattens any input: it fits


# Issue 54: three mistakes, one run of `fedemu check`.
THREE_MISTAKES = """
[run]
clock = "virtal"

[algorithm]
C = 2
deadine_s = 30
"""


def test_fedemu_check_names_every_problem_at_once_with_suggestions(tmp_path):
    path = tmp_path / "three.toml"
    path.write_text(THREE_MISTAKES)
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "check", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "3 problems in the config" in done.stderr
    assert "unknown key algorithm.deadine_s (did you mean algorithm.deadline_s?)" in done.stderr
    assert "algorithm.C = 2.0 is out of range; it must be in (0, 1]" in done.stderr
    assert "run.clock = 'virtal' is not allowed (did you mean 'virtual'?); choose one of 'virtual', 'wall'" \
        in done.stderr
    assert "ok: the config is valid" not in done.stdout


def test_fedemu_launch_refuses_a_config_naming_every_problem(tmp_path):
    path, run_dir = tmp_path / "three.toml", tmp_path / "run"
    path.write_text(THREE_MISTAKES)
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", str(path), "--out", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    for key in ("algorithm.deadine_s", "algorithm.C", "run.clock"):
        assert key in done.stderr, done.stderr
    assert not run_dir.exists()


def test_every_problem_is_an_error_of_its_own_naming_its_key():
    with pytest.raises(ConfigError) as err:
        config.load(None, ["algorithm.deadine_s=5", "algorithm.C=2", "run.clock=virtal", "run.rounds=0"])
    errors = err.value.errors
    assert all(isinstance(e, ConfigError) for e in errors)
    # loading's problems first, then the schema's order
    assert [re.search(r"[a-z]+\.\w+", str(e)).group() for e in errors] \
        == ["algorithm.deadine_s", "run.rounds", "run.clock", "algorithm.C"]


@pytest.mark.parametrize("override, suggestion", [
    ("algorithm.deadine_s=5", "unknown key algorithm.deadine_s (did you mean algorithm.deadline_s?)"),
    ("algorithm.c=0.2", "unknown key algorithm.c (did you mean algorithm.C?)"),  # case aside
    ("run.heartbeat_intervall_s=1", "(did you mean run.heartbeat_interval_s?)"),
    ("algoritm.C=0.2", "unknown section 'algoritm' (did you mean 'algorithm'?)"),
    ("network.transprt=tcp", "unknown key network.transprt (did you mean network.transport?)"),
    ("network.dropout.per_rnd=0.1", "(did you mean network.dropout.per_round?)"),
])
def test_a_misspelt_key_gets_a_suggestion(override, suggestion):
    with pytest.raises(ConfigError) as err:
        config.load(None, [override])
    assert suggestion in str(err.value)


@pytest.mark.parametrize("override, suggestion", [
    ("run.clock=virtual_", "run.clock = 'virtual_' is not allowed (did you mean 'virtual'?)"),
    ("algorithm.on_quorum_missed=extend", "(did you mean 'extend_once'?)"),
    ("algorithm.name=fedprx", "unknown algorithm 'fedprx' (did you mean 'fedprox'?)"),
    ("model.name=CNN", "unknown model 'CNN' (did you mean 'cnn'?)"),
    ("data.dataset=mnsit", "unknown data set 'mnsit' (did you mean 'mnist'?)"),
    ("network.transport=tpc", "network.transport = 'tpc' (did you mean 'tcp'?) must be one of tcp, message"),
    ("network.default_profile=lan_", "network.default_profile = 'lan_' is not a profile (did you mean 'lan'?)"),
    ("network.stragglers.distribution=lognormel", "(did you mean 'lognormal'?)"),
])
def test_a_misspelt_value_gets_a_suggestion(override, suggestion):
    with pytest.raises(ConfigError) as err:
        config.load(None, [override])
    assert suggestion in str(err.value)


@pytest.mark.parametrize("override", ["algorithm.X=1", "run.clock=sundial", "algorithm.name=scaffold"])
def test_nothing_close_gets_no_suggestion(override):
    with pytest.raises(ConfigError) as err:
        config.load(None, [override])
    assert "did you mean" not in str(err.value)


def test_a_check_across_sections_is_skipped_where_a_key_it_reads_is_bad():
    # heartbeat_interval_s is not a number: comparing it with the timeout would only restate that
    with pytest.raises(ConfigError) as err:
        config.load(None, ["run.heartbeat_interval_s=fast", "data.dataset=nosuchdata"])
    assert [str(e).split(" ")[0] for e in err.value.errors] == ["run.heartbeat_interval_s", "data.dataset:"]
    # ... and runs where they are good, next to a bad key elsewhere
    with pytest.raises(ConfigError) as err:
        config.load(None, ["run.heartbeat_interval_s=10", "run.heartbeat_timeout_s=5", "algorithm.E=0"])
    assert len(err.value.errors) == 2 and "must be at least twice" in str(err.value)


def test_a_file_that_is_not_toml_stops_at_once(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nseed = 1")
    with pytest.raises(ConfigError) as err:
        config.load(bad, ["algorithm.C=2"])
    assert "is not valid TOML" in str(err.value) and "algorithm.C" not in str(err.value)


def test_close_match_ignores_case_and_what_is_no_word():
    from fedemu.node.schema import close_match, did_you_mean

    assert close_match("Virtual", ["virtual", "wall"]) == "virtual"
    assert close_match("wall", ["virtual", "wall"]) is None  # not a misspelling
    assert close_match(3, ["virtual", "wall"]) is None
    assert did_you_mean("fedavgg", ["fedavg", "fedsgd"]) == " (did you mean 'fedavg'?)"
    assert did_you_mean("zzz", ["fedavg", "fedsgd"]) == ""


def test_a_bad_key_is_named_once():
    with pytest.raises(ConfigError) as err:
        config.load(None, ["algorithm.name=5"])
    assert [str(e) for e in err.value.errors] == ["algorithm.name = 5 must be a string"]
