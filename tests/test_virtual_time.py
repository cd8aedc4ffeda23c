"""Virtual time at the runtime level, through a real broker process: the clock moves only
when the run is quiescent, messages arrive exactly when the link model says, timers fire
at their instant, computing takes no emulated time, simultaneous events are ordered the
same way every time, and a run with nothing left to happen is told so at once."""
from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest

from fedemu.node import TIMEOUT, Node, Pid, Stalled, wire
from fedemu.node.wire import USER

from .linkmodel import model_arrivals
from .realprocs import Procs


def virtual_broker(procs: Procs, network: dict, num_clients: int = 4, seed: int = 1, *extra: str,
                   heartbeat_timeout: float = 5.0) -> str:
    path = procs.tmp / "net.json"
    path.write_text(json.dumps({"num_clients": num_clients, "seed": seed, "time_scale": 1.0, "clock": "virtual",
                                "network": network}))
    return procs.broker("--network", str(path), *extra, heartbeat_timeout=heartbeat_timeout)


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class Hogs:
    """Two busy processes beside the test: the host is loaded, the results must not change."""

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("transport", ["tcp", "message"])
def test_every_message_arrives_exactly_when_the_link_model_says_under_load(procs, nodes, transport):
    """Latency, jitter, a 1 MB/s uplink shared by back-to-back messages, and the server's
    own uplink bottleneck downstream: each arrival, read on the receiver's clock, equals
    the model's arrival computed independently from the same seed, to the last bit."""
    network = {"transport": transport, "default_profile": "p", "server_up_bandwidth": "2MB/s",
               "profiles": {"p": {"latency_ms": 40, "jitter_ms": 15, "jitter_distribution": "paretonormal",
                                  "up": {"bandwidth": "1MB/s"}, "down": {"bandwidth": "4MB/s"}}}}
    broker = virtual_broker(procs, network)
    server_node, client_node = nodes(broker, "srv", "cli")
    sizes = [100, 200_000, 10, 50_000, 1_000, 300_000]
    seen: list[tuple[float, int]] = []
    echoed: list[tuple[float, int]] = []
    server_pid = Pid("srv", 1)
    client_pid = Pid("cli", 1)

    def server(proc):
        proc.node.start_clock()
        for _ in sizes:
            msg = proc.receive(timeout=1e6)
            seen.append((proc.now(), len(msg.body)))
        for size in sizes[:3]:
            proc.send(client_pid, b"y" * size)  # down, through the server's uplink bottleneck

    def client(proc):
        for size in sizes:
            proc.send(server_pid, b"x" * size)
        for _ in sizes[:3]:
            msg = proc.receive(timeout=1e6)
            echoed.append((proc.now(), len(msg.body)))

    with Hogs():
        client_node.spawn(client, name="client/0", link=0)
        wait_for(lambda: server_node.whereis("client/0"), "client never registered")
        server_node.spawn(server, name="server")
        wait_for(lambda: len(echoed) == 3, "not every message arrived")

    def size_on_wire(src, dst, size):
        return wire.link_size(wire.encode(USER, src, dst, b"x" * size))

    sent_down = seen[-1][0]  # the server answered at the instant the last upload arrived
    model = model_arrivals(network, 4, 1, [(0.0, 0, 0, size_on_wire(client_pid, server_pid, s)) for s in sizes]
                           + [(sent_down, 0, 1, size_on_wire(server_pid, client_pid, s)) for s in sizes[:3]])
    up, down = model[:len(sizes)], model[len(sizes):]
    assert seen == [(t, s) for t, s in zip(up, sizes)]  # exact: no tolerance
    assert echoed == [(t, s) for t, s in zip(down, sizes[:3])]
    assert up[1] > 0.2 and down[1] - sent_down > 0.1  # the bandwidths did shape it


