"""Exactly-once request/reply for the asynchronous rules: clients resend unanswered
requests, the server answers a repeat with its stored reply and never merges twice,
and models are numbered by the server so compressed uploads survive lost replies.

In-process tests drive the real AsyncEngine and Client with scripted or lossy message
passing; the end-to-end tests run CO-OP under an on/off drop-out and FedBuff with
sketched uploads under message loss, through a real broker."""
from __future__ import annotations

import collections
import json
import signal
import subprocess
import time

import numpy as np
import pytest

from fedemu.launch import config as configuration
from fedemu.node import TIMEOUT, Message, Pid, wire
from fedemu.server.async_engine import AsyncEngine
from fedemu.common.algorithms.coop import Coop
from fedemu.common.algorithms.fedasync import FedAsync
from fedemu.server.engine import TRAFFIC_KEYS, Settings, Stop, Stopped
from fedemu.server.runlog import RunLog, read_events
from fedemu.worker.client import Client, ModelCache
from fedemu.common.ml.compression import CompressionSpec
from fedemu.common.ml.data import Data
from fedemu.common.ml.datasets import get as dataset_named
from fedemu.common.ml.models import ModelSpec
from fedemu.common.messages import (
    AgeReply, AgeRequest, AsyncStart, FetchRequest, ModelReply, RetryDue, TrainAgain, Upload, retry_wait,
)
from fedemu.common.stragglers import StragglerSpec

from .test_compression import RUN_SEED, SERVER, _async_pair, _data
from .test_launch import launch
from .test_rounds import WAIT, ScriptedProc
from .test_sweep import tiny_mnist

MNIST = dataset_named("mnist")

CLIENT_0, CLIENT_1 = Pid("worker", 0), Pid("worker", 1)


def engine(tmp_path, rule, clients=2, **settings) -> AsyncEngine:
    eng = AsyncEngine(Settings(**{"clients": clients, "seed": RUN_SEED, "rounds": 1, "eval_every": 100,
                                  "progress_timeout_s": 60.0, **settings}), rule, ModelSpec("2nn", MNIST), None, RunLog(tmp_path),
                      lr=0.1)
    eng.pids = {k: Pid("worker", k) for k in range(clients)}
    eng.client_of = {pid: k for k, pid in eng.pids.items()}
    eng.live = set(eng.pids)
    return eng


def weights_upload(eng: AsyncEngine, client: int, request: int, value: float) -> Message:
    body = Upload(client=client, update=np.full_like(eng.weights, value), is_delta=False, age=0,
                  num_samples=10, train_loss=0.0, compute_s=0.0, request=request)
    return Message(eng.pids[client], body)


def serve(eng: AsyncEngine, proc) -> None:
    with pytest.raises(Stopped):
        eng.main(proc)


def stop() -> Message:
    return Message(SERVER, Stop("interrupted", "end of script"))


def sent_to(proc: ScriptedProc, pid: Pid, kind: type) -> list:
    return [body for to, body in proc.sent if to == pid and isinstance(body, kind)]


def test_retry_s_is_checked_and_named():
    assert configuration.load(None)["algorithm"]["retry_s"] == 120.0
    with pytest.raises(configuration.ConfigError, match=r"algorithm\.retry_s = 0\.0 is out of range; it must be in \(0, 1e9\]"):
        configuration.load(None, ["algorithm.retry_s=0"])


# --- the server ------------------------------------------------------------------------------


