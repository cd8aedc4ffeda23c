import numpy as np
import pytest

from fedemu.server.strategies import FedAvg, FedSGD, make, weighted_average
from fedemu.worker.protocol import GRADIENT, TRAIN, TrainReply


def reply(update, n, task=TRAIN):
    return TrainReply(round=1, client=0, task=task, update=np.asarray(update, np.float32),
                      num_samples=n, train_loss=0.0, compute_s=0.0)


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
    w = np.zeros(3, np.float32)
    new = FedAvg(lr=0.1).aggregate(w, [reply([3, 3, 3], 600), reply([0, 6, 9], 200)], 1)
    np.testing.assert_allclose(new, [2.25, 3.75, 4.5], atol=1e-6)


def test_fedsgd_steps_along_the_weighted_gradient():
    w = np.array([1.0, 1.0], np.float32)
    strategy = FedSGD(lr=0.5)
    assert strategy.task == GRADIENT
    new = strategy.aggregate(w, [reply([2, 0], 1, GRADIENT), reply([0, 4], 3, GRADIENT)], 1)
    # g = (1*[2,0] + 3*[0,4]) / 4 = [0.5, 3]; w - 0.5 g = [0.75, -0.5]
    np.testing.assert_allclose(new, [0.75, -0.5], atol=1e-6)


def test_keras_style_learning_rate_decay():
    s = FedAvg(lr=0.088, lr_decay=3.2e-6)
    assert s.learning_rate(1) == pytest.approx(0.088)
    assert s.learning_rate(1001) == pytest.approx(0.088 / (1 + 3.2e-6 * 1000))


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="unknown algorithm 'coop'; round-based ones are fedavg, fedsgd"):
        make("coop", 0.1)
