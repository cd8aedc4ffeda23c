import math

import numpy as np
import pytest

from fedemu.launch import config as configuration
from fedemu.common.algorithms.coop import Coop
from fedemu.common.algorithms.fedasync import FedAsync, staleness_weight
from fedemu.common.algorithms.fedbuff import FedBuff
from fedemu.server.checks import check
from fedemu.node import Message
from fedemu.common.ml import models
from fedemu.worker.client import Client, ModelCache, client_generator
from fedemu.common.ml.data import Data
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.models import ModelSpec
from fedemu.common.messages import AgeReply, AgeRequest, AsyncStart, TrainAgain, Upload
from fedemu.common.ml.training import client_update

from .test_compression import CLIENT, RUN_SEED, SERVER, _data, _Outbox

MNIST = dataset_named("mnist")


def upload(update, age, is_delta=False, client=0):
    return Upload(client=client, update=np.asarray(update, np.float32), is_delta=is_delta, age=age,
                  num_samples=600, train_loss=0.0, compute_s=0.0)


def test_coop_merge_weight_follows_the_age_gap():
    rule = Coop(b_l=16, b_u=51)
    assert rule.server_age_start() == 16
    w = np.zeros(2, np.float32)
    # a = 19, a_k = 16: alpha = (19 - 16 + 1)^(-1/2) = 1/2
    new, age, merged = rule.merge(w, 19, upload([2.0, -4.0], 16))
    np.testing.assert_allclose(new, [1.0, -2.0])
    assert (age, merged) == (20, True)


@pytest.mark.parametrize("kind, s, expected", [
    ("constant", 7, 1.0),
    ("polynomial", 3, (3 + 1) ** -0.5),
    ("hinge", 4, 1.0),  # s <= b
    ("hinge", 6, 1 / (0.5 * (6 - 4) + 1)),
])
def test_fedasync_staleness_functions(kind, s, expected):
    assert staleness_weight(kind, s, a=0.5, b=4) == pytest.approx(expected)


def test_fedasync_mixes_by_alpha_times_staleness():
    rule = FedAsync(alpha=0.6, staleness="polynomial", a=0.5, b=4)
    new, age, merged = rule.merge(np.zeros(1, np.float32), 10, upload([1.0], 7))
    assert new[0] == pytest.approx(0.6 * (3 + 1) ** -0.5)
    assert (age, merged) == (11, True)
    with pytest.raises(ValueError, match="unknown staleness function 'cubic'"):
        FedAsync(0.6, "cubic", 0.5, 4)


def test_fedbuff_waits_for_a_full_buffer_of_staleness_weighted_deltas():
    rule = FedBuff(buffer_size=2, server_lr=0.5)
    w = np.ones(1, np.float32)
    w1, age1, merged1 = rule.merge(w, 5, upload([2.0], 5, is_delta=True))  # staleness 0: weight 1
    assert (w1[0], age1, merged1) == (1.0, 5, False)
    w2, age2, merged2 = rule.merge(w1, 5, upload([4.0], 2, is_delta=True))  # staleness 3: weight 1/2
    assert w2[0] == pytest.approx(1.0 + 0.5 * (2.0 + 4.0 / math.sqrt(4)) / 2)
    assert (age2, merged2) == (6, True)
    with pytest.raises(ValueError, match="FedBuff needs model deltas"):
        rule.merge(w2, 6, upload([1.0], 6, is_delta=False))


def algo(**changes):
    return {**configuration.default()["algorithm"], **changes}


