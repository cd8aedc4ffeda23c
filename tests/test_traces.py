"""Traces alone: the rate and step series, the file formats (a safe pickle loader among
them), the mapping of trace entries to clients, and time-of-day conditions."""
from __future__ import annotations

import io
import math
import pickle
from pathlib import Path

import numpy as np
import pytest

from fedemu.node.net import trace_files
from fedemu.node.net.links import Network
from fedemu.node.net.network_spec import NetworkSpec
from fedemu.node.net.profiles import DOWN, UP, LinkConfigError, LinkProfile
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


# --- the formats --------------------------------------------------------------------------


def fedscale_devices(path, records: dict) -> str:
    path.write_bytes(pickle.dumps(records))
    return str(path)


def test_fedscales_device_capacity_becomes_seconds_per_example_and_a_bandwidth(tmp_path):
    path = fedscale_devices(tmp_path / "client_device_capacity",
                            {1: {"computation": 20.0, "communication": 1000.0},
                             2: {"computation": 50.0, "communication": 250.0}})
    table = trace_files.read(path)
    assert table.format == "fedscale" and list(table.entries) == ["1", "2"]
    # FedScale trains at 3 x its inference latency (ms per sample); its kbit is 1,024 bits.
    assert table.series("1", "example_s").value_at(0) == pytest.approx(0.060)
    assert table.series("2", "up_bytes_per_s").value_at(1e6) == pytest.approx(250 * 128)


def test_fedscales_behaviour_trace_becomes_repeating_online_intervals(tmp_path):
    path = tmp_path / "client_behave_trace"
    path.write_bytes(pickle.dumps({7: {"active": [10, 50], "inactive": [30, 60], "finish_time": 100,
                                       "duration": 100, "model": "Pixel 3"}}))
    online = trace_files.read(path).series("7", "online")
    assert [online.value_at(t) for t in (0, 10, 29, 30, 55, 60, 99, 110, 125, 135)] == \
        [0, 1, 1, 0, 1, 0, 0, 1, 1, 0]
    assert online.next_change(60) == 110  # into the next period


@pytest.mark.parametrize("content", [
    pickle.dumps({1: {"computation": np.float64(20.0), "communication": 1.0}}),  # a NumPy scalar: a global
    pickle.dumps({1: {1, 2}}),  # a set: plain, but not what a trace holds
    b"\x80\x04cos\nsystem\n(S'echo pwned'\ntR.",  # a pickle that would run a command
])
def test_a_pickle_holding_anything_but_plain_data_is_refused_naming_the_file(tmp_path, content):
    path = tmp_path / "client_device_capacity"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=str(path)):
        trace_files.read(path)


def test_the_fedemu_csv_reads_each_field_as_steps_and_writes_back_the_same(tmp_path):
    path = tmp_path / "pop.csv"
    path.write_text("client,t,field,value\n"
                    "a,0,flops,2e9\n"
                    "a,5,up_bytes_per_s,1000\n"  # a field's first row holds from t = 0
                    "a,20,up_bytes_per_s,0\n"
                    "a,0,period_s,40\n"
                    "b,0,online,1\nb,12.5,online,0\nb,0,example_s:cnn,0.25\n")
    table = trace_files.read(path)
    assert table.format == "fedemu" and table.periods == {"a": 40.0}
    up = table.series("a", "up_bytes_per_s")
    assert isinstance(up, RateTrace) and up.value_at(1) == 1000 and up.value_at(45) == 1000 and up.value_at(25) == 0
    assert table.series("b", "online").next_change(0) == 12.5
    out = io.StringIO()
    trace_files.write_csv(table, out)
    again = tmp_path / "again.csv"
    again.write_text(out.getvalue())
    reread = trace_files.read(again)
    assert {e: {f: (t.tolist(), v.tolist()) for f, (t, v) in fs.items()} for e, fs in reread.entries.items()} == \
        {e: {f: (t.tolist(), v.tolist()) for f, (t, v) in fs.items()} for e, fs in table.entries.items()}
    assert reread.periods == table.periods


