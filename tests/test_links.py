"""The link model alone: exact arithmetic, distributions, and reproducible decisions."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from fedemu.node.net.availability import Availability
from fedemu.node.net.links import Network, uniform
from fedemu.node.net.profiles import DOWN, UP, LinkConfigError, LinkProfile, jitter_sample, parse_bandwidth


def net(**profile) -> Network:
    return Network(seed=7, default=LinkProfile(**profile))


def test_bandwidth_units():
    assert parse_bandwidth("10Mbit") == 10e6 / 8
    assert parse_bandwidth("1.5 MB/s") == 1.5e6
    assert parse_bandwidth("100kbit") == 100e3 / 8
    assert parse_bandwidth("1MiB") == 1024**2
    assert parse_bandwidth(2500) == 2500.0
    assert parse_bandwidth("unlimited") == math.inf
    for bad in ("fast", "10 parsecs", 0, -5, True):
        with pytest.raises(LinkConfigError, match="bandwidth"):
            parse_bandwidth(bad)


def test_serialization_then_latency_on_a_fifo():
    n = net(latency_ms=10, bandwidth=1000, overhead_bytes=100)
    # 900 + 100 bytes at 1000 B/s: 1 s on the link, then 10 ms of flight.
    first = n.transmit(0, UP, 900, now=0.0)
    assert first.arrival == pytest.approx(1.010)
    # Sent at t=0.5 while the link is busy until 1.0: starts at 1.0.
    second = n.transmit(0, UP, 400, now=0.5)
    assert second.arrival == pytest.approx(1.0 + 0.5 + 0.010)
    assert second.transfer_s == pytest.approx(second.arrival - 0.5)
    # An idle link starts at once.
    third = n.transmit(0, UP, 900, now=5.0)
    assert third.arrival == pytest.approx(6.010)


def test_links_are_per_client_and_per_direction():
    n = net(bandwidth=1000)
    assert n.transmit(0, UP, 1000, 0.0).arrival == pytest.approx(1.0)
    assert n.transmit(1, UP, 1000, 0.0).arrival == pytest.approx(1.0)  # another client: no sharing
    assert n.transmit(0, DOWN, 1000, 0.0).arrival == pytest.approx(1.0)  # the other direction


def test_shared_server_uplink_serializes_a_broadcast():
    n = Network(seed=1, default=LinkProfile(bandwidth=1000), server_up_bandwidth=10_000)
    # 10 downloads of 1000 B leave the server's 10 kB/s uplink one after another (0.1 s
    # each), then each crosses its own 1 kB/s downlink (1 s).
    arrivals = [n.transmit(k, DOWN, 1000, 0.0).arrival for k in range(10)]
    assert arrivals == pytest.approx([0.1 * (k + 1) + 1.0 for k in range(10)])


def test_asymmetric_profiles():
    n = Network(seed=1)
    n.set_profile(3, UP, LinkProfile(bandwidth=100))
    n.set_profile(3, DOWN, LinkProfile(bandwidth=1000))
    assert n.transmit(3, UP, 100, 0.0).arrival == pytest.approx(1.0)
    assert n.transmit(3, DOWN, 100, 0.0).arrival == pytest.approx(0.1)


def test_jitter_keeps_fifo_unless_reorder():
    def arrivals(reorder: bool) -> list[float]:
        n = net(latency_ms=50, jitter_ms=40, reorder=reorder)
        return [n.transmit(0, UP, 10, now=i * 0.001).arrival for i in range(500)]

    fifo = arrivals(False)
    assert fifo == sorted(fifo)
    reordered = arrivals(True)
    assert reordered != sorted(reordered)  # with 40 ms jitter every 1 ms, order breaks


# Jitter of 10 ms: each distribution's standard deviation (ms) and kurtosis (None: Pareto
# with shape 3 has no fourth moment).
JITTER_SHAPES = {"uniform": (10 / math.sqrt(3), 1.8), "normal": (10.0, 3.0), "pareto": (10.0, None),
                 "paretonormal": (10 * math.sqrt(0.25**2 + 0.75**2), None)}
SPREAD_Z = 5.0  # every check is a 5-sigma band of its statistic: 6e-7 to fail by chance
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
# A Pareto sample's mean is pulled by its largest draw: it is 1.6 ms off only if a draw
# passes about n * 1.6 ms = 32 s, which has probability 20,000 * (11.55 / 32,000)^3 = 1e-6
# (the shape-3 tail P(X > t) = (11.55 / (t + 17.3))^3 at 10 ms); without one, 1.6 ms is 22
# of the mean's standard errors.
PARETO_MEAN_TOLERANCE_MS = 1.6


def jitter_samples(dist: str, seed: int, n: int = 20_000) -> np.ndarray:
    """n jitters drawn as the broker draws them, from the run seed's counter-based stream."""
    profile = LinkProfile(jitter_ms=10, jitter_distribution=dist)
    return np.array([jitter_sample(profile, lambda i, c=c: uniform(seed, f"jitter/{i}", 0, 0, c))
                     for c in range(n)])


