import math

import numpy as np
import pytest
import torch

from fedemu.node import Message, Pid, wire
from fedemu.server.async_engine import AsyncEngine
from fedemu.common.algorithms.coop import Coop
from fedemu.common.algorithms.fedasync import FedAsync
from fedemu.common.algorithms.fedbuff import FedBuff
from fedemu.server.engine import Settings
from fedemu.server.runlog import RunLog, read_events
from fedemu.common.ml import compression, models
from fedemu.worker.client import Client, ModelCache
from fedemu.common.ml.data import Data
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.models import ModelSpec
from fedemu.common.ml.compression import (
    ENCODED_HEADER_BYTES,
    CompressionSpec,
    encoded_size,
    fwht,
    make_codec,
    pack_bits,
    rotate,
    unpack_bits,
    unrotate,
    update_seed,
)
from fedemu.common.messages import AgeReply, AgeRequest, AsyncStart, TrainAgain, Upload
from fedemu.common.ml.structured import compressed_client_update
from fedemu.common.ml.training import client_update, evaluate

MNIST = dataset_named("mnist")

@pytest.fixture(autouse=True)
def _one_torch_thread():
    # These models are tiny: one thread is as fast, and does not collapse when
    # other processes (e.g. end-to-end tests) hold the cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A small model's parameter shapes: two compressible tensors (one 4-D) of
# non-power-of-two sizes, and two biases that stay raw.
SHAPES = [(20, 15), (15,), (4, 3, 5, 5), (7,)]
SIZES = [math.prod(s) for s in SHAPES]


def _heavy_tailed_update(seed=0):
    """Mixed scales, outliers and exact zeros: where quantization without rotation struggles."""
    rng = np.random.default_rng(seed)
    delta = rng.standard_normal(sum(SIZES)) * np.exp(rng.standard_normal(sum(SIZES)))
    delta[rng.random(delta.shape) < 0.2] = 0.0
    return delta.astype(np.float32)


def _data(count, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=count).astype(np.uint8)
    return images, labels


# --- unbiasedness -----------------------------------------------------------------------

TRIALS = 1000
# Bound on N * ||mean - target||^2 / sigma^2, with sigma^2 = E||decode - target||^2.
# If the sketch is unbiased, the numerator is a sum of w_i chi2_1 (w_i >= 0, sum 1);
# for c >= 1.54 such a sum exceeds c no more often than one chi2_1 does (Szekely &
# Bakirov 2003), and P(chi2_1 > 16) = 6e-5. A bias b adds N ||b||^2 / sigma^2, so
# any bias above 4 sigma / sqrt(N) (~0.13 sigma here) fails.
UNBIASED_BOUND = 16.0


def _bias_statistic(decodes, targets):
    errors = decodes - targets
    per_trial = np.mean(np.sum(errors.astype(np.float64) ** 2, axis=1))  # estimates sigma^2
    mean_error = errors.mean(axis=0, dtype=np.float64)
    return len(decodes) * float(mean_error @ mean_error) / per_trial


def _decodes(spec, delta, trials=TRIALS):
    """Decodes over seeds, and for each the exact (unsketched) value it estimates."""
    codec = make_codec(spec, SHAPES)
    lossless = make_codec(CompressionSpec.from_dict(
        {k: v for k, v in spec.items() if k not in ("subsample", "rotate", "bits")}), SHAPES)
    decodes, targets = [], []
    for seed in range(trials):
        decodes.append(codec.decode(codec.encode(delta, seed), seed))
        targets.append(lossless.decode(lossless.encode(delta, seed), seed))
    return np.array(decodes), np.array(targets)


SKETCHES = [
    {"subsample": 0.25},
    {"bits": 1},
    {"bits": 2},
    {"bits": 8},
    {"rotate": True, "bits": 1},
    {"subsample": 0.3, "bits": 4},
    {"subsample": 0.5, "rotate": True},
    {"subsample": 0.1, "rotate": True, "bits": 2},
    # A sketch on top of a structured update estimates that structured update.
    {"structured": "random_mask", "keep_fraction": 0.5, "rotate": True, "bits": 2},
]