def test_a_repeated_upload_is_answered_again_and_merged_once(tmp_path):
    eng = engine(tmp_path, FedAsync(alpha=0.5, staleness="constant", a=0.5, b=4))
    first = weights_upload(eng, 0, request=1, value=1.0)
    proc = ScriptedProc(first, weights_upload(eng, 0, 1, 1.0),  # the reply was lost: the same request again
                        weights_upload(eng, 0, 2, 3.0),
                        weights_upload(eng, 0, 1, 1.0),  # a stale copy, after request 2 was answered
                        stop())
    serve(eng, proc)
    assert eng.totals.uploads == 2 and eng.age == 2  # requests 1 and 2, each merged once
    replies = sent_to(proc, CLIENT_0, ModelReply)
    # Uncompressed, a repeat gets the model as it is now (numbered anew): nothing old is kept.
    assert [(r.request, r.model) for r in replies] == [(1, 2), (1, 3), (2, 4)]  # AsyncStart was model 1
    assert eng.replies[0] is None
    assert eng.sent[0] == 4 and eng.duplicates == 2
    assert eng.doing[0] == "resent Upload 1"


def test_a_repeated_age_request_is_answered_and_a_fetch_repeat_gets_the_same_model(tmp_path):
    eng = engine(tmp_path, Coop(b_l=1, b_u=3))
    ask = AgeRequest(client=1, age=0, request=1)
    fetch = FetchRequest(client=1, request=2)
    proc = ScriptedProc(Message(CLIENT_1, ask), Message(CLIENT_1, ask), Message(CLIENT_1, fetch),
                        Message(CLIENT_1, fetch), stop())
    serve(eng, proc)
    assert [(r.age, r.request) for r in sent_to(proc, CLIENT_1, AgeReply)] == [(1, 1), (1, 1)]
    fetched = sent_to(proc, CLIENT_1, ModelReply)
    assert [r.model for r in fetched] == [2, 3] and eng.sent[1] == 3
    assert eng.duplicates == 2


def test_with_compression_a_repeat_gets_the_very_model_its_upload_will_be_encoded_against(tmp_path):
    spec = CompressionSpec(subsample=0.25, rotate=True, bits=2).to_dict()
    eng = engine(tmp_path, Coop(b_l=1, b_u=3), compression=spec)
    fetch = FetchRequest(client=1, request=1)
    proc = ScriptedProc(Message(CLIENT_1, fetch), Message(CLIENT_1, fetch), stop())
    serve(eng, proc)
    fetched = sent_to(proc, CLIENT_1, ModelReply)
    assert len(fetched) == 2 and fetched[0] is fetched[1] and fetched[0].model == eng.sent[1] == 2
    assert eng.bases[1] is fetched[0].weights  # the model kept is the one the base needs anyway


def test_requests_from_an_earlier_process_of_a_restarted_client_are_ignored(tmp_path):
    eng = engine(tmp_path, FedAsync(alpha=0.5, staleness="constant", a=0.5, b=4))
    old = weights_upload(eng, 0, 1, 1.0)
    proc = ScriptedProc(Message(Pid("worker", 99), old.body), stop())
    serve(eng, proc)
    assert eng.totals.uploads == 0 and sent_to(proc, Pid("worker", 99), ModelReply) == []


def test_an_upload_that_does_not_fit_the_model_is_refused_named_and_its_client_goes_on(tmp_path):
    eng = engine(tmp_path, FedAsync(alpha=0.5, staleness="constant", a=0.5, b=4))
    before = eng.weights
    diverged = weights_upload(eng, 0, 1, np.nan)
    short = Message(CLIENT_1, Upload(client=1, update=np.zeros(7, np.float32), is_delta=False, age=0, num_samples=10,
                                     train_loss=0.0, compute_s=0.0, request=1))
    proc = ScriptedProc(diverged, short, stop())
    serve(eng, proc)
    assert eng.totals.uploads == 0 and eng.weights is before  # nothing merged
    events = read_events(tmp_path)
    assert [(e["client"], e["reason"]) for e in events if e["event"] == "fault"] == [
        (0, f"update refused: {before.size} of its {before.size} values are NaN or infinite (training diverged)"),
        (1, f"update refused: an update of shape (7,), not the model's ({before.size},)")]
    assert ["algorithm.lr (now 0.1)" in e["message"] for e in events if e["event"] == "hint"] == [True]
    # The update is lost, not the client: each gets the model to go on from.
    assert len(sent_to(proc, CLIENT_0, ModelReply)) == 1 and len(sent_to(proc, CLIENT_1, ModelReply)) == 1
    assert eng.doing[0] == "sent an update that was refused"


