"""Round policies of the round engine: over-selection (the first m replies count, the rest
are discarded) and what happens when a deadline passes below the quorum (skip, or
extend once). Scripted phases test the logic; two small launched runs test it end to end."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fedemu.launch import config as configuration
from fedemu.node import TIMEOUT, Message, Pid
from fedemu.server.checks import check
from fedemu.server.engine import Settings
from fedemu.server.outcome import no_answer_hint
from fedemu.server.round_engine import RoundBook, RoundEngine
from fedemu.server.timeline import ClientRound
from fedemu.server.runlog import RunLog, read_events
from fedemu.common.algorithms.fedavg import FedAvg
from fedemu.common.algorithms.rounds import weighted_average
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.models import ModelSpec
from fedemu.common.messages import TRAIN, TrainReply, TrainRequest

MNIST = dataset_named("mnist")

WAIT = "wait"  # script step: nothing arrives until the current deadline has passed
SIZE = 199_210  # the 2NN's weights: the engine refuses an update of any other shape


class ScriptedProc:
    """Stands in for the server process: replies arrive in the scripted order; a WAIT
    step (or an empty script) lets the engine's current receive time out."""

    def __init__(self, *script):
        self.script = list(script)
        self.sent: list = []

    def send(self, pid, body):
        self.sent.append((pid, body))

    def send_many(self, pids, body):
        for pid in pids:
            self.send(pid, body)

    def now(self) -> float:  # the engine's clock: wall time, as on the wall clock at time_scale 1
        return time.monotonic()

    def receive(self, match, timeout=None, wall_timeout=None):
        if self.script and self.script[0] is not WAIT:
            return self.script.pop(0)
        if self.script:
            self.script.pop(0)
        time.sleep(min(t for t in (timeout, wall_timeout, 1.0) if t is not None))
        return TIMEOUT


def reply(k: int, round_: int = 1) -> Message:
    body = TrainReply(round=round_, client=k, task=TRAIN, update=np.zeros(SIZE, np.float32), num_samples=100,
                      train_loss=0.0, compute_s=0.0)
    return Message(Pid("worker", k), body)


def engine(tmp_path: Path, clients: int = 5, **settings) -> RoundEngine:
    defaults = dict(clients=clients, seed=1, rounds=1, C=0.6, deadline_s=0.05, quorum=1, over_select=0,
                    on_quorum_missed="skip", progress_timeout_s=60.0)
    eng = RoundEngine(Settings(**{**defaults, **settings}), FedAvg(lr=0.1), ModelSpec("2nn", MNIST), None, RunLog(tmp_path))
    eng.pids = {k: Pid("worker", k) for k in range(clients)}
    eng.live = set(range(clients))
    return eng


def run_phase(eng: RoundEngine, proc: ScriptedProc, selected: list[int], target: int | None = None):
    book = RoundBook(selected, target=target)
    return eng._phase(proc, 1, book, TRAIN, 0.1), book


def test_over_selection_keeps_the_first_m_and_discards_the_rest(tmp_path):
    eng = engine(tmp_path, C=0.6, over_select=2)  # m = 3 of K = 5, 5 asked
    proc = ScriptedProc(reply(3), reply(1), reply(4), reply(0))
    replies, book = run_phase(eng, proc, [0, 1, 2, 3, 4], target=3)
    assert [r.client for r in replies] == [3, 1, 4]
    assert book.discarded == {0, 2} and book.stragglers == set()
    asked, told = proc.sent[:5], proc.sent[5:]
    assert all(isinstance(body, TrainRequest) for _, body in asked)
    # The discarded are told, so a slow device among them does not upload for nothing.
    assert [(pid.id, type(body).__name__, body.round) for pid, body in told] == [(0, "Cancel", 1), (2, "Cancel", 1)]
    assert len(proc.script) == 1  # the fourth reply was not taken: the phase had closed


