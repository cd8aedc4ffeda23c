"""The ``tcp`` transport in a real broker: flows that share the server's link finish
together, a packet loss delays a message and never loses it, a device going offline
mid-transfer loses that message with its bytes in the books, and the wall clock never
delivers before the model. Real broker process, real nodes; the model itself is tested
alone in test_tcp.py."""
from __future__ import annotations

import time

import pytest

from fedemu.node import TIMEOUT, Pid
from fedemu.node.net.emulator import TRANSFER_FIELDS
from fedemu.node.net.profiles import UP

from .linkmodel import model_arrivals
from .test_fanout import broker_with
from .test_virtual_time import wait_for

UPDATE = 797_015  # the 2NN's update, bytes
LTE = {"latency_ms": 35, "bandwidth": "12Mbit"}


def uploads(procs, nodes, network: dict, clock: str, count: int, size: int, messages: int = 1):
    """``count`` clients (links 0..count-1, on two nodes) each send ``messages`` of
    ``size`` bytes to the server at once; returns the server's (receive time, client,
    message number) in arrival order, the send time, and the broker's stats."""
    broker = broker_with(procs, network, clock, num_clients=count)
    server_node, node_a, node_b = nodes(broker, "srv", "na", "nb")
    got: list = []
    sent: list = []

    def server(proc):
        proc.node.start_clock()
        sent.append((proc.now(), time.monotonic()))
        for pid in clients:
            proc.send(pid, "go")
        while len(got) < count * messages:
            msg = proc.receive(timeout=1e5, wall_timeout=60)
            if msg is TIMEOUT:
                return
            got.append((proc.now() if clock == "virtual" else time.monotonic(), *msg.body[:2]))

    def client(proc, k):
        proc.receive(timeout=1e5)
        for i in range(messages):
            proc.send(Pid("srv", 1), (k, i, b"x" * size))

    clients = [(node_a if k % 2 else node_b).spawn(client, k, name=f"client/{k}", link=k) for k in range(count)]
    wait_for(lambda: all(node_a.whereis(f"client/{k}") for k in range(count)), "clients never registered")
    server_node.spawn(server, name="server")
    wait_for(lambda: len(got) == count * messages, "not every upload arrived", timeout=90)
    return got, sent[0], server_node.broker_stats(timeline=True)


def transfers_of(stats: dict) -> list[dict]:
    return [dict(zip(TRANSFER_FIELDS, t)) for t in stats["transfers"]]


def upload_size(stats: dict) -> int:
    """The bytes an upload puts on its link: the body and fedemu's framing of it."""
    (size,) = {t["bytes"] for t in transfers_of(stats) if t["direction"] == UP}
    return size


def model_of(network: dict, clients: int, stats: dict) -> list[float]:
    """The uploads' arrivals, sorted, by the model fed every transfer the broker saw
    (both directions: the server's "go" came down first), as they entered."""
    transfers = transfers_of(stats)
    arrivals = model_arrivals(network, clients, 3, [(t["entry_s"], t["link"], t["direction"], t["bytes"])
                                                    for t in transfers])
    return sorted(a for a, t in zip(arrivals, transfers) if t["direction"] == UP)


def test_flows_sharing_the_servers_link_share_it_and_finish_together(procs, nodes):
    """Issue 42's case: ten clients upload the 2NN's update at once, over LTE access links,
    through a shared 10 Mbit/s server link. TCP's flows share it: none arrives before
    10 S / B, all within a few percent of each other, each exactly when the model says
    (virtual time). The message pipe served them one by one, the first after 1.2 s."""
    network = {"transport": "tcp", "default_profile": "lte", "server_down_bandwidth": "10Mbit",
               "profiles": {"lte": LTE}}
    got, _, stats = uploads(procs, nodes, network, "virtual", 10, UPDATE)
    arrivals = sorted(t for t, _, _ in got)
    assert arrivals[0] >= 10 * UPDATE / 1.25e6  # ten updates through 1.25 MB/s: no sooner
    assert arrivals[-1] <= arrivals[0] * 1.15  # together (their headers and windows differ a little)
    model = model_of(network, 10, stats)
    assert sorted(t for t, _, _ in got) == model  # exact: the broker is the model
    size = upload_size(stats)
    pipe = model_arrivals({**network, "transport": "message"}, 10, 3, [(0.0, k, UP, size) for k in range(10)])
    assert min(pipe) < 1.3 and max(pipe) > 6.0  # what the pipe said: one after another


