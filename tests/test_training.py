import math
import warnings

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fedemu.common.algorithms.fedprox import proximal_term
from fedemu.common.algorithms.fsvrg import svrg_pass
from fedemu.common.ml import models
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.training import (
    TrainResult,
    client_update,
    evaluate,
    local_gradient,
)

MNIST = dataset_named("mnist")


def _random_data(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=count).astype(np.uint8)
    return images, labels


def _separable_data(count: int, seed: int = 0):
    """Class c lights up image row band c: trivially separable."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count).astype(np.uint8)
    images = rng.integers(0, 40, size=(count, 28, 28), dtype=np.uint8)
    for index, label in enumerate(labels):
        images[index, 2 * label : 2 * label + 2, :] = 255
    return images, labels


def _reference_client_update(model, images, labels, epochs, batch_size, lr, generator):
    """McMahan's ClientUpdate written out by hand: manual SGD, no optimizer."""
    inputs = torch.from_numpy(images.astype(np.float32) / 255).reshape(-1, 1, 28, 28)
    targets = torch.from_numpy(labels.astype(np.int64))
    count = len(labels)
    batch = batch_size or count
    parameters = list(model.parameters())
    losses = []
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator)
        losses = []
        for start in range(0, count, batch):
            chosen = order[start : start + batch]
            loss = F.cross_entropy(model(inputs[chosen]), targets[chosen])
            gradients = torch.autograd.grad(loss, parameters)
            with torch.no_grad():
                for parameter, gradient in zip(parameters, gradients):
                    parameter -= lr * gradient
            losses.append(loss.item())
    return models.get_flat(model), float(np.mean(losses))


def test_mnist_inputs_scale_and_shape():
    images = np.array([[[0] * 28] * 28, [[255] * 28] * 28], dtype=np.uint8)
    images[0, 3, 4] = 51
    tensor = MNIST.inputs(images)
    assert tensor.dtype == torch.float32 and tensor.shape == (2, 1, 28, 28)
    assert tensor[0, 0, 3, 4] == pytest.approx(0.2)
    assert tensor[1].min() == 1.0 and tensor[0].max() == pytest.approx(0.2)
    flat_rows = MNIST.inputs(images.reshape(2, 784))
    assert torch.equal(flat_rows, tensor)


def test_mnist_inputs_from_read_only_memory_map(tmp_path):
    images, _ = _random_data(5)
    np.save(tmp_path / "images.npy", images)
    mapped = np.load(tmp_path / "images.npy", mmap_mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensor = MNIST.inputs(mapped[[0, 3]])
    assert torch.equal(tensor, MNIST.inputs(images[[0, 3]]))


@pytest.mark.parametrize("name", ["2nn", "cnn"])
def test_client_update_equals_hand_written_reference(name):
    # 23 samples in batches of 5: the last batch of each epoch is partial.
    images, labels = _random_data(23)
    model = models.build(name, (1, 28, 28), 10, seed=0)
    reference = models.build(name, (1, 28, 28), 10, seed=0)

    result = client_update(
        model, images, labels, epochs=2, batch_size=5, lr=0.05,
        generator=torch.Generator().manual_seed(42),
    )
    expected_weights, expected_loss = _reference_client_update(
        reference, images, labels, epochs=2, batch_size=5, lr=0.05,
        generator=torch.Generator().manual_seed(42),
    )

    assert isinstance(result, TrainResult)
    assert result.weights.dtype == np.float32
    np.testing.assert_allclose(result.weights, expected_weights, rtol=0, atol=1e-6)
    assert result.train_loss == pytest.approx(expected_loss, rel=1e-6)
    assert result.num_samples == 23
    assert result.steps == 2 * math.ceil(23 / 5)
    # The model itself was trained in place.
    np.testing.assert_array_equal(models.get_flat(model), result.weights)


@pytest.mark.parametrize("batch_size", [None, 0, 1000])
def test_infinite_batch_takes_one_step_per_epoch(batch_size):
    images, labels = _random_data(30)
    model = models.build("2nn", (1, 28, 28), 10, seed=0)
    reference = models.build("2nn", (1, 28, 28), 10, seed=0)

    result = client_update(
        model, images, labels, epochs=3, batch_size=batch_size, lr=0.1,
        generator=torch.Generator().manual_seed(0),
    )

    assert result.steps == 3
    # Full-batch gradient descent, which is what B = infinity means.
    inputs = torch.from_numpy(images.astype(np.float32) / 255).reshape(-1, 1, 28, 28)
    targets = torch.from_numpy(labels.astype(np.int64))
    for _ in range(3):
        loss = F.cross_entropy(reference(inputs), targets)
        gradients = torch.autograd.grad(loss, list(reference.parameters()))
        with torch.no_grad():
            for parameter, gradient in zip(reference.parameters(), gradients):
                parameter -= 0.1 * gradient
    np.testing.assert_allclose(result.weights, models.get_flat(reference), rtol=0, atol=1e-6)


def test_loss_decreases_on_a_separable_problem():
    images, labels = _separable_data(200)
    model = models.build("2nn", (1, 28, 28), 10, seed=3)
    accuracy_before, loss_before = evaluate(model, images, labels)

    result = client_update(
        model, images, labels, epochs=5, batch_size=10, lr=0.1,
        generator=torch.Generator().manual_seed(0),
    )
    accuracy_after, loss_after = evaluate(model, images, labels)

    assert result.train_loss < loss_before / 4
    assert loss_after < loss_before / 4
    assert accuracy_before < 0.5 and accuracy_after == 1.0


def test_same_generator_seed_same_weights_other_seed_different():
    images, labels = _random_data(40)

    def train(seed):
        return client_update(
            models.build("cnn", (1, 28, 28), 10, seed=0), images, labels, epochs=1, batch_size=10, lr=0.1,
            generator=torch.Generator().manual_seed(seed),
        ).weights

    np.testing.assert_array_equal(train(5), train(5))
    assert not np.array_equal(train(5), train(6))


def test_client_update_rejects_empty_or_mismatched_data():
    model = models.build("2nn", (1, 28, 28), 10, seed=0)
    images, labels = _random_data(4)
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="at least one sample"):
        client_update(model, images[:0], labels[:0], epochs=1, batch_size=2, lr=0.1, generator=generator)
    with pytest.raises(ValueError, match="3 examples but 4 targets"):
        client_update(model, images[:3], labels, epochs=1, batch_size=2, lr=0.1, generator=generator)