def test_a_phase_folds_each_update_as_it_arrives_and_keeps_none_unless_the_rule_asks(tmp_path):
    """FedAvg needs only the phase's weighted mean: the engine folds each update into it
    on arrival and lets the buffer go. A rule that reads the updates (a plug-in's
    median, say: keeps_updates) still gets them, and the same mean."""
    def replies():
        return [Message(Pid("worker", k), TrainReply(round=1, client=k, task=TRAIN, update=np.full(SIZE, k, np.float32),
                                                     num_samples=n, train_loss=0.0, compute_s=0.0))
                for k, n in ((3, 100), (1, 300), (4, 600))]

    expected = weighted_average([np.full(SIZE, k, np.float32) for k in (3, 1, 4)], [100, 300, 600])
    eng = engine(tmp_path)
    folded, _ = run_phase(eng, ScriptedProc(*replies()), [1, 3, 4])
    assert [r.update for r in folded] == [None, None, None]
    assert folded.mean().tolist() == expected.tolist() == [3.0] * SIZE  # (300 + 300 + 2400) / 1000

    (tmp_path / "kept").mkdir()
    eng = engine(tmp_path / "kept")
    eng.strategy.keeps_updates = True
    kept, _ = run_phase(eng, ScriptedProc(*replies()), [1, 3, 4])
    assert [r.update[0] for r in kept] == [3, 1, 4] and kept.mean().tolist() == expected.tolist()


def test_a_slow_device_told_its_round_closed_does_not_send_its_held_reply():
    from fedemu.worker.client import Client, ModelCache
    from fedemu.common.ml.data import Data
    from fedemu.common.ml.models import build, get_flat
    from fedemu.common.messages import Cancel
    from fedemu.common.stragglers import StragglerSpec

    class HeldSend:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    class Proc:
        offline, offline_count = False, 0  # its device stays online

        def __init__(self):
            self.held = []

        def send_after(self, delay, pid, body, unless_offline=False):
            self.held.append((delay, body, HeldSend()))
            return self.held[-1][2]

        def has_message(self, match):  # nothing arrives while it trains
            return False

        def now(self):  # the run's clock stands still meanwhile (virtual time)
            return 0.0

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 255, (20, 28, 28), dtype=np.uint8), rng.integers(0, 10, 20)
    client = Client(0, np.arange(20), Data("fake", MNIST, images, labels, images, labels), ModelSpec("2nn", MNIST), ModelCache(),
                    StragglerSpec.from_config({"distribution": "fixed", "factor": 10}, 1, 0))
    proc, server = Proc(), Pid("server", 1)
    weights = get_flat(build("2nn", (1, 28, 28), 10))
    client.handle(proc, Message(server, TrainRequest(round=1, task=TRAIN, weights=weights, epochs=1, batch_size=10,
                                                     lr=0.1, seed=1)))
    delay, body, held = proc.held[-1]
    assert delay > 0 and isinstance(body, TrainReply)  # a 10x slower device holds its reply back
    client.handle(proc, Message(server, Cancel(round=2)))
    assert not held.cancelled  # another round's cancel is not this reply's
    client.handle(proc, Message(server, Cancel(round=1)))
    assert held.cancelled


def test_over_selection_short_at_the_deadline_records_stragglers_not_discards(tmp_path):
    eng = engine(tmp_path, over_select=2)
    replies, book = run_phase(eng, ScriptedProc(reply(2), reply(0), WAIT), [0, 1, 2, 3, 4], target=3)
    assert [r.client for r in replies] == [2, 0]  # two >= quorum 1: aggregated
    assert book.stragglers == {1, 3, 4} and book.discarded == set()
    assert book.quorum_missed is None


def test_extend_once_waits_a_second_deadline_and_aggregates_if_the_quorum_arrives(tmp_path):
    eng = engine(tmp_path, quorum=2, on_quorum_missed="extend_once")
    replies, book = run_phase(eng, ScriptedProc(reply(0), WAIT, reply(1), WAIT), [0, 1, 2])
    assert [r.client for r in replies] == [0, 1]
    assert book.quorum_missed == "extended" and book.stragglers == {2}


def test_extend_once_then_skip_when_still_short(tmp_path):
    eng = engine(tmp_path, quorum=3, on_quorum_missed="extend_once")
    proc = ScriptedProc(reply(0), WAIT, WAIT, reply(1))
    replies, book = run_phase(eng, proc, [0, 1, 2])
    assert replies is None  # the round keeps the model
    assert book.quorum_missed == "extended_then_skipped" and book.stragglers == {1, 2}
    assert len(proc.script) == 1  # only one extension: client 1's late reply was not waited for


def test_skip_policy_does_not_extend(tmp_path):
    eng = engine(tmp_path, quorum=2, on_quorum_missed="skip")
    proc = ScriptedProc(reply(0), WAIT, reply(1))
    replies, book = run_phase(eng, proc, [0, 1, 2])
    assert replies is None and book.quorum_missed == "skipped"
    assert len(proc.script) == 1