@functools.cache
def jitter_reference(dist: str, n: int = 200_000) -> np.ndarray:
    """A large sample through the same transform from numpy's generator, an independent
    source of uniforms."""
    rng = np.random.default_rng(0)
    profile = LinkProfile(jitter_ms=10, jitter_distribution=dist)
    return np.array([jitter_sample(profile, lambda i: rng.random()) for _ in range(n)])


def jitter_spread_problems(dist: str, samples: np.ndarray) -> list[str]:
    """What in ``samples`` departs from the set distribution by more than its sampling
    spread allows (empty if nothing). Over seeds 0-199 of the stream (20,000 samples
    each, every distribution), none failed:
    python -c "from tests.test_links import *; print(sum(bool(jitter_spread_problems(d, jitter_samples(d, s)))
                                                     for s in range(200) for d in JITTER_SHAPES))"
    """
    n, problems = len(samples), []
    sd, kurtosis = JITTER_SHAPES[dist]
    mean_tolerance = SPREAD_Z * sd / math.sqrt(n) if kurtosis is not None else PARETO_MEAN_TOLERANCE_MS
    if abs(samples.mean()) > mean_tolerance:
        problems.append(f"mean {samples.mean():.3f} ms, beyond +-{mean_tolerance:.3f}")
    if kurtosis is not None:
        # The sample deviation's standard error: sd * sqrt((kurtosis - 1) / 4n).
        tolerance = SPREAD_Z * sd * math.sqrt((kurtosis - 1) / (4 * n))
        if abs(samples.std() - sd) > tolerance:
            problems.append(f"deviation {samples.std():.3f} ms, beyond {sd:.3f} +- {tolerance:.3f}")
        return problems
    # No fourth moment: a sample's deviation wanders (8.8 to 13 ms over 20 seeds), so
    # compare quantiles with the reference instead. The share of samples at or below the
    # reference's p-quantile is p, give or take the binomial spread of both samples.
    reference = jitter_reference(dist)
    for p in QUANTILES:
        share = np.mean(samples <= np.quantile(reference, p))
        tolerance = SPREAD_Z * math.sqrt(p * (1 - p) * (1 / n + 1 / len(reference)))
        if abs(share - p) > tolerance:
            problems.append(f"{share:.4f} of the samples below the reference's {p} quantile, beyond +-{tolerance:.4f}")
    return problems


@pytest.mark.parametrize("dist", list(JITTER_SHAPES))
def test_jitter_distributions_have_the_set_spread(dist):
    samples = jitter_samples(dist, seed=1)
    assert jitter_spread_problems(dist, samples) == []
    if dist == "uniform":
        assert np.abs(samples).max() <= 10
    if dist in ("pareto", "paretonormal"):  # the reference itself has the set deviation
        assert jitter_reference(dist).std() == pytest.approx(JITTER_SHAPES[dist][0], rel=0.1)


def test_delay_is_never_negative():
    n = net(latency_ms=1, jitter_ms=50, jitter_distribution="normal", reorder=True)
    for i in range(2000):
        v = n.transmit(0, UP, 1, now=float(i))
        assert v.arrival >= i


def binomial_interval(n: int, p: float, z: float = 4.0) -> tuple[float, float]:
    """n*p -/+ z standard deviations: a 4-sigma band fails by chance 6e-5 of the time."""
    sd = math.sqrt(n * p * (1 - p))
    return n * p - z * sd, n * p + z * sd


