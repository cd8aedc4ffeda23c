"""Link emulation through a real broker process: rates, order, loss, reproducibility,
and a client that drops out mid-transfer during FedAvg."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fedemu.node import TIMEOUT, Behaviour, Down, Node, Pid, Process

from .realprocs import Procs
from .test_launch import launch, wait_for_round
from .test_links import binomial_interval


def start_broker(procs: Procs, network: dict, num_clients: int = 4, seed: int = 1, name: str = "net") -> str:
    path = procs.tmp / f"{name}.json"
    path.write_text(json.dumps({"num_clients": num_clients, "seed": seed, "time_scale": 1.0, "network": network}))
    procs.tmp.joinpath("broker.endpoint").unlink(missing_ok=True)
    return procs.broker("--network", str(path))


class Pair:
    """A client process (owner of link 0) on one node and a server on another."""

    def __init__(self, broker: str):
        self.client_node = Node("client-node", broker).start()
        self.server_node = Node("server-node", broker).start()
        self.arrivals: list[tuple[float, object]] = []
        self.server = self.server_node.spawn(self._collect, name="server")
        # Another node registers "server": until the broker knows the name, a message to
        # it is dropped before it enters the link (and before the link's counter moves).
        deadline = time.monotonic() + 10
        while self.client_node.whereis("server") is None:
            assert time.monotonic() < deadline, "server never registered"
            time.sleep(0.02)

    def _collect(self, proc):
        while True:
            msg = proc.receive(timeout=10)
            if msg is TIMEOUT:
                return
            self.arrivals.append((time.monotonic(), msg.body))

    def send_up(self, bodies: list) -> float:
        started = []

        def client(proc):
            started.append(time.monotonic())
            for body in bodies:
                proc.send("server", body)

        self.client_node.spawn(client, name="client/0", link=0)
        time.sleep(0.2)  # let the sender start; its name is registered before it sends (FIFO)
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
    rate, size, count = 2_000_000, 100_000, 20  # 2 MB/s: one 100 kB message every 50 ms
    broker = start_broker(procs, {"default_profile": "slow", "profiles": {"slow": {"bandwidth": rate}}})
    pair = Pair(broker)
    try:
        pair.send_up([np.zeros(size - 60, np.uint8) for _ in range(count)])
        arrivals = [t for t, _ in pair.wait(count, 10)]
    finally:
        pair.close()
    assert len(arrivals) == count
    # Sizes on the wire are the body plus a small header: measure against the model.
    gaps = np.diff(arrivals)
    assert np.median(gaps) == pytest.approx(size / rate, rel=0.1)
    span = arrivals[-1] - arrivals[0]
    assert span == pytest.approx((count - 1) * size / rate, rel=0.1)


def numbers_through(procs: Procs, profile: dict, count: int) -> list:
    """Send 0..count-1 up one link with ``profile``; the bodies in arrival order."""
    pair = Pair(start_broker(procs, {"default_profile": "p", "profiles": {"p": profile}}))
    try:
        pair.send_up(list(range(count)))
        return [body for _, body in pair.wait(count, 10)]
    finally:
        pair.close()


def test_fifo_holds_under_jitter(procs):
    got = numbers_through(procs, {"latency_ms": 30, "jitter_ms": 25}, 500)
    assert got == list(range(500))


def test_reorder_lets_jitter_reorder(procs):
    got = numbers_through(procs, {"latency_ms": 30, "jitter_ms": 25, "reorder": True}, 300)
    assert sorted(got) == list(range(300)) and got != list(range(300))


def lossy_run(procs: Procs, seed: int, loss: float, count: int, name: str) -> tuple[set, dict]:
    broker = start_broker(procs, {"default_profile": "lossy", "profiles": {"lossy": {"loss": loss}}},
                          seed=seed, name=name)
    pair = Pair(broker)
    try:
        pair.send_up(list(range(count)))
        time.sleep(1.0)  # nothing is delayed: whatever is not here by now was lost
        received = {body for _, body in pair.arrivals}
        stats = pair.server_node.broker_stats()
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
        arrivals = pair.wait(1, 5)
        pair.server_node.set_links("0", offline=True)
        pair.send_up(["lost"])
        time.sleep(0.5)
        stats = pair.server_node.broker_stats()
    finally:
        pair.close()
    assert [b for _, b in arrivals] == ["hello"]
    assert arrivals[0][0] - started >= 0.075
    assert stats["dropped"].get("offline") == 1


def in_flight_run(procs: Procs, network: dict, go_offline) -> tuple[list, list, dict]:
    """Client 0 and the server each send one message across client 0's 400 ms link,
    then ``go_offline(server_node)`` while both are in flight; then one more each way
    once back online. Returns (bodies the server got, bodies the client got, stats)."""
    pair = Pair(start_broker(procs, network))
    client_got: list = []

    def client(proc):
        proc.send("server", "up-1")
        while (msg := proc.receive(timeout=3)) is not TIMEOUT:
            client_got.append(msg.body)

    try:
        pair.client_node.spawn(client, name="client/0", link=0)
        deadline = time.monotonic() + 5
        while pair.server_node.whereis("client/0") is None:
            assert time.monotonic() < deadline, "client never registered"
            time.sleep(0.01)
        pair.server_node.send("client/0", "down-1")
        time.sleep(0.1)  # both are a quarter of the way across their links
        go_offline(pair.server_node)
        time.sleep(0.6)  # past when they were due
        pair.server_node.set_links("0", offline=False)
        pair.server_node.announce_round(0)  # (a round without drop-outs, where rounds matter)
        pair.server_node.send("client/0", "down-2")
        time.sleep(0.6)
        stats = pair.server_node.broker_stats()
    finally:
        pair.close()
    return [body for _, body in pair.arrivals], client_got, stats


@pytest.mark.parametrize("how", ["set_links", "round"])
def test_messages_in_flight_when_a_client_goes_offline_are_dropped_and_counted(procs, how):
    """The broker forwards at once and the receiving node holds a message until due:
    a client that goes offline meanwhile must still lose what is in flight, both ways,
    by the API or by a new round's drop-out."""
    slow = {"latency_ms": 400}
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
        client = proc.receive(Pid, timeout=5).body
        proc.monitor(client)
        proc.send(client, "go")
        while (msg := proc.receive(timeout=2)) is not TIMEOUT:
            seen.append("down" if isinstance(msg.body, Down) else msg.body)

    def client(proc):
        proc.receive(timeout=5)
        proc.send(w, "last words")

    try:
        w = pair.server_node.spawn(watcher)
        c = pair.client_node.spawn(client, name="client/0", link=0)
        pair.server_node.send(w, c)
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        pair.close()
    assert seen == ["last words", "down"]