def test_computing_takes_no_emulated_time_and_timers_fire_at_their_instant(procs, nodes):
    broker = virtual_broker(procs, {})
    [node] = nodes(broker, "a")
    log: list = []

    def worker(proc):
        proc.node.start_clock()
        busy_until = time.monotonic() + 0.3
        while time.monotonic() < busy_until:  # real work: the clock must wait, not run
            pass
        log.append(("after work", proc.now()))
        proc.send_after(2.5, proc.pid, "ping")
        proc.send_after(1.25, proc.pid, "early")
        log.append(("got", proc.receive(timeout=100).body, proc.now()))
        log.append(("got", proc.receive(timeout=100).body, proc.now()))
        log.append(("timeout", proc.receive(timeout=7.0), proc.now()))
        log.append(("wall", proc.receive(timeout=1e9, wall_timeout=0.2), proc.now()))

    node.spawn(worker)
    wait_for(lambda: len(log) == 5, "the process did not finish")
    assert log[:4] == [("after work", 0.0), ("got", "early", 1.25), ("got", "ping", 2.5), ("timeout", TIMEOUT, 9.5)]
    # A wall-time wait times out in real time; the 1e9 s emulated timeout is the only
    # event pending, so the clock may have jumped to it meanwhile: either is right.
    assert log[4][1] is TIMEOUT


def test_the_clock_stands_at_zero_until_the_run_starts_it(procs, nodes):
    broker = virtual_broker(procs, {})
    [node] = nodes(broker, "a")
    fired: list = []
    go = threading.Event()

    def waiter(proc):
        msg = proc.receive(timeout=5.0)  # due at 5, but the clock has not started
        fired.append((msg, proc.now()))

    def starter(proc):
        go.wait()
        proc.node.start_clock()

    node.spawn(waiter)
    node.spawn(starter)
    time.sleep(0.5)  # real time passes; emulated time may not
    assert fired == []
    go.set()
    wait_for(lambda: fired, "the timeout never fired")
    assert fired == [(TIMEOUT, 5.0)]


def test_simultaneous_arrivals_come_in_the_same_order_whatever_the_real_timing(procs, nodes):
    """Twelve clients on two nodes all send at the same instant, each after a random
    real delay: the server takes them in (due, sender, sequence) order every time."""
    broker = virtual_broker(procs, {}, num_clients=12)
    server_node, a, b = nodes(broker, "srv", "na", "nb")
    orders = []
    for attempt in range(2):
        rng = random.Random(attempt)
        got: list = []

        def server(proc, got=got):
            for _ in range(24):
                got.append(proc.receive().body)

        def client(proc, k, delay, name):
            time.sleep(delay)  # real time only: the instant does not end while anyone is busy
            proc.send(name, (k, 1))
            proc.send(name, (k, 2))

        name = f"server-{attempt}"
        server_node.spawn(server, name=name)
        wait_for(lambda: a.whereis(name) and b.whereis(name), "the server never registered")
        for k in range(12):
            (a if k % 2 else b).spawn(client, k, rng.random() * 0.2, name)
        wait_for(lambda: len(got) == 24, "not every message arrived")
        orders.append(got)
    assert orders[0] == orders[1]
    assert [m[1] for m in orders[0][:2]] == [1, 2]  # one sender's two in sequence, together


def test_a_run_with_nothing_left_to_happen_is_told_at_once(procs, nodes):
    broker = virtual_broker(procs, {})
    [node] = nodes(broker, "a")
    told: list = []
    started = time.monotonic()

    def stuck(proc):
        proc.node.start_clock()
        proc.send_after(3.0, proc.pid, "last timer")
        assert proc.receive(str, timeout=100).body == "last timer"
        msg = proc.receive((Stalled, int))  # waits for an int nobody will send
        told.append((msg.body, proc.now(), time.monotonic() - started))

    def bystander(proc):
        told.append(("bystander", proc.receive(int, timeout=None)))  # does not take Stalled: not woken

    node.spawn(bystander)
    node.spawn(stuck)
    wait_for(lambda: told, "no stalled notice")
    time.sleep(0.3)
    assert len(told) == 1
    body, now, waited = told[0]
    assert body == Stalled(3.0) and now == 3.0
    assert waited < 5  # at once, not after some watchdog's timeout