def test_asyncstart_is_resent_to_a_client_not_heard_from_and_no_longer_once_it_is(tmp_path):
    eng = engine(tmp_path, FedAsync(alpha=0.5, staleness="constant", a=0.5, b=4), retry_s=0.05)
    proc = ScriptedProc(WAIT, WAIT, weights_upload(eng, 0, 1, 1.0), WAIT, WAIT, stop())
    serve(eng, proc)
    order = [(to, type(body)) for to, body in proc.sent]
    heard = order.index((CLIENT_0, ModelReply))
    assert (CLIENT_0, AsyncStart) not in order[heard:]  # client 0 was heard from: no more resends
    assert order[:heard].count((CLIENT_0, AsyncStart)) >= 2
    starts = sent_to(proc, CLIENT_1, AsyncStart)
    assert len(starts) > order[:heard].count((CLIENT_1, AsyncStart)) >= 2  # client 1 never answered
    assert all(s is starts[0] for s in starts) and starts[0].model == 1 and eng.sent[1] == 1
    assert starts[0].retry_s == 0.05
    assert eng.starts_resent == [t for _, t in order].count(AsyncStart) - 2


# --- the client ------------------------------------------------------------------------------


def test_the_client_takes_only_the_reply_to_its_pending_request(tmp_path):
    engine_, client, out = _async_pair(tmp_path, Coop(b_l=1, b_u=4), None)
    ask = out.sent[-1]
    assert isinstance(ask, AgeRequest) and ask.request == 1 and client._bases == 1
    model = engine_.weights

    def deliver(body):
        before = len(out.sent)
        client.handle(out, Message(SERVER, body))
        return out.sent[before:]

    assert deliver(AgeReply(engine_.age, request=0)) == []  # not an answer to request 1
    assert deliver(ModelReply(model, 1, request=1, model=9)) == []  # request 1 asked the age, not a model
    upload = deliver(AgeReply(engine_.age, request=1))  # a - a_k = 1 = b_l: upload
    assert [type(b) for b in upload] == [Upload] and upload[0].request == 2 and upload[0].base == 1
    assert deliver(AgeReply(engine_.age, request=1)) == []  # a duplicate of the reply taken
    assert deliver(ModelReply(model, 2, request=1, model=5)) == []  # stale
    assert client._bases == 1
    trained = deliver(ModelReply(model, 2, request=2, model=7))
    assert [type(b) for b in trained] == [AgeRequest] and trained[0].request == 3
    assert client._bases == 7  # the server's number, whatever the client received before
    assert deliver(ModelReply(model, 2, request=2, model=7)) == []  # the same reply again: no second training
    again = AsyncStart(rule="coop", weights=model, age=0, epochs=1, batch_size=10, lr=0.1, lr_decay=0.0,
                       seed=RUN_SEED, extra=Coop(b_l=1, b_u=4).client_payload(), model=1)
    assert deliver(again) == []  # a resent AsyncStart: this process has started already
    assert client.stale_replies == 5 and client._updates == 2 and client._bases == 7


class _Device:
    """A client's process whose device a test takes offline and back; sends held back
    for a slow device stay pending until the test looks at them."""

    class Timer:
        def __init__(self):
            self.cancelled = False

        def cancel(self) -> bool:  # never fired in these tests
            self.cancelled = True
            return True

    pid = Pid("worker", 0)

    def __init__(self):
        self.offline, self.offline_count = False, 0
        self.sent, self.held, self.delays = [], [], []

    def send(self, dst, body) -> None:
        self.sent.append(body)

    def send_after(self, delay, dst, body, unless_offline=False):
        if delay <= 0:
            self.send(dst, body)
            return None
        self.delays.append(delay)
        self.held.append((body, self.Timer()))
        return self.held[-1][1]

    def now(self) -> float:  # the run's clock, which no test here moves
        return 0.0

    def switch(self, client: Client, offline: bool) -> None:
        self.offline = offline
        self.offline_count += offline
        client.link_changed(self, offline)