def test_a_clients_node_hears_when_its_device_goes_offline_and_back(procs):
    """A scheduled window takes client 0 offline: the broker tells the client's own node
    when the window opens and closes (its flags, and a behaviour's link_changed in
    order), and a send the device had scheduled with unless_offline never happens."""
    window = (5.0, 6.0)  # emulated seconds from the broker's start
    pair = Pair(start_broker(procs, {"dropout": {"windows": [{"clients": "0", "start_s": window[0],
                                                                "end_s": window[1]}]}}))
    heard: list = []

    class Device(Behaviour):
        def handle(self, proc, msg):
            pass

        def link_changed(self, proc, offline):
            heard.append(offline)

    try:
        now = pair.server_node.broker_stats()["emulated_s"]
        assert now < window[0] - 1, f"the broker took {now:.1f}s to get here; the window is at {window[0]}s"
        pair.client_node.spawn_behaviour(Device(), name="client/1", link=0)  # a second owner of link 0
        proc = pair.link_owner(life_s=15)
        due_after_window = window[1] + 0.5 - now
        proc.send_after(due_after_window, "server", "guarded", unless_offline=True)
        proc.send_after(due_after_window, "server", "plain")
        flips = []  # (wall seconds from `now`, offline)
        started = time.monotonic()
        while time.monotonic() - started < due_after_window + 0.5:
            if proc.offline != (flips[-1][1] if flips else False):
                flips.append((time.monotonic() - started, proc.offline))
            time.sleep(0.005)
        arrivals = pair.wait(1, 2)
    finally:
        pair.close()
    assert [state for _, state in flips] == [True, False]
    assert window[0] - now - 0.3 < flips[0][0] < window[0] - now + 0.5  # when the window opened
    assert 0.5 < flips[1][0] - flips[0][0] < 1.5  # open for about its 1 s
    assert proc.offline_count == 1
    assert heard == [True, False]
    assert [body for _, body in arrivals] == ["plain"]  # "guarded" was lost with the device


