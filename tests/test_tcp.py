"""The TCP transport model alone (node/net/tcp.py): behaviour that must hold whatever the
parameters, checked on emulated time only (no sockets, no wall clock)."""
from __future__ import annotations

import math
import statistics

import pytest

from fedemu.node.net.profiles import DOWN, UP, LinkConfigError, LinkProfile
from fedemu.node.net.tcp import Arrival, Failure, TcpTransport, default_buffer

LTE = dict(transport="tcp", latency_ms=35, bandwidth=12e6 / 8)
UPDATE = 797_015  # the 2NN's update, bytes


def tcp(**keys) -> LinkProfile:
    return LinkProfile(**{"transport": "tcp", **keys})


def transport(profile: LinkProfile | dict, seed: int = 1, server_up: float = math.inf,
              server_down: float = math.inf, server_buffer: dict | None = None) -> TcpTransport:
    if isinstance(profile, dict):
        profile = tcp(**{k: v for k, v in profile.items() if k != "transport"})
    return TcpTransport(seed, lambda link, direction: profile, {UP: server_down, DOWN: server_up}, server_buffer)


def drain(model: TcpTransport) -> list:
    """Every remaining completion, asking the model as a scheduler would."""
    out = []
    while (t := model.next_arrival()) < math.inf:
        out.extend(model.arrivals(t))
    return out


def feed(model: TcpTransport, sends: list[tuple]) -> list:
    """Send (t, link, direction, size, token) in time order, collecting what completes
    meanwhile, then everything else."""
    out = []
    for t, link, direction, size, token in sorted(sends, key=lambda s: s[0]):
        out.extend(model.arrivals(t))
        model.send(t, link, direction, size, token)
    return out + drain(model)


def one(profile, size: int, seed: int = 1) -> Arrival:
    model = transport(profile, seed)
    model.send(0.0, 0, UP, size, "m")
    (arrival,) = drain(model)
    assert isinstance(arrival, Arrival)
    return arrival


@pytest.mark.parametrize("size", [1, 1_000, 100_000, UPDATE, 5_000_000])
@pytest.mark.parametrize("keys", [
    dict(latency_ms=35, bandwidth=12e6 / 8),
    dict(latency_ms=0.1, bandwidth=1e9 / 8),
    dict(latency_ms=300, bandwidth=1e6 / 8),
    dict(latency_ms=50, bandwidth=100e6 / 8, loss=0.02),
    dict(latency_ms=14, bandwidth=1e6 / 8, buffer_bytes=15_000),
])
def test_never_faster_than_serialization_then_latency(keys, size):
    profile = tcp(**keys)
    arrival = one(profile, size)
    segments = math.ceil(size / profile.mss_bytes)
    assert arrival.wire_bytes >= size + segments * profile.header_bytes
    floor = (size + segments * profile.header_bytes) / profile.bandwidth + profile.latency_ms / 1000
    assert arrival.arrival - arrival.entry >= floor * (1 - 1e-9)


def test_a_window_takes_round_trips_where_bandwidth_is_plenty():
    # 100 Mbit/s, 50 ms: 551 segments leave in slow start's rounds of 10, 20, 40, ...
    # (6 rounds), far longer than the pipe's 0.114 s.
    arrival = one(tcp(latency_ms=50, bandwidth=100e6 / 8), UPDATE)
    assert 5 * 0.1 < arrival.arrival - arrival.entry < 7 * 0.1
    assert arrival.retransmitted_bytes == 0


def test_more_loss_is_never_faster():
    clean = one(tcp(**LTE), UPDATE).arrival
    medians = []
    for loss in (0.002, 0.01, 0.05):
        times = [one(tcp(**LTE, loss=loss), UPDATE, seed).arrival for seed in range(15)]
        assert min(times) >= clean * (1 - 1e-9)  # a lost packet never speeds a transfer up
        medians.append(statistics.median(times))
    assert medians == sorted(medians) and medians[-1] > medians[0]