def _async_client(stragglers: StragglerSpec = StragglerSpec()) -> tuple[Client, np.ndarray, _Device]:
    images, labels = _data(20)
    client = Client(0, np.arange(20), Data("fake", MNIST, images, labels, images, labels), ModelSpec("2nn", MNIST), ModelCache(),
                    stragglers)
    weights = np.zeros(199_210, dtype=np.float32)  # the 2NN's size
    device = _Device()
    client.handle(device, Message(SERVER, AsyncStart(rule="coop", weights=weights, age=0, epochs=1, batch_size=10,
                                                     lr=0.1, lr_decay=0.0, seed=RUN_SEED,
                                                     extra=Coop(b_l=1, b_u=4).client_payload(),
                                                     model=1, retry_s=60.0)))
    return client, weights, device


def test_an_async_client_whose_slow_device_goes_offline_loses_its_update_and_redoes_it_when_back():
    client, start, device = _async_client(StragglerSpec.from_config({"distribution": "fixed", "factor": 10}, 1, 0))
    held = [body for body, _ in device.held if isinstance(body, AgeRequest)]
    assert len(held) == 1 and not np.array_equal(client._weights, start)  # trained; its ask is held back
    retry_timer = next(timer for body, timer in device.held if isinstance(body, RetryDue))
    device.switch(client, offline=True)
    assert client.trainings_stopped == 1 and client._pending is None and retry_timer.cancelled
    assert np.array_equal(client._weights, start)  # the update never finished on the device
    device.switch(client, offline=False)
    again = [body for body, _ in device.held if isinstance(body, AgeRequest)]
    assert len(again) == 2 and again[1].request == 2 and client._pending is again[1]
    assert device.sent == []  # nothing left the device before it was done


def test_an_async_client_stops_training_offline_and_resends_its_pending_request_once_back():
    client, _, device = _async_client()
    [ask] = device.sent
    assert isinstance(ask, AgeRequest)
    device.switch(client, offline=True)
    device.switch(client, offline=False)  # back: the unanswered ask goes again at once
    assert device.sent == [ask, ask] and client.retries == 1 and client.trainings_stopped == 0
    device.offline, device.offline_count = True, 2  # offline before it reads its next message
    client.handle(device, Message(device.pid, TrainAgain()))
    assert client.trainings_stopped == 1 and client._updates == 2 and len(device.sent) == 2  # stopped at once
    device.switch(client, offline=False)  # back: the lost update is run again
    assert [type(b) for b in device.sent[2:]] == [AgeRequest] and client._updates == 3


def test_each_resend_of_a_request_waits_twice_as_long_up_to_8x_and_a_reconnect_starts_over():
    client, _, device = _async_client()  # retry_s = 60
    [ask] = device.sent
    for _ in range(5):
        client.handle(device, Message(device.pid, RetryDue(ask.request)))
    assert device.sent == [ask] * 6
    assert device.delays == [60, 120, 240, 480, 480, 480]
    device.switch(client, offline=True)
    device.switch(client, offline=False)  # back online: resent at once, and the wait starts over
    assert device.sent == [ask] * 7 and device.delays[-1] == 60
    assert retry_wait(60, 0) == 60 and retry_wait(60, 10) == 480  # the rule the server's AsyncStart resends follow