def test_local_gradient_equals_full_batch_autograd():
    # 2,345 samples: more than one internal chunk, and a partial last one.
    images, labels = _random_data(2345)
    model = models.build("2nn", (1, 28, 28), 10, seed=4)

    gradient, loss = local_gradient(model, images, labels)

    inputs = torch.from_numpy(images.astype(np.float32) / 255).reshape(-1, 1, 28, 28)
    expected_loss = F.cross_entropy(model(inputs), torch.from_numpy(labels.astype(np.int64)))
    expected = torch.cat(
        [g.reshape(-1) for g in torch.autograd.grad(expected_loss, list(model.parameters()))]
    ).numpy()
    assert gradient.dtype == np.float32 and gradient.shape == (199_210,)
    np.testing.assert_allclose(gradient, expected, rtol=1e-4, atol=1e-7)
    assert loss == pytest.approx(expected_loss.item(), rel=1e-6)
    assert all(parameter.grad is None for parameter in model.parameters())


def test_evaluate_matches_direct_computation_and_restores_mode():
    images, labels = _random_data(53)
    model = models.build("cnn", (1, 28, 28), 10, seed=2)
    model.train()

    accuracy, loss = evaluate(model, images, labels, batch_size=7)

    with torch.no_grad():
        logits = model(torch.from_numpy(images.astype(np.float32) / 255).reshape(-1, 1, 28, 28))
    targets = torch.from_numpy(labels.astype(np.int64))
    assert accuracy == pytest.approx((logits.argmax(1) == targets).float().mean().item())
    assert loss == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-5)
    assert model.training


# --- FSVRG and learning-rate decay ------------------------------------------------------


def _tiny_problem(seed: int = 0, n: int = 12):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    return images, labels


def test_svrg_pass_matches_a_hand_written_loop():
    from fedemu.common.ml import models, training

    images, labels = _tiny_problem()
    model = models.build("2nn", (1, 28, 28), 10, seed=3)
    anchor = models.build("2nn", (1, 28, 28), 10, seed=3)
    w_t = models.get_flat(model)
    full, _ = training.local_gradient(models.build("2nn", (1, 28, 28), 10, seed=3), images, labels)
    full = full * 0.5  # any vector: the pass must add exactly this term
    # h_k = 0.5 / 12: big enough to move, small enough that float32 rounding in a
    # different operation order cannot flip a ReLU and amplify.
    result = svrg_pass(model, images, labels, anchor=anchor, full_gradient=full,
                                stepsize=0.5, generator=torch.Generator().manual_seed(11))

    reference = models.build("2nn", (1, 28, 28), 10, seed=3)
    fixed = models.build("2nn", (1, 28, 28), 10, seed=3)
    w = w_t.copy()
    for i in torch.randperm(len(labels), generator=torch.Generator().manual_seed(11)).tolist():
        models.set_flat(reference, w)
        g, _ = training.local_gradient(reference, images[i : i + 1], labels[i : i + 1])
        g0, _ = training.local_gradient(fixed, images[i : i + 1], labels[i : i + 1])
        w = w - (0.5 / len(labels)) * (g - g0 + full)
    np.testing.assert_allclose(result.weights, w, rtol=0, atol=2e-6)
    assert result.steps == len(labels)
    np.testing.assert_array_equal(models.get_flat(anchor), w_t)  # w_t stays fixed