def test_packet_loss_loses_no_message_and_costs_retransmissions():
    model = transport(tcp(**LTE, loss=0.05), seed=3)
    out = feed(model, [(i * 0.5, i % 4, UP if i % 2 else DOWN, 50_000 + 7_919 * i, i) for i in range(20)])
    assert sorted(a.token for a in out) == list(range(20))
    assert all(isinstance(a, Arrival) for a in out)
    assert sum(a.retransmitted_bytes for a in out) > 0
    assert all(a.wire_bytes > a.payload_bytes for a in out)


def test_bursty_loss_per_packet_loses_no_message():
    bursts = tcp(**LTE, ge_p=0.01, ge_r=0.3, ge_loss_bad=0.8)
    model = transport(bursts, seed=5)
    for i in range(10):
        model.send(0.0, i, UP, UPDATE, i)
    out = drain(model)
    assert sorted(a.token for a in out) == list(range(10))
    assert any(a.retransmitted_bytes for a in out)


def test_equal_flows_share_a_bottleneck_and_finish_together():
    n, rate = 10, 10e6 / 8
    model = transport(LTE, server_down=rate)  # uploads enter the server's 10 Mbit/s downlink
    for k in range(n):
        model.send(0.0, k, UP, UPDATE, k)
    out = drain(model)
    times = [a.arrival for a in out]
    wire = out[0].wire_bytes - out[0].retransmitted_bytes
    assert max(times) >= n * wire / rate  # n messages through a link of rate B
    assert min(times) >= 0.8 * n * wire / rate  # none had the link to itself: they shared it
    assert max(times) / min(times) < 1.15


def test_flows_that_lose_unequally_at_a_shallow_shared_queue_finish_apart():
    """A drop-tail FIFO serves each flow in proportion to what it has queued: a flow the
    queue dropped more from (a seeded draw) queues less and falls behind, so ten equal
    uploads through a queue of one bandwidth-delay product spread out (Linux: 4.96-6.99 s
    in one run, bench/linux_reference.py). Max-min sharing kept them within about a
    tenth of their mean whatever was dropped (median spread 0.09 over these seeds)."""
    n, rate = 10, 10e6 / 8
    spreads = []
    for seed in range(1, 8):
        runs = []
        for _ in range(2):
            model = transport(LTE, seed=seed, server_down=rate, server_buffer={UP: rate * 0.070})
            for k in range(n):
                model.send(0.0, k, UP, UPDATE, k)
            runs.append(sorted((a.token, a.arrival) for a in drain(model)))
        assert runs[0] == runs[1]  # the spread is the seed's, not chance
        times = [t for _, t in runs[0]]
        assert len(times) == n and min(times) >= 0.8 * UPDATE / (rate / n * 2)  # never more than twice a fair share
        spreads.append((max(times) - min(times)) / statistics.mean(times))
    assert statistics.median(spreads) > 0.2, spreads


def test_completion_moves_when_another_flow_starts_or_ends():
    rate = 10e6 / 8

    def first(other_size: int | None, other_start: float = 0.0) -> float:
        model = transport(LTE, server_down=rate)
        sends = [(0.0, 0, UP, UPDATE, "a")] + ([(other_start, 1, UP, other_size, "b")] if other_size else [])
        return next(a.arrival for a in feed(model, sends) if a.token == "a")

    alone = first(None)
    joined = first(UPDATE, other_start=0.3)  # another upload starts mid-transfer
    short = first(100_000, other_start=0.3)  # another that ends soon after it starts
    assert alone < short < joined


def test_idle_connection_restarts_its_window():
    model = transport(tcp(latency_ms=50, bandwidth=100e6 / 8))
    model.send(0.0, 0, UP, UPDATE, "first")
    (first,) = drain(model)
    model.send(first.arrival, 0, UP, UPDATE, "back to back")  # the window is open
    (warm,) = drain(model)
    model.send(warm.arrival + 10.0, 0, UP, UPDATE, "after training")  # idle for longer than the RTO
    (cold,) = drain(model)
    warm_s, cold_s = warm.arrival - warm.entry, cold.arrival - cold.entry
    assert warm_s < 0.7 * cold_s
    assert cold_s == pytest.approx(first.arrival - first.entry, rel=0.05)