class LossyLoop:
    """One AsyncEngine and its Clients in this process. Every message crosses the wire
    codec, in order; the n-th message of a kind to or from a client is lost if
    (kind, client, n) is in ``lose``. A client's retry timer fires after ``TIMER_STEPS``
    more deliveries, or as soon as nothing else is in flight: later than any round trip
    here, so every resend follows a loss, as with a well-chosen retry_s."""

    TIMER_STEPS = 20

    def __init__(self, eng: AsyncEngine, clients: dict[int, Client], lose=()):
        self.eng, self.clients, self.lose = eng, clients, set(lose)
        self.ends = {k: _ClientEnd(self, k) for k in clients}
        self.crossed: collections.Counter = collections.Counter()
        self.lost: list[tuple] = []
        self.to_server: collections.deque = collections.deque()
        self.to_clients: collections.deque = collections.deque()
        self.timers: collections.deque = collections.deque()  # (due step, client, message)
        self.steps = 0  # deliveries to clients so far: the clock of the timers
        self.node = self  # the engine asks its node for the broker's counters
        eng._traffic = self.broker_stats()

    def broker_stats(self, timeline: bool = False) -> dict:  # no link here records a transfer
        return {**{key: 0 for key in TRAFFIC_KEYS}, "emulated_s": 0.0, "offline": [],
                **({"transfers": [], "availability": []} if timeline else {})}

    def cross(self, body, k: int):
        """The body as the far end decodes it, or None if lost."""
        key = (type(body).__name__, k)
        self.crossed[key] += 1
        if (*key, self.crossed[key]) in self.lose:
            self.lost.append((*key, self.crossed[key]))
            return None
        return wire.decode(wire.encode(wire.USER, SERVER, SERVER, body))[1]

    # the server process
    def send(self, pid: Pid, body) -> None:
        if (copy := self.cross(body, pid.id)) is not None:
            self.to_clients.append((pid.id, Message(SERVER, copy)))

    def send_many(self, pids: list[Pid], body) -> None:  # each receiver decodes its own copy
        for pid in pids:
            self.send(pid, body)

    def now(self) -> float:  # the engine's clock: wall time here (retry_s is a wall interval)
        return time.monotonic()

    def receive(self, match, timeout=None, wall_timeout=None):
        timeout = min(t for t in (timeout, wall_timeout, 60.0) if t is not None)
        for _ in range(10_000):
            if self.to_server:
                return self.to_server.popleft()
            if self.timers and (self.timers[0][0] <= self.steps or not self.to_clients):
                _, k, msg = self.timers.popleft()
            elif self.to_clients:
                k, msg = self.to_clients.popleft()
            else:
                time.sleep(min(timeout, 1.0))  # all quiet: only the server's own resend can help
                return TIMEOUT
            self.steps += 1
            self.clients[k].handle(self.ends[k], msg)
        raise AssertionError("the clients never stop talking")

    def flush(self) -> None:
        """Deliver what is still on its way to the clients."""
        while self.to_clients:
            k, msg = self.to_clients.popleft()
            self.clients[k].handle(self.ends[k], msg)


class _ClientEnd:
    offline, offline_count = False, 0  # messages are lost, devices stay online

    def __init__(self, loop: LossyLoop, k: int):
        self.loop, self.k, self.pid = loop, k, Pid("worker", k)

    def send(self, dst, body) -> None:
        if dst == self.pid:
            self.loop.to_clients.append((self.k, Message(self.pid, body)))
        elif (copy := self.loop.cross(body, self.k)) is not None:
            self.loop.to_server.append(Message(self.pid, copy))

    def send_after(self, delay, dst, body, unless_offline=False) -> None:
        if dst == self.pid:
            self.loop.timers.append((self.loop.steps + self.loop.TIMER_STEPS, self.k, Message(self.pid, body)))
        else:
            self.send(dst, body)

    def now(self) -> float:  # the loop's clock: deliveries so far
        return float(self.loop.steps)

    def stop(self) -> None:
        pass


