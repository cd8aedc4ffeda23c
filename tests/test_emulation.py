"""Link emulation through a real broker process: rates, order, loss, reproducibility,
and a client that drops out mid-transfer during FedAvg."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from fedemu.node import TIMEOUT, Behaviour, Down, Node, Pid, Process
from fedemu.node.runtime.holding import BrokerClock, clock_identity
from fedemu.node.security import load_token
from fedemu.server.runlog import read_events

from .realprocs import Procs
from .test_launch import launch, wait_for_round
from .test_links import binomial_interval

# None of these tests is about liveness: the broker forgets a node, and a node the broker,
# only after this much silence, far beyond any pause a loaded host gives a node's I/O
# thread (its nodes beat every 0.1 s).
HEARTBEAT_TIMEOUT = 10.0
HEARTBEAT_INTERVAL = 0.1


def start_broker(procs: Procs, network: dict, num_clients: int = 4, seed: int = 1, name: str = "net") -> str:
    path = procs.tmp / f"{name}.json"
    path.write_text(json.dumps({"num_clients": num_clients, "seed": seed, "time_scale": 1.0, "network": network}))
    procs.tmp.joinpath("broker.endpoint").unlink(missing_ok=True)
    return procs.broker("--network", str(path), heartbeat_timeout=HEARTBEAT_TIMEOUT)


class Pair:
    """A client process (owner of link 0) on one node and a server on another."""

    def __init__(self, broker: str):
        self.client_node = Node("client-node", broker, heartbeat_interval=HEARTBEAT_INTERVAL,
                                heartbeat_timeout=HEARTBEAT_TIMEOUT).start()
        self.server_node = Node("server-node", broker, heartbeat_interval=HEARTBEAT_INTERVAL,
                                heartbeat_timeout=HEARTBEAT_TIMEOUT).start()
        self.arrivals: list[tuple[float, object]] = []
        self.server = self.server_node.spawn(self._collect, name="server")
        # Another node registers "server": until the broker knows the name, a message to
        # it is dropped before it enters the link (and before the link's counter moves).
        wait_for(lambda: self.client_node.whereis("server") is not None, "server never registered")

    def _collect(self, proc):
        while not self.server_node.closed.is_set():  # as long as the test needs it
            msg = proc.receive(timeout=0.2)
            if msg is not TIMEOUT:
                self.arrivals.append((time.monotonic(), msg.body))

    def send_up(self, bodies: list) -> float:
        """Send ``bodies`` from client/0 (link 0) to the server, back to back; returns
        once all are sent, with the time the sender started. ``sent_between`` is then
        (just before the first send, just after the last)."""
        started: list = []
        done = threading.Event()

        def client(proc):
            started.append(time.monotonic())
            for body in bodies:
                proc.send("server", body)
            started.append(time.monotonic())
            done.set()

        # Its name is registered before it sends (FIFO through the broker).
        self.client_node.spawn(client, name="client/0", link=0)
        assert done.wait(30), "the sender never ran"
        self.sent_between = (started[0], started[1])
        return started[0]

    def wait(self, count: int, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        while len(self.arrivals) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.arrivals

    def link_owner(self, life_s: float) -> Process:
        """A thread process on the client node that owns link 0 as client/0 and lives
        ``life_s`` seconds; returned once the server node can find it."""
        owner: list = []

        def client(proc):
            owner.append(proc)
            proc.receive(timeout=life_s)

        self.client_node.spawn(client, name="client/0", link=0)
        wait_for(lambda: owner and self.server_node.whereis("client/0"), "client/0 never registered")
        return owner[0]

    def close(self) -> None:
        self.client_node.close()
        self.server_node.close()


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.close()


def test_bandwidth_limited_link_delivers_back_to_back_messages_at_the_rate(procs):
    """The ``message`` pipe: each message occupies its link size / rate, one after another."""
    rate, size, count = 1_000_000, 100_000, 20  # 1 MB/s: one 100 kB message every 100 ms
    broker = start_broker(procs, {"transport": "message", "default_profile": "slow",
                                  "profiles": {"slow": {"bandwidth": rate}}})
    pair = Pair(broker)
    try:
        pair.send_up([np.zeros(size - 60, np.uint8) for _ in range(count)])
        arrivals = [t for t, _ in pair.wait(count, 30)]
        link = pair.server_node.broker_stats(per_link=True)["links"][0]
    finally:
        pair.close()
    assert len(arrivals) == count
    # The broker's model, exactly: every message entered the link whole, and the link
    # serialized them one after another. Message i (from 0) cannot finish before the
    # first entered plus (i + 1) message times, nor later than its own entry plus that:
    # its transfer time is (i + 1) * wire / rate less how much later than the first it
    # entered, which is at most how long the sender took to send them all.
    assert (link["up_msgs"], link["up_lost"]) == (count, 0)
    assert link["up_bytes"] % count == 0
    wire = link["up_bytes"] // count  # the body (headers are fedemu routing, not charged)
    assert size - 60 < wire <= size + 100
    model = sum(i + 1 for i in range(count)) * wire / rate
    sending = pair.sent_between[1] - pair.sent_between[0] + 0.01  # (+ the send stamps' clock slop)
    assert model - (count - 1) * sending - 1e-6 <= link["up_transfer_s"] <= model + 1e-6
    # And the wall clock agrees. Never early, whatever the load: message i is released no
    # sooner than the first could enter plus i + 1 message times (one clock: the nodes
    # share the broker's). Late only now and then: a loaded host delays a release, which
    # moves one gap, not the median (within 1 ms beside two CPU hogs; the bound is 50 ms).
    message_s = wire / rate
    assert all(t >= pair.sent_between[0] + (i + 1) * message_s - 1e-3 for i, t in enumerate(arrivals))
    assert np.median(np.diff(arrivals)) == pytest.approx(message_s, abs=0.05)


def numbers_through(procs: Procs, profile: dict, count: int, transport: str = "tcp") -> list:
    """Send 0..count-1 up one link with ``profile``; the bodies in arrival order."""
    pair = Pair(start_broker(procs, {"transport": transport, "default_profile": "p", "profiles": {"p": profile}}))
    try:
        pair.send_up(list(range(count)))
        return [body for _, body in pair.wait(count, 30)]
    finally:
        pair.close()


def test_fifo_holds_under_jitter(procs):
    got = numbers_through(procs, {"latency_ms": 30, "jitter_ms": 25}, 500)
    assert got == list(range(500))


def test_reorder_lets_jitter_reorder(procs):
    # A TCP connection delivers in order; the ``message`` pipe lets each message draw its own delay.
    got = numbers_through(procs, {"latency_ms": 30, "jitter_ms": 25, "reorder": True}, 300, transport="message")
    assert sorted(got) == list(range(300)) and got != list(range(300))


def lossy_run(procs: Procs, seed: int, loss: float, count: int, name: str) -> tuple[set, dict]:
    # The ``message`` pipe loses whole messages (TCP retransmits: tests/test_tcp.py).
    broker = start_broker(procs, {"transport": "message", "default_profile": "lossy",
                                  "profiles": {"lossy": {"loss": loss}}}, seed=seed, name=name)
    pair = Pair(broker)
    try:
        pair.send_up(list(range(count)))
        # Done once every message entered the link and each one either arrived or is on
        # the books as lost (nothing is delayed: an arrival follows its entry at once).
        stats: dict = {}

        def settled() -> bool:
            stats.update(pair.server_node.broker_stats())
            return stats["msgs_up"] == count and len(pair.arrivals) + stats["lost_up"] == count

        wait_for(settled, "not every message arrived or was counted lost", timeout=30)
        received = {body for _, body in pair.arrivals}
    finally:
        pair.close()
        procs.broker_proc.terminate()
        procs.broker_proc.wait(5)
    return received, stats


def test_loss_rate_is_binomial_counted_and_reproducible(procs):
    count, loss = 3000, 0.1
    received, stats = lossy_run(procs, seed=5, loss=loss, count=count, name="a")
    lost = count - len(received)
    low, high = binomial_interval(count, loss)
    assert low <= lost <= high
    # Every lost message is on the books, none vanished silently.
    assert stats["lost_up"] == lost and stats["dropped"]["loss"] == lost
    assert stats["msgs_up"] == count
    again, _ = lossy_run(procs, seed=5, loss=loss, count=count, name="b")
    assert again == received  # same seed, same decisions
    other, _ = lossy_run(procs, seed=6, loss=loss, count=count, name="c")
    assert other != received


def test_set_links_api_changes_a_running_network(procs):
    broker = start_broker(procs, {})
    pair = Pair(broker)
    try:
        with pytest.raises(Exception, match="profile 'warp' is unknown"):
            pair.server_node.set_links("0", profile="warp")
        pair.server_node.set_links("0", profile="3g")  # 75 ms one way from now on
        started = pair.send_up(["hello"])
        arrivals = pair.wait(1, 20)
        pair.server_node.set_links("0", offline=True)
        pair.send_up(["lost"])
        # Dropped where it enters the link, and counted there: once counted, it can
        # never arrive.
        stats: dict = {}
        wait_for(lambda: stats.update(pair.server_node.broker_stats()) or stats["msgs_up"] == 2,
                 "the second message never entered the link")
    finally:
        pair.close()
    assert [b for _, b in arrivals] == ["hello"]
    assert arrivals[0][0] - started >= 0.075
    assert stats["dropped"].get("offline") == 1



def test_a_node_on_the_brokers_machine_reads_its_clock_exactly():
    # Same kernel, same monotonic clock: no offset estimate (whose error, up to half a
    # heartbeat round trip, once released a 75 ms message 0.25 ms early on a loaded host).
    broker_id = clock_identity()
    assert broker_id is not None
    here = BrokerClock()
    here.welcome({"clock_id": broker_id, "t": time.monotonic() - 0.002, "now": time.monotonic() + 5.0})
    here.sample({"t": time.monotonic() - 0.001, "now": time.monotonic() + 7.0})
    assert here.shared and here.offset == 0.0
    # Another machine's broker: estimated from round trips, the shortest recent one winning.
    away = BrokerClock()
    t0 = time.monotonic()
    away.welcome({"clock_id": "another-boot/monotonic 0 0", "t": t0 - 0.004, "now": t0 + 100.0})
    away.sample({"t": time.monotonic() - 0.0005, "now": time.monotonic() + 100.0})
    assert not away.shared and away.offset == pytest.approx(100.0, abs=0.003)


def test_nodes_on_the_brokers_machine_share_its_clock(procs):
    broker = start_broker(procs, {})
    pair = Pair(broker)
    try:
        for node in (pair.client_node, pair.server_node):
            assert node._broker_clock.shared and node._broker_clock.offset == 0.0
    finally:
        pair.close()


# One way on client 0's link: in flight long after going offline takes (0.15 s at most,
# beside two CPU hogs).
LATENCY_S = 5.0


def in_flight_run(procs: Procs, network: dict, go_offline) -> tuple[list, list, dict]:
    """Client 0 and the server each send one message across client 0's slow link,
    then ``go_offline(server_node)`` while both are in flight; then one more each way
    once back online. Returns (bodies the server got, bodies the client got, stats)."""
    pair = Pair(start_broker(procs, network))
    client_got: list = []

    def client(proc):
        proc.send("server", "up-1")
        while not pair.client_node.closed.is_set():
            msg = proc.receive(timeout=0.2)
            if msg is not TIMEOUT:
                client_got.append(msg.body)

    def stats_when(condition, what: str) -> dict:
        stats: dict = {}
        wait_for(lambda: stats.update(pair.server_node.broker_stats()) or condition(stats), what)
        return stats

    try:
        sent = time.monotonic()  # neither message is sent before this
        pair.client_node.spawn(client, name="client/0", link=0)
        wait_for(lambda: pair.server_node.whereis("client/0") is not None, "client never registered")
        pair.server_node.send("client/0", "down-1")
        # Both have entered their links (the broker counted them), and are held at the
        # receiving nodes until due.
        stats_when(lambda st: (st["msgs_up"], st["msgs_down"]) == (1, 1), "the first messages never left")
        go_offline(pair.server_node)
        # Not a precondition a fast host could miss: both are still in flight now.
        assert time.monotonic() - sent < LATENCY_S, "too slow to go offline while the messages were in flight"
        # The nodes dropped both on the broker's notice, and reported it back.
        stats_when(lambda st: st["dropped"].get("offline", 0) >= 2, "the held messages were not dropped")
        pair.server_node.set_links("0", offline=False)
        pair.server_node.announce_round(0)  # (a round without drop-outs, where rounds matter)
        pair.server_node.send("client/0", "down-2")
        wait_for(lambda: "down-2" in client_got, "down-2 never arrived", timeout=LATENCY_S + 20)
        # Past when "up-1" and "down-1" were due: had they not been dropped, they were here.
        stats = pair.server_node.broker_stats()
    finally:
        pair.close()
    return [body for _, body in pair.arrivals], client_got, stats


@pytest.mark.parametrize("how", ["set_links", "round"])
def test_messages_in_flight_when_a_client_goes_offline_are_dropped_and_counted(procs, how):
    """The broker forwards at once and the receiving node holds a message until due:
    a client that goes offline meanwhile must still lose what is in flight, both ways,
    by the API or by a new round's drop-out."""
    slow = {"latency_ms": LATENCY_S * 1000}
    if how == "set_links":
        network = {"default_profile": "slow", "profiles": {"slow": slow}}
        go_offline = lambda node: node.set_links("0", offline=True)  # noqa: E731
    else:  # client 0 drops out of every round after round 0
        network = {"default_profile": "slow", "profiles": {"slow": slow},
                   "dropout": {"per_round": 1.0, "clients": "0"}}
        go_offline = lambda node: node.announce_round(1)  # noqa: E731
    server_got, client_got, stats = in_flight_run(procs, network, go_offline)
    assert server_got == []  # "up-1" never arrived
    assert client_got == ["down-2"]  # "down-1" never arrived; after coming back, traffic flows
    assert stats["dropped"].get("offline") == 2
    assert (stats["lost_up"], stats["lost_down"]) == (1, 1)
    assert (stats["msgs_up"], stats["msgs_down"]) == (1, 2)