def test_a_deadline_that_cuts_every_client_is_named_once(tmp_path):
    from fedemu.server.runlog import read_events

    eng = engine(tmp_path, quorum=1, on_quorum_missed="skip")
    replies, book = run_phase(eng, ScriptedProc(WAIT), [0, 1, 2])
    assert replies is None and book.stragglers == {0, 1, 2}
    straggling = [ClientRound(k, "straggler", "straggler") for k in book.selected]
    hint = eng._hint_if_no_one_answered(1, book, straggling)
    assert "none of the 3 selected clients answered within algorithm.deadline_s = 0.05 emulated s" in hint
    assert "raise algorithm.deadline_s" in hint
    assert eng._hint_if_no_one_answered(2, book, straggling) is None  # once a run for a cause
    # Another cause is named once too: every device offline is not the deadline's doing.
    offline = [ClientRound(k, "straggler", "offline") for k in book.selected]
    other = eng._hint_if_no_one_answered(3, book, offline)
    assert "every selected client was offline" in other and "raise algorithm.deadline_s" not in other
    assert eng._hint_if_no_one_answered(4, book, offline) is None
    assert [e["message"] for e in read_events(tmp_path) if e["event"] == "hint"] == [hint, other]
    # A round that aggregated, or lost a client, is not that case.
    fresh = engine(tmp_path / "b", quorum=1)
    _, answered = run_phase(fresh, ScriptedProc(reply(0), WAIT), [0, 1])
    assert fresh._hint_if_no_one_answered(1, answered, [ClientRound(0, "answered", "answered"),
                                                        ClientRound(1, "straggler", "straggler")]) is None


@pytest.mark.parametrize("outcomes, cause, says, not_says", [
    (["offline"] * 10, "offline", ["none of the 10 selected clients answered: every selected client was offline",
                                   "network.dropout", "algorithm.C"], ["raise algorithm.deadline_s"]),
    (["straggler"] * 4, "deadline", ["none of the 4 selected clients answered within algorithm.deadline_s = 30 "
                                     "emulated s", "raise algorithm.deadline_s"], ["offline"]),
    (["offline"] * 7 + ["straggler"] * 3, "mixed", ["none of the 10 selected clients answered within",
                                                    "7 were offline, 3 straggled",
                                                    "for the 3 that straggled, if their training",
                                                    "for the 7 offline, a longer deadline would not help"], []),
    (["offline", "failed_transfer"], "mixed", ["1 was offline, 1 lost a message on their link",
                                               "loss and queue settings"], ["raise algorithm.deadline_s"]),
])
def test_a_round_nobody_answered_is_hinted_by_its_clients_outcomes(outcomes, cause, says, not_says):
    got, message = no_answer_hint(2, outcomes, 30.0)
    assert got == cause
    for text in says:
        assert text in message
    for text in not_says:
        assert text not in message
    assert no_answer_hint(2, ["dropped"], 30.0) is None  # a lost client has its own fault event


def test_quorum_met_in_time_records_nothing(tmp_path):
    eng = engine(tmp_path, quorum=2, on_quorum_missed="extend_once")
    replies, book = run_phase(eng, ScriptedProc(reply(0), reply(1), reply(2)), [0, 1, 2])
    assert len(replies) == 3 and book.quorum_missed is None and book.discarded == set()


def test_the_brokers_word_that_nothing_can_happen_is_a_deadlock_naming_who_is_waited_for(tmp_path):
    """Virtual time: the run is quiescent with nothing pending while replies are
    awaited. The server stops at once with a deadlock event, not after a watchdog."""
    from fedemu.node import BROKER_NODE, Stalled
    from fedemu.server.engine import Stopped
    from fedemu.server.runlog import read_events

    eng = engine(tmp_path, C=0.6, deadline_s=0, progress_timeout_s=3600)
    proc = ScriptedProc(reply(1), Message(Pid(BROKER_NODE, 0), Stalled(42.0)))
    with pytest.raises(Stopped) as stopped:
        run_phase(eng, proc, [0, 1, 4])
    assert stopped.value.status == "failed" and stopped.value.reason.startswith("deadlock: ")
    [event] = [e for e in read_events(tmp_path) if e["event"] == "deadlock"]
    assert event["emulated_s"] == 42.0
    assert "replies of round 1 from clients 0, 4" in event["cause"] and "nothing pending" in event["cause"]