@pytest.mark.parametrize("sketch", SKETCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_each_sketch_is_unbiased(sketch):
    spec = {"min_layer_size": 100, **sketch}
    delta = _heavy_tailed_update()
    decodes, targets = _decodes(spec, delta)
    assert not np.allclose(decodes[0], targets[0])  # it is a lossy sketch
    assert _bias_statistic(decodes, targets) < UNBIASED_BOUND
    # Raw biases pass through exactly.
    np.testing.assert_array_equal(decodes[:, 300:315], np.broadcast_to(delta[300:315], (TRIALS, 15)))


def test_bias_statistic_catches_a_forgotten_rescale():
    # The subsample sketch without its 1/f scaling: E[decode] = f * H.
    delta = _heavy_tailed_update()
    decodes, targets = _decodes({"min_layer_size": 100, "subsample": 0.25}, delta, trials=300)
    assert _bias_statistic(decodes, targets) < UNBIASED_BOUND
    unscaled = decodes.copy()
    unscaled[:, :300] *= 0.25
    assert _bias_statistic(unscaled, targets) > UNBIASED_BOUND


def test_rotation_makes_one_bit_quantization_more_accurate():
    # The paper's motivation for the rotation, on an update with outliers.
    delta = _heavy_tailed_update(1)
    plain, target = _decodes({"min_layer_size": 100, "bits": 1}, delta, trials=50)
    rotated, _ = _decodes({"min_layer_size": 100, "bits": 1, "rotate": True}, delta, trials=50)
    assert np.mean((rotated - target) ** 2) < 0.5 * np.mean((plain - target) ** 2)


# --- Hadamard rotation ----------------------------------------------------------------


def _sylvester(n):
    matrix = np.array([[1.0]])
    while len(matrix) < n:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix / math.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_fwht_is_the_orthonormal_hadamard_matrix(n):
    transform = np.stack([fwht(column) for column in np.eye(n, dtype=np.float32)], axis=1)
    np.testing.assert_allclose(transform, _sylvester(n), atol=1e-6)
    np.testing.assert_allclose(transform @ transform.T, np.eye(n), atol=1e-5)


def test_fwht_inverts_itself_and_keeps_the_norm():
    x = np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32)
    y = fwht(x)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5)
    np.testing.assert_allclose(fwht(y), x, atol=1e-5)
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(np.ones(12))


@pytest.mark.parametrize("n", [1, 3, 16, 17, 300, 1000])
def test_randomized_rotation_pads_and_inverts(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    padded = compression.next_power_of_two(n)
    signs = np.where(np.random.default_rng(1).random(padded) < 0.5, -1.0, 1.0).astype(np.float32)
    y = rotate(x, signs)
    assert y.shape == (padded,) and padded >= n and padded < 2 * n + 1
    # Orthonormal: the zero padding adds no energy.
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-5)
    np.testing.assert_allclose(unrotate(y, signs, n), x, atol=1e-5)


def test_rotation_spreads_a_spike():
    signs = np.ones(1024, dtype=np.float32)
    y = rotate(np.eye(1, 1000, 7, dtype=np.float32)[0], signs)
    np.testing.assert_allclose(np.abs(y), 1 / 32, rtol=1e-6)


# --- shared randomness ----------------------------------------------------------------


def test_update_seed_is_deterministic_and_distinct():
    seeds = {update_seed(7, r, k) for r in range(1, 21) for k in range(100)}
    assert len(seeds) == 2000
    assert update_seed(7, 3, 4) == update_seed(7, 3, 4) != update_seed(8, 3, 4)
    assert all(0 <= s < 2**64 for s in seeds)
    with pytest.raises(ValueError, match="client"):
        update_seed(7, 3, -1)


def _client_and_server(spec):
    # Two independently built codecs, the server's from the serialized spec.
    client = make_codec(CompressionSpec.from_dict(spec), SHAPES)
    server = make_codec(CompressionSpec.from_dict(client.spec.to_dict()), SHAPES)
    return client, server


def test_masks_and_bases_agree_across_sides_and_differ_across_clients_and_rounds():
    mask_client, mask_server = _client_and_server({"structured": "random_mask", "min_layer_size": 100})
    rank_client, rank_server = _client_and_server({"structured": "low_rank", "min_layer_size": 100})
    seed = update_seed(1, 5, 9)
    for layer in (0, 2):
        mask = mask_client.mask(layer, seed)
        np.testing.assert_array_equal(mask, mask_server.mask(layer, seed))
        assert mask.shape == SHAPES[layer] and mask.sum() == math.ceil(0.25 * SIZES[layer])
        np.testing.assert_array_equal(rank_client.basis(layer, seed), rank_server.basis(layer, seed))
        for other in (update_seed(1, 5, 10), update_seed(1, 6, 9)):
            assert not np.array_equal(mask, mask_client.mask(layer, other))
            assert not np.array_equal(rank_client.basis(layer, seed), rank_client.basis(layer, other))
    assert rank_client.basis(0, seed).shape == (20, 4)  # k = ceil(0.25 * min(20, 15))
    assert rank_client.basis(2, seed).shape == (4, 1)  # (4, 75): k = ceil(0.25 * 4)