def test_fifo_holds_when_the_link_stops_being_emulated_mid_flight(procs):
    """Messages sent after the network became ideal are not held, yet must not overtake
    the ones still held on the same pair."""
    pair = Pair(start_broker(procs, {"default_profile": "p", "profiles": {"p": {"latency_ms": 300}}}))

    def client(proc):
        for i in range(10):
            proc.send("server", i)
        pair.server_node.set_links("0-3", profile="ideal")  # the whole network is ideal now
        for i in range(10, 20):
            proc.send("server", i)

    try:
        pair.client_node.spawn(client, name="client/0", link=0)
        got = [body for _, body in pair.wait(20, 5)]
    finally:
        pair.close()
    assert got == list(range(20))


def test_down_does_not_overtake_the_last_messages_of_a_process(procs):
    """A process sends across a 300 ms link and ends: its watcher gets the messages
    first, then the Down (as Erlang orders a process's messages and its exit)."""
    pair = Pair(start_broker(procs, {"default_profile": "p", "profiles": {"p": {"latency_ms": 300}}}))
    seen: list = []

    def watcher(proc):
        client = proc.receive(Pid, timeout=20).body
        proc.monitor(client)
        proc.send(client, "go")
        while (msg := proc.receive(timeout=10)) is not TIMEOUT:
            seen.append("down" if isinstance(msg.body, Down) else msg.body)

    def client(proc):
        proc.receive(timeout=20)
        proc.send(w, "last words")

    try:
        w = pair.server_node.spawn(watcher)
        c = pair.client_node.spawn(client, name="client/0", link=0)
        pair.server_node.send(w, c)
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pair.close()
    assert seen == ["last words", "down"]