def test_lost_messages_are_resent_merged_once_and_compressed_bases_stay_known(tmp_path):
    """CO-OP with sketched uploads; the first AsyncStart to client 1, an age request and
    an age reply, an upload and the reply to an upload are lost. Before retries, any of
    these left its client waiting for ever; before the server numbered models, the lost
    ModelReply made every later upload of client 0 undecodable."""
    spec = CompressionSpec(subsample=0.5, rotate=True, bits=8).to_dict()
    eng = engine(tmp_path, Coop(b_l=1, b_u=2), rounds=4, eval_every=2, compression=spec, retry_s=0.2)
    images, labels = _data(40)
    dataset = Data("fake", MNIST, images, labels, images, labels)
    eng.data = dataset
    clients = {k: Client(k, np.arange(20 * k, 20 * k + 20), dataset, ModelSpec("2nn", MNIST), ModelCache()) for k in (0, 1)}
    lose = {("AsyncStart", 1, 1), ("AgeRequest", 0, 2), ("AgeReply", 1, 1), ("Upload", 1, 2), ("ModelReply", 0, 1)}
    loop = LossyLoop(eng, clients, lose)
    status, reason = eng.main(loop)
    assert (status, reason) == ("completed", "ran 4 rounds")
    assert sorted(loop.lost) == sorted(lose)  # every planned loss happened
    events = read_events(tmp_path)
    assert [e for e in events if e["event"] == "fault"] == []  # every sketched upload decoded
    rounds = [e for e in events if e["event"] == "round"]
    assert rounds[-1]["merges"] == rounds[-1]["total_uploads"] == eng.totals.uploads == 8
    assert eng.age == 1 + 8  # b_l + one per merge: no upload merged twice
    # Resent: client 0's upload whose reply was lost, client 1's age request whose reply
    # was lost; the lost requests never arrived, so their resends are not repeats.
    assert sum(e["duplicate_requests"] for e in rounds) == 2
    assert sum(e["starts_resent"] for e in rounds) >= 1
    assert clients[0].retries >= 2 and clients[1].retries >= 2
    loop.flush()  # the last replies (and AsyncStop)
    assert {k: c._bases for k, c in clients.items()} == eng.sent  # both sides agree on every model number


# --- through a real broker: the device goes offline, a reply is lost ----------------------------


def _served_client(procs, stragglers: StragglerSpec, retry_s: float):
    """A real Client (owner of link 0) on one node and a scripted server process on
    another, through a real broker process. The server sends AsyncStart (CO-OP) and keeps
    what arrives in ``arrivals``; the test speaks for it with ``reply``."""
    from .test_emulation import Pair, start_broker, wait_for

    images, labels = _data(20)
    client = Client(0, np.arange(20), Data("fake", MNIST, images, labels, images, labels), ModelSpec("2nn", MNIST), ModelCache(),
                    stragglers)
    pair = Pair(start_broker(procs, {}))
    pair.client_node.spawn_behaviour(client, name="client/0", link=0)
    wait_for(lambda: pair.server_node.whereis("client/0"), "the client never registered")
    start = AsyncStart(rule="coop", weights=np.zeros(199_210, np.float32), age=0, epochs=1, batch_size=10, lr=0.1,
                       lr_decay=0.0, seed=RUN_SEED, extra=Coop(b_l=1, b_u=4).client_payload(), model=1,
                       retry_s=retry_s)
    arrivals: list = []
    outbox: collections.deque = collections.deque()

    def server(proc):
        proc.send("client/0", start)
        while not pair.server_node.closed.is_set():
            while outbox:
                proc.send("client/0", outbox.popleft())
            msg = proc.receive(timeout=0.05)
            if msg is not TIMEOUT:
                arrivals.append(msg.body)

    pair.server_node.spawn(server)
    return client, pair, arrivals, outbox.append, wait_for


