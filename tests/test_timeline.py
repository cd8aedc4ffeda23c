"""The ground truth of a round (what happened to each selected client, beside what the
server saw), the run's timeline (timeline.csv), and its two views: the Chrome trace
export and the Gantt figure. Judging is tested on made-up facts; the rest on one small
real run with drop-outs and stragglers (virtual time: the same run on any host)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedemu.launch.cli import main
from fedemu.launch.studies.report_timeline import chrome_trace, plot_gantt
from fedemu.server.runlog import RunLog, read_events
from fedemu.server.timeline import DOWN, UP, Timeline

# --- judging, on made-up facts ------------------------------------------------------------


def transfer(link, direction, entry, end, outcome="delivered"):
    return [link, direction, entry, end, 1000, 1000, 0, outcome, None]


class Reply:
    num_samples, train_loss, compute_s = 10, 0.5, 1.0


def judge(tmp_path, stats, seen, replies=(), start=10.0, end=20.0, before=None):
    timeline = Timeline(RunLog(tmp_path))
    if before is not None:
        timeline.take(before, 0)
    facts = timeline.take(stats, 1)
    for k in replies:
        timeline.reply(1, k, 11.0, 12.0, 1.0)
    selected = sorted(set(seen) | set(replies))
    out = timeline.judge(1, start, end, facts, selected, seen, {k: Reply() for k in replies}, lambda k: 3.0)
    return {c.client: c for c in out}


def test_a_device_offline_during_the_round_is_offline_with_the_time_though_the_server_saw_a_straggler(tmp_path):
    got = judge(tmp_path, {"transfers": [transfer(1, DOWN, 10.0, 10.5)], "availability": [[1, 13.5, True]]},
                seen={1: "straggler"})
    assert (got[1].seen, got[1].outcome, got[1].offline_at) == ("straggler", "offline", 13.5)
    assert got[1].slowdown == 3.0


def test_a_device_offline_since_an_earlier_round_is_offline_since_then(tmp_path):
    got = judge(tmp_path, {"transfers": [transfer(2, DOWN, 10.0, 10.0, "offline")], "availability": []},
                seen={2: "straggler"}, before={"availability": [[2, 4.0, True]]})
    assert (got[2].outcome, got[2].offline_at) == ("offline", 4.0)


def test_a_device_back_online_as_the_round_starts_is_not_offline(tmp_path):
    """Per-round drop-outs: offline in the last round, online from this round's first instant."""
    got = judge(tmp_path, {"transfers": [transfer(3, DOWN, 10.0, 10.5)], "availability": [[3, 10.0, False]]},
                seen={3: "straggler"}, before={"availability": [[3, 0.0, True]]})
    assert (got[3].outcome, got[3].offline_at) == ("straggler", None)


def test_a_lost_message_is_a_failed_transfer_naming_its_direction(tmp_path):
    got = judge(tmp_path, {"transfers": [transfer(4, DOWN, 10.0, 10.5), transfer(4, UP, 12.0, 12.0, "loss")]},
                seen={4: "straggler"})
    assert (got[4].outcome, got[4].failed) == ("failed_transfer", "up loss")


def test_an_answer_keeps_its_compute_span_bytes_and_transfer_times(tmp_path):
    got = judge(tmp_path, {"transfers": [transfer(5, DOWN, 10.0, 11.0), transfer(5, UP, 12.0, 12.5)]}, seen={},
                replies=[5])
    c = got[5]
    assert (c.outcome, c.seen, c.compute_start_s, c.compute_end_s) == ("answered", "answered", 11.0, 12.0)
    assert (c.bytes_down, c.bytes_up, c.download_s, c.upload_s) == (1000, 1000, 1.0, 0.5)


def test_a_late_reply_from_an_earlier_round_is_not_counted_in_the_round_it_lands_in(tmp_path):
    timeline = Timeline(RunLog(tmp_path))
    timeline.reply(1, 6, 0.5, 14.0, 1.0, late=True)  # round 1's reply, after round 1 closed at 10
    facts = timeline.take({"transfers": [transfer(6, DOWN, 10.0, 10.5), transfer(6, UP, 14.0, 14.5)]}, 2)
    (c,) = timeline.judge(2, 10.0, 20.0, facts, [6], {6: "straggler"}, {}, lambda k: 1.0)
    assert (c.outcome, c.bytes_up) == ("straggler", 0)


# --- one real run -------------------------------------------------------------------------

DROPOUT_RUN = """
[run]
rounds = 4
target_accuracy = 0.0
heartbeat_interval_s = 0.2
[data]
clients = 10
partition = "sample"
examples_per_client = 100
[algorithm]
C = 0.5
deadline_s = 5.0
[network]
default_profile = "lte"
[network.dropout]
per_round = 0.3
[network.stragglers]
# Half the devices 100 times slower: 8.8 emulated seconds of training, past the 5 s deadline.
distribution = "classes"
classes = [[0.5, 1.0], [0.5, 100.0]]
"""


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dropout")
    (folder / "run.toml").write_text(DROPOUT_RUN)
    run_dir = folder / "run"
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", str(folder / "run.toml"), "--out",
                           str(run_dir), "--workers", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    return run_dir


def rows(run_dir: Path, name: str) -> list[dict]:
    with open(run_dir / name, newline="") as f:
        return list(csv.DictReader(f))


def round_events(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "round"]


