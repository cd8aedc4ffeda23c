import numpy as np
import pytest

from fedemu.server.strategies import FSVRG, Centralised, FedAvg, FedSGD, make, weighted_average
from fedemu.worker.protocol import GRADIENT, SVRG, TRAIN, TrainReply


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
    np.testing.assert_allclose(extra2["full_gradient"], [0.25, 0.75])  # n_k / n weighted
    np.testing.assert_allclose(new, [7.0, 1.0])
    assert FSVRG.selects_all and not FedAvg.selects_all


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="unknown algorithm 'coop'; round-based ones are fedavg, fedsgd, fsvrg"):
        make("coop", 0.1)