def test_fifo_per_direction_even_with_jitter():
    model = transport(tcp(latency_ms=30, jitter_ms=25, jitter_distribution="pareto", bandwidth=2e6, loss=0.01))
    sizes = [400_000, 1_000, 50_000, 10, 200_000, 3_000]
    out = feed(model, [(0.01 * i, 0, d, size, i + 100 * d) for i, size in enumerate(sizes) for d in (UP, DOWN)])
    assert [a.token for a in out if a.direction == UP] == list(range(len(sizes)))
    assert [a.token for a in out if a.direction == DOWN] == [100 + i for i in range(len(sizes))]


def test_client_going_offline_loses_its_transfer_with_bytes_in_the_books():
    model = transport(LTE)
    model.send(0.0, 0, UP, 5_000_000, "big")
    model.send(0.0, 1, UP, UPDATE, "other")
    assert model.arrivals(0.5) == []
    failures = model.fail(0.5, 0)
    assert [f.token for f in failures] == ["big"]
    (failure,) = failures
    assert isinstance(failure, Failure) and failure.cause == "offline" and failure.time == 0.5
    assert 0 < failure.sent_payload_bytes < failure.payload_bytes == 5_000_000
    assert failure.wire_bytes > failure.sent_payload_bytes
    assert [a.token for a in drain(model)] == ["other"]
    # Back online, a new connection starts with a fresh window.
    model.send(20.0, 0, UP, UPDATE, "again")
    (again,) = drain(model)
    assert again.arrival - again.entry == pytest.approx(one(tcp(**LTE), UPDATE).arrival, rel=1e-6)


def test_a_connection_that_gets_nothing_through_times_out():
    model = transport(tcp(**LTE, loss=1.0, connection_timeout_s=30.0))
    model.send(0.0, 0, UP, 10_000, "lost")
    model.send(0.0, 0, DOWN, 10_000, "other direction")
    out = drain(model)
    assert {f.token for f in out} == {"lost", "other direction"}
    assert all(isinstance(f, Failure) and f.cause == "timeout" for f in out)
    # RTOs back off 0.2, 0.4, ... s: the first expiry at or past 30 s after the first RTO.
    assert all(30.0 <= f.time < 90.0 for f in out)


def test_same_inputs_same_outputs_whenever_the_model_is_asked():
    def run(ask_between: bool) -> list:
        model = transport(tcp(**LTE, loss=0.02, jitter_ms=5), seed=11, server_down=20e6 / 8)
        out = []
        for i in range(12):
            t = 0.137 * i
            if ask_between:
                model.next_arrival()  # simulates ahead; the next send comes earlier
            out.extend(model.arrivals(t))
            model.send(t, i % 5, UP, 150_000 + 10_000 * i, i)
        return out + drain(model)

    plain, asked = run(False), run(True)
    assert [(a.token, a.arrival, a.wire_bytes) for a in plain] == [(a.token, a.arrival, a.wire_bytes) for a in asked]
    assert len(plain) == 12


def test_asking_ahead_never_changes_a_result():
    """Speculation undone by earlier inputs, the scheduler's until, and no questions at
    all give the same arrivals, failures included, with shared links both ways."""
    profile = tcp(**LTE, loss=0.02, jitter_ms=3)
    inputs = [(0.0, k, DOWN, 300_000, ("down", k)) for k in range(8)]
    inputs += [(0.4 + 0.173 * k, k, UP, 200_000 + 5_000 * k, ("up", k)) for k in range(8)]
    inputs = sorted(inputs + [(0.9, 3, None, 0, "fail")], key=lambda i: i[0])

    def run(mode: str) -> list:
        model = TcpTransport(5, lambda link, direction: profile, {UP: 6e6 / 8, DOWN: 8e6 / 8})
        out = []
        for i, (t, link, direction, size, token) in enumerate(inputs):
            if mode == "ask":
                model.next_arrival()
            elif mode == "until":
                while (due := model.next_arrival(until=t)) <= t:
                    out.extend(model.arrivals(due))
            out.extend(model.arrivals(t))
            if direction is None:
                out.extend(model.fail(t, link))
            else:
                model.send(t, link, direction, size, token)
        return [(type(a).__name__, a.token, a.arrival if isinstance(a, Arrival) else a.time) for a in out + drain(model)]

    quiet = run("quiet")
    assert run("ask") == quiet and run("until") == quiet
    assert sum(1 for kind, *_ in quiet if kind == "Failure") >= 1