def test_a_reply_counts_only_from_the_process_the_request_went_to(tmp_path):
    """A reply naming an awaited client, round and task, but sent by another process (a
    forger, a restarted client's old process), is ignored: the client is still waited
    for, and only its own reply is folded in."""
    eng = engine(tmp_path, C=0.6)
    forged = reply(1)
    forged.body.update = np.full(SIZE, 9.0, np.float32)
    proc = ScriptedProc(Message(Pid("intruder", 7), forged.body), reply(0), reply(1))
    replies, book = run_phase(eng, proc, [0, 1])
    assert [r.client for r in replies] == [0, 1] and book.stragglers == set() and book.dropped == set()
    assert replies.mean().tolist() == [0.0] * SIZE  # the forged update never touched the model


def test_an_update_that_does_not_fit_the_model_is_refused_and_named(tmp_path):
    """An update with NaN or infinite values (training diverged), of another shape or
    dtype, or missing, never touches the model: its client's fault event names the
    cause, the summary counts it, and the first divergence is a hint naming the rate."""
    from fedemu.server.runlog import read_events

    eng = engine(tmp_path, C=1.0)
    diverged = reply(0)
    diverged.body.update = np.zeros(SIZE, np.float32)
    diverged.body.update[[3, 5]] = [np.nan, np.inf]
    short, wide, missing = reply(1), reply(2), reply(3)
    short.body.update = np.zeros(7, np.float32)
    wide.body.update = np.zeros(SIZE, np.float64)
    missing.body.update = None
    replies, book = run_phase(eng, ScriptedProc(diverged, short, wide, missing, reply(4)), [0, 1, 2, 3, 4])
    assert [r.client for r in replies] == [4] and book.dropped == {0, 1, 2, 3}
    events = read_events(tmp_path)
    assert [(e["client"], e["reason"]) for e in events if e["event"] == "fault"] == [
        (0, f"update refused: 2 of its {SIZE} values are NaN or infinite (training diverged)"),
        (1, f"update refused: an update of shape (7,), not the model's ({SIZE},)"),
        (2, "update refused: an update of dtype float64, not float32"),
        (3, "update refused: an update of type NoneType, not an array"),
    ]
    assert len(eng.totals.faults) == 4
    [hint] = [e["message"] for e in events if e["event"] == "hint"]
    assert "client 0's update in round 1 held NaN or infinite values" in hint and "algorithm.lr (now 0.1)" in hint


@pytest.mark.parametrize("deadline_s, cause", [
    (3600.0, "no reply from these clients, and the clock has not reached the deadline at emulated "),
    (0.0, "no reply from these clients; no deadline set"),
])
def test_a_stall_says_whether_a_deadline_is_set(tmp_path, deadline_s, cause):
    """The watchdog's stall event (a clock that has not moved for progress_timeout_s of
    wall time) names the deadline the round waits for, or says there is none."""
    from fedemu.server.runlog import read_events

    eng = engine(tmp_path, deadline_s=deadline_s, progress_timeout_s=0.05)
    run_phase(eng, ScriptedProc(WAIT, reply(0)), [0])
    [stall] = [e for e in read_events(tmp_path) if e["event"] == "stall"]
    assert stall["cause"].startswith(cause) and stall["waiting_for"] == [0]


def test_a_worker_ready_counts_only_from_the_node_it_names(tmp_path):
    from fedemu.common.messages import WorkerReady

    eng = engine(tmp_path)
    own = Message(Pid("w1", 0), WorkerReady("w1", [[0, Pid("w1", 5)]], Pid("w1", 2)))
    assert eng._ready_from(own) is own.body
    for sender, ready in [(Pid("w2", 0), WorkerReady("w1", [[1, Pid("w1", 6)]])),  # another node speaking for w1
                          (Pid("w1", 0), WorkerReady("w1", [[1, Pid("intruder", 6)]])),  # a pid elsewhere
                          (Pid("w1", 0), WorkerReady("w1", [[1, Pid("w1", 6)]], Pid("intruder", 1))),
                          (Pid("w1", 0), WorkerReady("w1", [["1", Pid("w1", 6)]])),
                          (Pid("w1", 0), WorkerReady("w1", "every client"))]:
        assert eng._ready_from(Message(sender, ready)) is None


def test_engine_refuses_what_config_validation_would(tmp_path):
    with pytest.raises(ValueError, match="on_quorum_missed = 'wait'"):
        engine(tmp_path, on_quorum_missed="wait")


