"""Aggregation on the worker nodes (run.aggregation = "nodes"): a client's update stays at
its node, its reply weighs on its link what the update would have, and the server adds
one exact sum per node. Scripted phases test the server's side and the node's store;
launched runs test that the model does not depend on placement and that links are
charged as if every update had crossed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedemu.launch import config as configuration
from fedemu.node import Down, Message, Pid, wire
from fedemu.server.round_engine import RoundBook
from fedemu.server.runlog import read_events
from fedemu.common.ml.exact_sum import ExactSum
from fedemu.worker.node_sums import KeptUpdates, NodeSums
from fedemu.common.messages import GRADIENT, TRAIN, SumReply, SumRequest, TrainReply

from .test_rounds import ScriptedProc, engine


def reply(k: int, update: np.ndarray | None, n: int = 100, round_: int = 1, task: str = TRAIN) -> TrainReply:
    return TrainReply(round=round_, client=k, task=task, update=update, num_samples=n, train_loss=0.0,
                      compute_s=0.0)


def update_of(k: int, size: int = 5) -> np.ndarray:
    return np.linspace(-1.0, 1.0, size, dtype=np.float32) * (k + 1)


# --- the node's side ------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 30, 4_000, 199_210])
def test_a_kept_update_leaves_a_token_that_weighs_what_the_reply_did(size):
    kept = KeptUpdates()
    full = reply(3, update_of(3, size))
    weight = wire.message_size(wire.pack_body(full))
    kept.keep(full)
    assert full.update is None and full.link_charge > 0
    assert wire.message_size(wire.pack_body(full)) + full.link_charge == weight
    total, missing = kept.sum_of(1, TRAIN, [3])
    fresh = ExactSum()
    fresh.add(update_of(3, size), 100)
    assert missing == [] and total.total == 100 and total.mean().tobytes() == fresh.mean().tobytes()


def test_the_store_drops_what_can_no_longer_be_asked_for():
    kept = KeptUpdates()
    for k in (0, 1):
        kept.keep(reply(k, update_of(k), round_=1))
    kept.keep(reply(2, update_of(2), round_=2))
    kept.keep(reply(3, update_of(3), round_=2, task=GRADIENT))
    assert kept.sum_of(2, TRAIN, [2])[0].total == 100
    assert len(kept) == 1  # round 1's updates went with round 2's sum; round 2's other phase stays
    kept.keep(reply(4, update_of(4), round_=1))  # a straggler of a summed round
    assert len(kept) == 1 and kept.sum_of(2, GRADIENT, [3])[0].total == 100
    assert len(kept) == 0


class NodeProc:
    """Stands in for the NodeSums process: what it sends, and its node's name."""

    class node:
        name = "worker-0"

    def __init__(self):
        self.sent = []

    def send(self, pid, body):
        self.sent.append((pid, body))


def test_a_node_answers_with_the_exact_sum_of_the_clients_asked_for_and_names_the_missing():
    kept = KeptUpdates()
    for k in range(4):
        kept.keep(reply(k, update_of(k), n=10 * (k + 1)))
    proc, server = NodeProc(), Pid("server", 1)
    NodeSums(kept).handle(proc, Message(server, SumRequest(1, TRAIN, [2, 0, 7])))
    (to, answer), = proc.sent
    expected = ExactSum()
    expected.add(update_of(0), 10)
    expected.add(update_of(2), 30)
    got = ExactSum()
    got.merge(answer.state)
    assert to == server and isinstance(answer, SumReply) and answer.missing == [7] and answer.node == "worker-0"
    assert got.total == 40 and got.mean().tobytes() == expected.mean().tobytes()
    assert len(kept) == 0  # clients 1 and 3 did not count: their updates are dropped


def test_updates_that_did_not_count_are_taken_back_exactly_even_a_diverged_one():
    """A node adds each update to its running sum as the task ends; those the server did
    not count (stragglers, lost replies) are subtracted: the same bits as summing only the
    counted ones. A diverged update (inf) cannot be subtracted: the node sums afresh."""
    for excluded in (update_of(9), np.array([np.inf, 0, 0, 0, 0], np.float32)):
        kept = KeptUpdates()
        for k in range(3):
            kept.keep(reply(k, update_of(k), n=7 + k))
        kept.keep(reply(9, excluded.copy(), n=5))
        total, missing = kept.sum_of(1, TRAIN, [0, 1, 2])
        fresh = ExactSum()
        for k in range(3):
            fresh.add(update_of(k), 7 + k)
        assert missing == [] and total.total == fresh.total
        assert total.mean().tobytes() == fresh.mean().tobytes()