@pytest.mark.mnist
def test_a_dropout_run_names_offline_clients_with_the_time_and_stragglers_with_their_factor(dropout_run):
    events = round_events(dropout_run)
    clients = rows(dropout_run, "clients.csv")
    switches = {(int(r["client"]), float(r["start_s"])) for r in rows(dropout_run, "timeline.csv")
                if r["kind"] == "offline"}
    offline_seen = straggler_seen = 0
    for e in events:
        mine = {int(r["client"]): r for r in clients if int(r["round"]) == e["round"]}
        assert sorted(mine) == e["selected"]
        assert sum(e["outcome_counts"].values()) == len(e["selected"])
        for k in e["outcomes"]["offline"]:
            offline_seen += 1
            at = e["offline_at"][str(k)]
            assert at <= e["emulated_s"] and (k, at) in switches  # the time its device went offline
            assert k in e["stragglers"]  # what the server could see: no answer
            assert mine[k]["outcome"] == "offline" and mine[k]["seen"] == "straggler"
            assert float(mine[k]["offline_at_s"]) == at
        for k in e["outcomes"]["straggler"]:
            straggler_seen += 1
            assert e["slowdowns"][str(k)] == 100.0  # only the slow devices miss the deadline here
            assert mine[k]["outcome"] == "straggler" and float(mine[k]["slowdown"]) == 100.0
        for k in e["outcomes"]["answered"]:
            assert mine[k]["outcome"] == mine[k]["seen"] == "answered" and int(mine[k]["num_samples"]) == 100
    assert offline_seen and straggler_seen  # this seed's run has both


@pytest.mark.mnist
def test_the_timeline_has_each_answered_clients_download_compute_and_upload_in_order(dropout_run):
    events = round_events(dropout_run)
    timeline = rows(dropout_run, "timeline.csv")
    spans = {int(r["round"]): (float(r["start_s"]), float(r["end_s"])) for r in timeline if r["kind"] == "round"}
    previous_end = 0.0
    for e in events:
        start, end = spans[e["round"]]
        assert (start, end) == (previous_end, e["emulated_s"])  # rounds follow each other, as the events say
        assert e["round_emulated_s"] == pytest.approx(end - start)
        previous_end = end
        for k in e["selected"]:
            mine = [r for r in timeline if r["client"] == str(k) and r["kind"] != "round"
                    and start <= float(r["start_s"]) < end]
            (download,) = [r for r in mine if r["kind"] == "download"]
            if k in e["outcomes"]["offline"] and download["outcome"] == "offline":
                continue  # offline when its model was sent: nothing more to see
            assert download["outcome"] == "delivered"
            if k not in e["answered"]:
                assert not [r for r in mine if r["kind"] == "compute" and r["outcome"] == "on time"]
                continue
            (compute,) = [r for r in mine if r["kind"] == "compute"]
            (upload,) = [r for r in mine if r["kind"] == "upload"]
            # Virtual time: local work starts as the model arrives; the reply enters the
            # uplink as the emulated device finishes.
            assert float(download["end_s"]) == float(compute["start_s"])
            assert float(compute["end_s"]) == float(upload["start_s"])
            assert float(upload["start_s"]) < float(upload["end_s"]) <= end
            assert upload["outcome"] == "delivered" and int(upload["bytes"]) > 0


@pytest.mark.mnist
def test_on_the_wall_clock_the_timeline_is_in_one_time_the_brokers(tmp_path):
    """Wall clock, two worker nodes: transfers are the broker's times, computations the
    worker nodes'; each node's clock counts from the broker's emulated zero, so a
    client's download, computation and upload follow each other on one axis (they were
    hours apart when a node's clock was its host's monotonic clock)."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--workers", "2",
                           "--set", "run.clock=wall", "--set", "run.rounds=1", "--set", "network.default_profile=lte",
                           "--set", "run.target_accuracy=0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    (event,) = round_events(run_dir)
    timeline = rows(run_dir, "timeline.csv")
    for k in event["answered"]:
        mine = {r["kind"]: r for r in timeline if r["client"] == str(k)}
        download, compute, upload = mine["download"], mine["compute"], mine["upload"]
        # Each starts after the one before ends (the held model is released when due; the
        # reply is stamped as it is sent); slack for the clocks' reading order only.
        assert float(download["end_s"]) <= float(compute["start_s"]) + 1e-3
        assert float(compute["end_s"]) <= float(upload["start_s"]) + 1e-3
        assert float(upload["end_s"]) <= event["emulated_s"] + 1e-3
        assert float(compute["start_s"]) - float(download["end_s"]) < 30  # not another clock's origin


@pytest.mark.mnist
def test_the_chrome_trace_export_is_valid_trace_json_with_a_track_per_client(dropout_run, tmp_path):
    out = tmp_path / "trace.json"
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "export", "--trace", str(dropout_run), "-o",
                           str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    trace = json.loads(out.read_text())
    assert trace == json.loads(json.dumps(chrome_trace(dropout_run)))
    events = trace["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "M"}
    for e in events:
        assert isinstance(e["name"], str) and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"
              and e["pid"] == 1}
    first = round_events(dropout_run)[0]
    for k in first["answered"]:
        assert tracks[k] == f"client {k}"
        kinds = [e["name"] for e in sorted((e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == k),
                                           key=lambda e: e["ts"])]
        assert kinds[:3] == ["download", "compute", "upload"]
    rounds = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    assert [e["args"]["round"] for e in rounds] == [e["round"] for e in round_events(dropout_run)]
    # Without -o the trace goes under the run, not into the current folder.
    result = CliRunner().invoke(main, ["export", "--trace", str(dropout_run)])
    assert result.exit_code == 0, result.output
    assert json.loads((dropout_run / "trace.json").read_text()) == trace
    (dropout_run / "trace.json").unlink()  # the fixture's run is shared with other tests


@pytest.mark.mnist
def test_the_gantt_figure_is_drawn_for_chosen_rounds(dropout_run, tmp_path):
    (png,) = plot_gantt(dropout_run, tmp_path, rounds="2-3", formats=("png",))
    assert png.name == "timeline.png" and png.stat().st_size > 10_000