def test_static_checks_name_the_rule_and_the_numbers():
    certain = check(algo(name="coop", b_l=10, b_u=30), clients=10, network_can_drop=False)
    assert [f.rule for f in certain] == ["coop-certain-deadlock"]
    assert "b_l = 10 >= K = 10 deadlocks for certain" in certain[0].message
    possible = check(algo(name="coop", b_l=10, b_u=15), clients=100, network_can_drop=False)
    assert [f.rule for f in possible] == ["coop-possible-deadlock"]
    assert "b_u = 15 < 2*b_l = 20 and K = 100 >= b_u - b_l + 1 = 6" in possible[0].message
    assert possible[0].waivable_by == "algorithm.accept_deadlock_risk"
    assert check(algo(name="coop", b_l=16, b_u=51), clients=100, network_can_drop=True) == []
    no_deadline = check(algo(name="fedavg", deadline_s=0.0), clients=100, network_can_drop=True)
    assert [f.rule for f in no_deadline] == ["sync-without-deadline"]
    assert check(algo(name="fedavg", deadline_s=0.0), clients=100, network_can_drop=False) == []
    quorum = check(algo(name="fsvrg", quorum=101), clients=100, network_can_drop=False)
    assert [f.rule for f in quorum] == ["quorum-above-selection"]


def test_launch_refuses_unless_the_risk_is_accepted():
    with pytest.raises(configuration.ConfigError, match="Theorem A.1"):
        configuration.load(None, ["algorithm.name=coop", "algorithm.b_l=10", "algorithm.b_u=15"])
    accepted = configuration.load(None, ["algorithm.name=coop", "algorithm.b_l=10", "algorithm.b_u=15",
                                         "algorithm.accept_deadlock_risk=true"])
    assert accepted["algorithm"]["accept_deadlock_risk"] is True
    # A certain deadlock cannot be waived.
    with pytest.raises(configuration.ConfigError, match="deadlocks for certain"):
        configuration.load(None, ["algorithm.name=coop", "algorithm.b_l=100", "algorithm.b_u=300",
                                  "algorithm.accept_deadlock_risk=true"])


SKETCH = ["compression.subsample=0.0625", "compression.rotate=true", "compression.bits=2"]


@pytest.mark.parametrize("name", ["fedbuff", "fedasync", "coop"])
def test_config_accepts_compression_for_the_asynchronous_rules(name):
    loaded = configuration.load(None, [f"algorithm.name={name}", *SKETCH])
    assert loaded["compression"]["bits"] == 2


@pytest.mark.parametrize("name, uploads", [("fedsgd", "gradients"), ("fsvrg", "a full gradient")])
def test_compression_refusal_names_the_rule_and_why(name, uploads):
    with pytest.raises(configuration.ConfigError) as err:
        configuration.load(None, [f"algorithm.name={name}", *SKETCH])
    assert f"algorithm.name = {name!r} uploads {uploads}" in str(err.value)
    assert "(algorithm.name = fedavg, coop, fedasync, fedbuff, fedprox, fedadam, fedyogi: " in str(err.value)


MODEL_BYTES = 199_210 * 4  # one 2NN as float32


@pytest.mark.mnist
@pytest.mark.slow
def test_fedbuff_with_compression_uploads_far_fewer_bytes_and_still_learns(tmp_path):
    import json

    from fedemu.server.runlog import read_events

    from .test_launch import launch

    run_dir = tmp_path / "run"
    proc = launch(run_dir, "data.clients=10", "algorithm.name=fedbuff", "algorithm.buffer_size=5",
                  "algorithm.eval_every_uploads=5", "algorithm.B=50", "run.rounds=3", *SKETCH, workers=1)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["uploads"] == 15 and summary["faults"] == 0
    # Uploads are the only messages up: each is the sketch (about 5 kB) instead of an 800 kB delta.
    # (Per run, not per evaluation: a burst of uploads is counted in the evaluation
    # before the merges it feeds, so one period can carry none.)
    evaluations = [e for e in read_events(run_dir) if e["event"] == "round"]
    bytes_up, msgs_up = sum(e["bytes_up"] for e in evaluations), sum(e["msgs_up"] for e in evaluations)
    assert msgs_up >= 15 and 0 < bytes_up < msgs_up * MODEL_BYTES / 100
    assert not [e for e in read_events(run_dir) if e["event"] == "fault"]
    # Chance is 0.10; 15 sketched uploads of one local epoch each reach about 0.8.
    assert summary["final_accuracy"] >= 0.6


