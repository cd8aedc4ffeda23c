"""Messages to many (``send_many``): one body crosses the broker once per receiving node,
each receiver still gets its own copy at the instant its own link says, and what its
link loses on the way is lost for it alone. Real broker process, real nodes."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fedemu.node import TIMEOUT, Node, Pid, wire
from fedemu.node.net.profiles import DOWN
from fedemu.node.wire import MANY, USER, WireError

from .linkmodel import model_arrivals
from .realprocs import Procs
from .test_virtual_time import wait_for

PAYLOAD = np.arange(50_000, dtype=np.float32)  # 200 KB: the bandwidth shapes it


def broker_with(procs: Procs, network: dict, clock: str, num_clients: int = 6) -> str:
    path = procs.tmp / "net.json"
    path.write_text(json.dumps({"num_clients": num_clients, "seed": 3, "time_scale": 1.0, "clock": clock,
                                "network": network}))
    return procs.broker("--network", str(path), heartbeat_timeout=5.0)


def receivers(node_a: Node, node_b: Node, got: dict, wait: float = 1e6) -> list[Pid]:
    """Clients 0-2 on node_a, 3-5 on node_b (links 0-5); each records (now, body)."""

    def client(proc, k):
        msg = proc.receive(timeout=wait)
        got[k] = (proc.now(), msg if msg is TIMEOUT else msg.body)

    pids = [(node_a if k < 3 else node_b).spawn(client, k, name=f"client/{k}", link=k) for k in range(6)]
    wait_for(lambda: all(node_a.whereis(f"client/{k}") for k in range(6)), "clients never registered")
    return pids


JITTERY = {"default_profile": "p", "profiles": {"p": {"latency_ms": 30, "jitter_ms": 20, "down": {"bandwidth": "2MB/s"}}}}


@pytest.mark.parametrize("transport", ["tcp", "message"])
def test_each_receiver_gets_its_copy_when_its_own_link_says_and_the_body_crosses_once_per_node(procs, nodes,
                                                                                                transport):
    """Virtual time: six clients on two nodes, one send_many of a 200 KB body. Each
    arrival equals the link model's, computed apart from the same seed, to the last bit;
    each link is charged the body its client alone would have got (so a link's books do
    not depend on who shares its node); the broker relayed one message per node."""
    network = {**JITTERY, "transport": transport}
    broker = broker_with(procs, network, "virtual")
    server_node, node_a, node_b = nodes(broker, "srv", "na", "nb")
    got: dict = {}
    pids = receivers(node_a, node_b, got)
    body = {"weights": PAYLOAD, "round": 1}

    def server(proc):
        proc.node.start_clock()
        proc.send_many(pids, body)

    server_node.spawn(server, name="server")
    wait_for(lambda: len(got) == 6, "not every client got its copy")

    src = Pid("srv", 1)
    assert len({wire.message_size(wire.encode(USER, src, pid, body)) for pid in pids}) == 1  # (the ids' lengths alike)
    # Each link is charged the body, as if sent to its client alone (headers are fedemu's routing).
    sizes = [wire.link_size(wire.encode(USER, src, pid, body)) for pid in pids]
    expected = dict(enumerate(model_arrivals(network, 6, 3, [(0.0, k, DOWN, sizes[k]) for k in range(6)])))
    assert {k: t for k, (t, _) in got.items()} == expected  # exact: no tolerance
    assert len(set(expected.values())) == 6  # the jitter made every link's instant its own
    for _, copy in got.values():
        assert np.array_equal(copy["weights"], PAYLOAD) and not copy["weights"].flags.writeable
    stats = server_node.broker_stats()
    assert stats["msgs_down"] == 6 and stats["bytes_down"] == sum(sizes)
    assert stats["fanout_msgs"] == 2 and stats["fanout_receivers"] == 6
    wait_for(lambda: not node_a._stashes and not node_b._stashes, "a node kept a body nobody will receive")


@pytest.mark.parametrize("transport", ["tcp", "message"])
def test_a_receiver_whose_link_goes_offline_in_flight_loses_only_its_own_copy(procs, nodes, transport):
    """Virtual time: a 1 s link latency; at 0.5 s client 4's link goes offline. The five
    others get the body when the model says (1.0 s down the pipe; a few round trips of
    TCP's window); client 4's copy is counted lost, it times out, and its node frees the
    body once every receiver's turn has come."""
    network = {"transport": transport, "default_profile": "slow", "profiles": {"slow": {"latency_ms": 1000}}}
    broker = broker_with(procs, network, "virtual")
    server_node, node_a, node_b = nodes(broker, "srv", "na", "nb")
    got: dict = {}
    pids = receivers(node_a, node_b, got, wait=30.0)

    def server(proc):
        proc.node.start_clock()
        proc.send_many(pids, {"weights": PAYLOAD})
        proc.receive(timeout=0.5)
        proc.node.set_links([4], offline=True)

    server_node.spawn(server, name="server")
    wait_for(lambda: len(got) == 6, "a client neither got its copy nor timed out")
    assert got[4] == (30.0, TIMEOUT)
    size = wire.link_size(wire.encode(USER, Pid("srv", 1), pids[0], {"weights": PAYLOAD}))
    expected = model_arrivals(network, 6, 3, [(0.0, k, DOWN, size) for k in range(6)])
    assert expected[0] == 1.0 if transport == "message" else 4.0 < expected[0] < 30.0  # TCP: slow start's round trips
    assert all(got[k][0] == expected[k] and np.array_equal(got[k][1]["weights"], PAYLOAD) for k in (0, 1, 2, 3, 5))
    stats = server_node.broker_stats()
    assert stats["lost_down"] == 1 and stats["dropped"].get("offline") == 1
    assert not node_a._stashes and not node_b._stashes


def test_wall_time_receivers_each_decode_their_own_copy_after_their_links_delay(procs, nodes):
    """Wall time: with a 150 ms downlink, no copy arrives sooner; receivers on one node
    share the received buffer read-only but never a mutable object."""
    network = {"default_profile": "p", "profiles": {"p": {"down": {"latency_ms": 150}}}}
    broker = broker_with(procs, network, "wall")
    server_node, node_a, node_b = nodes(broker, "srv", "na", "nb")
    got: dict = {}

    def client(proc, k):
        msg = proc.receive(timeout=30)
        msg.body["mine"] = k  # a receiver's own copy: the others must not see this
        got[k] = (time.monotonic(), msg.body)

    pids = [(node_a if k < 3 else node_b).spawn(client, k, name=f"client/{k}", link=k) for k in range(6)]
    wait_for(lambda: all(node_a.whereis(f"client/{k}") for k in range(6)), "clients never registered")
    sent: list = []

    def server(proc):
        sent.append(time.monotonic())
        proc.send_many(pids, {"weights": PAYLOAD, "mine": None})

    server_node.spawn(server)
    wait_for(lambda: len(got) == 6, "not every client got its copy")
    for k, (arrived, copy) in got.items():
        assert arrived - sent[0] >= 0.15 and copy["mine"] == k
        assert np.array_equal(copy["weights"], PAYLOAD) and not copy["weights"].flags.writeable
    stats = server_node.broker_stats()
    assert stats["msgs_down"] == 6 and stats["fanout_msgs"] == 2


def test_messages_to_many_are_checked_like_any_other():
    src = Pid("srv", 1)
    frames = wire.encode_many(src, "na", [3, 5, 9], {"x": PAYLOAD[:4]})
    header, fanout = wire.decode(frames)
    assert header.kind == MANY and header.dst == 3 and fanout.recipients == [3, 5, 9]
    first, second = fanout.body(), fanout.body()
    assert first is not second and np.array_equal(first["x"], PAYLOAD[:4])
    assert wire.check_ids(fanout.recipients, 3) == [3, 5, 9]
    for ids, count in (([3, 3, 5], 3), ([3, 5], 3), (["3", 5, 9], 3), ([0, 5, 9], 3), ("nope", 3)):
        with pytest.raises(WireError, match="distinct process ids"):
            wire.check_ids(ids, count)
    for dst in (0, wire.MAX_RECIPIENTS + 1, "client/1"):
        bad = [wire.msgpack.packb([wire.VERSION, MANY, "srv", 1, "na", dst]), frames[1], *frames[2:]]
        with pytest.raises(WireError, match="a message to many"):
            wire.decode(bad)