def test_packet_loss_delays_messages_and_loses_none(procs, nodes):
    """2% of packets lost on every link: all 60 messages arrive, in order per client, the
    retransmissions are in the books, no message is counted lost, and each arrival is
    the model's (virtual time: reproducible to the bit)."""
    network = {"transport": "tcp", "default_profile": "lossy", "profiles": {"lossy": {**LTE, "loss": 0.02}}}
    got, _, stats = uploads(procs, nodes, network, "virtual", 3, 100_000, messages=20)
    for k in range(3):
        assert [i for _, c, i in got if c == k] == list(range(20))
    assert stats["lost_up"] == 0 and stats["msgs_up"] == 60
    assert stats["retransmitted_bytes_up"] > 0
    assert {t["outcome"] for t in transfers_of(stats)} == {"delivered"}
    model = model_of(network, 3, stats)
    assert sorted(t for t, _, _ in got) == model
    lossless = model_of({**network, "profiles": {"lossy": LTE}}, 3, stats)
    assert model[-1] > lossless[-1]  # the retransmissions cost time


def test_a_device_going_offline_mid_transfer_loses_that_message_with_its_bytes_booked(procs, nodes):
    """Virtual time: an 800 kB upload on a 200 kB/s link takes about 4 s; the device goes
    offline at 1 s. The message is lost, the books say why, and the bytes that already
    crossed stay counted; back online, its next message goes through a new connection."""
    network = {"transport": "tcp", "default_profile": "slow", "profiles": {"slow": {"up": {"bandwidth": 200_000}}}}
    broker = broker_with(procs, network, "virtual", num_clients=1)
    server_node, client_node = nodes(broker, "srv", "cli")
    log: list = []

    def server(proc):
        proc.node.start_clock()
        proc.send(client, "go")
        log.append(proc.receive(timeout=1.0))
        proc.node.set_links([0], offline=True)
        log.append(proc.receive(timeout=9.0))  # nothing: the upload died with its connection
        proc.node.set_links([0], offline=False)
        proc.send(client, "again")
        msg = proc.receive(timeout=60.0)
        log.append((proc.now(), msg if msg is TIMEOUT else msg.body[:2]))

    def client_proc(proc):
        proc.receive(timeout=1e5)
        proc.send(Pid("srv", 1), (0, 0, b"x" * 800_000))
        proc.receive(timeout=1e5)
        proc.send(Pid("srv", 1), (0, 1, b"x" * 800_000))

    client = client_node.spawn(client_proc, name="client/0", link=0)
    wait_for(lambda: server_node.whereis("client/0"), "client never registered")
    server_node.spawn(server, name="server")
    wait_for(lambda: len(log) == 3, "the server did not finish")
    assert log[0] is TIMEOUT and log[1] is TIMEOUT
    now, body = log[2]
    assert body == [0, 1] and 10.0 + 800_000 / 200_000 < now < 10.0 + 2 * 800_000 / 200_000
    stats = server_node.broker_stats(timeline=True)
    assert stats["lost_up"] == 1 and stats["dropped"] == {"offline": 1} and stats["msgs_up"] == 2
    first, second = (t for t in transfers_of(stats) if t["direction"] == UP)
    assert first["outcome"] == "offline" and first["end_s"] == pytest.approx(1.0)
    # What the sender had put on the wire by 1 s (delivered, or queued at the link) is on
    # the books: at least a first window, not the whole message.
    assert 14_480 < first["wire_bytes"] < 800_000
    assert second["outcome"] == "delivered" and second["wire_bytes"] > 800_000
    assert stats["wire_bytes_up"] == first["wire_bytes"] + second["wire_bytes"]


def test_on_the_wall_clock_no_message_arrives_before_the_model_says(procs, nodes):
    """Wall clock: four clients' updates through a shared 20 Mbit/s server link and LTE
    access links. Whatever the host's load, none arrives sooner than the model fed the
    messages as they entered says (under load the clients start apart, and the first
    then has the shared link to itself for a while: the model knows that too)."""
    network = {"transport": "tcp", "default_profile": "lte", "server_down_bandwidth": "20Mbit",
               "profiles": {"lte": LTE}}
    got, (started_emulated, started), stats = uploads(procs, nodes, network, "wall", 4, UPDATE)
    size = upload_size(stats)
    together = min(model_arrivals(network, 4, 3, [(0.0, k, UP, size) for k in range(4)]))
    assert together > 4 * UPDATE / 2.5e6  # the shared link binds: the case is a sharing one
    # The server's receive stamps (monotonic) on the broker's clock, where the entries are.
    received = sorted(t - started + started_emulated for t, _, _ in got)
    model = model_of(network, 4, stats)
    # Sorted against sorted: if each arrival is no sooner than its own model time, so is
    # each order statistic. (5 ms: the send stamps' clock slop.)
    assert all(r >= m - 0.005 for r, m in zip(received, model)), (received, model)
    assert stats["lost_up"] == 0 and stats["msgs_up"] == 4