def test_rotations_and_samples_agree_across_sides_and_differ_across_clients_and_rounds():
    client, server = _client_and_server({"subsample": 0.1, "rotate": True, "bits": 2, "min_layer_size": 100})
    seed = update_seed(1, 5, 9)
    for layer in (0, 2):
        signs = client.rotation_signs(layer, seed)
        indices = client.sample_indices(layer, seed)
        np.testing.assert_array_equal(signs, server.rotation_signs(layer, seed))
        np.testing.assert_array_equal(indices, server.sample_indices(layer, seed))
        assert signs.shape == (512,) and set(np.unique(signs)) == {-1.0, 1.0}
        assert len(indices) == 30 and len(set(indices)) == 30 and indices.max() < 512
        for other in (update_seed(1, 5, 10), update_seed(1, 6, 9)):
            assert not np.array_equal(signs, client.rotation_signs(layer, other))
            assert not np.array_equal(indices, client.sample_indices(layer, other))
    # And the whole round trip on the server equals the client's own decode.
    delta = _heavy_tailed_update()
    encoded = client.encode(delta, seed)
    np.testing.assert_array_equal(server.decode(encoded, seed), client.decode(encoded, seed))
    assert not np.array_equal(server.decode(encoded, seed + 1), server.decode(encoded, seed))


# --- sizes and packing ----------------------------------------------------------------

TWO_NN = [(200, 784), (200,), (200, 200), (200,), (10, 200), (10,)]
TWO_NN_BIASES = 4 * (200 + 200 + 10)


@pytest.mark.parametrize("spec, payload", [
    ({}, 4 * 199_210),
    ({"structured": "random_mask", "keep_fraction": 0.25}, 4 * (39_200 + 10_000 + 500) + TWO_NN_BIASES),
    # k = 50, 50, 3: B is k x d2.
    ({"structured": "low_rank", "rank_fraction": 0.25}, 4 * (50 * 784 + 50 * 200 + 3 * 200) + TWO_NN_BIASES),
    # 6.25% of each weight matrix at 2 bits, plus a float32 (min, max) per matrix.
    ({"subsample": 0.0625, "rotate": True, "bits": 2},
     math.ceil(9800 * 2 / 8) + math.ceil(2500 * 2 / 8) + math.ceil(125 * 2 / 8) + 3 * 8 + TWO_NN_BIASES),
    # No subsampling: the rotated (zero-padded) vectors are sent whole.
    ({"rotate": True, "bits": 1}, (262_144 + 65_536 + 2048) // 8 + 3 * 8 + TWO_NN_BIASES),
    ({"bits": 3}, math.ceil(156_800 * 3 / 8) + math.ceil(40_000 * 3 / 8) + math.ceil(2000 * 3 / 8) + 24
     + TWO_NN_BIASES),
    ({"bits": 3, "min_layer_size": 0, "compress_biases": True},
     sum(math.ceil(n * 3 / 8) + 8 for n in (156_800, 200, 40_000, 200, 2000, 10))),
    ({"subsample": 0.5, "min_layer_size": 50_000}, 4 * (78_400 + 200 + 40_000 + 200 + 2000 + 10)),
])
def test_encoded_size_matches_the_formula(spec, payload):
    codec = make_codec(spec, TWO_NN)
    delta = np.random.default_rng(0).standard_normal(codec.num_parameters).astype(np.float32)
    encoded = codec.encode(delta, 3)
    assert encoded_size(encoded) == ENCODED_HEADER_BYTES + payload == codec.encoded_bytes
    # Wire-ready, and the header bound holds: everything but the array frames.
    body, *frames = wire.pack_body(encoded)
    assert len(body) <= ENCODED_HEADER_BYTES
    assert sum(len(memoryview(f)) for f in frames) == payload
    received = wire.unpack_body(body, [bytes(memoryview(f)) for f in frames])
    np.testing.assert_array_equal(codec.decode(received, 3), codec.decode(encoded, 3))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 8, 13, 1001])