@pytest.mark.parametrize("rows, problem", [
    ("a,0,speed,1\n", "unknown field 'speed'"),
    ("a,0,online,0.5\n", "online = 0.5 must be 0 or 1"),
    ("a,x,online,1\n", "must be numbers"),
    ("a,0,online,1\na,0,online,0\n", "two online rows at t = 0"),
    ("a,0,loss,1\na,0,period_s,0.0001\na,5,loss,0\n", "period_s"),
])
def test_a_malformed_fedemu_csv_is_refused_naming_the_file_and_line(tmp_path, rows, problem):
    path = tmp_path / "bad.csv"
    path.write_text("client,t,field,value\n" + rows)
    with pytest.raises(TraceError, match=problem):
        trace_files.read(path)


def test_formats_are_told_apart_by_content(tmp_path):
    assert trace_files.detect(tmp_path.joinpath("m").write_text("3\n4\n") and tmp_path / "m") == "mahimahi"
    (tmp_path / "c").write_text("client,t,field,value\n")
    assert trace_files.detect(tmp_path / "c") == "fedemu"
    (tmp_path / "x").write_text("hello\n")
    with pytest.raises(TraceError, match="not a trace"):
        trace_files.detect(tmp_path / "x")


# --- traces mapped to clients -------------------------------------------------------------


def spec(network: dict, clients: int = 6, seed: int = 1) -> NetworkSpec:
    return NetworkSpec.from_config(network, clients, seed)


def test_entries_go_to_clients_by_index_at_random_or_to_a_group(tmp_path):
    path = fedscale_devices(tmp_path / "dev", {i: {"computation": 10.0 * (i + 1), "communication": 100.0}
                                                for i in range(3)})
    by_index = spec({"traces": {"d": {"file": path, "use": ["compute"]}}}).population.compute()
    assert [round(by_index[k]["example_s"], 6) for k in range(6)] == [0.03, 0.06, 0.09, 0.03, 0.06, 0.09]
    group = spec({"traces": {"d": {"file": path, "use": ["compute"], "clients": "2-3"}}}).population.compute()
    assert sorted(group) == [2, 3] and group[2]["example_s"] == pytest.approx(0.03)
    drawn = [spec({"traces": {"d": {"file": path, "assign": "random"}}}, seed=s).population.compute()
             for s in (1, 1, 2)]
    assert drawn[0] == drawn[1]  # the same seed, the same draw
    assert drawn[0] != drawn[2]
    links = spec({"traces": {"d": {"file": path, "use": ["links"]}}}).population.links()
    assert links[0].up.value_at(0) == 100 * 128 and not spec(
        {"traces": {"d": {"file": path, "use": ["compute"]}}}).population.links()


def test_a_later_trace_wins_over_an_earlier_one_and_device_classes_come_first(tmp_path):
    a = fedscale_devices(tmp_path / "a", {0: {"computation": 10.0, "communication": 1.0}})
    b = fedscale_devices(tmp_path / "b", {0: {"computation": 20.0, "communication": 1.0}})
    compute = spec({"devices": [{"class": "raspberry-pi-5"}, {"flops": 5e9, "clients": "5"}],
                    "traces": {"one": {"file": a, "clients": "0-3"}, "two": {"file": b, "clients": "2-3"}}}
                   ).population.compute()
    assert compute[0]["example_s"] == pytest.approx(0.03) and compute[2]["example_s"] == pytest.approx(0.06)
    assert compute[4] == {"flops": pytest.approx(DEVICE_CLASSES["raspberry-pi-5"]["flops"])}
    assert compute[5] == {"flops": 5e9}


