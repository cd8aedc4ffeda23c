"""Authentication: a broker with run keys admits the run's nodes and refuses, logs and
counts everyone else, and survives whatever an admitted but buggy node sends. Real
broker and node processes on real sockets, as in test_runtime."""
from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from fedemu.node import TIMEOUT, Broker, Node, NodeError, Pid, wire
from fedemu.node.security import (KeyFileError, RunKeys, load_token, new_token, private_ipc_endpoint, save_private,
                                  token_matches)

from .test_runtime import echo_round_trips

# None of these tests is about liveness (test_runtime's are): the broker and the nodes
# give each other this long before declaring the other lost, so a loaded host's pause
# never turns a run's node into an unknown one mid-test (its messages would then be
# dropped as "unknown-node", not judged as what they are).
HEARTBEAT_TIMEOUT = 30.0


@pytest.fixture
def keys(tmp_path):
    keys = RunKeys.generate()
    keys.save(tmp_path / "run.keys")
    keys.for_nodes().save(tmp_path / "node.keys")
    return keys


def node(name: str, broker: str, keys: RunKeys | None) -> Node:
    return Node(name, broker, heartbeat_interval=0.1, heartbeat_timeout=HEARTBEAT_TIMEOUT, keys=keys)


# --- the key file ----------------------------------------------------------------------------


def test_run_keys_file_is_private_round_trips_and_is_checked(tmp_path, keys):
    path = tmp_path / "run.keys"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert RunKeys.load(path) == keys
    node_copy = RunKeys.load(tmp_path / "node.keys")
    assert node_copy.server_secret is None and node_copy.client_secret == keys.client_secret
    assert "server_secret" not in json.loads((tmp_path / "node.keys").read_text())
    assert keys != RunKeys.generate()  # fresh keys every run
    # Saving again replaces the file whole and keeps it private.
    other = RunKeys.generate()
    other.save(path)
    assert RunKeys.load(path) == other and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left

    with pytest.raises(KeyFileError, match=f"run key file {tmp_path / 'missing.keys'} does not exist"):
        RunKeys.load(tmp_path / "missing.keys")
    bad = tmp_path / "bad.keys"
    cases = {
        "{not json": "is not JSON",
        json.dumps({"server_public": keys.server_public}): "is not a fedemu run key file",
        json.dumps({"fedemu_run_keys": 1, **{k: getattr(keys, k) for k in ("server_public", "server_secret",
                                                                          "client_public")},
                    "client_secret": "short"}): "client_secret is missing or not a 40-character Z85 key",
        json.dumps({"fedemu_run_keys": 1, "server_public": other.server_public, "server_secret": keys.server_secret,
                    "client_public": keys.client_public, "client_secret": keys.client_secret}):
            "server_public does not match server_secret",
    }
    for text, reason in cases.items():
        bad.write_text(text)
        with pytest.raises(KeyFileError, match=reason) as err:
            RunKeys.load(bad)
        assert str(bad) in str(err.value)
    # A node's copy cannot run a broker: it has no server secret.
    with pytest.raises(ValueError, match="no server secret"):
        Broker("tcp://127.0.0.1:0", keys=node_copy)


# --- who gets in -------------------------------------------------------------------------------