def test_bit_packing_round_trips(bits, count):
    codes = np.random.default_rng(bits * count).integers(0, 1 << bits, size=count, dtype=np.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == np.uint8 and packed.shape == (math.ceil(count * bits / 8),)
    np.testing.assert_array_equal(unpack_bits(packed, bits, count), codes)


def test_bit_packing_layout_is_msb_first():
    np.testing.assert_array_equal(pack_bits(np.array([1, 0, 1], np.uint8), 1), [0b1010_0000])
    np.testing.assert_array_equal(pack_bits(np.array([3, 0, 2, 1, 3], np.uint8), 2), [0b1100_1001, 0b1100_0000])


def test_quantization_hits_the_end_points_and_constant_vectors_are_exact():
    codec = make_codec({"bits": 2, "min_layer_size": 0, "compress_biases": True}, [(5,)])
    values = np.array([-1.0, 2.0, 0.5, -1.0, 2.0], np.float32)
    decoded = codec.decode(codec.encode(values, 0), 0)
    np.testing.assert_array_equal(decoded[[0, 1, 3, 4]], values[[0, 1, 3, 4]])
    assert decoded[2] in (0.0, 1.0)  # levels -1, 0, 1, 2
    constant = np.full(5, 0.3, np.float32)
    np.testing.assert_array_equal(codec.decode(codec.encode(constant, 0), 0), constant)


def test_decode_rejects_malformed_or_foreign_updates():
    codec = make_codec({"bits": 2, "min_layer_size": 100}, SHAPES)
    encoded = codec.encode(_heavy_tailed_update(), 0)
    other = make_codec({"bits": 3, "min_layer_size": 100}, SHAPES)
    with pytest.raises(ValueError, match="different compression spec"):
        other.decode(encoded, 0)
    with pytest.raises(ValueError, match="'codes' must be uint8"):
        codec.decode({**encoded, "codes": encoded["codes"][:-1]}, 0)
    with pytest.raises(ValueError, match="keys"):
        codec.decode({k: v for k, v in encoded.items() if k != "ranges"}, 0)
    with pytest.raises(ValueError, match="shape"):
        codec.encode(np.zeros(5, np.float32), 0)


def test_a_diverged_update_decodes_to_nan_not_to_finite_values():
    codec = make_codec({"bits": 2, "min_layer_size": 100}, SHAPES)
    delta = _heavy_tailed_update()
    delta[3] = np.inf
    decoded = codec.decode(codec.encode(delta, 0), 0)
    assert np.isnan(decoded[:300]).all()  # the quantized layer holding the inf
    np.testing.assert_array_equal(decoded[300:], codec.decode(codec.encode(_heavy_tailed_update(), 0), 0)[300:])


# --- structured training --------------------------------------------------------------


def _train(name, spec, images, labels, seed=12345, epochs=1, batch_size=5, **schedule):
    model = models.build(name, (1, 28, 28), 10, seed=0)
    start = models.get_flat(model)
    codec = make_codec(spec, compression.parameter_shapes(model))
    result = compressed_client_update(
        model, images, labels, codec=codec, seed=seed, epochs=epochs, batch_size=batch_size, lr=0.1,
        generator=torch.Generator().manual_seed(42), **schedule)
    return codec, start, models.get_flat(model), result


def test_random_mask_trains_only_masked_entries_and_decodes_exactly():
    images, labels = _data(23)
    codec, start, trained, result = _train("2nn", {"structured": "random_mask", "keep_fraction": 0.1},
                                           images, labels, epochs=2)
    decoded = codec.decode(result.encoded, 12345)
    np.testing.assert_array_equal(decoded, result.delta)
    np.testing.assert_array_equal(trained - start, result.delta)
    for plan in codec.layers:
        block = slice(plan.offset, plan.offset + plan.size)
        changed = trained[block] != start[block]
        if plan.kind == "random_mask":
            mask = codec.mask(plan.index, 12345).reshape(-1)
            assert not changed[~mask].any()
            assert changed[mask].mean() > 0.5  # ReLU units can be dead, so not all
        else:
            assert plan.kind == "raw" and len(plan.shape) == 1 or plan.size < 1024
            assert changed.any()
    assert result.steps == 2 * 5 and result.num_samples == 23


@pytest.mark.parametrize("name", ["2nn", "cnn"])
def test_low_rank_delta_has_rank_k_and_decodes_exactly(name):
    # A layer's update lies in the span of its inputs' outer products, so with
    # fewer samples than k the rank would be the sample count: use more (k <= 128).
    images, labels = _data(136)
    codec, start, trained, result = _train(name, {"structured": "low_rank", "rank_fraction": 0.25},
                                           images, labels, batch_size=34)
    decoded = codec.decode(result.encoded, 12345)
    np.testing.assert_array_equal(decoded, result.delta)
    np.testing.assert_allclose(trained - start, result.delta, rtol=0, atol=1e-6)
    low_rank = [plan for plan in codec.layers if plan.kind == "low_rank"]
    assert len(low_rank) == 3
    for plan in low_rank:
        matrix = result.delta[plan.offset : plan.offset + plan.size].reshape(plan.rows, plan.cols)
        # Multiplying by a Gaussian (d2 x 2k) probe keeps any rank <= 2k (almost
        # surely) and makes the SVD of CNN's 512 x 3136 layer cheap.
        probe = np.random.default_rng(0).standard_normal((plan.cols, 2 * plan.rank)).astype(np.float32)
        rank = np.linalg.matrix_rank(matrix @ probe)
        # At most k by construction; well above k/2, so training moved most of
        # B's directions (ReLU and pooling leave some inputs dead, so not always all k).
        assert plan.rank // 2 < rank <= plan.rank < min(plan.rows, plan.cols)
    # What was sent is B: k x d2 float32 values per low-rank layer.
    assert result.encoded["values"].size == sum(
        p.rank * p.cols if p.kind == "low_rank" else p.size for p in codec.layers)


@pytest.mark.parametrize("spec", [
    {"structured": "random_mask", "keep_fraction": 1.0},  # a mask of everything
    {"structured": "low_rank", "min_layer_size": 10**9},  # nothing qualifies
    {"structured": "random_mask", "min_layer_size": 10**9},
])
@pytest.mark.parametrize("schedule", [{}, {"lr_decay": 0.05, "start_iteration": 7}])
def test_unrestricted_structured_training_is_client_update(spec, schedule):
    # Same optimizer, lr schedule, batches and generator use as client_update, bit for bit.
    images, labels = _data(23)
    _, start, trained, result = _train("2nn", spec, images, labels, epochs=2, **schedule)
    reference = models.build("2nn", (1, 28, 28), 10, seed=0)
    expected = client_update(reference, images, labels, epochs=2, batch_size=5, lr=0.1,
                             generator=torch.Generator().manual_seed(42), **schedule)
    np.testing.assert_array_equal(trained, expected.weights)
    assert result.train_loss == expected.train_loss and result.steps == expected.steps


@pytest.mark.parametrize("structured", ["low_rank", "random_mask"])
def test_restricted_training_learns(structured):
    # Separable data: class c lights up rows 2c and 2c + 1.
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, size=200).astype(np.uint8)
    images = rng.integers(0, 40, size=(200, 28, 28), dtype=np.uint8)
    for index, label in enumerate(labels):
        images[index, 2 * label : 2 * label + 2, :] = 255
    model = models.build("2nn", (1, 28, 28), 10, seed=3)
    accuracy_before, loss_before = evaluate(model, images, labels)
    codec = make_codec({"structured": structured}, compression.parameter_shapes(model))
    # 10 epochs: at 5 this reaches 0.82-0.95 for most model and codec seeds, at 10 always 1.0.
    compressed_client_update(model, images, labels, codec=codec, seed=1, epochs=10, batch_size=10,
                             lr=0.1, generator=torch.Generator().manual_seed(0))
    accuracy_after, loss_after = evaluate(model, images, labels)
    assert accuracy_before < 0.5 and accuracy_after == 1.0
    assert loss_after < 0.7 * loss_before