def test_svrg_pass_at_the_anchor_starts_along_the_full_gradient():
    """At w = w_t the variance-reduced direction is exactly grad f(w_t)."""
    from fedemu.common.ml import models, training

    images, labels = _tiny_problem(n=1)
    model, anchor = models.build("2nn", (1, 28, 28), 10, seed=1), models.build("2nn", (1, 28, 28), 10, seed=1)
    w_t = models.get_flat(model)
    full = np.random.default_rng(2).standard_normal(w_t.size).astype(np.float32)
    result = svrg_pass(model, images, labels, anchor=anchor, full_gradient=full,
                                stepsize=0.1, generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(result.weights, w_t - 0.1 * full, atol=1e-6)


def test_keras_decay_lowers_each_steps_learning_rate():
    from fedemu.common.ml import models, training

    images, labels = _tiny_problem(n=4)
    decayed = models.build("2nn", (1, 28, 28), 10, seed=5)
    training.client_update(decayed, images, labels, epochs=1, batch_size=1, lr=0.1,
                           generator=torch.Generator().manual_seed(1), lr_decay=0.5, start_iteration=2)
    # Same batches by hand: step i uses lr / (1 + 0.5 * (2 + i)).
    manual = models.build("2nn", (1, 28, 28), 10, seed=5)
    for i, j in enumerate(torch.randperm(4, generator=torch.Generator().manual_seed(1)).tolist()):
        training.client_update(manual, images[j : j + 1], labels[j : j + 1], epochs=1, batch_size=1,
                               lr=0.1 / (1 + 0.5 * (2 + i)), generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(models.get_flat(decayed), models.get_flat(manual), atol=1e-6)


def test_svrg_fast_mlp_path_equals_the_autograd_path():
    """The 2NN takes an analytic path; it must compute exactly what autograd does."""
    from fedemu.common.ml import models, training

    images, labels = _tiny_problem(seed=4, n=30)
    full = np.random.default_rng(9).standard_normal(199_210).astype(np.float32) * 0.01
    results = []
    for generic in (False, True):
        model, anchor = models.build("2nn", (1, 28, 28), 10, seed=6), models.build("2nn", (1, 28, 28), 10, seed=6)
        if generic:  # hide the MLP structure so the autograd path runs
            model, anchor = torch.nn.Sequential(model), torch.nn.Sequential(anchor)
        results.append(svrg_pass(model, images, labels, anchor=anchor, full_gradient=full,
                                          stepsize=4.0, generator=torch.Generator().manual_seed(3)))
    np.testing.assert_allclose(results[0].weights, results[1].weights, rtol=0, atol=1e-5)
    assert results[0].train_loss == pytest.approx(results[1].train_loss, rel=1e-5)


def test_fedprox_term_pulls_each_step_toward_the_start_by_lr_mu():
    """Two steps (E = 1, B = n/2) from w0. Step one: w - w0 = 0, so the proximal term adds
    nothing and w1 is plain SGD's. Step two: the gradient gains mu (w1 - w0), so
    w2_prox - w2_plain = -lr mu (w1 - w0), whatever the data term is."""
    images, labels = _random_data(20, seed=5)
    lr, mu = 0.1, 0.5
    start = models.get_flat(models.build("2nn", (1, 28, 28), 10, seed=2))

    def train(images, labels, batch_size, prox_mu, seed=9):
        model = models.build("2nn", (1, 28, 28), 10)
        models.set_flat(model, start)
        hook = proximal_term(models.parameters_of(model), prox_mu) if prox_mu else None
        return client_update(model, images, labels, epochs=1, batch_size=batch_size, lr=lr,
                             generator=torch.Generator().manual_seed(seed), after_backward=hook).weights

    assert np.array_equal(train(images, labels, 20, mu), train(images, labels, 20, 0.0))  # one step, at w0
    first_half = torch.randperm(20, generator=torch.Generator().manual_seed(9))[:10].numpy()
    w1 = train(images[first_half], labels[first_half], 10, 0.0)  # the two-step runs' first step
    w2_plain, w2_prox = train(images, labels, 10, 0.0), train(images, labels, 10, mu)
    np.testing.assert_allclose(w2_prox - w2_plain, -lr * mu * (w1 - start), atol=2e-7)
    assert np.abs(w2_prox - w2_plain).max() > 1e-4  # the term did something