@pytest.mark.parametrize("network, problem", [
    ({"traces": {"t": {"file": "/nonexistent/trace.csv"}}}, "does not exist"),
    ({"traces": {"t": {"file": "F", "assign": "round-robin"}}}, "assign"),
    ({"traces": {"t": {"file": "F", "use": ["links"]}}}, "no field for it"),
    ({"traces": {"t": {"file": "F", "colour": 1}}}, "unknown key network.traces.t.colour"),
    ({"devices": [{"class": "cray-1"}]}, "not a device class"),
    ({"devices": [{"class": "raspberry-pi-5", "flops": 1e9}]}, "needs one of"),
])
def test_bad_trace_settings_are_refused_naming_the_key(tmp_path, network, problem):
    path = fedscale_devices(tmp_path / "dev", {0: {"computation": 10.0, "communication": 1.0}})
    for entry in network.get("traces", {}).values():
        if entry["file"] == "F":
            entry["file"] = str(tmp_path / "behave")
            (tmp_path / "behave").write_bytes(pickle.dumps({0: {"active": [0], "inactive": [5], "finish_time": 10}}))
    with pytest.raises(LinkConfigError, match=problem):
        spec(network)
    assert path


def test_an_availability_trace_takes_its_clients_offline_when_it_says(tmp_path):
    path = tmp_path / "behave"
    path.write_bytes(pickle.dumps({"x": {"active": [0, 40], "inactive": [20, 60], "finish_time": 80}}))
    network = spec({"traces": {"b": {"file": str(path), "clients": "1"}}}).build()
    assert [network.is_offline(1, t) for t in (0, 19, 20, 39, 40, 60, 80)] == \
        [False, False, True, True, False, True, False]
    assert not network.is_offline(0, 30)  # not in the group
    assert network.availability.next_change(1, 20) == 40


# --- time of day ----------------------------------------------------------------------------


def test_diurnal_availability_follows_the_profile_in_each_clients_time_zone():
    profile = [0.1] * 8 + [0.9] * 12 + [0.1] * 4  # online mostly 8:00-20:00 local
    tod = TimeOfDay(seed=5, offsets_h={k: -6.0 for k in range(500, 1000)}, online=tuple(profile))
    def fraction(clients, t):
        return sum(tod.online_at(k, t) for k in clients) / len(clients)
    noon = 12 * HOUR_S
    assert fraction(range(500), noon) == pytest.approx(0.9, abs=0.05)
    assert fraction(range(500, 1000), noon) == pytest.approx(0.1, abs=0.05)  # 6:00 there
    assert fraction(range(500, 1000), noon + 6 * HOUR_S) == pytest.approx(0.9, abs=0.05)
    # next_online_change lands where the state changes, and nothing changes before it.
    for k in (3, 600):
        t = 0.0
        for _ in range(6):
            change = tod.next_online_change(k, t)
            assert change > t
            before = tod.online_at(k, t)
            assert all(tod.online_at(k, x) == before for x in np.linspace(t, change - 1e-3, 50))
            assert tod.online_at(k, change) != before
            t = change


def test_bandwidth_by_time_of_day_scales_the_rate_hour_by_hour():
    tod = TimeOfDay(seed=1, bandwidth=tuple([1.0] * 12 + [0.5] * 12))
    # 1000 B/s nominal: 11:30 to 12:00 at 1000 B/s, then 500 B/s.
    start = 11.5 * HOUR_S
    rate = tod.rate(0, UP, 1000.0)
    assert rate.finish(start, 1800 * 1000 + 500 * 100) == pytest.approx(12 * HOUR_S + 100)
    assert rate.served(start, 12 * HOUR_S + 100) == pytest.approx(1800 * 1000 + 500 * 100)
    assert rate.value_at(start) == 1000 and rate.next_change(start) == 12 * HOUR_S and rate.value_at(12 * HOUR_S) == 500
    jittered = TimeOfDay(seed=1, bandwidth=tuple([1.0] * 24), bandwidth_sigma=0.5)
    factors = {jittered.bandwidth_factor(k, UP, 0.0) for k in range(20)}
    assert len(factors) == 20 and jittered.bandwidth_factor(3, UP, 10.0) == jittered.bandwidth_factor(3, UP, 3000.0)
    network = NetworkSpec.from_config({"default_profile": "lte", "time_of_day": {"bandwidth": [0.5] * 24}}, 2, 1).build()
    assert network.transmit(0, DOWN, 1_500_000, 0.0).arrival == pytest.approx(2.0 + 0.035)  # 12 Mbit/s halved