def test_a_slow_device_that_goes_offline_loses_its_update_and_trains_again_when_back(procs):
    """The device goes offline while its held-back request stands for compute still under
    way (a straggler factor so large that it surely is): the update is lost, nothing
    leaves the device, and once back the client trains again and holds its new request."""
    client, pair, arrivals, _, wait_for = _served_client(procs, StragglerSpec(distribution="fixed", factor=1e7),
                                                         retry_s=600.0)
    try:
        # Held back: its device is still "computing", for hours.
        wait_for(lambda: client._updates == 1 and client._send_timer is not None, "the first training never ended")
        pair.server_node.set_links("0", offline=True)
        wait_for(lambda: client.trainings_stopped == 1, "going offline did not cost the update")
        assert client._pending is None and client._stopped
        pair.server_node.set_links("0", offline=False)
        wait_for(lambda: client._updates == 2 and client._send_timer is not None, "it did not train again")
        assert client._pending.request == 2 and client.trainings_stopped == 1
        assert pair.server_node.broker_stats()["msgs_up"] == 0  # nothing left the device
    finally:
        pair.close()
    assert arrivals == []


def test_a_client_whose_reply_was_lost_offline_resends_its_request_when_back(procs):
    """The server answers while the client's device is offline: the broker drops the
    reply. Back online, the client resends the same request at once (its retry timer is
    far off), and the loss is on the broker's books."""
    client, pair, arrivals, reply, wait_for = _served_client(procs, StragglerSpec(), retry_s=600.0)
    try:
        wait_for(lambda: arrivals, "the client never asked the age")
        [ask] = arrivals
        assert isinstance(ask, AgeRequest) and ask.request == 1
        pair.server_node.set_links("0", offline=True)
        reply(AgeReply(age=1, request=1))  # lost on the way
        wait_for(lambda: pair.server_node.broker_stats()["lost_down"] == 1, "the reply was not lost")
        pair.server_node.set_links("0", offline=False)
        wait_for(lambda: len(arrivals) == 2, "the client did not resend")
    finally:
        pair.close()
    assert [type(body) for body in arrivals] == [AgeRequest, AgeRequest]
    assert arrivals[1].request == 1 and client.retries == 1 and client._pending.request == 1


# --- end to end ------------------------------------------------------------------------------

TINY = ["model.name=2nn", "data.clients=4", "algorithm.E=1", "algorithm.B=10", "algorithm.eval_every_uploads=4",
        "run.rounds=1000", "run.max_uploads_per_client=5", "algorithm.retry_s=2",
        "run.progress_timeout_s=20"]  # a run that hangs shows its stall events
# Every client is offline a third of the time, for 5 emulated seconds on average; where a
# switch lands is the seed's business in virtual time (the tests above arrange both
# cases on purpose). Client 3 is gone from the start, so the network
# bites on every host: its AsyncStart is lost, and the server keeps resending it.
COOP_ON_OFF = ["algorithm.name=coop", "algorithm.b_l=1", "algorithm.b_u=3",
               "network.dropout.on_off.mean_up_s=10", "network.dropout.on_off.mean_down_s=5",
               "network.dropout.leave=[{clients='3', at_s=0}]"]
# A quarter of all messages lost, both ways: many replies among them (the ``message`` pipe
# loses whole messages; TCP would retransmit the packets).
FEDBUFF_LOSSY_SKETCHED = ["algorithm.name=fedbuff", "algorithm.buffer_size=2", "network.transport=message",
                          "network.default_profile=lossy",
                          "network.profiles.lossy.loss=0.25", "compression.subsample=0.25",
                          "compression.rotate=true", "compression.bits=4"]