def test_a_clients_node_hears_when_its_device_goes_offline_and_back(procs):
    """A scheduled window takes client 0 offline: the broker tells the client's own node
    when the window opens and closes (its flags, and a behaviour's link_changed in
    order), and a send the device had scheduled with unless_offline never happens."""
    # Emulated seconds from the broker's start: after the set-up below, even on a loaded
    # host (the broker is at 0.3 s at most when asked, beside two CPU hogs).
    window = (10.0, 12.0)
    # How late a loaded host may let the node see a switch (the broker's loop, the notice):
    # 35 ms at most beside two CPU hogs. Never early, whatever the load.
    late = 3.0
    pair = Pair(start_broker(procs, {"dropout": {"windows": [{"clients": "0", "start_s": window[0],
                                                                "end_s": window[1]}]}}))
    heard: list = []

    class Device(Behaviour):
        def handle(self, proc, msg):
            pass

        def link_changed(self, proc, offline):
            heard.append(offline)

    try:
        asked = time.monotonic()
        now = pair.server_node.broker_stats()["emulated_s"]
        started = time.monotonic()  # the broker read `now` between `asked` and this (one clock, one host)
        assert now < window[0] - 3, f"the broker took {now:.1f}s to get here; the window is at {window[0]}s"
        pair.client_node.spawn_behaviour(Device(), name="client/1", link=0)  # a second owner of link 0
        proc = pair.link_owner(life_s=60)
        due_after_window = window[1] + 0.5 - now
        proc.send_after(due_after_window, "server", "guarded", unless_offline=True)
        proc.send_after(due_after_window, "server", "plain")
        flips = []  # (wall seconds from `started`, offline)
        while len(flips) < 2 and time.monotonic() - started < due_after_window + late:
            if proc.offline != (flips[-1][1] if flips else False):
                flips.append((time.monotonic() - started, proc.offline))
            time.sleep(0.005)
        pair.wait(1, due_after_window + 20)
        arrivals = pair.wait(2, 1.0)  # the guarded send, had it gone, was due with the plain one
    finally:
        pair.close()
    assert [state for _, state in flips] == [True, False]
    # When the window opened and closed: never before (exactly, up to the stats call's
    # round trip), and not much after.
    for (seen_at, _), edge in zip(flips, window, strict=True):
        assert edge - now - (started - asked) - 1e-3 <= seen_at < edge - now + late
    assert proc.offline_count == 1
    assert heard == [True, False]
    assert [body for _, body in arrivals] == ["plain"]  # "guarded" was lost with the device