def test_only_nodes_with_the_run_keys_get_in_and_refusals_are_logged_and_counted(procs, tmp_path, keys):
    broker = procs.broker(keys=tmp_path / "run.keys", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    procs.peer("peer", broker, keys=tmp_path / "node.keys", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    member = node("observer", broker, keys.for_nodes()).start()
    try:
        assert echo_round_trips(member, 50, "before") == list(range(50))
        # Traffic between the run's nodes keeps flowing while intruders knock.
        during: dict = {}
        pinger = threading.Thread(target=lambda: during.update(got=echo_round_trips(member, 2000, "during")))
        pinger.start()
        stranger = RunKeys.generate()  # another run: other server and client keys
        impostor = RunKeys(keys.server_public, None, stranger.client_public, stranger.client_secret)
        reasons = {}
        for name, their_keys in (("no-keys", None), ("other-run", stranger), ("impostor", impostor)):
            with pytest.raises(NodeError, match="refused node") as err:
                node(name, broker, their_keys).start(connect_timeout=10)
            reasons[name] = str(err.value)
        pinger.join(30)
        assert during.get("got") == list(range(2000))
        stats = member.broker_stats()
        assert echo_round_trips(member, 50, "after") == list(range(50))
    finally:
        member.close()
    assert "no run keys; the broker requires them" in reasons["no-keys"]
    assert "not the run's" in reasons["impostor"]
    # Nothing of theirs reached the broker as a message: refused at the handshake.
    assert stats["refused"] >= 3
    assert stats["dropped"] == {}
    log_text = procs.log("broker")
    assert log_text.count("refused connection from") >= 3
    # The impostor passed CURVE with the right server key and was refused by the
    # broker's key check (ZAP), which knows its address and key.
    assert f"refused connection from 127.0.0.1 (#1 from there): CURVE client key {impostor.client_public}" \
           " is not this run's" in log_text
    assert "node no-keys joined" not in log_text and "node impostor joined" not in log_text


def test_a_raw_socket_without_keys_gets_no_answer(procs, tmp_path, keys):
    broker = procs.broker(keys=tmp_path / "run.keys", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"raw")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker)
    try:
        sock.send_multipart(wire.encode(wire.CTL, Pid("raw", 0), Pid("$broker", 0), {"op": "hello"}))
        # Silence, until the broker has logged the refusal (and a while at least).
        started = time.monotonic()
        while "refused connection from" not in procs.log("broker") or time.monotonic() - started < 1.5:
            assert time.monotonic() - started < 30, "the broker never logged the refusal"
            assert not sock.poll(100), "a node without keys got an answer"
    finally:
        sock.close()


# --- an admitted node that sends garbage -----------------------------------------------------------------


def garbage(rng: random.Random, targets: list) -> list:
    """One message an authenticated but buggy node might send: random frames, broken
    headers, wrong types, bodies that are not what they claim, control requests with
    nonsense fields, and requests only the broker may send."""
    def junk(n: int = 64) -> bytes:
        return rng.randbytes(rng.randrange(n))

    def value(depth: int = 0):
        choices = [lambda: rng.randrange(-2**40, 2**40), lambda: rng.random() * 1e9, lambda: None,
                   lambda: rng.choice([True, False]), lambda: junk(), lambda: "x" * rng.randrange(40),
                   lambda: msgpack.ExtType(rng.randrange(128), junk(20))]
        if depth < 2:
            choices += [lambda: [value(depth + 1) for _ in range(rng.randrange(5))],
                        lambda: {str(value(depth + 1))[:10]: value(depth + 1) for _ in range(rng.randrange(4))}]
        return rng.choice(choices)()

    src = Pid("buggy", rng.randrange(3))
    kind = rng.randrange(9)
    if kind == 0:  # random frames
        return [junk(300) for _ in range(rng.randrange(1, 6))]
    if kind == 1:  # a header of the right length with wrong field types, and a timing field
        fields = [rng.choice([1, 1, 2, "1"]), rng.choice([0, 1, 5]), "buggy", value(), value(), value()]
        if rng.random() < 0.5:
            fields.append(rng.choice([value(), [0.1, 0.2, 3, 1], 1e300, float("nan")]))
        return [msgpack.packb(fields, default=str), junk()]
    if kind == 2:  # a user message to a real process whose body is not msgpack
        return [wire.pack_header(wire.USER, src, rng.choice(targets)), junk(), *([junk()] * rng.randrange(2))]
    if kind == 3:  # a body claiming arrays that are not there, or do not fit
        meta = msgpack.packb([rng.randrange(-1, 3), rng.choice(["<f4", "|O", "V8", "<i8", 7]),
                              [rng.randrange(-2, 50)]])
        return [wire.pack_header(wire.USER, src, rng.choice(targets)),
                msgpack.packb(msgpack.ExtType(2, meta)), *[junk(40) for _ in range(rng.randrange(3))]]
    if kind == 4:  # registered message classes with wrong fields, unknown classes
        inner = msgpack.packb([rng.choice(["Down", "Evil", "TrainRequest"]), {"ref": value(), "x": value()}],
                              default=str)
        return [wire.pack_header(wire.USER, src, rng.choice(targets)), msgpack.packb(msgpack.ExtType(3, inner))]
    if kind == 5:  # control requests to the broker with nonsense fields ("shutdown" is a valid request)
        op = rng.choice(["hello", "hb", "register", "unregister", "whereis", "stats", "round", "set_links",
                         "held_dropped", "bye", "no-such-op", 17])
        body = {"op": op, **{k: value() for k in rng.sample(["entries", "names", "name", "round", "clients",
                                                             "profile", "offline", "counts", "ref", "t"], 3)}}
        return wire.encode(wire.CTL, Pid("buggy", 0), Pid("$broker", 0), body)
    if kind == 6:  # control to a real node: ops only the broker may send, and broken monitor traffic
        op = rng.choice(["shutdown", "node_down", "unknown_node", "offline", "welcome", "reply",
                         "monitor", "demonitor", "down", "no-such-op"])
        body = {"op": op, **{k: value() for k in rng.sample(["node", "links", "at", "ref", "watcher", "target",
                                                             "down", "value"], 3)}}
        return wire.encode(wire.CTL, Pid("buggy", 0), rng.choice([Pid("peer", 0), Pid("observer", 0)]), body)
    if kind == 7:  # a header naming someone else as the source
        return wire.encode(wire.USER, Pid(rng.choice(["peer", "observer", "$broker"]), 1), rng.choice(targets), 1)
    # well-formed messages with random content: delivered, and the echo answers them
    return wire.encode(wire.USER, src, rng.choice(targets), value())


def test_broker_survives_an_authenticated_node_sending_garbage(procs, tmp_path, keys):
    broker = procs.broker(keys=tmp_path / "run.keys", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    procs.peer("peer", broker, keys=tmp_path / "node.keys", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    member = node("observer", broker, keys.for_nodes()).start()
    buggy = zmq.Context.instance().socket(zmq.DEALER)
    buggy.setsockopt(zmq.ROUTING_ID, b"buggy")
    buggy.setsockopt(zmq.LINGER, 0)
    keys.for_nodes().make_client(buggy)
    buggy.connect(broker)
    try:
        buggy.send_multipart(wire.encode(wire.CTL, Pid("buggy", 0), Pid("$broker", 0), {"op": "hello", "t": 0.0}))
        assert buggy.poll(5000), "the broker did not welcome an authenticated raw node"
        # One request only the broker may give, sent by a node: the peer must not obey.
        buggy.send_multipart(wire.encode(wire.CTL, Pid("buggy", 0), Pid("peer", 0), {"op": "shutdown"}))
        rng = random.Random(20240611)
        targets = ["peer/echo", Pid("peer", 1), Pid("peer", 99), Pid("observer", 1), "nobody", Pid("ghost", 1)]
        during: dict = {}
        pinger = threading.Thread(target=lambda: during.update(got=echo_round_trips(member, 1000, "during")))
        pinger.start()
        for i in range(3000):
            if i % 200 == 0:  # stay known to the broker: a silent node is declared lost
                buggy.send_multipart(wire.encode(wire.CTL, Pid("buggy", 0), Pid("$broker", 0),
                                                 {"op": "hello" if i % 400 else "hb", "t": 0.0}))
            buggy.send_multipart(garbage(rng, targets))
            while buggy.poll(0):  # whatever comes back (echoes, replies) is read and ignored
                buggy.recv_multipart()
        pinger.join(30)
        assert during.get("got") == list(range(1000))
        assert echo_round_trips(member, 200, "after") == list(range(200))
        stats = member.broker_stats()
    finally:
        buggy.close()
        member.close()
    assert procs.broker_proc.poll() is None, "broker died"
    assert stats["dropped"].get("malformed", 0) >= 300
    assert stats["dropped"].get("spoofed", 0) >= 100
    broker_log, peer_log = procs.log("broker"), procs.log("peer")
    # Every bad message was turned away by a check, none by an unexpected error.
    assert "error handling a message" not in broker_log and "Traceback" not in broker_log
    # Garbage that reached the peer was dropped there, and the peer lives on: ops only
    # the broker may send were refused from a node.
    assert "node peer dropped a message (malformed)" in peer_log
    assert "node peer dropped a message (spoofed): control 'shutdown'" in peer_log
    assert "I/O thread of peer failed" not in peer_log and "Traceback" not in peer_log
    assert "closing" not in peer_log


# --- on one machine: the run's token, its controllers, its private socket ---------------------------


def raw_member(broker: str, name: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, name.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker)
    return sock


def answer(sock: zmq.Socket, timeout_s: float = 10.0) -> dict:
    assert sock.poll(timeout_s * 1000), "no answer from the broker"
    return wire.decode(sock.recv_multipart())[1]


def _forged(token: str) -> str:
    """The token with its last character changed, whatever that character was (a fixed
    "x" matched one token in 64)."""
    return token[:-1] + ("y" if token.endswith("x") else "x")


def test_the_token_file_is_private_and_checked(tmp_path):
    token = new_token()
    path = save_private(tmp_path / "run.token", token + "\n")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and load_token(path) == token
    assert new_token() != token and len(token) >= 32
    forged = _forged(token)
    assert token_matches(token, token) and not token_matches(token, forged)
    assert not token_matches(token, None) and not token_matches(token, 17)
    with pytest.raises(KeyFileError, match=f"run token file {tmp_path / 'none'} does not exist"):
        load_token(tmp_path / "none")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(KeyFileError, match="holds no run token"):
        load_token(tmp_path / "empty")


def test_a_hello_without_the_run_token_is_refused_and_never_holds_the_virtual_clock(procs, tmp_path):
    """A process without the token (a stray script, another run's node) is told it is
    refused, counted and logged, and is in none of virtual time's books: the run's clock
    moves on at once, where a stranger that joined would hold it until its heartbeat
    timeout (30 s here)."""
    from .test_virtual_time import virtual_broker

    token = new_token()
    token_file = save_private(tmp_path / "run.token", token)
    broker = virtual_broker(procs, {}, 4, 1, "--token-file", str(token_file), heartbeat_timeout=HEARTBEAT_TIMEOUT)
    stranger = raw_member(broker, "stranger")
    try:
        stranger.send_multipart(wire.encode(wire.CTL, Pid("stranger", 0), Pid("$broker", 0), {"op": "hello"}))
        assert answer(stranger) == {"op": "refused", "reason": "no token: not a node of this run"}
        stranger.send_multipart(wire.encode(wire.CTL, Pid("stranger", 0), Pid("$broker", 0),
                                            {"op": "hello", "token": _forged(token)}))
        assert answer(stranger) == {"op": "refused", "reason": "a wrong token: not a node of this run"}
        stranger.send_multipart(wire.encode(wire.CTL, Pid("stranger", 0), Pid("$broker", 0), {"op": "shutdown"}))
        assert answer(stranger) == {"op": "unknown_node"}  # not in the run: nothing it says counts
        for name, their_token in (("tokenless", None), ("impostor", new_token())):
            with pytest.raises(NodeError, match=f"refused node {name}: its hello was refused"):
                Node(name, broker, heartbeat_timeout=HEARTBEAT_TIMEOUT, token=their_token).start(connect_timeout=10)
        member = Node("member", broker, heartbeat_interval=0.1, heartbeat_timeout=HEARTBEAT_TIMEOUT,
                      token=token).start()
        waited: list = []
        started = time.monotonic()

        def timer(proc):
            proc.node.start_clock()
            waited.append((proc.receive(str, timeout=60.0), proc.now(), time.monotonic() - started))

        try:
            member.spawn(timer)
            deadline = time.monotonic() + HEARTBEAT_TIMEOUT - 5
            while not waited:
                assert time.monotonic() < deadline, "the clock waited for a process that is not in the run"
                time.sleep(0.05)
            stats = member.broker_stats()
        finally:
            member.close()
    finally:
        stranger.close()
    assert waited[0][:2] == (TIMEOUT, 60.0)
    assert stats["refused"] == 4 and stats["dropped"].get("unknown-node") == 1
    log_text = (procs.tmp / "logs" / "broker.log").read_text()  # the broker's whole log (INFO and up)
    assert "refused hello from <stranger.0> (#1 refused): no token, not this run's" in log_text
    assert "node member joined" in log_text
    assert not any(f"node {name} joined" in log_text for name in ("stranger", "tokenless", "impostor"))


def test_only_the_run_controllers_may_stop_it_or_steer_its_network(procs):
    """Shutdown, round announcements, link changes and the clock's start are taken only
    from the nodes the broker was told to take them from (a run's server and launcher):
    from a worker node they are dropped, counted and logged, and the run goes on."""
    broker = procs.broker("--controller", "server", heartbeat_timeout=HEARTBEAT_TIMEOUT)
    worker = node("worker-0", broker, None).start()
    try:
        worker.shutdown_all()
        worker.announce_round(3)
        worker._send_ctl(Pid("$broker", 0), {"op": "set_links", "ref": 1, "clients": [0], "offline": True})
        worker._send_ctl(Pid("$broker", 0), {"op": "clock_start"})
        stats = worker.broker_stats()  # answered after everything above: one socket, in order
        assert stats["dropped"] == {"not-entitled": 4}
        assert procs.broker_proc.poll() is None and not worker.closed.is_set()
        server = node("server", broker, None).start()
        server.shutdown_all()
        assert procs.broker_proc.wait(10) == 0  # the server's shutdown is honoured
        assert worker.wait(10) and server.wait(10)
    finally:
        worker.close()
    log_text = (procs.tmp / "logs" / "broker.log").read_text()
    assert "control 'shutdown' is for the run's controllers only" in log_text
    assert "shutdown requested by <server.0>" in log_text and "shutdown requested by <worker-0" not in log_text


def test_a_local_runs_socket_lies_in_a_directory_only_its_user_can_enter(tmp_path):
    inside, endpoint = private_ipc_endpoint(tmp_path)
    assert inside.parent == tmp_path and endpoint == f"ipc://{inside}/broker"
    assert stat.S_IMODE(os.stat(inside).st_mode) == 0o700
    # A parent too deep for a unix socket's 107-byte path: the socket goes to /tmp instead.
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    far, far_endpoint = private_ipc_endpoint(deep)
    far.rmdir()
    assert far.parent == Path("/tmp") and len(far_endpoint) - len("ipc://") <= 107
    folder, endpoint = private_ipc_endpoint()  # where a run's goes: under /tmp, which anyone may enter
    umask = os.umask(0)  # the worst case: a socket file anyone may write to
    try:
        broker = Broker(endpoint)
    finally:
        os.umask(umask)
    try:
        assert broker.endpoint == endpoint
        if os.geteuid() == 0:  # another user cannot even connect: the directory keeps them out
            assert connect_as_nobody(endpoint) == "PermissionError"
            os.chmod(folder, 0o755)  # the control: a directory others may enter lets them in
            assert connect_as_nobody(endpoint) == "connected"
    finally:
        broker._sock.close(linger=0)
        broker._ctx.term()
        shutil.rmtree(folder)


def connect_as_nobody(endpoint: str) -> str:
    """What a unix-socket connect to ``endpoint`` gives a process running as ``nobody``:
    the exception's name, or "connected" (needs root, to change user)."""
    script = ("import os, pwd, socket, sys\n"
              "os.setgid(pwd.getpwnam('nobody').pw_gid); os.setuid(pwd.getpwnam('nobody').pw_uid)\n"
              "s = socket.socket(socket.AF_UNIX)\n"
              "try:\n    s.connect(sys.argv[1]); print('connected')\n"
              "except OSError as exc:\n    print(type(exc).__name__)\n")
    out = subprocess.run([sys.executable, "-c", script, endpoint[len("ipc://"):]], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()
