"""Straggler groups: ``[network.stragglers]`` is one, ``[[network.stragglers]]`` several,
a client's factor the product of its groups' factors."""
import pytest

from fedemu.launch import config
from fedemu.launch.config import ConfigError
from fedemu.common.stragglers import StragglerSpec

JITTER = '[data]\nclients = 10\n{header}\ndistribution = "lognormal"\nsigma = 0.5\nper_round = true\n'
TWO_GROUPS = ('[data]\nclients = 10\n'
              '[[network.stragglers]]\ndistribution = "fixed"\nfactor = 3.0\nclients = "5-9"\n'
              '[[network.stragglers]]\ndistribution = "lognormal"\nsigma = 0.5\nper_round = true\n')


def stragglers_of(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return config.network_parts(config.load(path))[1]


def factors(stragglers, round_: int) -> list[float]:
    return [stragglers.slowdown(k, round_) for k in range(10)]


def test_an_array_of_one_group_draws_what_the_table_draws(tmp_path):
    table = stragglers_of(tmp_path, JITTER.format(header="[network.stragglers]"))
    array = stragglers_of(tmp_path, JITTER.format(header="[[network.stragglers]]"))
    for round_ in (1, 2):
        assert factors(array, round_) == factors(table, round_)
    assert len(set(factors(table, 1))) > 1  # the jitter did draw


def test_a_clients_factor_is_the_product_of_its_groups(tmp_path):
    groups = stragglers_of(tmp_path, TWO_GROUPS)
    # The second group alone, on its own stream (not the first group's).
    jitter = StragglerSpec(distribution="lognormal", sigma=0.5, per_round=True, seed=groups.groups[1].seed, group=1)
    for round_ in (1, 2, 3):
        expected = [(3.0 if k >= 5 else 1.0) * jitter.slowdown(k, round_) for k in range(10)]
        assert factors(groups, round_) == expected
    first_alone = StragglerSpec(distribution="lognormal", sigma=0.5, per_round=True, seed=groups.groups[1].seed)
    assert factors(jitter, 1) != factors(first_alone, 1)  # group 1 has a stream of its own


@pytest.mark.parametrize("text, message", [
    (TWO_GROUPS.replace("sigma = 0.5", "sigma = -1"), "network.stragglers[1].sigma = -1 must be >= 0"),
    (TWO_GROUPS.replace('clients = "5-9"', 'clients = "5-12"'), "network.stragglers[0].clients"),
    ('[data]\nclients = 10\n[network]\nstragglers = [1, 2]\n', "must be a table, or an array of tables"),
])
def test_a_bad_group_is_named_by_its_place(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        stragglers_of(tmp_path, text)
    assert message in str(err.value)


def test_a_clients_own_device_speed_replaces_device_flops_and_its_straggler_factor_multiplies():
    from fedemu.common.ml.datasets import get as dataset_named
    from fedemu.common.ml.devices import ComputeModel, training_flops_per_example
    from fedemu.common.ml.models import ModelSpec

    model = ModelSpec("2nn", dataset_named("mnist"))
    per_example = training_flops_per_example(model)
    compute = ComputeModel(clock="virtual", device_flops=1e9,
                           speeds={0: {"flops": 4e9}, 1: {"example_s": 0.01, "example_s:2nn": 0.002},
                                   2: {"example_s": 0.01}})
    # (seconds the device spends, the hold: times the straggler factor)
    assert compute.times(model, 100, 3.0, 0.0, 0.0, client=0) == pytest.approx((100 * per_example / 4e9,
                                                                                 300 * per_example / 4e9))
    assert compute.times(model, 100, 1.0, 0.0, 0.0, client=1) == pytest.approx((0.2, 0.2))  # the model's own figure
    assert compute.times(model, 100, 2.0, 0.0, 0.0, client=2) == pytest.approx((1.0, 2.0))
    assert compute.times(model, 100, 1.0, 0.0, 0.0, client=7)[0] == pytest.approx(100 * per_example / 1e9)
