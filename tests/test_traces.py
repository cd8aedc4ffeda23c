"""Traces alone: the rate and step series, the file formats (a safe pickle loader among
them), the mapping of trace entries to clients, and time-of-day conditions."""
from __future__ import annotations

import io
import math
import pickle

import numpy as np
import pytest

from fedemu.node.net import trace_files
from fedemu.node.net.links import DOWN, UP, LinkConfigError, LinkProfile, Network, NetworkSpec
from fedemu.node.net.population import DEVICE_CLASSES, LinkTrace
from fedemu.node.net.time_of_day import HOUR_S, TimeOfDay
from fedemu.node.net.traces import RateTrace, StepSeries, TraceError


def mahimahi(path, per_ms: list[tuple[int, int]]) -> str:
    """A Mahimahi trace: for each (milliseconds, packets per ms), that many ms at that rate."""
    lines, t = [], 0
    for ms, packets in per_ms:
        for _ in range(ms):
            t += 1
            lines += [str(t)] * packets
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# --- the series ---------------------------------------------------------------------------


def test_a_step_series_holds_each_value_until_the_next_and_repeats_with_its_period():
    s = StepSeries([0, 10, 25], [1, 0, 1], period=40)
    assert [s.value_at(t) for t in (0, 9.99, 10, 24, 25, 39.9, 40, 50, 65)] == [1, 1, 0, 0, 1, 1, 1, 0, 1]
    assert s.next_change(0) == 10 and s.next_change(10) == 25
    assert s.next_change(30) == 50  # the last step runs into the next period's first: equal, so no change at 40
    once = StepSeries([0, 10], [1, 0])
    assert once.value_at(1e9) == 0 and once.next_change(10) == math.inf


@pytest.mark.parametrize("bad", [dict(times=[1, 2], values=[1, 0]), dict(times=[0, 0], values=[1, 0]),
                                 dict(times=[0, 5], values=[1, 0], period=5)])
def test_a_malformed_series_is_refused(bad):
    with pytest.raises(TraceError):
        StepSeries(bad["times"], bad["values"], bad.get("period"))


def test_a_rate_trace_serves_bytes_at_the_rate_of_each_step():
    r = RateTrace([0, 1, 3], [100, 0, 50])  # 100 B/s for 1 s, an outage, then 50 B/s
    assert r.finish(0, 50) == pytest.approx(0.5)
    assert r.finish(0.5, 100) == pytest.approx(3 + 50 / 50)  # 50 B before the outage, 50 after it
    assert r.finish(2, 25) == pytest.approx(3.5)  # starts in the outage
    assert r.served(0, 4) == pytest.approx(150)
    assert RateTrace([0, 1], [100, 0]).finish(0, 200) == math.inf  # dead from t = 1 on


def test_a_repeating_rate_trace_wraps_for_long_transfers():
    r = RateTrace([0, 1], [100, 300], period=2)  # 400 B per 2 s
    assert r.finish(0, 400) == pytest.approx(2.0)
    assert r.finish(0, 1000) == pytest.approx(4 + 1 + 100 / 300)
    assert r.finish(1.5, 50) == pytest.approx(1.5 + 50 / 300)


def test_mahimahi_lines_become_millisecond_steps(tmp_path):
    path = mahimahi(tmp_path / "t.up", [(2, 1), (2, 3)])  # 1 packet/ms for 2 ms, then 3/ms
    r = RateTrace.from_mahimahi(open(path), where=path)
    assert r.period == pytest.approx(0.004)
    assert r.value_at(0.0005) == 1_500_000 and r.value_at(0.0035) == 4_500_000
    assert r.served(0, 0.004) == pytest.approx(8 * 1500)  # exactly the trace's 8 packets per period


def test_a_malformed_mahimahi_trace_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "bad.trace"
    path.write_text("1\n2\nfast\n")
    with pytest.raises(TraceError, match="line 3"):
        RateTrace.from_mahimahi(open(path), where=str(path))
    path.write_text("5\n3\n")
    with pytest.raises(TraceError, match="non-decreasing"):
        RateTrace.from_mahimahi(open(path), where=str(path))


# --- the message pipe on a trace ------------------------------------------------------------


def test_a_mahimahi_rate_step_in_the_middle_of_an_upload_gives_the_piecewise_transfer_time(tmp_path):
    """12 Mbit/s (one 1500-byte packet per ms) for 1 s, then 24 Mbit/s: 2 MB entering at
    0.5 s crosses 750 kB in the first half second and the remaining 1.25 MB at 3 MB/s."""
    path = mahimahi(tmp_path / "step.up", [(1000, 1), (1000, 2)])
    network = Network(seed=1, default=LinkProfile(latency_ms=20))
    network.link_traces[0] = LinkTrace(up=RateTrace.from_mahimahi(open(path), where=path))
    verdict = network.transmit(0, UP, 2_000_000, now=0.5)
    expected_tx = 0.5 + 750_000 / 1.5e6 + 1_250_000 / 3e6
    assert verdict.arrival == pytest.approx(expected_tx + 0.020, abs=1e-9)
    # The downlink has no trace: its profile (unlimited) holds.
    assert network.transmit(0, DOWN, 2_000_000, now=0.5).arrival == pytest.approx(0.520)
    # The next upload queues behind the first on the same FIFO, at the faster rate.
    second = network.transmit(0, UP, 300_000, now=0.6)
    assert second.arrival == pytest.approx(expected_tx + 300_000 / 3e6 + 0.020, abs=1e-9)


def test_a_trace_of_latency_and_loss_replaces_the_profiles_at_each_messages_entry():
    network = Network(seed=3, default=LinkProfile(latency_ms=10, bandwidth=1e6))
    network.link_traces[0] = LinkTrace(latency_ms=StepSeries([0, 5], [100, 300]), loss=StepSeries([0, 8], [0, 1]))
    assert network.transmit(0, UP, 1000, 1.0).arrival == pytest.approx(1.0 + 0.001 + 0.100)
    assert network.transmit(0, UP, 1000, 6.0).arrival == pytest.approx(6.0 + 0.001 + 0.300)
    assert network.transmit(0, UP, 1000, 9.0).dropped == "loss"
    assert network.transmit(1, UP, 1000, 9.0).arrival == pytest.approx(9.011)  # another client: its profile


def test_a_link_that_never_serves_again_loses_the_message_as_an_outage():
    network = Network(seed=1)
    network.link_traces[0] = LinkTrace(up=RateTrace([0, 1], [1000, 0]))
    assert network.transmit(0, UP, 5000, 0.0).dropped == "outage"