def test_a_clients_node_hears_of_its_per_round_drop_outs_at_each_round(procs):
    """Per-round drop-outs are decided when the server announces a round: the client's
    node must hear of each change then, matching the seeded decisions."""
    from fedemu.node.net.network_spec import NetworkSpec

    network = {"dropout": {"per_round": 0.5, "clients": "0"}}
    expected_spec = NetworkSpec.from_config(network, num_clients=4, run_seed=1)
    expected = [expected_spec.availability.offline(0, 0.0, r) for r in range(1, 9)]
    assert True in expected and False in expected  # the seed gives both; else pick another
    pair = Pair(start_broker(procs, network))
    seen = []
    marks: list = []
    try:
        owner = pair.link_owner(life_s=60)
        # A barrier: a process on the client's node that owns no link (so nothing it gets
        # is emulated or held). The broker handles the server node's messages in the order
        # sent, and tells the client node of a round's drop-outs while it handles the
        # announcement; it forwards a later message from the same node down the same
        # connection after that notice, and the client node's I/O thread sets the flags
        # on the notice before it hands the later message over. So once the barrier has
        # the mark sent after announce_round(r), the flag is round r's.
        barrier = pair.client_node.spawn(
            lambda proc: [marks.append(proc.receive().body) for _ in range(8)])
        for r in range(1, 9):
            pair.server_node.announce_round(r)
            pair.server_node.send(barrier, r)
            wait_for(lambda: r in marks, f"the mark after round {r} never came")
            seen.append(owner.offline)
    finally:
        pair.close()
    assert seen == expected
    went_offline = sum(1 for before, now in zip([False] + expected, expected) if now and not before)
    assert owner.offline_count == went_offline