@pytest.mark.slow
@pytest.mark.parametrize("network", [COOP_ON_OFF, FEDBUFF_LOSSY_SKETCHED], ids=["coop-on-off", "fedbuff-loss"])
def test_a_lossy_network_no_longer_stalls_the_run(tmp_path, network):
    """Before retries, a lost message left its client waiting for ever; once all four
    were, the run stalled and never finished. Before the server numbered models, a lost
    ModelReply also made every later sketched upload of that client undecodable."""
    tiny_mnist(tmp_path / "cache")
    run_dir = tmp_path / "run"
    proc = launch(run_dir, f"data.cache_dir='{tmp_path / 'cache'}'", *TINY, *network, workers=1)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: the launcher stops the run's processes
        output, _ = proc.communicate(timeout=120)
        pytest.fail(f"the run did not finish: {[e for e in read_events(run_dir) if e['event'] == 'stall']}")
    assert proc.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["reason"].startswith("upload budget spent")
    assert summary["uploads"] == 20 and summary["faults"] == 0
    rounds = [e for e in read_events(run_dir) if e["event"] == "round"]
    assert sum(e["lost_up"] + e["lost_down"] for e in rounds) > 0  # the network did bite
    if network is FEDBUFF_LOSSY_SKETCHED:  # about 15 of some 60 replies are lost (seeded)
        assert "resends" in (run_dir / "logs" / "worker-0.log").read_text()
        assert sum(e["duplicate_requests"] for e in rounds) > 0
    else:
        assert 3 not in {k for e in rounds for k in e["uploaders"]}  # gone: never started


# --- the server's service time (algorithm.merge_s) -----------------------------------------


class ClockProc:
    """Stands in for the server process on an emulated clock: each scripted message
    arrives at its time; a receive whose timeout comes first moves the clock to it."""

    def __init__(self, *script):
        self.script = list(script)  # (emulated time, Message)
        self.t = 0.0
        self.sent: list = []  # (emulated time, pid, body)

    def now(self) -> float:
        return self.t

    def send(self, pid, body):
        self.sent.append((self.t, pid, body))

    def send_many(self, pids, body):
        for pid in pids:
            self.send(pid, body)

    def receive(self, match, timeout=None, wall_timeout=None):
        due = self.script[0][0] if self.script else float("inf")
        if timeout is not None and self.t + timeout < due:
            self.t += timeout
            return TIMEOUT
        t, msg = self.script.pop(0)
        self.t = max(self.t, t)
        return msg


def test_with_merge_s_uploads_queue_at_the_server_and_the_age_is_answered_at_once(tmp_path):
    """Three uploads arrive together at a server that takes 1 emulated second each: they
    are merged and answered at 1, 2 and 3 s, in arrival order; an age request at 0.5 s is
    answered at once with the age before any merge (Nilsson et al.'s age tracker); a
    repeat of a queued upload waits for the original's answer."""
    eng = engine(tmp_path, Coop(b_l=1, b_u=100), clients=3, merge_s=1.0)
    script = [(0.0, weights_upload(eng, k, request=1, value=float(k + 1))) for k in (2, 0, 1)]
    script += [(0.5, Message(CLIENT_0, AgeRequest(client=0, age=0, request=2))),
               (0.6, weights_upload(eng, 1, request=1, value=2.0)),  # client 1 resends its queued upload
               (10.0, stop())]
    proc = ClockProc(*script)
    serve(eng, proc)
    replies = [(t, pid.id, body) for t, pid, body in proc.sent if isinstance(body, (ModelReply, AgeReply))]
    assert [(t, k, type(b).__name__) for t, k, b in replies] == [
        (0.5, 0, "AgeReply"), (1.0, 2, "ModelReply"), (2.0, 0, "ModelReply"), (3.0, 1, "ModelReply")]
    assert replies[0][2].age == 1  # b_l: nothing merged yet
    assert [b.age for _, _, b in replies[1:]] == [2, 3, 4]
    assert eng.totals.uploads == 3 and eng.duplicates == 1


def test_merge_s_is_checked_and_named():
    assert configuration.load(None)["algorithm"]["merge_s"] == 0.0
    with pytest.raises(configuration.ConfigError, match=r"algorithm\.merge_s = -1\.0 is out of range"):
        configuration.load(None, ["algorithm.merge_s=-1"])