# --- config keys and static checks ----------------------------------------------------------


def algo(**changes):
    return {**configuration.default()["algorithm"], **changes}


def test_defaults_keep_todays_behaviour():
    a = configuration.load(None)["algorithm"]
    assert (a["over_select"], a["on_quorum_missed"]) == (0, "skip")


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.over_select=-1"], "algorithm.over_select = -1 is out of range; it must be >= 0"),
    (["algorithm.over_select=1.5"], "algorithm.over_select = 1.5 must be an integer"),
    (["algorithm.on_quorum_missed=wait"],
     "algorithm.on_quorum_missed = 'wait' is not allowed; choose one of 'skip', 'extend_once'"),
    (["algorithm.over_select=91"],
     "algorithm.over_select = 91 with m = 10 selects 101 clients per round, more than the K = 100"),
    (["algorithm.name=fsvrg", "algorithm.over_select=1"], "FSVRG selects every client"),
    (["algorithm.name=fedbuff", "algorithm.over_select=1"], "'fedbuff' is asynchronous"),
    (["algorithm.on_quorum_missed=extend_once", "algorithm.deadline_s=0"],
     "algorithm.on_quorum_missed = 'extend_once' extends the round deadline, but there is none"),
])
def test_bad_round_policies_name_the_key(overrides, message):
    with pytest.raises(configuration.ConfigError) as err:
        configuration.load(None, overrides)
    assert message in str(err.value)


def test_over_selection_checks_name_the_rule():
    assert check(algo(over_select=90), clients=100, network_can_drop=False) == []  # 10 + 90 = K
    above = check(algo(over_select=91), clients=100, network_can_drop=False)
    assert [f.rule for f in above] == ["over-select-above-clients"]
    assert [f.rule for f in check(algo(name="fsvrg", over_select=1), 100, False)] == ["over-select-not-applicable"]
    assert [f.rule for f in check(algo(name="coop", over_select=1), 100, False)] == ["over-select-not-applicable"]
    no_deadline = check(algo(on_quorum_missed="extend_once", deadline_s=0.0), 100, False)
    assert [f.rule for f in no_deadline] == ["extend-without-deadline"]


# --- on real runs --------------------------------------------------------------------------------

LATE_UP = 4000  # ms: one way, on the uplink only. B = 0 (one full-batch step) keeps training
# short, so even the last of five clients trained in turn answers well before that.


def launch_file(run_dir: Path, config_text: str, *sets: str) -> subprocess.CompletedProcess:
    path = run_dir.parent / f"{run_dir.name}.toml"
    path.write_text(config_text)
    argv = [sys.executable, "-m", "fedemu.launch", "launch", str(path), "--out", str(run_dir), "--workers", "1",
            "--set", "run.target_accuracy=0", "--set", "run.heartbeat_interval_s=0.2"]
    for item in sets:
        argv += ["--set", item]
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)


def round_events(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "round"]