def test_sketch_codec_trains_fully_then_encodes():
    images, labels = _data(23)
    codec, start, trained, result = _train("2nn", {"subsample": 0.25, "bits": 2}, images, labels)
    np.testing.assert_array_equal(result.delta, trained - start)
    assert encoded_size(result.encoded) == codec.encoded_bytes


# --- spec validation ------------------------------------------------------------------


@pytest.mark.parametrize("table, key", [
    ({"structured": "svd"}, "structured"),
    ({"bits": 9}, "bits"),
    ({"bits": 0}, "bits"),
    ({"bits": True}, "bits"),
    ({"bits": 2.5}, "bits"),
    ({"subsample": 0}, "subsample"),
    ({"subsample": 1.5}, "subsample"),
    ({"structured": "low_rank", "rank_fraction": 0.0}, "rank_fraction"),
    ({"structured": "random_mask", "keep_fraction": "half"}, "keep_fraction"),
    ({"rotate": "yes"}, "rotate"),
    ({"compress_biases": 1}, "compress_biases"),
    ({"min_layer_size": -1}, "min_layer_size"),
    ({"min_layer_size": 10.5}, "min_layer_size"),
    ({"bitz": 2}, "bitz"),
    ({"structured": "random_mask", "rank_fraction": 0.5}, "rank_fraction"),
    ({"keep_fraction": 0.5}, "keep_fraction"),
    ({"structured": "low_rank", "compress_biases": True}, "compress_biases"),
])
def test_bad_specs_name_the_key(table, key):
    with pytest.raises(ValueError, match=rf"compression\.{key}\b"):
        CompressionSpec.from_dict(table, prefix="compression.")