def test_a_node_lost_for_real_leaves_the_quiescence_set(procs):
    """A node that has work and stops for real (SIGSTOP) can never report idle: the
    clock waits for it, until the broker declares it lost (wall time, its heartbeats
    stopped); then time moves on without it."""
    import os
    import signal

    broker = virtual_broker(procs, {})
    peer = procs.peer("victim", broker)
    node = Node("survivor", broker, heartbeat_interval=0.1, heartbeat_timeout=5.0).start()
    fired: list = []
    try:
        os.kill(peer.pid, signal.SIGSTOP)
        started = time.monotonic()

        def waiter(proc):
            proc.node.start_clock()
            proc.send("victim/echo", "work it will never finish")
            fired.append((proc.receive(str, timeout=10.0), proc.now(), time.monotonic() - started))

        node.spawn(waiter)
        wait_for(lambda: fired, "the clock never moved", timeout=30)
    finally:
        os.kill(peer.pid, signal.SIGKILL)
        node.close()
    msg, now, waited = fired[0]
    assert (msg, now) == (TIMEOUT, 10.0)
    assert waited > 4.0  # held until the victim was declared lost (5 s heartbeat timeout)


def send_raw(node: Node, frames: list) -> None:
    """Frames out of ``node``'s socket as they are: what a buggy node of the run sends."""
    node._outbox.append(frames)
    node._report_due = True
    node._wake()


def test_what_a_node_or_the_broker_drops_still_counts_as_taken_in(procs):
    """A node of the run sends, at one instant, everything a node or the broker drops:
    bodies that do not decode or leave an array frame unreferenced, a message for no
    local process, control only the broker may send or that lacks its fields, a message
    over the receiver's size limit; and, dropped by the broker, messages to no one, over
    its limit, malformed or not its sender's to send. The clock moves on at once: the
    receiver counts what it drops as taken in, as the broker counted it sent. (A message
    left uncounted would hold the clock for good: the nodes stay alive, so no heartbeat
    timeout ever frees it.)"""
    patience = 30.0  # no node is lost in this test, however slow the host
    broker = virtual_broker(procs, {}, 4, 1, "--max-message-bytes", str(1 << 20), "--controller", "rx",
                            heartbeat_timeout=patience)
    rx = Node("rx", broker, heartbeat_interval=0.1, heartbeat_timeout=patience, max_message_bytes=64 << 10).start()
    buggy = Node("buggy", broker, heartbeat_interval=0.1, heartbeat_timeout=patience).start()
    src, to_rx, to_broker = Pid("buggy", 0), Pid("rx", 1), Pid("$broker", 0)
    unreferenced = msgpack.packb("x")
    dropped_by_rx = [
        [wire.pack_header(USER, src, to_rx), unreferenced, b"\0" * 8],  # an array frame the body does not name
        [wire.pack_header(USER, src, to_rx), b"\xc1"],  # not msgpack
        [msgpack.packb([1, USER, "buggy", 0, "rx", "nobody"]), msgpack.packb("hi")],  # no such local name
        wire.encode(wire.CTL, src, Pid("rx", 0), {"op": "advance", "now": 99.0, "count": 0}),  # the broker's op
        wire.encode(wire.CTL, src, Pid("rx", 0), {"op": "monitor"}),  # lacks its fields
        wire.encode(USER, src, to_rx, np.zeros(100_000, np.uint8)),  # over rx's 64 KB
    ]
    dropped_by_broker = [
        wire.encode(USER, src, "ghost", "hi"),  # no process of that name
        wire.encode(USER, src, to_rx, np.zeros(2 << 20, np.uint8)),  # over the broker's 1 MB
        wire.encode(wire.CTL, src, to_broker, {"op": "whereis"}),  # lacks its fields
        wire.encode(wire.CTL, src, to_broker, {"op": "shutdown"}),  # not a controller
    ]
    got: dict = {}

    def receiver(proc):  # the clock stands at 0 until the garbage is in: both timers are set from 0
        assert proc.receive(str).body == "sent"
        proc.node.start_clock()  # (rx is the broker's one controller)
        got["rx"] = (proc.receive(str, timeout=10.0), proc.now())

    def sender(proc):
        for frames in dropped_by_rx + dropped_by_broker:
            send_raw(proc.node, frames)
        proc.send("rx/receiver", "sent")
        got["buggy"] = (proc.receive(str, timeout=5.0), proc.now())

    try:
        rx.spawn(receiver, name="rx/receiver")
        wait_for(lambda: buggy.whereis("rx/receiver"), "the receiver never registered")
        buggy.spawn(sender)
        wait_for(lambda: len(got) == 2, f"the clock froze: {got}", timeout=patience - 5)
        stats = rx.broker_stats()
        rx_dropped = dict(rx.dropped)
    finally:
        buggy.close()
        rx.close()
    assert got == {"rx": (TIMEOUT, 10.0), "buggy": (TIMEOUT, 5.0)}
    assert rx_dropped == {"malformed": 3, "unknown-destination": 1, "spoofed": 1, "oversize": 1}
    assert {k: stats["dropped"].get(k) for k in ("unknown-destination", "oversize", "malformed", "not-entitled")} \
        == {"unknown-destination": 1, "oversize": 1, "malformed": 1, "not-entitled": 1}
    assert procs.broker_proc.poll() is None