@pytest.mark.parametrize("loss", [0.01, 0.1, 0.3])
def test_loss_rate_within_a_binomial_interval(loss):
    n, count = net(loss=loss), 20_000
    lost = sum(n.transmit(k % 50, UP, 100, 0.0).dropped == "loss" for k in range(count))
    low, high = binomial_interval(count, loss)
    assert low <= lost <= high


def test_gilbert_elliott_losses_come_in_bursts():
    # Stationary P(bad) = p / (p + r) = 0.05/0.3; all losses happen in the bad state.
    n, count = net(ge_p=0.05, ge_r=0.25, ge_loss_bad=1.0), 40_000
    lost = [n.transmit(0, UP, 10, 0.0).dropped == "loss" for _ in range(count)]
    rate = sum(lost) / count
    assert rate == pytest.approx(0.05 / 0.30, rel=0.1)
    bursts = sum(1 for a, b in zip(lost, lost[1:]) if b and not a)
    mean_burst = sum(lost) / bursts
    assert mean_burst == pytest.approx(1 / 0.25, rel=0.15)  # bursts last 1/r messages
    bernoulli = net(loss=rate)
    independent = [bernoulli.transmit(0, UP, 10, 0.0).dropped == "loss" for _ in range(count)]
    assert sum(independent) / max(1, sum(1 for a, b in zip(independent, independent[1:]) if b and not a)) < 1.5


def test_queue_limit_tail_drops_and_counts():
    n = net(bandwidth=1000, queue_messages=3)
    verdicts = [n.transmit(0, UP, 1000, 0.0) for _ in range(5)]
    assert [v.dropped for v in verdicts] == [None, None, None, "queue", "queue"]
    assert n.transmit(0, UP, 1000, 1.5).dropped is None  # the first left the queue at t=1
    b = net(bandwidth=1000, queue_bytes=2500)
    assert [b.transmit(0, UP, 1000, 0.0).dropped for _ in range(3)] == [None, None, "queue"]


def test_offline_client_traffic_is_dropped():
    n = net(latency_ms=5)
    n.offline.add(4)
    assert n.transmit(4, UP, 10, 0.0).dropped == "offline"
    assert n.transmit(4, DOWN, 10, 0.0).dropped == "offline"
    assert n.transmit(5, UP, 10, 0.0).dropped is None


def test_same_seed_same_decisions_whatever_the_interleaving():
    def decisions(order):
        n = Network(seed=42, default=LinkProfile(latency_ms=20, jitter_ms=10, loss=0.2))
        out = {}
        for link, i in order:
            v = n.transmit(link, UP, 100, now=float(i))
            out[(link, i)] = (v.dropped, v.arrival)
        return out

    by_link = [(link, i) for link in range(5) for i in range(200)]
    interleaved = [(link, i) for i in range(200) for link in range(5)]
    assert decisions(by_link) == decisions(interleaved)
    other_seed = Network(seed=43, default=LinkProfile(latency_ms=20, jitter_ms=10, loss=0.2))
    assert [other_seed.transmit(0, UP, 100, float(i)).dropped for i in range(200)] != \
        [decisions(by_link)[(0, i)][0] for i in range(200)]


def test_profile_validation_names_the_key():
    with pytest.raises(LinkConfigError, match=r"lte\.loss = 1.5 must be a probability in \[0, 1\]"):
        LinkProfile.from_dict({"loss": 1.5}, "lte")
    with pytest.raises(LinkConfigError, match=r"unknown key lte\.latency \(did you mean lte\.latency_ms\?\); link keys are"):
        LinkProfile.from_dict({"latency": 5}, "lte")
    with pytest.raises(LinkConfigError, match="jitter_distribution"):
        LinkProfile.from_dict({"jitter_distribution": "gamma"}, "lte")
    assert LinkProfile.from_dict({"bandwidth": "8Mbit", "latency_ms": 60}).bandwidth == 1e6


