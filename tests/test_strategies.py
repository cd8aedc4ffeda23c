import math
from fractions import Fraction

import numpy as np
import pytest

from fedemu.common import algorithms
from fedemu.common.algorithms.fedopt import FedAdam, FedYogi
from fedemu.common.algorithms.fedprox import FedProx, Proximal
from fedemu.common.algorithms.centralised import Centralised
from fedemu.common.algorithms.fedavg import FedAvg
from fedemu.common.algorithms.fedsgd import FedSGD
from fedemu.common.algorithms.fsvrg import FSVRG
from fedemu.common.algorithms.rounds import WeightedMean, weighted_average
from fedemu.common.messages import GRADIENT, SVRG, TRAIN, TrainReply


def reply(update, n, task=TRAIN):
    return TrainReply(round=1, client=0, task=task, update=np.asarray(update, np.float32),
                      num_samples=n, train_loss=0.0, compute_s=0.0)


class Phases:
    """Stands in for the round engine's run_phase: records each request, answers from a script."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = []

    def __call__(self, task, lr, **extra):
        self.calls.append((task, lr, extra))
        return self.answers.pop(0)


def test_weighted_average_by_sample_counts_hand_computed():
    # (100*[1,2] + 300*[5,-2]) / 400 = [4, -1]
    got = weighted_average([np.array([1.0, 2.0]), np.array([5.0, -2.0])], [100, 300])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [4.0, -1.0], rtol=0, atol=1e-7)


def test_the_mean_folded_one_update_at_a_time_is_the_exact_mean_rounded_once():
    """The server folds updates as they arrive and keeps none: the result is the exact
    rational mean sum n_k u_k / sum n_k, rounded to float32 (checked with Fractions)."""
    rng = np.random.default_rng(5)
    updates = [rng.standard_normal(200).astype(np.float32) * 10.0 ** rng.integers(-4, 2) for _ in range(7)]
    counts = [1, 600, 3, 17, 600, 250, 9]
    mean = WeightedMean()
    for update, n in zip(updates, counts):
        mean.add(update, n)
    got = mean.result()
    assert got.dtype == np.float32 and mean.total == sum(counts)
    exact = [sum(Fraction(float(u[i])) * n for u, n in zip(updates, counts)) / sum(counts) for i in range(200)]
    assert got.tolist() == np.array([float(x) for x in exact], dtype=np.float32).tolist()
    with pytest.raises(ValueError, match="shape"):
        mean.add(np.zeros(3, np.float32), 1)


def test_weighted_average_rejects_nothing_to_average():
    with pytest.raises(ValueError, match="no updates"):
        weighted_average([], [])
    with pytest.raises(ValueError, match="2 updates but 1"):
        weighted_average([np.zeros(1), np.zeros(1)], [1])


def test_fedavg_averages_only_the_arrivals():
    phases = Phases([reply([3, 3, 3], 600), reply([0, 6, 9], 200)])
    new = FedAvg(lr=0.1, lr_decay=1e-4).run_round(phases, np.zeros(3, np.float32), 1)
    np.testing.assert_allclose(new, [2.25, 3.75, 4.5], atol=1e-6)
    # The clients get the base rate and the decay: they count their own iterations.
    assert phases.calls == [(TRAIN, 0.1, {"lr_decay": 1e-4})]


def test_centralised_takes_its_one_clients_model_bit_for_bit():
    trained = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    phases = Phases([reply(trained, 56_000)])
    new = Centralised(lr=0.0703, lr_decay=3.77e-6).run_round(phases, np.zeros(1000, np.float32), 1)
    np.testing.assert_array_equal(new, trained)  # no averaging error: it is plain SGD over all the data
    assert phases.calls == [(TRAIN, 0.0703, {"lr_decay": 3.77e-6})]
    assert Centralised.selects_all


def test_a_round_without_quorum_keeps_the_model():
    assert FedAvg(lr=0.1).run_round(Phases(None), np.zeros(3, np.float32), 1) is None
    assert FSVRG(lr=0.1, h=4.0).run_round(Phases(None), np.zeros(3, np.float32), 1) is None


def test_fedsgd_steps_along_the_weighted_gradient_with_per_round_decay():
    w = np.array([1.0, 1.0], np.float32)
    phases = Phases([reply([2, 0], 1, GRADIENT), reply([0, 4], 3, GRADIENT)])
    new = FedSGD(lr=0.5).run_round(phases, w, 1)
    # g = (1*[2,0] + 3*[0,4]) / 4 = [0.5, 3]; w - 0.5 g = [0.75, -0.5]
    np.testing.assert_allclose(new, [0.75, -0.5], atol=1e-6)
    assert phases.calls[0][0] == GRADIENT
    decayed = FedSGD(lr=0.088, lr_decay=3.2e-6)
    assert decayed.learning_rate(1001) == pytest.approx(0.088 / (1 + 3.2e-6 * 1000))


def test_fsvrg_sends_the_weighted_full_gradient_then_averages_the_models():
    w = np.zeros(2, np.float32)
    phases = Phases([reply([1, 0], 100, GRADIENT), reply([0, 1], 300, GRADIENT)],
                    [reply([4, 4], 100, SVRG), reply([8, 0], 300, SVRG)])
    new = FSVRG(lr=0.1, h=4.0).run_round(phases, w, 1)
    (task1, _, extra1), (task2, h, extra2) = phases.calls
    assert (task1, task2, h) == (GRADIENT, SVRG, 4.0)
    np.testing.assert_allclose(extra2["extra"]["full_gradient"], [0.25, 0.75])  # n_k / n weighted
    np.testing.assert_allclose(new, [7.0, 1.0])
    assert FSVRG.selects_all and not FedAvg.selects_all


def test_unknown_algorithm_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown algorithm 'fedavgg' \(did you mean 'fedavg'\?\): fedemu has fedavg, fedsgd, fsvrg, "
                                         "centralised, coop, fedasync, fedbuff, fedprox, fedadam, fedyogi"):
        algorithms.get("fedavgg")
    with pytest.raises(ValueError, match=r"cannot import 'nosuchpackage.algos' \(No module named 'nosuchpackage'\)"):
        algorithms.get("nosuchpackage.algos:Mine")
    with pytest.raises(ValueError, match="module 'fedemu.common.algorithms.rounds' has no 'Nope'"):
        algorithms.get("fedemu.common.algorithms.rounds:Nope")
    with pytest.raises(ValueError, match="not a subclass of fedemu's Strategy or AsyncRule"):
        algorithms.get("fedemu.common.algorithms.rounds:weighted_average")
    assert algorithms.get("fedemu.common.algorithms.fedavg:FedAvg") is FedAvg


def test_fedprox_asks_for_the_proximal_term_and_averages_as_fedavg():
    phases = Phases([reply([3, 3, 3], 600), reply([0, 6, 9], 200)])
    new = FedProx(lr=0.1, lr_decay=1e-4, mu=0.5).run_round(phases, np.zeros(3, np.float32), 1)
    np.testing.assert_allclose(new, [2.25, 3.75, 4.5], atol=1e-6)
    assert phases.calls == [(Proximal, 0.1, {"lr_decay": 1e-4, "extra": {"mu": 0.5}})]


def _fedopt_rounds(cls, w0, averages):
    """Rounds whose clients' average model is w_t + Delta_t (one client, so the average is it)."""
    strategy = cls(lr=0.1, eta=1.0, beta1=0.5, beta2=0.75, tau=1.0)
    w = np.asarray(w0, np.float32)
    out = []
    for delta in averages:
        w = strategy.run_round(Phases([reply(w + np.asarray(delta, np.float32), 10)]), w, len(out) + 1)
        out.append(w)
    return out


