"""ExactSum: the weighted mean that worker nodes and the server can split between them
(aggregation on the nodes) without changing a bit of the result."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from fedemu.common.algorithms.rounds import WeightedMean
from fedemu.common.ml.exact_sum import ExactSum


def updates(rng, count: int, size: int, scales=(1e-4, 0.05, 3.0)) -> list[tuple[np.ndarray, int]]:
    """Terms of several magnitudes (so of several exponents) and sample counts."""
    return [((rng.standard_normal(size) * scales[i % len(scales)]).astype(np.float32), int(rng.integers(1, 700)))
            for i in range(count)]


def grouped(terms, groups: int, rng) -> ExactSum:
    """The terms dealt at random to ``groups`` sums (nodes), each adding its share in a
    random order, merged into one in a random order."""
    owner = rng.integers(0, groups, len(terms))
    parts = []
    for g in range(groups):
        part = ExactSum()
        mine = [t for t, o in zip(terms, owner) if o == g]
        for i in rng.permutation(len(mine)):
            part.add(*mine[i])
        parts.append(part.state())
    total = ExactSum()
    for i in rng.permutation(groups):
        total.merge(parts[i])
    return total


def test_the_mean_is_the_same_bits_however_the_terms_are_grouped_and_ordered():
    rng = np.random.default_rng(1)
    terms = updates(rng, 40, 5_000)
    one = ExactSum()
    for update, n in terms:
        one.add(update, n)
    expected = one.mean()
    for groups in (1, 2, 3, 7):
        assert grouped(terms, groups, rng).mean().tobytes() == expected.tobytes()
    # A float64 running sum is not: 1e30 + 1e-30 - 1e30 is 0 in one order, 1e-30 in another.
    big, small = np.array([1e30], np.float32), np.array([1e-30], np.float32)
    orders = [[(big, 1), (small, 1), (-big, 1)], [(big, 1), (-big, 1), (small, 1)]]
    running = [WeightedMean() for _ in orders]
    exact = [ExactSum() for _ in orders]
    for order, r, e in zip(orders, running, exact):
        for update, n in order:
            r.add(update, n)
            e.add(update, n)
    assert running[0].result()[0] == 0.0 != running[1].result()[0]
    assert exact[0].mean()[0] == exact[1].mean()[0] == np.float32(1e-30 / 3)


def test_the_mean_is_the_exact_mean_rounded_to_float32():
    """Checked against rational arithmetic on sampled elements."""
    rng = np.random.default_rng(2)
    terms = updates(rng, 12, 20_000)
    exact, running = ExactSum(), WeightedMean()
    for update, n in terms:
        exact.add(update, n)
        running.add(update, n)
    total = sum(n for _, n in terms)
    picked = rng.integers(0, 20_000, 400)
    reference = np.array([float(sum(Fraction(float(u[i])) * n for u, n in terms) / total) for i in picked],
                         dtype=np.float32)
    assert np.array_equal(exact.mean()[picked], reference)
    # And it differs from the float64 running sum in few elements, by one float32 step.
    differ = exact.mean() != running.result()
    assert np.count_nonzero(differ) < 20
    assert np.all(np.abs(exact.mean()[differ] - running.result()[differ])
                  <= np.spacing(np.abs(running.result()[differ])))


def test_a_term_is_cut_to_its_grid_exactly_whatever_the_array_it_comes_in():
    """The compiled fold gives each term's integers trunc(n u 2^(40 - e)), as the float64
    formula does, for updates read from the wire (read-only) or strided views; and a
    subtraction takes them all back."""
    from fedemu.common.ml.exact_sum import FRACTION_BITS

    rng = np.random.default_rng(4)
    base = (rng.standard_normal(2 * 3_001) * 0.05).astype(np.float32)
    read_only = base[:3_001].copy()
    read_only.flags.writeable = False
    for update in (base[:3_001], read_only, base[::2]):
        n = 37
        e = int(np.frexp(np.abs(update).max() * np.float64(n))[1])
        expected = np.trunc(update.astype(np.float64) * (n * 2.0 ** (FRACTION_BITS - e))).astype(np.int64)
        assert np.count_nonzero(expected) > 2_900  # a grid that keeps the values
        one = ExactSum()
        one.add(update, n)
        [[exponent, terms, integers]] = one.state()["buckets"]
        assert (exponent, terms) == (e, 1) and np.array_equal(integers, expected)
        one.subtract(update, n)
        assert not one.state()["buckets"][0][2].any()


def test_a_sum_whose_compiled_loop_cannot_load_is_left_as_it_was(monkeypatch):
    """The loop compiles on a process's first addition; if that fails (numba missing or
    broken), the addition raises and the sum has not counted it."""
    import sys

    from fedemu.common.ml import exact_sum

    one = ExactSum()
    monkeypatch.setattr(exact_sum, "_fold_kernel", None)
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    with pytest.raises(ImportError):
        one.add(np.ones(4, np.float32), 3)
    assert (one.total, one.terms, one.state()["buckets"]) == (0, 0, [])


def test_many_terms_of_one_magnitude_stay_exact_past_the_float64_spill():
    """Over 4,096 terms of one exponent a bucket moves into int64; grouping still does
    not matter."""
    rng = np.random.default_rng(3)
    terms = [(rng.uniform(0.5, 0.99, 8).astype(np.float32), 1) for _ in range(5_000)]
    one = ExactSum()
    for update, n in terms:
        one.add(update, n)
    assert grouped(terms, 3, rng).mean().tobytes() == one.mean().tobytes()
    reference = np.array([float(sum(Fraction(float(u[i])) for u, _ in terms) / len(terms)) for i in range(8)],
                         dtype=np.float32)
    assert np.array_equal(one.mean(), reference)


def test_non_finite_elements_propagate_as_a_float_sum_would():
    diverged = np.array([np.inf, 1.0, np.nan, -np.inf], np.float32)
    total = ExactSum()
    total.add(np.array([1.0, 2.0, 3.0, 4.0], np.float32), 1)
    total.add(diverged, 1)
    mean = total.mean()
    assert mean[0] == np.inf and mean[1] == 1.5 and np.isnan(mean[2]) and mean[3] == -np.inf
    other = ExactSum()
    other.add(np.array([-np.inf, 0.0, 0.0, 0.0], np.float32), 2)
    other.merge(total.state())
    assert np.isnan(other.mean()[0])  # inf - inf, in any order


def test_zero_counts_and_zero_updates_add_nothing_but_their_count():
    total = ExactSum()
    total.add(np.zeros(3, np.float32), 5)
    total.add(np.ones(3, np.float32), 0)
    total.add(np.full(3, 2.0, np.float32), 5)
    assert total.total == 10 and total.mean().tolist() == [1.0, 1.0, 1.0]


def test_bad_terms_and_states_are_refused_by_name_and_change_nothing():
    total = ExactSum()
    total.add(np.ones(4, np.float32), 2)
    with pytest.raises(ValueError, match="an update of 3 values among updates of 4"):
        total.add(np.ones(3, np.float32), 1)
    with pytest.raises(ValueError, match="flat float32"):
        total.add(np.ones(4, np.float64), 1)
    with pytest.raises(ValueError, match="sample count of -1"):
        total.add(np.ones(4, np.float32), -1)
    with pytest.raises(TypeError, match="integer"):
        total.add(np.ones(4, np.float32), 1.5)
    before = total.mean().tobytes()
    good = ExactSum()
    good.add(np.ones(4, np.float32), 1)
    state = good.state()
    bad_bucket = {**state, "buckets": [*state["buckets"], [3, 1, np.ones(4, np.float64)]]}
    for bad, message in [(bad_bucket, "bucket is malformed"),
                         ({**state, "size": 5}, "partial sum of 5 values"),
                         ({**state, "total": -1}, "not non-negative"),
                         ({**state, "special": np.ones(2)}, "non-finite elements are malformed")]:
        with pytest.raises(ValueError, match=message):
            total.merge(bad)
    assert total.mean().tobytes() == before and total.total == 2  # nothing of a refused state was added
    with pytest.raises(ValueError, match="no updates"):
        ExactSum().mean()
