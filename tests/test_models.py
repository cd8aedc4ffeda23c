import math
import warnings

import numpy as np
import pytest
import torch

from fedemu.common.ml import models

# What each built-in model is built for in these tests, and a batch of its inputs.
INPUTS = {
    "2nn": ((1, 28, 28), lambda n: torch.rand(n, 1, 28, 28)),
    "cnn": ((1, 28, 28), lambda n: torch.rand(n, 1, 28, 28)),
    "cifar-cnn": ((3, 24, 24), lambda n: torch.rand(n, 3, 24, 24)),
    "char-lstm": ((80,), lambda n: torch.randint(0, 10, (n, 80))),
}


@pytest.mark.parametrize("name, expected", [("2nn", 199_210), ("cnn", 1_663_370)])
def test_parameter_counts_match_the_paper(name, expected):
    assert models.num_parameters(models.build(name, (1, 28, 28), 10)) == expected


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_output_is_one_logit_per_class(name):
    shape, inputs = INPUTS[name]
    logits = models.build(name, shape, 10, seed=0)(inputs(3))
    assert logits.shape == ((3, 80, 10) if name == "char-lstm" else (3, 10))  # a sequence: per position


def test_model_names_and_unknown_name():
    assert models.MODEL_NAMES == ("2nn", "cnn", "cifar-cnn", "char-lstm")
    with pytest.raises(models.UnknownModel,
                       match="unknown model 'resnet': fedemu has 2nn, cnn, cifar-cnn, char-lstm"):
        models.build("resnet", (1, 28, 28), 10)


def test_a_registered_builder_is_found_by_name_and_a_taken_name_is_refused(monkeypatch):
    monkeypatch.setattr(models, "_builders", dict(models._builders))

    @models.register("tiny-linear")
    def tiny(input_shape, num_classes):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape), num_classes))

    assert models.builder("tiny-linear") is tiny
    assert models.num_parameters(models.build("tiny-linear", (1, 28, 28), 10)) == 784 * 10 + 10
    with pytest.raises(ValueError, match="model '2nn' is registered already"):
        models.register("2nn")(tiny)
    with pytest.raises(ValueError, match="lower-case letters"):
        models.register("Tiny Model")


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_seeded_build_is_deterministic_and_leaves_global_rng_alone(name):
    state = torch.get_rng_state()
    shape = INPUTS[name][0]
    first = models.get_flat(models.build(name, shape, 10, seed=11))
    again = models.get_flat(models.build(name, shape, 10, seed=11))
    other = models.get_flat(models.build(name, shape, 10, seed=12))
    assert torch.equal(torch.get_rng_state(), state)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_get_flat_is_an_independent_float32_vector_in_parameter_order():
    model = models.build("2nn", (1, 28, 28), 10, seed=0)
    flat = models.get_flat(model)

    assert flat.dtype == np.float32 and flat.ndim == 1 and flat.flags.c_contiguous
    assert flat.size == 199_210
    first_layer = model[1].weight.detach().numpy()
    np.testing.assert_array_equal(flat[: first_layer.size], first_layer.ravel())
    np.testing.assert_array_equal(flat[-10:], model[-1].bias.detach().numpy())

    flat[:] = 0  # must not reach into the model
    assert model[1].weight.abs().sum() > 0


@pytest.mark.parametrize("name", models.MODEL_NAMES)
def test_set_flat_round_trip(name):
    shape, inputs = INPUTS[name]
    source = models.build(name, shape, 10, seed=1)
    target = models.build(name, shape, 10, seed=2)
    images = inputs(4)

    models.set_flat(target, models.get_flat(source))

    np.testing.assert_array_equal(models.get_flat(target), models.get_flat(source))
    assert torch.equal(target(images), source(images))


def test_set_flat_accepts_a_read_only_wire_buffer_silently():
    source = models.build("2nn", (1, 28, 28), 10, seed=1)
    wire = models.get_flat(source).tobytes()
    received = np.frombuffer(wire, dtype=np.float32)
    assert not received.flags.writeable
    target = models.build("2nn", (1, 28, 28), 10, seed=2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models.set_flat(target, received)

    np.testing.assert_array_equal(models.get_flat(target), received)


def test_set_flat_rejects_wrong_length():
    model = models.build("2nn", (1, 28, 28), 10, seed=0)
    with pytest.raises(ValueError, match=r"model needs \(199210,\)"):
        models.set_flat(model, np.zeros(199_209, np.float32))


@pytest.mark.parametrize("name", ["2nn", "cnn"])
def test_glorot_init_is_tensorflows_default_zero_biases_and_the_glorot_bound(name):
    from fedemu.common.ml.datasets import get as dataset_named

    model = models.ModelSpec(name, dataset_named("mnist"), init="glorot").build(seed=4)
    torch_default = models.ModelSpec(name, dataset_named("mnist")).build(seed=4)
    for layer in model.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            weight = layer.weight.detach()
            assert not layer.bias.detach().any()
            receptive = weight[0, 0].numel() if weight.dim() > 2 else 1
            bound = (6.0 / (receptive * (weight.shape[0] + weight.shape[1]))) ** 0.5
            assert float(weight.abs().max()) <= bound
            assert float(weight.abs().max()) > 0.9 * bound  # uniform over the whole range
    assert not np.array_equal(models.get_flat(model), models.get_flat(torch_default))
    again = models.ModelSpec(name, dataset_named("mnist"), init="glorot").build(seed=4)
    np.testing.assert_array_equal(models.get_flat(model), models.get_flat(again))