def test_fedadam_and_fedyogi_hand_computed():
    """beta1 = 0.5, beta2 = 0.75, tau = 1, eta = 1; m starts at 0, v at tau^2 = 1.
    Round 1, Delta = [1, -1]: m = [0.5, -0.5]; Adam v = 0.75 + 0.25 = [1, 1]; Yogi v = 1 - 0.25 *
    1 * sign(1 - 1) = [1, 1]; w1 = w0 + m / (sqrt(v) + 1) = w0 + [0.25, -0.25] for both.
    Round 2, Delta = [3, 0]: m = 0.5 m + 0.5 Delta = [1.75, -0.25]. Adam v = 0.75 [1, 1] +
    0.25 [9, 0] = [3, 0.75]; Yogi v = [1, 1] - 0.25 [9, 0] sign([1 - 9, 1 - 0]) = [3.25, 1]:
    Yogi's v moved by (1 - beta2) Delta^2 only, and did not decay where Delta = 0."""
    w0 = [2.0, 2.0]
    adam = _fedopt_rounds(FedAdam, w0, [[1, -1], [3, 0]])
    yogi = _fedopt_rounds(FedYogi, w0, [[1, -1], [3, 0]])
    for w in (adam, yogi):
        np.testing.assert_allclose(w[0], [2.25, 1.75], atol=1e-6)
    np.testing.assert_allclose(adam[1], [2.25 + 1.75 / (math.sqrt(3) + 1), 1.75 - 0.25 / (math.sqrt(0.75) + 1)],
                               atol=1e-6)
    np.testing.assert_allclose(yogi[1], [2.25 + 1.75 / (math.sqrt(3.25) + 1), 1.75 - 0.25 / 2], atol=1e-6)