def test_machine_entries_resolve_to_each_hosts_clients_in_config_order():
    from fedemu.node.net.network_spec import NetworkSpec

    spec = NetworkSpec.from_config({"assign": [
        {"profile": "lte", "machine": "h2"},
        {"profile": "3g", "clients": "60-64"},  # later: wins over h2's lte for these five
        {"profile": "cable", "machine": "alice@h3:2222"},
    ]}, num_clients=100, run_seed=1)
    assert spec.machines == ["h2", "alice@h3:2222"]
    network = spec.build()  # until placement, the hosts' clients keep the default
    assert network.profile(55, UP) == network.profile(0, UP) and network.profile(60, UP) == spec.profiles["3g"][0]
    resolved = spec.resolve_machines({"h1": range(0, 34), "h2": range(34, 67), "alice@h3:2222": range(67, 100)})
    assert resolved == [("lte", frozenset(range(34, 67))), ("3g", frozenset(range(60, 65))),
                        ("cable", frozenset(range(67, 100)))]
    with pytest.raises(LinkConfigError, match=r"network.assign\[0\].machine = 'h2' is not a host of this run; "
                                              r"the hosts are none \(a local run\)"):
        spec.resolve_machines({})


def test_a_machine_entry_stands_alone():
    from fedemu.node.net.network_spec import NetworkSpec

    with pytest.raises(LinkConfigError, match=r"network.assign\[0\]: machine = 'h2' must name one host"):
        NetworkSpec.from_config({"assign": [{"profile": "lte", "machine": "h2", "clients": "0-9"}]}, 100, 1)
    with pytest.raises(LinkConfigError, match=r"network.assign\[0\] must have profile and clients"):
        NetworkSpec.from_config({"assign": [{"profile": "lte", "host": "h2"}]}, 100, 1)


def test_next_change_names_every_time_based_switch_of_a_client():
    """Stepping from change to change (as the broker wakes up to tell a client's node)
    sees every switch a fine scan sees."""
    avail = Availability(seed=3, windows=[(frozenset({0}), 5.0, 9.0)], leave=[(None, 40.0)],
                         on_off=(frozenset({0, 1}), 6.0, 2.0))
    for link in (0, 1, 2):
        scanned = []  # times (to 0.01 s) where a fine scan sees the state flip
        state = avail.offline(link, 0.0, 0)
        for step in range(1, 5000):
            now = step / 100
            if avail.offline(link, now, 0) != state:
                state = not state
                scanned.append(now)
        stepped, now = [], 0.0
        while (now := avail.next_change(link, now)) < 50:
            if avail.offline(link, now, 0) != avail.offline(link, now - 1e-9, 0):
                stepped.append(now)
        assert len(scanned) >= 1
        assert [math.ceil(t * 100) / 100 for t in stepped] == scanned
    assert avail.next_change(2, 0.0) == 40.0  # client 2 has only the leave rule
    assert avail.next_change(2, 40.0) == math.inf


def test_every_seeded_choice_draws_from_its_own_named_stream():
    """Groups chosen by fraction are named by their config path, so the 11th offline
    window and the first permanent leave pick independent clients (numbered salts
    once made them the same draw), and a group's choice is not uplink k's first
    Gilbert-Elliott or loss draw."""
    from fedemu.node.net.network_spec import NetworkSpec

    K = 200
    windows = [{"fraction": 0.5, "start_s": 1.0 + i, "end_s": 2.0 + i} for i in range(11)]
    spec = NetworkSpec.from_config({"dropout": {"windows": windows, "leave": [{"fraction": 0.5, "at_s": 50.0}]}},
                                   num_clients=K, run_seed=3)
    window_groups = [group for group, _, _ in spec.availability.windows]
    leave_group = spec.availability.leave[0][0]
    assert len(leave_group) == K // 2 and all(len(g) == K // 2 for g in window_groups)
    assert len(set(window_groups + [leave_group])) == 12  # twelve different halves
    for group in window_groups:  # independent halves overlap by about a quarter of K, never fully
        assert 30 < len(group & leave_group) < 70

    for i in range(6):  # whatever its place in the list, an assignment is no link's loss draws
        assign = [{"profile": "lte", "fraction": 0.0}] * i + [{"profile": "lte", "fraction": 0.5}]
        chosen = NetworkSpec.from_config({"assign": assign}, num_clients=K, run_seed=3).assign[i][1]
        for purpose in ("loss", "gilbert-elliott"):
            first_draws = sorted(range(K), key=lambda k: uniform(3, purpose, k, UP, 0))[: K // 2]
            assert chosen != frozenset(first_draws)