def test_a_clients_node_hears_of_its_per_round_drop_outs_at_each_round(procs):
    """Per-round drop-outs are decided when the server announces a round: the client's
    node must hear of each change then, matching the seeded decisions."""
    from fedemu.node.links import NetworkSpec

    network = {"dropout": {"per_round": 0.5, "clients": "0"}}
    expected_spec = NetworkSpec.from_config(network, num_clients=4, run_seed=1)
    expected = [expected_spec.availability.offline(0, 0.0, r) for r in range(1, 9)]
    assert True in expected and False in expected  # the seed gives both; else pick another
    pair = Pair(start_broker(procs, network))
    seen = []
    try:
        owner = pair.link_owner(life_s=20)
        for r in range(1, 9):
            pair.server_node.announce_round(r)
            time.sleep(0.3)  # the notice is one hop away
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
    from fedemu.worker.client import Client, _ModelCache
    from fedemu.worker.data import Dataset
    from fedemu.worker.models import build, get_flat
    from fedemu.worker.protocol import TRAIN, Cancel, TrainReply, TrainRequest

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 255, (200, 28, 28), dtype=np.uint8), rng.integers(0, 10, 200)
    client = Client(0, np.arange(200), Dataset("fake", images, labels, images, labels, 10), "2nn", _ModelCache())
    weights = get_flat(build("2nn"))
    got: dict = {}  # epochs asked for -> the answer, or None
    pair = Pair(start_broker(procs, {}))

    def server(proc, epochs, wait_s):
        proc.send("client/0", TrainRequest(round=epochs, task=TRAIN, weights=weights, epochs=epochs,
                                           batch_size=10, lr=0.1, seed=1))
        if how == "cancel" and epochs > 1:
            time.sleep(1.0)  # well into it
            proc.send("client/0", Cancel(round=epochs))
        msg = proc.receive(timeout=wait_s)
        got[epochs] = msg.body if msg else None

    try:
        pair.client_node.spawn_behaviour(client, name="client/0", link=0)
        wait_for(lambda: pair.server_node.whereis("client/0"), "the client never registered")
        pair.server_node.spawn(server, 100_000, 5.0)  # hours of training
        if how == "offline":
            time.sleep(1.0)  # well into it
            pair.server_node.set_links("0", offline=True)
        wait_for(lambda: client.trainings_stopped == 1, "training did not stop")
        pair.server_node.set_links("0", offline=False)
        pair.server_node.spawn(server, 1, 20.0)
        wait_for(lambda: len(got) == 2, "the servers did not finish")
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
    proc = launch(run_dir, "run.rounds=3", "algorithm.deadline_s=12",
                  "network.default_profile=slow", "network.profiles.slow.up.bandwidth=200000")
    wait_for_round(run_dir, 1, proc)
    operator = Node("operator", (run_dir / "broker.endpoint").read_text().strip()).start()
    try:
        time.sleep(1.5)  # round 2: models are down, 4-second uploads are under way
        operator.set_links("0-49", offline=True)
        time.sleep(6.0)  # past when those uploads would have landed, before the deadline
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
    assert second["round_s"] >= 12 * 0.95  # it waited out its deadline
    assert rounds[3]["participants"] == 10  # back online, selected and answering again


@pytest.mark.mnist
@pytest.mark.slow
def test_compression_shortens_rounds_on_a_slow_uplink(tmp_path):
    """1 MB/s uplinks: an 800 kB model takes 0.8 s to upload; the paper's 256x sketch
    (6.25% subsample, rotation, 2 bits) a few ms. The run log shows both."""
    slow_up = ["run.rounds=2", "network.default_profile=up1", "network.profiles.up1.up.bandwidth=1000000"]
    rounds = {}
    for name, extra in (("raw", []), ("sketched", ["compression.subsample=0.0625", "compression.rotate=true",
                                                   "compression.bits=2"])):
        proc = launch(tmp_path / name, *slow_up, *extra)
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        rounds[name] = [json.loads(line) for line in (tmp_path / name / "events.jsonl").open()
                        if json.loads(line)["event"] == "round"]
    for raw, sketched in zip(rounds["raw"], rounds["sketched"]):
        assert sketched["bytes_up"] * 100 < raw["bytes_up"]
        # Each upload spends its bytes / 1 MB/s on its own link: 10 x 0.8 s in all.
        assert raw["transfer_s_up"] == pytest.approx(raw["bytes_up"] / 1e6, rel=0.05)
        assert sketched["transfer_s_up"] < raw["transfer_s_up"] / 50
        # Every raw round contains its 0.8 s uploads; wall-clock comparisons between the
        # two runs are left to benchmarks (computation time varies with machine load).
        assert raw["round_s"] >= 0.8