def test_fedopt_keeps_its_moments_through_a_round_without_quorum():
    strategy = FedAdam(lr=0.1, eta=1.0, beta1=0.5, beta2=0.75, tau=1.0)
    w = np.full(2, 2.0, np.float32)
    w = strategy.run_round(Phases([reply(w + np.array([1, -1], np.float32), 10)]), w, 1)
    assert strategy.run_round(Phases(None), w, 2) is None
    w = strategy.run_round(Phases([reply(w + np.array([3, 0], np.float32), 10)]), w, 3)
    np.testing.assert_allclose(w, [2.25 + 1.75 / (math.sqrt(3) + 1), 1.75 - 0.25 / (math.sqrt(0.75) + 1)],
                               atol=1e-6)


def test_fedopt_averages_by_sample_counts_before_its_step():
    """Two clients: Delta = (600 [4, 0] + 200 [0, 8]) / 800 = [3, 2]; one round with beta1 = 0,
    beta2 = 0, tau = 1, eta = 1 is w + Delta / (|Delta| + 1)."""
    strategy = FedAdam(lr=0.1, eta=1.0, beta1=0.0, beta2=0.0, tau=1.0)
    w = np.zeros(2, np.float32)
    new = strategy.run_round(Phases([reply([4, 0], 600), reply([0, 8], 200)]), w, 1)
    np.testing.assert_allclose(new, [3 / 4, 2 / 3], atol=1e-6)


def test_a_per_round_decay_scales_the_rate_each_round():
    """McMahan et al.'s CIFAR-10 decay: lr x gamma^(t - 1), FedAvg's sent to the clients,
    FedSGD's taken by the server's step (then Keras' decay on top)."""
    fedavg = FedAvg.from_config({"lr": 0.1, "lr_decay": 0.0, "lr_round_decay": 0.5})
    phases = Phases(*[[reply([1, 1], 1)]] * 3)
    for round_ in (1, 2, 3):
        fedavg.run_round(phases, np.zeros(2, np.float32), round_)
    assert [lr for _, lr, _ in phases.calls] == [0.1, 0.05, 0.025]
    fedsgd = FedSGD.from_config({"lr": 0.5, "lr_decay": 1.0, "lr_round_decay": 0.5})
    new = fedsgd.run_round(Phases([reply([2, 0], 1, GRADIENT)]), np.array([1.0, 1.0], np.float32), 3)
    # lr 0.5 x 0.5^2 = 0.125, then / (1 + 1.0 x 2) = 0.041666...; w - lr g
    np.testing.assert_allclose(new, [1.0 - 2 * 0.125 / 3, 1.0], rtol=1e-6)
    assert FedAvg.from_config({"lr": 0.1, "lr_decay": 0.0}).round_lr(50) == 0.1  # none unless asked


def test_a_per_round_decay_is_refused_without_rounds():
    from fedemu.launch import config as configuration

    with pytest.raises(configuration.ConfigError, match="algorithm.lr_round_decay = 0.99: coop has no rounds"):
        configuration.load(None, ["algorithm.name=coop", "algorithm.lr_round_decay=0.99"])
    with pytest.raises(configuration.ConfigError, match=r"lr_round_decay = 1.5 is out of range; it must be in \(0, 1\]"):
        configuration.load(None, ["algorithm.lr_round_decay=1.5"])
