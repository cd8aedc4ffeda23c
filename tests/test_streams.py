"""Named random streams (fedemu.node.streams): every random decision of a run draws from
a stream named by its purpose and ids, derived from the run seed."""
import numpy as np
import pytest

from fedemu.node import streams
from fedemu.node.net.links import uniform as link_uniform

from .test_rounds import engine


def test_a_stream_depends_only_on_its_seed_purpose_and_ids():
    first = streams.generator(7, "selection", 3).random(5)
    assert np.array_equal(first, streams.generator(7, "selection", 3).random(5))
    for other in (streams.generator(8, "selection", 3), streams.generator(7, "selection", 4),
                  streams.generator(7, "shuffle", 3)):
        assert not np.array_equal(first, other.random(5))
    assert streams.seed64(7, "model.init") == streams.seed64(7, "model.init")
    assert streams.seed64(7, "model.init") != streams.seed64(7, "model.init", 0)
    assert 0 <= streams.seed64(7, "model.init") < 2**64


def test_a_different_number_of_ids_is_a_different_stream():
    """Ids are fixed-width and bounded below 2**53, so (a, b) can never hash as (a,) with
    b's bytes read as part of the purpose."""
    seeds = {streams.seed64(1, "p"), streams.seed64(1, "p", 0), streams.seed64(1, "p", 0, 0),
             streams.seed64(1, "p", 0, 0, 0)}
    assert len(seeds) == 4


@pytest.mark.parametrize("bad", [
    dict(seed=-1, purpose="p", ids=()), dict(seed=2**63, purpose="p", ids=()),
    dict(seed=1, purpose="", ids=()), dict(seed=1, purpose="tab\there", ids=()),
    dict(seed=1, purpose="p", ids=(-1,)), dict(seed=1, purpose="p", ids=(2**53,)),
])
def test_out_of_range_seeds_ids_and_unnamed_purposes_are_refused(bad):
    with pytest.raises(ValueError):
        streams.generator(bad["seed"], bad["purpose"], *bad["ids"])


# Known draws of streams.uniform, derived once outside fedemu with coreutils' BLAKE2b:
#   python3 -c "import struct,sys; sys.stdout.buffer.write(struct.pack('<qqqq', SEED, LINK,
#       DIRECTION, COUNTER) + b'PURPOSE')" | b2sum -l 64
# then the digest read as a little-endian 64-bit integer, shifted right by 11, over 2**53.
# (3, "loss", 5, 0, 9) digests to 7a762988831efb48.
KNOWN_UNIFORM_DRAWS = [
    ((3, "loss", 5, 0, 9), 0.2850817748186836),
    ((3, "gilbert-elliott", 5, 0, 9), 0.0659973992189401),
    ((0, "jitter/0", 0, 0, 0), 0.8094500434260448),
    ((1, "jitter/2", 17, 1, 123456), 0.49414954710711945),
]


def test_the_link_model_draws_stay_as_they_were():
    """The broker's counter-based draws keep their encoding: a changed hash input (field
    order, widths, purpose bytes) or output mapping would change every link decision of
    every recorded run. The link model imports the same function."""
    assert link_uniform is streams.uniform
    assert [streams.uniform(*args) for args, _ in KNOWN_UNIFORM_DRAWS] == [value for _, value in KNOWN_UNIFORM_DRAWS]


def test_a_rounds_selection_does_not_depend_on_the_rounds_before_it(tmp_path):
    """The round engine draws round r's clients from stream ("selection", r): rounds that
    drew before it (another run length, a retried selection) leave round r alone."""
    fresh = engine(tmp_path / "fresh", clients=100, C=0.1)
    after_four = engine(tmp_path / "after", clients=100, C=0.1)
    earlier = [after_four.select(r) for r in range(1, 5)]
    round_5 = fresh.select(5)
    assert len(round_5) == 10 and round_5 == sorted(set(round_5))
    assert after_four.select(5) == round_5
    assert round_5 not in earlier  # each round draws its own clients
    assert fresh.select(5) == round_5  # and drawing it again changes nothing


def test_the_training_side_streams_are_independent_of_each_other():
    """Partition, fold split, shuffling and stragglers each have their own purpose. Under
    the old numbered seeds the IID partition and the IID k-fold split of a seed were the
    same permutation; now they are independent draws."""
    from fedemu.common.ml import kfold, partition
    from fedemu.worker.client import client_generator
    from fedemu.common.stragglers import StragglerSpec

    n, clients = 1000, 10
    by_partition = np.concatenate(partition.iid(n, clients, seed=4))
    assert sorted(by_partition.tolist()) == list(range(n))
    fold_0 = kfold.iid(n, 5, clients, seed=4).fold(0)
    assert not np.array_equal(np.sort(by_partition[: n // 5]), fold_0)

    assert np.array_equal(_permutation(client_generator(4, 1, 0)), _permutation(client_generator(4, 1, 0)))
    assert not np.array_equal(_permutation(client_generator(4, 1, 0)), _permutation(client_generator(4, 1, 1)))
    assert not np.array_equal(_permutation(client_generator(4, 1, 0)), _permutation(client_generator(4, 2, 0)))

    spec = StragglerSpec(distribution="lognormal", sigma=1.0, seed=4, per_round=True)
    factors = [spec.slowdown(k, 1) for k in range(50)]
    assert factors == [spec.slowdown(k, 1) for k in range(50)]
    assert factors != [spec.slowdown(k, 2) for k in range(50)]


def _permutation(generator, n=50):
    import torch
    return torch.randperm(n, generator=generator).numpy()