@pytest.mark.parametrize("how", ["offline", "cancel"])
def test_a_client_stops_unwanted_training_and_answers_the_next_request(procs, how):
    """A client whose device goes offline mid-training, or whose round closes without it
    (a Cancel), stops at its next minibatch and sends nothing; then it is selected and
    answers again."""
    from fedemu.worker.client import Client, ModelCache
    from fedemu.common.ml.data import Data
    from fedemu.common.ml.datasets import get as dataset_named
    from fedemu.common.ml.models import ModelSpec

    MNIST = dataset_named("mnist")
    from fedemu.common.ml.models import build, get_flat
    from fedemu.common.messages import TRAIN, Cancel, TrainReply, TrainRequest

    class CountingCache(ModelCache):
        """Counts the model's forward passes: one per minibatch, so we know when the
        client is well into a training (client.iterations moves only at its end)."""

        def get(self, name):
            model = super().get(name)
            if not getattr(model, "steps_counted", False):
                model.steps_counted = True
                model.register_forward_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
            return model

    steps = [0]  # minibatches trained so far, over every training
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 255, (200, 28, 28), dtype=np.uint8), rng.integers(0, 10, 200)
    client = Client(0, np.arange(200), Data("fake", MNIST, images, labels, images, labels), ModelSpec("2nn", MNIST), CountingCache())
    weights = get_flat(build("2nn", (1, 28, 28), 10))
    got: dict = {}  # epochs asked for -> the answer, or None
    pair = Pair(start_broker(procs, {}))

    def well_into_it():  # the hours-long training has run some minibatches
        wait_for(lambda: steps[0] >= 20, "the long training never started")

    def server(proc, epochs, wait_s):
        proc.send("client/0", TrainRequest(round=epochs, task=TRAIN, weights=weights, epochs=epochs,
                                           batch_size=10, lr=0.1, seed=1))
        if how == "cancel" and epochs > 1:
            well_into_it()
            proc.send("client/0", Cancel(round=epochs))
        msg = proc.receive(timeout=wait_s)
        got[epochs] = msg.body if msg else None

    try:
        pair.client_node.spawn_behaviour(client, name="client/0", link=0)
        wait_for(lambda: pair.server_node.whereis("client/0"), "the client never registered")
        pair.server_node.spawn(server, 100_000, 5.0)  # hours of training
        if how == "offline":
            well_into_it()
            pair.server_node.set_links("0", offline=True)
        wait_for(lambda: client.trainings_stopped == 1, "training did not stop")
        pair.server_node.set_links("0", offline=False)
        pair.server_node.spawn(server, 1, 20.0)
        wait_for(lambda: len(got) == 2, "the servers did not finish", timeout=30)
    finally:
        pair.close()
    assert got[100_000] is None  # the stopped training sent nothing
    assert isinstance(got[1], TrainReply) and got[1].round == 1
    assert client.iterations == 20  # only the second training's steps count