@pytest.mark.parametrize("section, problem", [
    ({"online": [0.5] * 23}, "24 values"),
    ({"online": [2.0] * 24}, "fraction"),
    ({"start_utc_h": 25, "online": [0.5] * 24}, "start_utc_h"),
    ({"zones": [{"clients": "0-1"}], "online": [0.5] * 24}, "utc_offset_h"),
    ({"bandwidth_sigma": 0.2}, "needs online"),
])
def test_bad_time_of_day_settings_are_refused_naming_the_key(section, problem):
    with pytest.raises(LinkConfigError, match=problem):
        spec({"time_of_day": section})


# --- fedemu traces convert / stats ------------------------------------------------------------


def test_convert_merges_fedscales_two_files_into_one_csv_that_means_the_same(tmp_path):
    from click.testing import CliRunner

    from fedemu.launch.cli import main

    devices = fedscale_devices(tmp_path / "client_device_capacity",
                               {1: {"computation": 20.0, "communication": 1000.0},
                                2: {"computation": 40.0, "communication": 500.0}})
    behaviour = tmp_path / "client_behave_trace"
    behaviour.write_bytes(pickle.dumps({1: {"active": [5], "inactive": [50], "finish_time": 60},
                                        2: {"active": [0, 30], "inactive": [10, 40], "finish_time": 60}}))
    out = tmp_path / "population.csv"
    result = CliRunner().invoke(main, ["traces", "convert", devices, str(behaviour), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 entries" in result.output
    from_pickles = spec({"traces": {"d": {"file": devices, "use": ["compute"]}, "b": {"file": str(behaviour)}}},
                        clients=4)
    from_csv = spec({"traces": {"p": {"file": str(out), "use": ["compute", "availability"]}}}, clients=4)
    assert from_csv.population.compute() == from_pickles.population.compute()
    for k in range(4):
        for t in (0, 5, 9.9, 10, 35, 45, 59, 65, 125):
            assert from_csv.availability.offline(k, t, 0) == from_pickles.availability.offline(k, t, 0)

    figure = tmp_path / "pop.png"
    result = CliRunner().invoke(main, ["traces", "stats", str(out), "--figure", str(figure)])
    assert result.exit_code == 0, result.output
    assert "2 entries (2 repeating), span 60 s" in result.output
    assert "compute, ms per training example: min 60" in result.output
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Without --figure it is drawn beside the trace, whatever the current folder.
    result = CliRunner().invoke(main, ["traces", "stats", str(out)])
    assert result.exit_code == 0 and f"figure: {out}.stats.png" in result.output
    assert Path(f"{out}.stats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_convert_refuses_an_unsafe_pickle_naming_it_and_writes_nothing(tmp_path):
    from click.testing import CliRunner

    from fedemu.launch.cli import main

    bad = tmp_path / "client_device_capacity"
    bad.write_bytes(b"\x80\x04cos\nsystem\n(S'echo pwned'\ntR.")
    out = tmp_path / "out.csv"
    result = CliRunner().invoke(main, ["traces", "convert", str(bad), "-o", str(out)])
    assert result.exit_code != 0 and str(bad) in result.output and "os.system" in result.output
    assert not out.exists()


# --- a trace as a sweep axis -------------------------------------------------------------------


def test_a_trace_file_and_its_mapping_are_sweep_axes(tmp_path, monkeypatch):
    from fedemu.launch.studies.sweep_spec import expand, load_spec

    monkeypatch.chdir(tmp_path)  # trace files are named from the current directory, as in a launch
    fedscale_devices(tmp_path / "slow", {0: {"computation": 90.0, "communication": 10.0}})
    fedscale_devices(tmp_path / "fast", {0: {"computation": 9.0, "communication": 10.0}})
    sweep_file = tmp_path / "s.toml"
    sweep_file.write_text("""
[base.network.traces.phones]
file = "slow"
use = ["compute"]
[axes]
"network.traces.phones.file" = ["slow", "fast"]
"network.traces.phones.assign" = ["index", "random"]
""")
    points = expand(load_spec(sweep_file))
    assert len(points) == 4 and len({p.hash for p in points}) == 4
    assert {p.config["network"]["traces"]["phones"]["file"] for p in points} == \
        {str(tmp_path / "slow"), str(tmp_path / "fast")}
    bad = tmp_path / "bad.toml"
    bad.write_text(sweep_file.read_text().replace('["slow", "fast"]', '["slow", "missing"]'))
    with pytest.raises(Exception, match="missing does not exist"):
        expand(load_spec(bad))


def test_converting_a_mahimahi_up_file_fills_only_the_uplink_and_a_pair_fills_both(tmp_path):
    from click.testing import CliRunner

    from fedemu.launch.cli import main

    up = mahimahi(tmp_path / "phone.up", [(10, 1)])
    down = mahimahi(tmp_path / "phone.down", [(10, 2)])
    out = tmp_path / "up.csv"
    result = CliRunner().invoke(main, ["traces", "convert", up, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert trace_files.read(out).fields() == {"up_bytes_per_s"}
    result = CliRunner().invoke(main, ["traces", "stats", up, "--figure", str(tmp_path / "up.png")])
    assert result.exit_code == 0, result.output
    assert "uplink" in result.output and "downlink" not in result.output
    # mm-link's pair: each file its own direction, merged into one entry per name.
    both = tmp_path / "both.csv"
    result = CliRunner().invoke(main, ["traces", "convert", up, down, "-o", str(both)])
    assert result.exit_code == 0, result.output
    table = trace_files.read(both)
    assert list(table.entries) == ["phone"]  # one phone, both its links
    assert table.entries["phone"]["down_bytes_per_s"][1][0] == pytest.approx(2 * 1500 * 1000)
    # A name that says no direction fills both, as before; --direction still decides.
    other = mahimahi(tmp_path / "link.trace", [(10, 1)])
    assert trace_files.read(other).fields() == {"up_bytes_per_s", "down_bytes_per_s"}
    assert trace_files.read(up, mahimahi_fields=("down_bytes_per_s",)).fields() == {"down_bytes_per_s"}


def test_a_constant_3_mbit_mahimahi_trace_converts_to_a_few_rows_of_3_mbit(tmp_path):
    from click.testing import CliRunner

    from fedemu.launch.cli import main

    # 3 Mbit/s = 250 packets of 1,500 B a second: one every 4 ms, for 4 s.
    path = tmp_path / "flat.up"
    path.write_text("".join(f"{t}\n" for t in range(4, 4001, 4)))
    out = tmp_path / "flat.csv"
    result = CliRunner().invoke(main, ["traces", "convert", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    times, values = trace_files.read(out).entries["flat"]["up_bytes_per_s"]
    assert len(times) <= 2  # one rate (and at most a short last window), not 1,000 bursts
    assert values[0] * 8 / 1e6 == pytest.approx(3.0)
    # The emulator's own 1 ms steps carry the same bytes over the period.
    exact = RateTrace.from_mahimahi(open(path))
    averaged = RateTrace.from_mahimahi(open(path), window_ms=100)
    assert averaged.served(0, 4.0) == pytest.approx(exact.served(0, 4.0))
    with pytest.raises(TraceError, match="averaging window"):
        RateTrace.from_mahimahi(open(path), window_ms=0)


def test_the_synthetic_fedscale_pair_is_what_its_script_writes_and_reads_as_fedscale(tmp_path):
    import runpy
    import shutil
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[1] / "examples" / "traces"
    script = tmp_path / "make_synthetic_fedscale.py"
    shutil.copy(shipped / script.name, script)  # it writes beside itself: here, not into the repository
    runpy.run_path(str(script), run_name="__main__")
    for name in ("client_device_capacity", "client_behave_trace"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name  # the committed files are its
        table = trace_files.read(shipped / name)
        assert table.format == "fedscale" and len(table.entries) == 20
    assert trace_files.read(shipped / "client_behave_trace").series("0", "online").value_at(0.0) == 1.0


@pytest.mark.mnist
@pytest.mark.slow
def test_the_readmes_trace_example_runs_as_written(tmp_path):
    """README.md's worked example, its shell lines and its TOML taken from the README
    itself, run in a directory whose examples/ is the repository's: convert, stats,
    then a two-round run on the population it wrote."""
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("A worked example, from FedScale's two"):]
    sh = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "examples").symlink_to(root / "examples")
    fedemu = [sys.executable, "-m", "fedemu.launch"]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    for line in sh.strip().splitlines():
        argv = line.split("#")[0].split()
        assert argv[0] == "fedemu", line
        done = subprocess.run(fedemu + argv[1:], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=120)
        assert done.returncode == 0, (line, done.stdout)
    assert trace_files.read(tmp_path / "runs" / "population.csv").fields() >= {"example_s", "online", "up_bytes_per_s"}
    (tmp_path / "traces.toml").write_text(toml)
    done = subprocess.run(fedemu + ["launch", "traces.toml", "--out", "run", "--workers", "1", "--set", "run.rounds=2"],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout
    assert "end: completed after 2 rounds" in done.stdout, done.stdout


def labelled_ticks(ax) -> list[str]:
    """The x tick labels shown inside the axes' limits (after a draw)."""
    lo, hi = sorted(ax.get_xlim())
    return [t.get_text() for t, v in zip(ax.get_xticklabels(), ax.get_xticks()) if t.get_text() and lo <= v <= hi]


@pytest.mark.parametrize("computation, communication", [
    ((20.0, 40.0), (1000.0, 500.0)),  # under a decade: a log axis showed the one label "10¹"
    ((2.0, 400.0), (30.0, 20000.0)),  # over two decades: log, labelled
])
def test_the_stats_figure_labels_at_least_two_ticks_on_each_distribution_axis(tmp_path, computation, communication):
    from click.testing import CliRunner

    from fedemu.launch.cli import main
    from fedemu.launch.studies import traces_cli

    devices = fedscale_devices(tmp_path / "client_device_capacity",
                               {k + 1: {"computation": c, "communication": b}
                                for k, (c, b) in enumerate(zip(computation, communication))})
    out = tmp_path / "population.csv"
    result = CliRunner().invoke(main, ["traces", "convert", devices, "-o", str(out)])
    assert result.exit_code == 0, result.output
    fig = traces_cli.stats_figure(traces_cli.summary(trace_files.read(str(out), "auto")))
    try:
        fig.canvas.draw()
        panels = [ax for ax in fig.axes if ax.get_xlabel().startswith(("mean rate", "training"))]
        assert len(panels) == 2
        for ax in panels:
            assert len(labelled_ticks(ax)) >= 2, (ax.get_xlabel(), ax.get_xscale(), labelled_ticks(ax))
            # every drawn point lies inside the axes
            lo, hi = ax.get_xlim()
            for line in ax.get_lines():
                xs = np.asarray(line.get_xdata(), dtype=float)
                assert lo <= xs.min() and xs.max() <= hi
    finally:
        fig.clf()