# --- an over-active CO-OP client (protocol.OVER_ACTIVE) ----------------------------------


@pytest.mark.parametrize("over_active", ["retrain", "continue"])
def test_an_over_active_coop_client_trains_again_from_the_model_its_rule_names(over_active):
    """Nilsson et al.'s code ("retrain") throws the over-active training away and trains
    again from the last model received; "continue" trains on from the trained model.
    Either way the age sent is the base's, and the iteration count (Keras-style decay)
    runs on across the discarded training."""
    images, labels = _data(20)
    dataset = Data("fake", MNIST, images, labels, images, labels)
    base = models.get_flat(models.build("2nn", (1, 28, 28), 10, seed=3))
    client = Client(0, np.arange(20), dataset, ModelSpec("2nn", MNIST), ModelCache())
    device = _Outbox()
    device.pid = CLIENT
    start = AsyncStart(rule="coop", weights=base, age=0, epochs=1, batch_size=10, lr=0.1, lr_decay=0.01,
                       seed=RUN_SEED, extra=Coop(b_l=2, b_u=5, over_active=over_active).client_payload())
    client.handle(device, Message(SERVER, start))
    trained_once = client._weights.copy()
    assert isinstance(device.sent[-1], AgeRequest)
    client.handle(device, Message(SERVER, AgeReply(age=1, request=device.sent[-1].request)))  # a - a_k = 1 < b_l
    assert isinstance(device.sent[-1], TrainAgain)
    client.handle(device, Message(CLIENT, device.sent[-1]))
    client.handle(device, Message(SERVER, AgeReply(age=2, request=device.sent[-1].request)))  # a - a_k = b_l
    upload = device.sent[-1]
    assert isinstance(upload, Upload) and upload.age == 0

    model = models.build("2nn", (1, 28, 28), 10)
    models.set_flat(model, base if over_active == "retrain" else trained_once)
    expected = client_update(model, images, labels, epochs=1, batch_size=10, lr=0.1, lr_decay=0.01,
                             generator=client_generator(RUN_SEED, 2, 0), start_iteration=2)
    np.testing.assert_array_equal(upload.update, expected.weights)
    assert client.iterations == 4  # 2 steps a training, the discarded one included


def test_over_active_is_checked_and_named():
    assert configuration.load(None)["algorithm"]["over_active"] == "retrain"
    with pytest.raises(configuration.ConfigError, match=r"algorithm\.over_active"):
        configuration.load(None, ["algorithm.over_active=skip"])


def test_normal_init_draws_every_weight_and_bias_from_its_normal():
    """model.init = "normal" (Nilsson et al.'s server: N(0, 0.003) in Erlang, whose second
    argument is the variance): every parameter, biases included, with the given spread;
    deterministic in the seed."""
    std = math.sqrt(0.003)
    model = models.build("2nn", (1, 28, 28), 10, seed=1, init="normal", init_std=std)
    for parameter in model.parameters():
        values = parameter.detach().numpy().ravel()
        assert abs(values.mean()) < 4 * std / math.sqrt(values.size) + 1e-3
        # Five standard errors of a sample standard deviation, sqrt(1 / (2n)) relative.
        assert values.std() == pytest.approx(std, rel=5 / math.sqrt(2 * values.size))
    again = models.get_flat(models.build("2nn", (1, 28, 28), 10, seed=1, init="normal", init_std=std))
    np.testing.assert_array_equal(models.get_flat(model), again)
    torch_default = models.get_flat(models.build("2nn", (1, 28, 28), 10, seed=1))
    assert abs(torch_default[:784 * 200].std() - std) > 0.02  # PyTorch's own is U(±1/28): std 0.021
    with pytest.raises(configuration.ConfigError, match=r"model\.init"):
        configuration.load(None, ["model.init=xavier"])