@pytest.mark.mnist
@pytest.mark.slow
def test_client_dropped_mid_transfer_is_a_missing_update_and_the_round_completes(tmp_path):
    """Clients 0-49 go offline while their uploads cross a slow uplink: the server sees
    no answer (no side channel), closes the round at its deadline with the rest."""
    run_dir = tmp_path / "run"
    deadline_s, upload_s = 12.0, 4.0  # a model (800 kB) takes 4 s up a 200 kB/s link
    # Wall clock: the operator acts in real time while uploads are under way; in virtual
    # time a change from outside applies at the run's next instant.
    proc = launch(run_dir, "run.clock=wall", "run.rounds=3", f"algorithm.deadline_s={deadline_s}",
                  "network.default_profile=slow", "network.profiles.slow.up.bandwidth=200000")
    wait_for_round(run_dir, 1, proc)
    first = next(e for e in read_events(run_dir) if e["event"] == "round")
    operator = Node("operator", (run_dir / "broker.endpoint").read_text().strip(),
                    token=load_token(run_dir / "run.token")).start()  # one of the run's controllers
    try:
        # Round 2 has begun once round 1 is logged. A client's only uploads are its
        # replies, one per round it was selected in: an uplink below 50 carrying more
        # than that has a round-2 upload in it, for 4 s from when it entered.
        def round_2_upload_in_flight() -> bool:
            links = operator.broker_stats(per_link=True)["links"]
            return any(c["up_msgs"] > (k in first["selected"]) for k, c in links.items() if k < 50)

        wait_for(round_2_upload_in_flight, "no upload of clients 0-49 in round 2", timeout=60)
        operator.set_links("0-49", offline=True)
        # Offline until 2 s before round 2's deadline (the broker's clock, which ran from
        # round 1's end, read by the server just before it began round 2): whatever a
        # selected client of 0-49 sends once back cannot land within the deadline, so
        # each of them misses round 2, however late the loaded host let it start
        # training. Back online in time for round 3's requests.
        back_at = first["emulated_s"] + deadline_s - 2.0  # 2.0 < upload_s
        wait_for(lambda: operator.broker_stats()["emulated_s"] >= back_at, "the broker's clock stopped",
                 timeout=deadline_s + 30)
        operator.set_links("0-49", offline=False)
    finally:
        operator.close()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    rounds = {e["round"]: e for e in (json.loads(line) for line in (run_dir / "events.jsonl").open())
              if e["event"] == "round"}
    second = rounds[2]
    cut_off = [k for k in second["selected"] if k < 50]
    assert cut_off, "no client of the dropped group was selected in round 2 (seeded choice changed?)"
    assert sorted(second["stragglers"]) == cut_off
    assert second["participants"] == len(second["selected"]) - len(cut_off)
    assert second["lost_up"] >= 1  # at least one upload was cut in flight
    assert second["round_s"] >= deadline_s * 0.95  # it waited out its deadline
    assert rounds[3]["participants"] == 10  # back online, selected and answering again