def test_threads_keep_without_waiting_for_each_other_and_the_sum_is_the_same(monkeypatch):
    import threading

    from fedemu.worker import node_sums

    # One pool thread stalls inside its add (a large update being summed); another
    # thread's keep must finish meanwhile. A keep that summed under one lock shared by
    # the threads would wait for the stalled one: then the second keep cannot finish.
    stalled_inside, release = threading.Event(), threading.Event()

    class StallingSum(ExactSum):
        def add(self, update, n):
            if threading.current_thread().name == "stalls":
                stalled_inside.set()
                release.wait(60)
            super().add(update, n)

    monkeypatch.setattr(node_sums, "ExactSum", StallingSum)
    kept = KeptUpdates()
    stalling = threading.Thread(target=kept.keep, args=(reply(0, update_of(0, 1000)),), name="stalls")
    stalling.start()
    try:
        assert stalled_inside.wait(30), "the first keep never reached its add"
        other = threading.Thread(target=kept.keep, args=(reply(1, update_of(1, 1000)),))
        other.start()
        other.join(30)  # at once when threads do not wait for each other; 30 s for a loaded host
        finished_meanwhile = not other.is_alive()
    finally:
        release.set()
        stalling.join(30)
    assert finished_meanwhile, "a thread's keep waited for another thread's add"
    other.join(30)
    monkeypatch.undo()

    # And the sum: 50 updates kept by two threads at once equal one thread's exact sum.
    threads = [threading.Thread(target=lambda ks: [kept.keep(reply(k, update_of(k, 1000))) for k in ks], args=(ks,))
               for ks in (range(2, 50, 2), range(3, 50, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total, _ = kept.sum_of(1, TRAIN, list(range(50)))
    one = ExactSum()
    for k in range(50):
        one.add(update_of(k, 1000), 100)
    assert total.total == 50 * 100 and total.mean().tobytes() == one.mean().tobytes()


# --- the server's side ----------------------------------------------------------------


def node_engine(tmp_path: Path):
    eng = engine(tmp_path, clients=4, C=1.0, aggregation="nodes")
    eng.pids = {k: Pid("worker-0" if k < 2 else "worker-1", k) for k in range(4)}
    eng.sums = {"worker-0": Pid("worker-0", 100), "worker-1": Pid("worker-1", 100)}
    return eng


def tokens(*clients: int) -> list[Message]:
    messages = []
    for k in clients:
        body = reply(k, update_of(k))
        KeptUpdates().keep(body)
        messages.append(Message(Pid("worker-0" if k < 2 else "worker-1", k), body))
    return messages


def node_sum(node: str, clients: list[int], missing: list[int] = ()) -> Message:
    total = ExactSum()
    for k in clients:
        total.add(update_of(k), 100)
    return Message(Pid(node, 100), SumReply(1, TRAIN, node, total.state(), list(missing)))


def test_the_server_adds_each_nodes_sum_and_asks_each_node_for_its_own_clients(tmp_path):
    eng = node_engine(tmp_path)
    proc = ScriptedProc(*tokens(2, 0, 3, 1), node_sum("worker-1", [2, 3]), node_sum("worker-0", [0, 1]))
    book = RoundBook([0, 1, 2, 3])
    replies = eng._phase(proc, 1, book, TRAIN, 0.1)
    requests = [(pid, body) for pid, body in proc.sent if isinstance(body, SumRequest)]
    assert [(pid.node, body.clients) for pid, body in requests] == [("worker-0", [0, 1]), ("worker-1", [2, 3])]
    assert all(request.keep_at_node for _, request in proc.sent[:4])
    expected = ExactSum()
    for k in range(4):
        expected.add(update_of(k), 100)
    assert replies.mean().tobytes() == expected.mean().tobytes() and book.dropped == set()


def test_a_node_lost_before_its_sum_loses_its_clients_updates_for_the_round(tmp_path):
    eng = node_engine(tmp_path)
    lost = Message(Pid("worker-1", 0), Down(ref=1, pid=Pid("worker-1", 100), reason="noconnection"))
    proc = ScriptedProc(*tokens(0, 1, 2, 3), lost, node_sum("worker-0", [0, 1]))
    book = RoundBook([0, 1, 2, 3])
    replies = eng._phase(proc, 1, book, TRAIN, 0.1)
    assert [r.client for r in replies] == [0, 1] and book.dropped == {2, 3}
    expected = ExactSum()
    for k in (0, 1):
        expected.add(update_of(k), 100)
    assert replies.mean().tobytes() == expected.mean().tobytes()
    assert "worker-1" not in eng.sums  # not asked again


def test_a_malformed_or_short_node_sum_leaves_out_exactly_those_clients(tmp_path):
    eng = node_engine(tmp_path)
    malformed = node_sum("worker-1", [2, 3])
    malformed.body.state["buckets"][0][2] = np.zeros(3, np.int64)  # the wrong length
    proc = ScriptedProc(*tokens(0, 1, 2, 3), malformed, node_sum("worker-0", [0], missing=[1]))
    book = RoundBook([0, 1, 2, 3])
    replies = eng._phase(proc, 1, book, TRAIN, 0.1)
    assert [r.client for r in replies] == [0] and book.dropped == {1, 2, 3}
    expected = ExactSum()
    expected.add(update_of(0), 100)
    assert replies.mean().tobytes() == expected.mean().tobytes()


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": {"name": "fedbuff"}}, "fedbuff is asynchronous"),
    ({"algorithm": {"name": "coop"}}, "coop is asynchronous"),
    ({"compression": {"structured": "random_mask"}}, "does not combine with compression"),
])
def test_what_cannot_be_summed_on_the_nodes_is_refused_by_name(overrides, message):
    config = configuration.default()
    config["run"]["aggregation"] = "nodes"
    for section, values in overrides.items():
        config.setdefault(section, {}).update(values)
    with pytest.raises(configuration.ConfigError, match=f"run.aggregation = 'nodes'.*{message}"):
        configuration.validate(config)


# --- launched runs --------------------------------------------------------------------

SLOW_UP_MS = 4000  # clients 0-4 upload past the deadline below: stragglers every round


def launch(run_dir: Path, workers: int, aggregation: str) -> dict:
    config = run_dir.parent / f"{run_dir.name}.toml"
    config.write_text(f"""
[data]
clients = 20
[algorithm]
C = 0.5
deadline_s = 3.0
[run]
rounds = 3
target_accuracy = 0
aggregation = "{aggregation}"
heartbeat_interval_s = 0.2
[network.profiles.slow]
up = {{ latency_ms = {SLOW_UP_MS} }}
[[network.assign]]
profile = "slow"
clients = "0-4"
""")
    done = subprocess.run([sys.executable, "-m", "fedemu.launch", "launch", str(config), "--out", str(run_dir),
                           "--workers", str(workers)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.mnist
@pytest.mark.slow
def test_summed_on_the_nodes_the_model_is_the_same_on_any_placement_and_links_carry_the_same_bytes(tmp_path):
    """Ten of twenty clients a round, the slow ones past the deadline (their updates are
    kept at their nodes, then taken back out of the sums). One worker node or three: the
    same model, bit for bit; and the same emulated time, bytes, stragglers and
    participants as when every update crosses to the server, whose model differs only in
    rounding."""
    one = launch(tmp_path / "nodes-1", 1, "nodes")
    three = launch(tmp_path / "nodes-3", 3, "nodes")
    server = launch(tmp_path / "server", 2, "server")
    assert one["weights_sha256"] == three["weights_sha256"] != server["weights_sha256"]
    for key in ("emulated_s", "bytes_up", "bytes_down", "uploads"):
        assert one[key] == three[key] == server[key], key
    rounds = {name: [e for e in read_events(tmp_path / name) if e["event"] == "round"] for name in ("nodes-1", "server")}
    assert ([(e["stragglers"], e["participants"]) for e in rounds["nodes-1"]]
            == [(e["stragglers"], e["participants"]) for e in rounds["server"]])
    assert any(e["stragglers"] for e in rounds["nodes-1"])  # the deadline did cut some
    assert abs(one["final_accuracy"] - server["final_accuracy"]) < 0.01