def test_spec_messages_state_the_allowed_range_and_round_trip():
    with pytest.raises(ValueError, match=r"bits = 9 .* 1\.\.8"):
        CompressionSpec.from_dict({"bits": 9})
    with pytest.raises(ValueError, match=r"subsample = 0 .* \(0, 1\]"):
        CompressionSpec(subsample=0)
    spec = CompressionSpec.from_dict({"structured": "low_rank", "rank_fraction": 1, "bits": 32})
    assert spec.rank_fraction == 1.0 and spec.bits is None and not spec.sketched
    for table in ({}, {"structured": "random_mask", "keep_fraction": 0.1, "bits": 2},
                  {"subsample": 0.0625, "rotate": True, "bits": 2, "min_layer_size": 0, "compress_biases": True}):
        spec = CompressionSpec.from_dict(table)
        assert CompressionSpec.from_dict(spec.to_dict()) == spec


def test_rotation_alone_is_lossless_to_float_precision():
    codec = make_codec({"rotate": True, "min_layer_size": 100}, SHAPES)
    delta = _heavy_tailed_update()
    encoded = codec.encode(delta, 5)
    assert encoded["values"].size == 512 + 15 + 512 + 7  # padded rotations travel whole
    np.testing.assert_allclose(codec.decode(encoded, 5), delta, rtol=0, atol=1e-5 * np.abs(delta).max())


def test_structured_training_with_a_sketch_on_top():
    # low_rank's B, quantized to 8 bits: close to the trained update, not equal.
    images, labels = _data(23)
    spec = {"structured": "low_rank", "bits": 8}
    codec, _, _, result = _train("2nn", spec, images, labels)
    decoded = codec.decode(result.encoded, 12345)
    assert encoded_size(result.encoded) == codec.encoded_bytes
    assert not np.array_equal(decoded, result.delta)
    error = np.linalg.norm(decoded - result.delta) / np.linalg.norm(result.delta)
    assert 0 < error < 0.05


# --- asynchronous rules: the client encodes its delta from the base, the server decodes ---

RUN_SEED = 7
SERVER, CLIENT = Pid("server-node", 1), Pid("worker-0", 3)


class _Outbox:
    """Stands in for a process: keeps what is sent (send_after sends at once)."""

    offline, offline_count = False, 0  # its device stays online

    def __init__(self):
        self.sent = []

    def send(self, pid, body):
        self.sent.append(body)

    def send_many(self, pids, body):
        self.sent.extend(body for _ in pids)

    def send_after(self, delay, pid, body, unless_offline=False):
        self.sent.append(body)

    def now(self) -> float:  # the run's clock, which no test here moves
        return 0.0


def _async_pair(tmp_path, rule, spec):
    """A server engine and one client (id 0) on 20 random images, after AsyncStart."""
    engine = AsyncEngine(Settings(clients=1, seed=RUN_SEED, rounds=1, batch_size=10, compression=spec),
                         rule, ModelSpec("2nn", MNIST), None, RunLog(tmp_path), lr=0.1)
    images, labels = _data(20)
    dataset = Data("fake", MNIST, images, labels, images, labels)
    client = Client(0, np.arange(20), dataset, ModelSpec("2nn", MNIST), ModelCache())
    server_out, client_out = _Outbox(), _Outbox()
    engine._send_model(server_out, 0, CLIENT, AsyncStart(
        rule=rule.name, weights=engine.weights, age=0, epochs=1, batch_size=10, lr=0.1, lr_decay=0.0,
        seed=RUN_SEED, extra=rule.client_payload(), compression=spec))
    client.handle(client_out, Message(SERVER, server_out.sent[-1]))
    return engine, client, client_out