def test_until_keeps_what_it_simulated():
    model = transport(LTE, server_down=10e6 / 8)
    for k in range(3):
        model.send(0.0, k, UP, UPDATE, k)
    first = model.next_arrival(until=0.5)
    assert first == math.inf  # nothing completes before 0.5 s
    model.send(0.5, 3, UP, 1_000, 3)  # the promised time: no rollback needed
    tokens = [a.token for a in drain(model)]
    assert sorted(tokens) == [0, 1, 2, 3]


def test_ideal_links_cost_nothing():
    model = TcpTransport(1, lambda link, direction: tcp())
    model.send(2.5, 0, UP, UPDATE, "m")
    assert model.next_arrival() == 2.5
    (arrival,) = model.arrivals(2.5)
    assert arrival.arrival == arrival.entry == 2.5 and arrival.retransmitted_bytes == 0


def test_an_ideal_link_delivers_what_enters_at_the_instant_the_model_was_last_asked():
    """A broker hands out arrivals up to now, then a message enters an ideal link at that
    same instant: it is due then, not forgotten as if it had been handed out already."""
    model = TcpTransport(1, lambda link, direction: tcp())
    model.send(2.5, 0, DOWN, UPDATE, "first")
    assert [a.token for a in model.arrivals(2.6)] == ["first"]
    model.send(2.6, 1, DOWN, UPDATE, "second")
    assert model.next_arrival() == 2.6
    assert [(a.token, a.arrival) for a in model.arrivals(2.6)] == [("second", 2.6)]


@pytest.mark.parametrize("latency_ms", [0, 10])
def test_asking_between_two_sends_of_one_instant_hands_each_message_back_once(latency_ms):
    """A broker asks when the next arrival is after each message it takes, and many
    senders' messages enter at one instant: what the model simulated ahead for the first
    is undone by the second, and the first's completion is found again, not twice."""
    model = transport(dict(latency_ms=latency_ms, bandwidth=1e6))
    for link, token in enumerate("abc"):
        model.send(0.0, link, UP, 1000, token)
        model.next_arrival()
    assert sorted(a.token for a in drain(model)) == ["a", "b", "c"]


def test_reno_and_cubic_both_recover():
    for congestion in ("reno", "cubic"):
        times = [one(tcp(**LTE, loss=0.01, congestion=congestion), UPDATE, seed).arrival for seed in range(5)]
        assert all(t < 60 for t in times)


def test_tcp_profile_keys_are_checked():
    with pytest.raises(LinkConfigError, match="reorder"):
        LinkProfile.from_dict({"transport": "tcp", "reorder": True})
    with pytest.raises(LinkConfigError, match="queue_bytes.*buffer_bytes"):
        LinkProfile.from_dict({"transport": "tcp", "queue_bytes": 10_000})
    with pytest.raises(LinkConfigError, match="congestion = 'reno' applies to transport = 'tcp'"):
        LinkProfile.from_dict({"transport": "message", "congestion": "reno"})
    with pytest.raises(LinkConfigError, match="congestion"):
        LinkProfile.from_dict({"transport": "tcp", "congestion": "bbr"})
    with pytest.raises(LinkConfigError, match="transport"):
        LinkProfile.from_dict({"transport": "quic"})
    with pytest.raises(LinkConfigError, match="buffer_bytes"):
        LinkProfile.from_dict({"transport": "tcp", "buffer_bytes": 0})
    profile = LinkProfile.from_dict({"transport": "tcp", "bandwidth": "100Mbit", "latency_ms": 50})
    # One bandwidth-delay product (1.25 MB) beats 1,000 packets (1.5 MB)? No: the larger wins.
    assert default_buffer(profile, profile) == 1000 * 1500
    fat = LinkProfile.from_dict({"transport": "tcp", "bandwidth": "1Gbit", "latency_ms": 150})
    assert default_buffer(fat, fat) == pytest.approx(1e9 / 8 * 0.3)