# --- whole runs: the same config and seed give the same run, bit for bit ---------------------

from .test_launch import launch  # noqa: E402

# Pathological non-IID MNIST (2 label shards per client), 20 clients, with everything that
# makes a wall-clock run vary: stragglers (lognormal), packet loss (TCP retransmits it),
# on/off drop-outs (which fail connections mid-transfer).
HARSH = ["run.clock=virtual", "network.transport=tcp", "data.partition=shards", "data.clients=20", "model.name=2nn",
         "algorithm.E=1",
         "algorithm.B=50", "network.default_profile=lossy", "network.profiles.lossy.latency_ms=35",
         "network.profiles.lossy.bandwidth='12Mbit'", "network.profiles.lossy.loss=0.05",
         "network.stragglers.distribution=lognormal", "network.stragglers.sigma=0.5",
         "network.dropout.on_off.mean_up_s=60", "network.dropout.on_off.mean_down_s=10", "algorithm.retry_s=30"]
RULES = {
    "coop": ["algorithm.name=coop", "algorithm.b_l=2", "algorithm.b_u=6", "algorithm.eval_every_uploads=5",
             "run.rounds=3"],
    "fedasync": ["algorithm.name=fedasync", "algorithm.eval_every_uploads=5", "run.rounds=3"],
    "fedbuff": ["algorithm.name=fedbuff", "algorithm.buffer_size=3", "algorithm.eval_every_uploads=5",
                "run.rounds=3"],
    "fedavg": ["algorithm.name=fedavg", "algorithm.C=0.25", "algorithm.deadline_s=6", "run.rounds=3"],
}
WALL_FIELDS = {"t", "round_s", "wall_s", "placement"}  # real time, and where clients ran
UNDER_LOAD = ("coop", "fedavg")  # also rerun beside CPU hogs


def run_log(run_dir) -> tuple[list[dict], dict]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return ([{k: v for k, v in e.items() if k not in WALL_FIELDS} for e in events],
            {k: v for k, v in summary.items() if k not in WALL_FIELDS})


@pytest.mark.mnist
@pytest.mark.slow
@pytest.mark.parametrize("rule", list(RULES))
def test_reruns_on_any_placement_and_under_load_are_identical(tmp_path, rule):
    """Runs of one config and seed: two worker nodes; one worker node; and, for one
    synchronous and one asynchronous rule (the load acts on the scheduler, not on the
    rule), two worker nodes beside two CPU hogs. Every event (but its wall-clock fields)
    and the final weights' hash are the same."""
    runs = []
    placements = [("a", 2, False), ("b", 1, False)] + ([("c", 2, True)] if rule in UNDER_LOAD else [])
    for name, workers, hogs in placements:
        with (Hogs() if hogs else contextlib.nullcontext()):
            proc = launch(tmp_path / name, *HARSH, *RULES[rule], workers=workers)
            output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        runs.append(run_log(tmp_path / name))
    (events, summary), *others = runs
    accuracies = [e["accuracy"] for e in events if e["event"] == "round"]
    assert len(accuracies) == 3 and summary["status"] == "completed"
    for other_events, other_summary in others:
        assert [e["accuracy"] for e in other_events if e["event"] == "round"] == accuracies
        assert other_summary["weights_sha256"] == summary["weights_sha256"]
        assert other_events == events
        assert other_summary == summary
    rounds = [e for e in events if e["event"] == "round"]
    assert sum(e["lost_up"] + e["lost_down"] for e in rounds) > 0  # the network did bite (drop-outs)
    assert sum(e["retransmitted_bytes_up"] + e["retransmitted_bytes_down"] for e in rounds) > 0  # and its packet loss
    assert summary["emulated_s"] > 0