def per_client(run_dir: Path, e: dict) -> dict[str, set]:
    """A round's clients by outcome: listed in its event, or (client_log = "csv") in
    clients.csv, with only their counts in the event."""
    if "clients" not in e:
        return {key: set(e[key]) for key in ("selected", "answered", "discarded", "stragglers")}
    with open(run_dir / "clients.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if int(row["round"]) == e["round"]]
    outcome = {"answered": "answered", "discarded": "discarded", "stragglers": "straggler"}
    got = {"selected": {int(r["client"]) for r in rows},
           **{key: {int(r["client"]) for r in rows if r["outcome"] == name} for key, name in outcome.items()}}
    assert e["clients"] == {**{key: len(v) for key, v in got.items()}, "dropped": 0, "slowed": 0}
    assert all(r["num_samples"] for r in rows if r["outcome"] == "answered")
    return got


@pytest.mark.mnist
@pytest.mark.slow
@pytest.mark.parametrize("client_log", ["events", "csv"])
def test_over_selection_on_a_real_run(tmp_path, client_log):
    """K = 10, m = 3, two extra; clients 5-9 have a 4 s uplink. Each round asks five and
    aggregates the first three to answer: the fast ones whenever three were selected.
    The clients are listed in the round events, or in clients.csv."""
    run_dir = tmp_path / "run"
    done = launch_file(run_dir, f"""
[data]
clients = 10
[algorithm]
C = 0.3
B = 0
over_select = 2
[run]
rounds = 3
client_log = "{client_log}"
[network.profiles.late]
up = {{ latency_ms = {LATE_UP} }}
[[network.assign]]
profile = "late"
clients = "5-9"
""")
    assert done.returncode == 0, done.stdout
    rounds = round_events(run_dir)
    assert [e["round"] for e in rounds] == [1, 2, 3]
    for e in rounds:
        clients = per_client(run_dir, e)
        selected, answered, discarded = clients["selected"], clients["answered"], clients["discarded"]
        assert len(selected) == 5 and e["participants"] == 3 and e["aggregated"]
        assert answered | discarded == selected and not answered & discarded
        assert clients["stragglers"] == set() and e["quorum_missed"] is None
        fast = {k for k in selected if k < 5}
        # The first three to arrive: every fast one if at most three were selected, else only fast ones.
        assert fast <= answered if len(fast) <= 3 else answered <= fast
    assert json.loads((run_dir / "summary.json").read_text())["uploads"] == 9


@pytest.mark.mnist
@pytest.mark.slow
def test_extend_once_on_a_real_run(tmp_path):
    """K = 4, all selected, quorum 4, an 8 s deadline. Round 1: client 2's upload takes
    9 s, so the quorum is missed (whatever the host's speed), the deadline extended once
    (to 16 s), and the round aggregates: client 2 trains third, well within the 7 s left.
    Round 2: its uplink takes 30 s, so even the extended deadline passes: the round is
    skipped and the model kept."""
    run_dir = tmp_path / "run"
    done = launch_file(run_dir, """
[data]
clients = 4
[algorithm]
C = 1.0
B = 0
quorum = 4
deadline_s = 8.0
on_quorum_missed = "extend_once"
[run]
rounds = 2
device_flops = 1e12  # training takes milliseconds: only the links decide (B = 0 is 15,000 examples)
[network]
transport = "message"  # an upload takes its latency (TCP's windows would take several round trips)
[network.profiles.late]
up = { latency_ms = 9000 }
[network.profiles.gone]
up = { latency_ms = 30000 }
[[network.assign]]
profile = "late"
clients = "2"
[[network.events]]
at_round = 2
profile = "gone"
clients = "2"
""")
    assert done.returncode == 0, done.stdout
    first, second = round_events(run_dir)
    assert first["quorum_missed"] == "extended" and first["aggregated"]
    assert first["answered"] == [0, 1, 2, 3] and first["stragglers"] == []
    assert second["quorum_missed"] == "extended_then_skipped" and not second["aggregated"]
    assert second["stragglers"] == [2] and second["answered"] == [0, 1, 3]
    # A skipped round keeps the model: the same weights score the same.
    assert second["accuracy"] == first["accuracy"]


@pytest.mark.mnist
@pytest.mark.slow
def test_hints_on_a_traced_population_name_the_outcomes_of_its_rounds(tmp_path):
    """examples/fedavg-traces.toml with a 1 s deadline: its population is offline most of
    the time, so rounds nobody answers come, some with every selected device offline.
    Each hint names the cause its round's outcome counts show: only an all-straggler
    round (or the stragglers of a mixed one) is told to raise the deadline."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "examples/fedavg-traces.toml", "--out", str(run_dir),
            "--workers", "1", "--set", "run.rounds=3", "--set", "algorithm.deadline_s=1"]
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])  # the example's trace paths are the repository's
    assert done.returncode == 0, done.stdout
    counts = {e["round"]: e["outcome_counts"] for e in round_events(run_dir)}
    hints = [e for e in read_events(run_dir) if e["event"] == "hint"]
    assert hints, done.stdout
    forms = set()
    for hint in hints:
        c, message = counts[hint["round"]], hint["message"]
        assert c["answered"] == 0
        if c["straggler"] == 0:
            forms.add("offline")
            assert "every selected client was offline" in message and "raise algorithm.deadline_s" not in message
        elif c["offline"]:
            forms.add("mixed")
            assert f"{c['offline']} {'was' if c['offline'] == 1 else 'were'} offline" in message and f"{c['straggler']} straggled" in message
        else:
            assert "raise algorithm.deadline_s" in message and "offline" not in message
        assert message in done.stdout  # the console prints it
    assert "offline" in forms, hints  # the case the hint used to blame on the deadline
    end = [e for e in read_events(run_dir) if e["event"] == "end"][0]
    offline = sum(c["offline"] for c in counts.values())
    if end["aggregations"] == 0:
        assert f"({offline} of them offline)" in end["reason"]
