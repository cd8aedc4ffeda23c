"""The runtime on real processes and sockets: a broker process, peer node processes,
and a node inside the test process observing them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from fedemu.node import TIMEOUT, Behaviour, Down, Node, NodeError, Pid, wire
from fedemu.node.wire import BROKER_PID
from fedemu.node.runtime.runtime import BUSY_BROKER_FACTOR


# Tests about losing a node or the broker take this much silence (ten heartbeats) as a
# loss, so that they end soon: the broker, in tests marked `heartbeats` (a killed node);
# a node, in the test of a stopped broker.
LOSS_TIMEOUT = 1.0
# Every other test asks no liveness question: a node or broker is lost only after this
# much silence, far beyond any pause a loaded host gives an I/O thread.
PATIENCE = 30.0


@pytest.fixture
def broker(procs, request):
    quick = request.node.get_closest_marker("heartbeats") is not None
    return procs.broker(heartbeat_timeout=LOSS_TIMEOUT if quick else PATIENCE)


@pytest.fixture
def node(broker):
    n = Node("observer", broker, heartbeat_interval=0.1, heartbeat_timeout=PATIENCE).start()
    yield n
    n.close()


def start_peer(procs, broker: str) -> subprocess.Popen:
    """The peer node (tests/peer_node.py), patient with the broker: no test here is about
    the peer losing it (those that lose the peer kill it)."""
    return procs.peer("peer", broker, heartbeat_timeout=PATIENCE)


def run_in_process(node: Node, fn, timeout: float = 30.0):
    """Run fn(proc) as a process of ``node`` and return what it returns (or raise)."""
    box: dict = {}
    done = threading.Event()

    def body(proc):
        try:
            box["value"] = fn(proc)
        except BaseException as exc:  # surfaced to the test below
            box["error"] = exc
        finally:
            done.set()

    node.spawn(body)
    assert done.wait(timeout), "process did not finish"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def whereis(proc, name: str, timeout: float = 5.0) -> Pid:
    deadline = time.monotonic() + timeout
    while (pid := proc.whereis(name)) is None:
        assert time.monotonic() < deadline, f"{name} never registered"
        time.sleep(0.05)
    return pid


# --- delivery --------------------------------------------------------------------------


def echo_round_trips(n: Node, count: int, tag: str, timeout: float = 10.0) -> list:
    """``count`` messages to the peer's echo process; the echoes' sequence numbers, in
    the order they came back (fewer if some never did)."""
    def body(proc):
        echo = whereis(proc, "peer/echo")
        for i in range(count):
            # A plain map: the peer process does not import this test's classes.
            proc.send(echo, {"tag": tag, "seq": i})
        got = []
        while len(got) < count:
            msg = proc.receive(lambda m: isinstance(m, dict) and m.get("tag") == tag, timeout=timeout)
            if msg is TIMEOUT:
                break
            got.append(msg.body["seq"])
        return got
    return run_in_process(n, body)


def test_fifo_per_pair_across_nodes(procs, broker, node):
    start_peer(procs, broker)
    count = 2000
    results = {}
    threads = [threading.Thread(target=lambda t=t: results.update({t: echo_round_trips(node, count, t, timeout=20)}))
               for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Two senders interleave at the peer, yet each pair's order is kept.
    assert results["a"] == list(range(count))
    assert results["b"] == list(range(count))


def test_ndarrays_cross_nodes_intact(procs, broker, node):
    start_peer(procs, broker)
    weights = np.random.default_rng(0).standard_normal(199_210).astype(np.float32)

    def body(proc):
        proc.send(whereis(proc, "peer/echo"), {"w": weights, "shape": np.zeros((3, 4), np.int64)})
        return proc.receive(dict, timeout=10)

    reply = run_in_process(node, body)
    assert np.array_equal(reply.body["w"], weights)
    assert reply.body["shape"].shape == (3, 4) and reply.body["shape"].dtype == np.int64


def test_selective_receive_leaves_other_messages_queued(node):
    def body(proc):
        proc.send(proc.pid, "first")
        proc.send(proc.pid, 42)
        proc.send(proc.pid, "second")
        picked = proc.receive(int, timeout=1)
        rest = [proc.receive(timeout=1).body for _ in range(2)]
        return picked.body, rest

    picked, rest = run_in_process(node, body)
    assert picked == 42
    assert rest == ["first", "second"]  # skipped messages keep their order


def test_send_after_fires_in_due_order_on_one_thread_and_can_be_cancelled(node):
    def body(proc):
        threads_before = threading.active_count()
        refs = [proc.send_after(0.3 + 0.001 * (1000 - i), proc.pid, i) for i in range(1000)]
        pending = threading.active_count() - threads_before  # one timer thread, not 1000
        for ref in refs[::2]:
            ref.cancel()
        got = [proc.receive(timeout=5).body for _ in range(500)]
        return pending, [ref.due for ref in refs], got, proc.receive(timeout=0.3)

    pending, dues, got, extra = run_in_process(node, body)
    assert pending <= 1
    assert sorted(got) == list(range(1, 1000, 2))  # the uncancelled ones, each once
    assert got == sorted(got, key=lambda i: dues[i])  # soonest due first
    assert extra is TIMEOUT  # nothing cancelled was sent


def test_a_timer_reference_keeps_nothing_of_what_it_sent_or_would_have(node):
    """A client keeps its last reply's timer: were the reference to keep the reply, a
    node whose 50,000 clients each trained once would keep 50,000 models."""
    model = np.zeros(1000, np.float32)

    def body(proc):
        sent = proc.send_after(0.05, proc.pid, {"model": model})
        dropped = proc.send_after(5.0, proc.pid, {"model": model})
        dropped.cancel()
        return sent, dropped, proc.receive(timeout=5)

    sent, dropped, got = run_in_process(node, body)
    assert got.body["model"].shape == (1000,)
    assert sent.args == () and dropped.args == ()
    assert sys.getrefcount(model) == 2  # this frame's name and getrefcount's argument: nothing else


def test_receive_predicate_and_timeout(node):
    def body(proc):
        proc.send(proc.pid, {"round": 1})
        started = time.monotonic()
        missed = proc.receive(lambda m: isinstance(m, dict) and m.get("round") == 2, timeout=0.3)
        waited = time.monotonic() - started
        hit = proc.receive(lambda m: isinstance(m, dict) and m.get("round") == 1, timeout=0.3)
        return missed, waited, hit

    missed, waited, hit = run_in_process(node, body)
    assert missed is TIMEOUT and not missed
    assert waited >= 0.3
    assert hit.body == {"round": 1}


def test_late_message_wakes_a_waiting_receive(node):
    def body(proc):
        threading.Timer(0.2, lambda: node.send(proc.pid, "late")).start()
        return proc.receive(str, timeout=5)

    assert run_in_process(node, body).body == "late"


# --- monitors ----------------------------------------------------------------------------


def _down_of(node: Node, target_name: str, trigger, timeout: float = 10.0):
    def body(proc):
        target = whereis(proc, target_name)
        ref = proc.monitor(target)
        trigger(proc, target)
        started = time.monotonic()
        msg = proc.receive(Down, timeout=timeout)
        waited = time.monotonic() - started
        assert msg is not TIMEOUT, "no DOWN arrived"
        assert msg.body.ref == ref and msg.body.pid == target
        extra = proc.receive(Down, timeout=2 * LOSS_TIMEOUT)  # a second DOWN, of a loss or an exit, would come by then
        return msg.body, waited, extra

    return run_in_process(node, body, timeout=timeout + 10)


def test_down_on_normal_exit(procs, broker, node):
    start_peer(procs, broker)
    down, _, extra = _down_of(node, "peer/echo", lambda proc, t: proc.send(t, "exit"))
    assert down.reason == "normal"
    assert extra is TIMEOUT  # exactly one DOWN per monitor


def test_down_comes_after_every_message_its_process_sent(procs, broker, node):
    # Erlang's guarantee, across nodes: the node's I/O thread hands a burst over in
    # groups, and a DOWN (a control message) must not overtake the group before it.
    start_peer(procs, broker)
    count = 500

    def body(proc):
        echo = whereis(proc, "peer/echo")
        proc.monitor(echo)
        for i in range(count):
            proc.send(echo, {"seq": i})
        proc.send(echo, "exit")
        arrived = []
        while not arrived or not isinstance(arrived[-1], Down):
            msg = proc.receive(timeout=10)  # whatever comes first
            assert msg is not TIMEOUT, f"stuck after {len(arrived)} messages"
            arrived.append(msg.body)
        return arrived

    arrived = run_in_process(node, body)
    assert [m["seq"] for m in arrived[:-1]] == list(range(count))
    assert arrived[-1].reason == "normal"


def test_messages_decoded_before_a_node_is_lost_come_before_its_downs():
    # The I/O thread's side, frames fed by hand to a node never started: what it has
    # decoded but not yet handed over (a group in progress) is delivered before the
    # DOWNs that a control message delivers at once.
    node = Node("unit", "tcp://127.0.0.1:9")
    release = threading.Event()
    try:
        pid = node.spawn(lambda proc: release.wait(10))
        proc = node._procs[pid.id]
        remote = Pid("peer", 5)
        proc.monitor(remote)
        for i in range(3):
            node._on_frames(wire.encode(wire.USER, remote, pid, {"seq": i}))
        node._on_frames(wire.encode(wire.CTL, BROKER_PID, Pid("unit", 0), {"op": "node_down", "node": "peer"}))
        node._hand_over()
        bodies = [msg.body for msg in proc._mailbox]
        assert bodies[:3] == [{"seq": i} for i in range(3)]
        assert len(bodies) == 4 and isinstance(bodies[3], Down) and bodies[3].reason == "noconnection"
    finally:
        release.set()
        node.close()


def test_down_on_crash_carries_the_error(procs, broker, node):
    start_peer(procs, broker)
    down, _, extra = _down_of(node, "peer/echo", lambda proc, t: proc.send(t, "crash"))
    assert down.reason.startswith("crash: RuntimeError")
    assert "asked to crash" in down.reason
    assert extra is TIMEOUT


class _Crashes(Behaviour):
    def handle(self, proc, msg):
        raise RuntimeError("out of memory in the task")


@pytest.mark.heartbeats
def test_a_node_that_cannot_send_a_down_fails_stop_and_its_watchers_see_it_lost(broker, node):
    """Issue 41: a worker node out of memory could not encode a crashed client's DOWN; the
    client stayed counted busy and virtual time never moved again. Now the node fails
    stop (an embedded one closes; a run's node ends its process, exit code 70), so its
    watchers see every process of it lost instead of waiting for ever."""
    failing = Node("failing", broker, heartbeat_interval=0.1, heartbeat_timeout=LOSS_TIMEOUT).start()
    try:
        def no_memory(watcher, down):  # as msgpack's Packer said under `prlimit --as`
            raise MemoryError("Unable to allocate internal buffer.")

        failing._send_down = no_memory
        target = failing.spawn_behaviour(_Crashes(), name="failing/client")

        def watch(proc):
            proc.monitor(whereis(proc, "failing/client"))
            proc.send(target, "train")
            return proc.receive(Down, timeout=LOSS_TIMEOUT + 10.0)

        down = run_in_process(node, watch, timeout=LOSS_TIMEOUT + 15.0)
        assert down is not TIMEOUT and down.body.reason == "noconnection"
        assert failing.closed.wait(5)
        assert failing.failure == f"running {target}: MemoryError: Unable to allocate internal buffer."
    finally:
        failing.close()


@pytest.mark.heartbeats
def test_down_noconnection_when_a_node_is_killed(procs, broker, node):
    peer = start_peer(procs, broker)
    down, waited, extra = _down_of(node, "peer/echo", lambda proc, t: peer.send_signal(signal.SIGKILL))
    assert down.reason == "noconnection"
    # Declared lost after the heartbeat timeout, and not much later (1.05 s beside two
    # CPU hogs; until this test timed the DOWN alone, it counted 2 s more, of the wait for
    # a second DOWN).
    assert waited < LOSS_TIMEOUT + 3.0
    assert extra is TIMEOUT


@pytest.mark.heartbeats
def test_down_for_every_process_of_a_killed_node(procs, broker, node):
    peer = start_peer(procs, broker)

    def body(proc):
        echo = whereis(proc, "peer/echo")
        proc.send(echo, "spawn-idle")
        idle = proc.receive(Pid, timeout=5).body
        refs = {proc.monitor(echo), proc.monitor(idle)}
        peer.send_signal(signal.SIGKILL)
        downs = [proc.receive(Down, timeout=10) for _ in range(2)]
        return refs, downs

    refs, downs = run_in_process(node, body)
    assert {d.body.ref for d in downs} == refs
    assert all(d.body.reason == "noconnection" for d in downs)


@pytest.mark.heartbeats
def test_monitor_many_gives_each_target_its_own_ref_and_exactly_one_down(procs, broker, node):
    peer = start_peer(procs, broker)

    def body(proc):
        echo = whereis(proc, "peer/echo")
        idle = []
        for _ in range(3):
            proc.send(echo, "spawn-idle")
            idle.append(proc.receive(Pid, timeout=5).body)
        targets = [*idle, Pid("peer", 99_999), Pid(node.name, 99_999)]
        refs = proc.monitor_many(targets)
        dead = [proc.receive(Down, timeout=5).body for _ in range(2)]
        peer.send_signal(signal.SIGKILL)
        lost = [proc.receive(Down, timeout=10).body for _ in range(3)]
        return targets, refs, dead, lost, proc.receive(Down, timeout=1)

    targets, refs, dead, lost, extra = run_in_process(node, body)
    assert len(set(refs)) == len(targets)
    target_of = dict(zip(refs, targets))
    assert all(target_of[d.ref] == d.pid for d in dead + lost)
    assert {(d.pid, d.reason) for d in dead} == {(targets[3], "noproc"), (targets[4], "noproc")}
    assert {(d.pid, d.reason) for d in lost} == {(t, "noconnection") for t in targets[:3]}
    assert extra is TIMEOUT


def test_monitor_of_a_dead_pid_is_noproc(procs, broker, node):
    start_peer(procs, broker)

    def body(proc):
        local_dead = Pid(node.name, 99_999)
        remote_dead = Pid("peer", 99_999)
        refs = [proc.monitor(local_dead), proc.monitor(remote_dead)]
        return refs, [proc.receive(Down, timeout=5).body for _ in refs]

    refs, downs = run_in_process(node, body)
    assert sorted(d.ref for d in downs) == sorted(refs)
    assert {d.reason for d in downs} == {"noproc"}


def test_monitor_of_an_unknown_node_is_noconnection(node):
    def body(proc):
        ref = proc.monitor(Pid("no-such-node", 1))
        return ref, proc.receive(Down, timeout=5)

    ref, msg = run_in_process(node, body)
    assert msg is not TIMEOUT
    assert msg.body.ref == ref and msg.body.reason == "noconnection"


def test_heartbeats_flow_while_a_process_hogs_the_cpu(procs):
    """A long computation in a process must not make its node look dead, to the broker
    or to itself: the hog holds the GIL for twice the heartbeat timeout (both ways),
    and neither the busy node's process watching the peer nor another node watching
    the busy node's process hears a DOWN."""
    timeout = 3.0  # thirty heartbeats: generous beside CPU hogs, yet half the hog's time
    broker = procs.broker(heartbeat_timeout=timeout)
    start_peer(procs, broker)
    busy = Node("busy", broker, heartbeat_interval=0.1, heartbeat_timeout=timeout).start()
    other = Node("other", broker, heartbeat_interval=0.1, heartbeat_timeout=PATIENCE).start()
    try:
        def hog(proc):
            deadline = time.monotonic() + 2 * timeout
            x = 0
            while time.monotonic() < deadline:  # pure-Python work that holds the GIL
                x += sum(range(1000))
            proc.receive(timeout=60)  # then stays, watched

        busy.spawn(hog, name="busy/hog")
        seen_from_outside: list = []

        def watch_the_busy_node(proc):
            proc.monitor(whereis(proc, "busy/hog"))
            return proc.receive(Down, timeout=2 * timeout)

        outside = threading.Thread(target=lambda: seen_from_outside.append(run_in_process(other, watch_the_busy_node)))
        outside.start()

        def watch_the_peer(proc):
            proc.monitor(whereis(proc, "peer/echo"))
            return proc.receive(Down, timeout=2 * timeout)

        assert run_in_process(busy, watch_the_peer) is TIMEOUT  # the busy node kept the broker
        outside.join(60)
        assert seen_from_outside == [TIMEOUT]  # and the broker kept the busy node
        assert not busy.closed.is_set()
    finally:
        busy.close()
        other.close()


def test_messages_sent_just_before_close_still_go_out(broker, node):
    """close() right after send() (a short-lived tool node) must not lose the send."""
    got: list = []
    # Keeps receiving until the node closes: a loaded host may take seconds per sender.
    receiver = node.spawn(lambda proc: got.extend(
        msg.body for msg in iter(lambda: proc.receive(timeout=60), TIMEOUT)))
    for i in range(20):
        sender = Node(f"brief-{i}", broker, heartbeat_interval=0.1, heartbeat_timeout=PATIENCE).start()
        sender.send(receiver, i)
        sender.close("done")
    deadline = time.monotonic() + 30
    while len(got) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(got) == list(range(20))


def test_pool_nice_lowers_the_priority_of_behaviours_only(broker):
    """Clients train in behaviour processes: with pool_nice they yield the CPU to the
    node's I/O thread, which sends, receives and releases held messages."""
    n = Node("niced", broker, heartbeat_interval=0.1, heartbeat_timeout=PATIENCE, pool_nice=5).start()
    seen: list = []
    done = threading.Event()

    class Report(Behaviour):
        def handle(self, proc, msg):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            done.set()

    try:
        n.send(n.spawn_behaviour(Report()), "which priority?")
        assert done.wait(5)
        io_nice = os.getpriority(os.PRIO_PROCESS, n._io_thread.native_id)
    finally:
        n.close()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert io_nice == base
    assert seen == [min(base + 5, 19)]


# --- bad input ---------------------------------------------------------------------------


def _raw_socket(endpoint: str, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_the_broker_beats_to_every_node_unasked(procs):
    # A node's own heartbeat can wait behind gigabytes of its uploads in the same stream
    # (and the broker's answer with it): the broker's beats say it is alive meanwhile.
    broker = procs.broker(heartbeat_timeout=60.0)
    quiet = _raw_socket(broker, b"quiet")
    quiet.send_multipart(wire.encode(wire.CTL, Pid("quiet", 0), Pid("$broker", 0), {"op": "hello"}))
    beats, deadline = 0, time.monotonic() + 20
    while beats < 3:  # the raw node never sends a heartbeat of its own
        assert quiet.poll(max(deadline - time.monotonic(), 0) * 1000), f"{beats} beats in 20 s"
        _, body = wire.decode(quiet.recv_multipart(copy=False), wire.DEFAULT_MAX_MESSAGE_BYTES)
        beats += body.get("op") == "hb" and "t" not in body


def test_a_request_to_a_stopped_broker_fails_when_the_broker_is_lost_naming_it(procs, broker):
    n = Node("asker", broker, heartbeat_interval=0.1, heartbeat_timeout=LOSS_TIMEOUT).start()
    procs.broker_proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(NodeError, match="broker did not answer 'stats': lost the broker: broker silent"):
            n.broker_stats(timeout=0.5)
        # Not the full patience for a busy broker (12 x 0.5 s): a silent one is lost sooner.
        assert time.monotonic() - started < 0.5 * BUSY_BROKER_FACTOR
    finally:
        procs.broker_proc.send_signal(signal.SIGCONT)
        n.close()


def test_broker_drops_malformed_and_oversize_frames_and_keeps_serving(procs, tmp_path):
    # Not a liveness test: the raw node never sends a heartbeat, and must stay known for
    # its garbage to be judged as what it is (not as a lost node's), however slow the host.
    patience = 60.0
    broker = procs.broker("--max-message-bytes", "100000", heartbeat_timeout=patience)
    procs.peer("peer", broker, heartbeat_timeout=patience)
    n = Node("observer", broker, heartbeat_interval=0.1, heartbeat_timeout=patience).start()
    try:
        # The peer registers its echo process after it starts: only then is a message to
        # peer/echo the peer's to judge, not an unknown destination.
        run_in_process(n, lambda proc: whereis(proc, "peer/echo", timeout=patience), timeout=patience)
        evil = _raw_socket(broker, b"evil")
        hello = wire.encode(wire.CTL, Pid("evil", 0), Pid("$broker", 0), {"op": "hello"})
        evil.send_multipart(hello)
        assert evil.poll(5000), "broker did not welcome the raw node"
        evil.recv_multipart()
        garbage = [
            [b""],  # no body
            [b"\xc1\xff\x00", b"x"],  # not msgpack
            [msgpack.packb([1, 0, "evil", 0]), b""],  # short header
            [msgpack.packb([99, 0, "evil", 0, "peer", 1]), msgpack.packb(None)],  # wrong version
            [msgpack.packb([1, 0, "mallory", 0, "peer", 1]), msgpack.packb(None)],  # spoofed source
            wire.encode(wire.USER, Pid("evil", 1), "nobody/here", "hi"),  # unknown name
            wire.encode(wire.USER, Pid("evil", 1), Pid("ghost-node", 1), "hi"),  # unknown node
            wire.encode(wire.USER, Pid("evil", 1), "peer/echo", np.zeros(200_000, np.uint8)),  # oversize
            [msgpack.packb([1, 1, "evil", 0, "$broker", 0]), b"\x93\x01"],  # truncated control body
        ]
        for frames in garbage:
            evil.send_multipart(frames)
        # A body the broker does not read but the peer must reject: array frame missing.
        evil.send_multipart([wire.pack_header(wire.USER, Pid("evil", 1), "peer/echo"),
                             msgpack.packb(msgpack.ExtType(2, msgpack.packb([0, "<f4", [10]])))])
        # A barrier: the broker handles one connection's messages in order, so once it has
        # answered this request it has judged everything above, and forwarded the last one
        # to the peer ahead of anything the observer below will send there.
        evil.send_multipart(wire.encode(wire.CTL, Pid("evil", 0), Pid("$broker", 0), {"op": "stats", "ref": 1}))
        deadline = time.monotonic() + 30
        while True:
            assert evil.poll(max(deadline - time.monotonic(), 0) * 1000), "the broker did not answer the raw node"
            _, body = wire.decode(evil.recv_multipart(copy=False), wire.DEFAULT_MAX_MESSAGE_BYTES)
            if body.get("op") == "reply" and body.get("ref") == 1:
                break

        def body(proc):
            proc.send(whereis(proc, "peer/echo"), "still there?")
            return proc.receive(str, timeout=patience)

        assert run_in_process(n, body).body == "still there?"
        stats = n.broker_stats()
    finally:
        n.close()
    evil.close()
    assert procs.broker_proc.poll() is None, "broker died"
    dropped = stats["dropped"]
    assert dropped.get("malformed", 0) >= 5
    assert dropped.get("spoofed") == 1
    assert dropped.get("oversize") == 1
    assert dropped.get("unknown-destination") == 2
    broker_log = procs.log("broker")
    assert "oversize" in broker_log and "no process registered as 'nobody/here'" in broker_log
    # The body the broker forwarded unread was rejected, with its reason, by the peer.
    assert "node peer dropped a message (malformed): array reference 0 is invalid" in procs.log("peer")


def test_node_start_names_an_unreachable_broker():
    with pytest.raises(NodeError, match="no broker answered at tcp://127.0.0.1:9"):
        Node("lonely", "tcp://127.0.0.1:9").start(connect_timeout=1.0)
