"""The link emulator and the broker's timebases, in one process: no sockets but the
broker's own (never connected to), messages handed to the router as the serve loop
would, and what the broker would send read back."""
from __future__ import annotations

import time

import pytest
import zmq

from fedemu.node import Broker, Pid, wire
from fedemu.node.net.network_spec import NetworkSpec
from fedemu.node.net.profiles import DOWN, UP
from fedemu.node.wire import USER

LATENCY_S = 0.2


class Outbox:
    """What the broker sends, instead of its socket."""

    def __init__(self, broker: Broker) -> None:
        self.sent: list[tuple[str, list]] = []
        broker.send = lambda identity, msg, node: self.sent.append((node, msg))


def wall_broker(network: dict, num_clients: int = 2) -> tuple[Broker, Outbox]:
    spec = NetworkSpec.from_config(network, num_clients=num_clients, run_seed=1)
    broker = Broker("tcp://127.0.0.1:0", network=spec, clock="wall")
    outbox = Outbox(broker)
    for node in ("srv", "cli"):
        broker.members.join(node.encode(), node, known=False)
    broker.members.register(b"srv", Pid("srv", 0), [["server", Pid("srv", 1), None]])
    broker.members.register(b"cli", Pid("cli", 0), [["client/0", Pid("cli", 1), 0]])
    return broker, outbox


def frames_of(header: bytes, body: object) -> list:
    return [zmq.Frame(header), *(zmq.Frame(bytes(f)) for f in wire.pack_body(body))]


@pytest.mark.parametrize("charge", [0, 4096])
def test_a_wall_clock_message_starts_its_links_clock_at_the_senders_stamp_charged_or_not(charge):
    """The broker starts a message's emulated delay at the sender's send stamp (so the
    bytes' trip to the broker overlaps it). A reply that carries a byte charge
    (``run.aggregation = "nodes"``) has eight header fields, the stamp still the seventh:
    it keeps its stamp (it used to be read only from seven-field headers, so a charged
    reply's delay started when the broker read it)."""
    broker, outbox = wall_broker({"transport": "message", "default_profile": "p",
                                  "profiles": {"p": {"latency_ms": LATENCY_S * 1000}}})
    try:
        time.sleep(0.6)  # the run's clock has run a while: a stamp 0.5 s old is not before it started
        stamp = time.monotonic() - 0.5  # sent half a second before the broker reads it
        header = wire.pack_header(USER, Pid("cli", 1), "server", stamp, charge)
        frames = frames_of(header, {"update": "token"})
        broker.router.on_message(b"cli", frames)
        (node, msg), = outbox.sent
        forwarded = wire.unpack_header(bytes(msg[0]))
        hold = forwarded.timing
        assert node == "srv" and isinstance(hold, wire.Hold) and (hold.link, hold.direction) == (0, UP)
        # Due LATENCY_S after the stamp, not after the broker read it.
        assert hold.sent_at + hold.hold == pytest.approx(stamp + LATENCY_S, abs=1e-6)
        books = broker.links.books()
        assert books["bytes_up"] == wire.link_size(frames) + charge  # the charge is on the link too
    finally:
        broker._sock.close(linger=0)
        broker._ctx.term()


def test_the_emulator_counts_each_direction_and_says_when_a_message_arrives():
    spec = NetworkSpec.from_config({"transport": "message", "default_profile": "p",
                                    "profiles": {"p": {"latency_ms": 10, "bandwidth": 1000}}},
                                   num_clients=2, run_seed=1)
    from fedemu.node.net.emulator import LinkEmulator

    links = LinkEmulator(spec)
    assert links.active
    assert links.account(None, 1, 500) == (1, DOWN)
    assert links.account(0, None, 300) == (0, UP)
    assert links.account(None, None, 7) is None
    assert links.transmit(1, DOWN, 500, 0.0) == pytest.approx(0.5 + 0.010)
    books = links.books()
    assert (books["bytes_down"], books["bytes_up"], books["bytes_other"]) == (500, 300, 7)
    assert books["transfer_s_down"] == pytest.approx(0.51)


def test_the_timeline_holds_each_transfer_as_it_ended_and_each_device_switch_once():
    from fedemu.node.net.emulator import TRANSFER_FIELDS, LinkEmulator

    spec = NetworkSpec.from_config({"transport": "message", "default_profile": "p",
                                    "profiles": {"p": {"latency_ms": 10, "bandwidth": 1000,
                                                                             "overhead_bytes": 20}},
                                    "dropout": {"windows": [{"clients": "1", "start_s": 5, "end_s": 8}]}},
                                   num_clients=2, run_seed=1)
    links = LinkEmulator(spec)
    links.transmit(0, UP, 480, 0.0)
    links.transmit(1, DOWN, 480, 4.9)  # would arrive at 5.41: its device is offline from 5
    assert links.device_changes([0, 1], 0.0, owned={0, 1}) == []
    assert links.next_device_check() == 5.0
    assert links.due_device_changes(5.0, owned={0, 1}) == [(1, True)]
    assert links.due_device_changes(8.0, owned={0, 1}) == [(1, False)]
    taken = links.take_timeline()
    rows = [dict(zip(TRANSFER_FIELDS, row)) for row in taken["transfers"]]
    assert [(r["link"], r["direction"], r["outcome"]) for r in rows] == [(0, UP, "delivered"), (1, DOWN, "offline")]
    assert rows[0]["end_s"] == pytest.approx(0.5 + 0.010) and rows[0]["wire_bytes"] == 500
    assert taken["availability"] == [[1, 5.0, True], [1, 8.0, False]]
    assert links.take_timeline() == {"transfers": [], "availability": []}  # taken once