def _copy(upload: Upload) -> Upload:
    return Upload(**{**upload.__dict__, "encoded": dict(upload.encoded)})


def test_fedbuff_upload_is_the_encoded_delta_and_decodes_with_the_same_seed(tmp_path):
    spec = CompressionSpec(subsample=0.25, rotate=True, bits=2).to_dict()
    engine, client, out = _async_pair(tmp_path, FedBuff(buffer_size=2, server_lr=1.0), spec)
    upload = out.sent[-1]
    assert isinstance(upload, Upload) and upload.update is None and upload.is_delta
    assert upload.base == 1  # the AsyncStart model
    codec = engine.codec
    assert encoded_size(upload.encoded) == codec.encoded_bytes < codec.num_parameters * 4 / 40
    expected = codec.decode(upload.encoded, update_seed(RUN_SEED, 1, 0))
    other_seed = codec.decode(upload.encoded, update_seed(RUN_SEED, 2, 0))
    assert engine._decode(upload, 0)
    np.testing.assert_array_equal(upload.update, expected)
    assert not np.allclose(upload.update, other_seed)  # a different base would decode to noise
    true_delta = client._weights - engine.weights
    # An unbiased but lossy sketch of the delta the client trained: same scale, same direction.
    assert float(np.dot(upload.update, true_delta)) > 0.3 * float(np.dot(true_delta, true_delta))


def test_fedasync_upload_decodes_to_base_plus_delta(tmp_path):
    spec = CompressionSpec(rotate=True).to_dict()  # rotation alone is lossless to float precision
    engine, client, out = _async_pair(tmp_path, FedAsync(0.6, "constant", 0.5, 4), spec)
    upload = out.sent[-1]
    assert not upload.is_delta and upload.encoded is not None
    assert engine._decode(upload, 0)
    np.testing.assert_allclose(upload.update, client._weights, atol=1e-5)
    assert not np.allclose(upload.update, engine.weights, atol=1e-5)  # it did train


def test_coop_keeps_one_mask_per_base_across_local_updates(tmp_path):
    """An over-active CO-OP client that keeps its training (over_active = "continue")
    trains twice before uploading: both trainings use the base's mask, so the summed
    delta is still a masked update and decodes exactly."""
    spec = CompressionSpec(structured="random_mask", keep_fraction=0.1).to_dict()
    engine, client, out = _async_pair(tmp_path, Coop(b_l=1, b_u=4), spec)
    assert isinstance(out.sent[-1], AgeRequest)
    client.handle(out, Message(CLIENT, TrainAgain()))
    assert client._trainings == 2 and client._encoded is None  # re-encoded at upload time
    client.handle(out, Message(SERVER, AgeReply(engine.age, out.sent[-1].request)))  # a - a_k = b_l: upload
    upload = out.sent[-1]
    assert isinstance(upload, Upload) and upload.base == 1 and not upload.is_delta
    seed = update_seed(RUN_SEED, 1, 0)
    delta = client._weights - engine.weights
    first = engine.codec.layers[0]
    mask = engine.codec.mask(0, seed).reshape(-1)
    block = delta[first.offset : first.offset + first.size]
    assert np.count_nonzero(block[~mask]) == 0 and np.count_nonzero(block[mask]) > 0
    assert engine._decode(upload, 0)
    np.testing.assert_allclose(upload.update, client._weights, atol=1e-6)


def test_an_upload_from_an_unknown_base_is_a_fault_not_a_merge(tmp_path):
    spec = CompressionSpec(bits=4).to_dict()
    engine, _, out = _async_pair(tmp_path, FedAsync(0.6, "constant", 0.5, 4), spec)
    upload = _copy(out.sent[-1])
    upload.base = 2  # the server sent this client one model
    assert not engine._decode(upload, 3)
    faults = [e for e in read_events(tmp_path) if e["event"] == "fault"]
    assert faults and faults[0]["client"] == 0 and "model #2" in faults[0]["reason"]