@pytest.mark.mnist
@pytest.mark.slow
def test_compression_shortens_rounds_on_a_slow_uplink(tmp_path):
    """1 MB/s uplinks: an 800 kB model takes 0.8 s to upload; the paper's 256x sketch
    (6.25% subsample, rotation, 2 bits) a few ms. The run log shows both."""
    # The ``message`` pipe, whose upload time is exactly bytes / rate (TCP adds its windows).
    slow_up = ["run.rounds=2", "network.transport=message", "network.default_profile=up1",
               "network.profiles.up1.up.bandwidth=1000000"]
    rounds = {}
    for name, extra in (("raw", []), ("sketched", ["compression.subsample=0.0625", "compression.rotate=true",
                                                   "compression.bits=2"])):
        proc = launch(tmp_path / name, *slow_up, *extra)
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        rounds[name] = [json.loads(line) for line in (tmp_path / name / "events.jsonl").open()
                        if json.loads(line)["event"] == "round"]
    def lengths(events: list[dict]) -> list[float]:  # emulated seconds each round took
        ends = [e["emulated_s"] for e in events]
        return [b - a for a, b in zip([0.0] + ends, ends)]

    assert [len(rounds["raw"]), len(rounds["sketched"])] == [2, 2]  # else the zip below would check less
    for raw, sketched, raw_s, sketched_s in zip(rounds["raw"], rounds["sketched"], lengths(rounds["raw"]),
                                                lengths(rounds["sketched"]), strict=True):
        assert sketched["bytes_up"] * 100 < raw["bytes_up"]
        # Each upload spends its bytes / 1 MB/s on its own link: 10 x 0.8 s in all.
        assert raw["transfer_s_up"] == pytest.approx(raw["bytes_up"] / 1e6, rel=1e-6)
        assert sketched["transfer_s_up"] < raw["transfer_s_up"] / 50
        # Virtual time: a round is the clients' training (charged the same in both runs)
        # then their uploads side by side, each on its own link; the raw round is longer
        # by exactly the upload time the sketch saves.
        saved = (raw["bytes_up"] - sketched["bytes_up"]) / raw["participants"] / 1e6
        assert raw_s - sketched_s == pytest.approx(saved, abs=1e-6) and saved > 0.75
