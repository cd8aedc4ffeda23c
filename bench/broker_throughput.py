"""Broker throughput against a bare pyzmq ROUTER relay, measured in the same run.

Issue requirement (b): throughput of the fedemu broker for 800 KB messages (about
the 2NN model: 199,210 float32) and for 100-byte messages, as a ratio to a bare
ROUTER relay (bench/bare_relay.py). Aim: above 70% of the bare relay.

Setup (each relay in its own OS process; only one is loaded at a time):

* fedemu: ``fedemu broker --bind tcp://127.0.0.1:0 --endpoint-file F``, spoken to in
  fedemu's wire format: hello first, then USER messages
  ``wire.encode(USER, Pid(tx, 1), Pid(rx, 1), payload)``.
* bare: bench/bare_relay.py; the same frames with the destination identity in front.

Sender and receiver are two DEALER sockets in *this* process, driven by one thread:
on 2 cores that makes two busy Python threads (relay + clients, each process with
its ZeroMQ I/O thread besides); separate sender and receiver processes would make
three Python threads compete for two cores.
A window of at most W messages is in flight (sent, not yet received), so no queue
grows without bound; a trial times the first send to the last receive.

Each trial uses fresh sockets (fresh node names for the broker), warms the
connection up with a few messages first, and the fedemu and bare trials alternate,
so slow drift in the machine hits both alike. Reported: median of the repeats.

Also reported: the relay process's CPU time per message (user+sys from /proc, all its
threads). On 2 cores the clients take a share of the CPU too, so throughput moves
less than the relay's own cost; the CPU ratio is the relay's capacity ratio.

    /work/venv/bin/python bench/broker_throughput.py [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import zmq

from fedemu.node import wire
from fedemu.node.wire import BROKER_PID
from fedemu.node.wire import CTL, USER, Pid

HERE = Path(__file__).resolve().parent
LARGE_BYTES = 800_000  # ~ the 2NN model: 199,210 float32 = 796,840 bytes
SMALL_BODY_BYTES = 100
KEEPALIVE_S = 1.0  # the broker forgets a node silent for 5 s (its default timeout)
RECV_TIMEOUT_MS = 10_000  # a lost message fails the trial instead of hanging it
_SNDMORE = int(zmq.SNDMORE)  # a plain int: OR-ing zmq's Flag enum costs microseconds


def load_average() -> float:
    """The 1-minute load average: other work on the machine skews every figure here."""
    return float(Path("/proc/loadavg").read_text().split()[0])


# --- relay processes ------------------------------------------------------------------


class Relay:
    """One relay OS process, started with an ephemeral port; ``close`` ends it."""

    def __init__(self, kind: str, workdir: Path, bind: str = "tcp://127.0.0.1:0", extra: tuple[str, ...] = (),
                 label: str | None = None):
        self.kind = kind
        self.label = label or kind
        endpoint_file = workdir / f"{self.label}.endpoint"
        if kind == "fedemu":  # extra: more `fedemu broker` options (--keys, --token-file)
            argv = [sys.executable, "-m", "fedemu.launch", "broker", "--bind", bind,
                    "--endpoint-file", str(endpoint_file), "--log-dir", str(workdir), *extra]
        else:
            argv = [sys.executable, str(HERE / "bare_relay.py"), "--bind", "tcp://127.0.0.1:0",
                    "--endpoint-file", str(endpoint_file)]
        self.log = open(workdir / f"{self.label}.out", "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not endpoint_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                output = (workdir / f"{self.label}.out").read_text(errors="replace").strip()
                raise RuntimeError(f"{self.label} relay did not start:\n{output[-2000:] or '(no output)'}")
            time.sleep(0.02)
        self.endpoint = endpoint_file.read_text().strip()

    def cpu_seconds(self) -> float:
        """User + system CPU time the relay process has used so far (all its threads)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# --- the two client sides: same traffic, each relay's own framing -------------------------


class ClientPair:
    """A sender and a receiver DEALER connected to one relay."""

    def __init__(self, ctx: zmq.Context, relay: Relay, trial: int, payload, keys=None, token: str | None = None):
        """``keys`` (a node's RunKeys) and ``token``: what a broker with --keys or
        --token-file asks of a node."""
        self.kind = relay.kind
        self.tx_name = f"bench-tx-{trial}"
        self.rx_name = f"bench-rx-{trial}"
        self.token = token
        self.tx = self._socket(ctx, self.tx_name, relay.endpoint, keys)
        self.rx = self._socket(ctx, self.rx_name, relay.endpoint, keys)
        message = wire.encode(USER, Pid(self.tx_name, 1), Pid(self.rx_name, 1), payload)
        self.header = message[0]  # what the receiver checks to tell bench traffic from keepalives
        self.message_bytes = wire.message_size(message)
        if self.kind == "fedemu":
            self.frames = message
            self.keepalive = wire.encode(CTL, Pid(self.rx_name, 0), BROKER_PID, {"op": "hb"})
            for sock, name in ((self.tx, self.tx_name), (self.rx, self.rx_name)):
                self._hello(sock, name)
        else:
            # The bare relay reads the destination from the first frame.
            self.frames = [self.rx_name.encode(), *message]
            self.keepalive = [self.rx_name.encode(), b"keepalive"]  # comes back to rx, ignored
            for sock, name in ((self.tx, self.tx_name), (self.rx, self.rx_name)):
                self._echo_to_self(sock, name)

    @staticmethod
    def _socket(ctx: zmq.Context, name: str, endpoint: str, keys=None) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, name.encode())  # the broker checks it against the header
        sock.setsockopt(zmq.SNDHWM, 0)  # as fedemu nodes: the window bounds the queues instead
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        if keys is not None:
            keys.make_client(sock)
        sock.connect(endpoint)
        return sock

    def _hello(self, sock: zmq.Socket, name: str) -> None:
        token = {"token": self.token} if self.token is not None else {}
        sock.send_multipart(wire.encode(CTL, Pid(name, 0), BROKER_PID, {"op": "hello", **token}))
        header, body = wire.decode(sock.recv_multipart())
        if header.kind != CTL or body.get("op") != "welcome":
            raise RuntimeError(f"{name}: expected a welcome from the broker, got {body!r}")

    @staticmethod
    def _echo_to_self(sock: zmq.Socket, name: str) -> None:
        # Proves the relay knows this identity before any timed traffic flows.
        sock.send_multipart([name.encode(), b"ready"])
        if sock.recv_multipart() != [b"ready"]:
            raise RuntimeError(f"{name}: the bare relay did not echo")

    def run(self, count: int, window: int, copy: bool) -> float:
        """Send ``count`` messages with at most ``window`` in flight; seconds from the
        first send to the last receive."""
        # Frame-level send/recv with int flags: half the Python cost of pyzmq's
        # send_multipart/recv_multipart (whose `SNDMORE | flags` builds an enum per
        # frame), so the clients take as little of the 2 cores as possible.
        tx_send, rx_recv = self.tx.send, self.rx.recv
        more_frames, last_frame = self.frames[:-1], self.frames[-1]
        header = self.header
        sent = received = 0
        next_keepalive = time.monotonic() + KEEPALIVE_S
        started = time.perf_counter()
        while received < count:
            while sent < count and sent - received < window:
                for frame in more_frames:
                    tx_send(frame, _SNDMORE, copy=copy)
                tx_send(last_frame, 0, copy=copy)
                sent += 1
            first = frame = rx_recv(0, copy=False)
            while frame.more:  # the rest of a multipart message is already here
                frame = rx_recv(0, copy=False)
            if first.bytes == header:
                received += 1
            now = time.monotonic()
            if now >= next_keepalive:  # keeps the receiver, which never sends, alive
                self.rx.send_multipart(self.keepalive)
                next_keepalive = now + KEEPALIVE_S
        return time.perf_counter() - started

    def broker_drops(self) -> dict:
        """The fedemu broker's drop counters by reason (cumulative since it started)."""
        self.tx.send_multipart(wire.encode(CTL, Pid(self.tx_name, 0), BROKER_PID, {"op": "stats", "ref": 1}))
        while True:
            header, body = wire.decode(self.tx.recv_multipart())
            if header.kind == CTL and body.get("op") == "reply":
                return body["value"]["dropped"]

    def close(self) -> None:
        if self.kind == "fedemu":
            for sock, name in ((self.tx, self.tx_name), (self.rx, self.rx_name)):
                sock.send_multipart(wire.encode(CTL, Pid(name, 0), BROKER_PID, {"op": "bye"}))
        for sock in (self.tx, self.rx):
            sock.close(linger=1000)


# --- measurement ------------------------------------------------------------------------------


@dataclass
class Trial:
    relay: str
    size: str
    count: int
    seconds: float
    msgs_per_s: float
    mb_per_s: float
    relay_cpu_us_per_msg: float


def trial(ctx: zmq.Context, relay: Relay, trial_no: int, size: str, count: int, window: int, keys=None,
          token: str | None = None) -> Trial:
    if size == "800KB":
        payload = np.full(LARGE_BYTES, 7, dtype=np.uint8)
        copy = False  # zero-copy for big frames, as the broker and nodes do
    else:
        payload = b"x" * (SMALL_BODY_BYTES - 2)  # msgpack bin8: 2 bytes of prefix -> 100-byte body
        copy = True  # pyzmq copies small frames faster than it tracks them
    pair = ClientPair(ctx, relay, trial_no, payload, keys, token)
    try:
        pair.run(max(count // 20, window), window, copy)  # warm-up: connection, allocator, caches
        # The broker's counters are cumulative (earlier trials' teardowns drop a
        # node_down or two): only what changes during the timed run counts.
        drops_before = pair.broker_drops() if relay.kind == "fedemu" else {}
        cpu_before = relay.cpu_seconds()
        seconds = pair.run(count, window, copy)
        cpu = relay.cpu_seconds() - cpu_before
        if relay.kind == "fedemu":
            drops = {k: v - drops_before.get(k, 0) for k, v in pair.broker_drops().items()}
            if any(drops.values()):
                raise RuntimeError(f"the broker dropped messages during the run: {drops}")
        message_bytes = pair.message_bytes
    finally:
        pair.close()
    return Trial(relay.label, size, count, seconds, count / seconds, count * message_bytes / seconds / 1e6,
                 cpu / count * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large-count", type=int, default=5000, help="800 KB messages per trial")
    parser.add_argument("--small-count", type=int, default=60_000, help="100-byte messages per trial")
    parser.add_argument("--large-window", type=int, default=8, help="800 KB messages in flight at most")
    parser.add_argument("--small-window", type=int, default=500, help="100-byte messages in flight at most")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    plan = [("800KB", args.large_count, args.large_window), ("100B", args.small_count, args.small_window)]
    trials: list[Trial] = []
    load_before = load_average()
    ctx = zmq.Context(io_threads=1)
    with tempfile.TemporaryDirectory(prefix="fedemu-bench-") as tmp:
        relays = {kind: Relay(kind, Path(tmp)) for kind in ("fedemu", "bare")}
        try:
            trial_no = 0
            for size, count, window in plan:
                for rep in range(args.repeats):
                    for kind in ("fedemu", "bare"):  # alternate: drift hits both alike
                        trial_no += 1
                        t = trial(ctx, relays[kind], trial_no, size, count, window)
                        trials.append(t)
                        print(f"  {size:>5} {kind:6} #{rep + 1}: {t.msgs_per_s:10,.0f} msgs/s "
                              f"{t.mb_per_s:8.1f} MB/s  ({t.seconds:.2f} s, relay CPU "
                              f"{t.relay_cpu_us_per_msg:.1f} us/msg)", file=sys.stderr, flush=True)
        finally:
            for relay in relays.values():
                relay.close()
    ctx.term()
    load_after = load_average()

    rows = []
    for size, count, window in plan:
        def median(kind: str, key: str) -> float:
            return statistics.median(getattr(t, key) for t in trials if t.relay == kind and t.size == size)

        rows.append({
            "size": size, "count": count, "window": window,
            "fedemu_msgs_per_s": median("fedemu", "msgs_per_s"), "bare_msgs_per_s": median("bare", "msgs_per_s"),
            "fedemu_mb_per_s": median("fedemu", "mb_per_s"), "bare_mb_per_s": median("bare", "mb_per_s"),
            "fedemu_relay_cpu_us_per_msg": median("fedemu", "relay_cpu_us_per_msg"),
            "bare_relay_cpu_us_per_msg": median("bare", "relay_cpu_us_per_msg"),
        })
        row = rows[-1]
        row["ratio"] = row["fedemu_msgs_per_s"] / row["bare_msgs_per_s"]
        # What the relay alone could do if it had the CPU to itself: bare / fedemu CPU per message.
        row["cpu_ratio"] = row["bare_relay_cpu_us_per_msg"] / row["fedemu_relay_cpu_us_per_msg"]

    cores = os.cpu_count()
    print(f"broker throughput: fedemu broker vs bare pyzmq ROUTER relay (bench/bare_relay.py); {cores} cores "
          f"({platform.processor() or platform.machine()}), pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}")
    print(f"median of {args.repeats} trials per cell; each relay in its own process; sender and receiver "
          "DEALERs together in one process, one thread")
    print("msgs/s from first send to last receive; MB/s counts every frame of a message (header, body, array)")
    print(f"1-min load average at start {load_before:.2f}, at end {load_after:.2f} "
          "(this benchmark keeps about 2 cores busy; more means other work was running)")
    print()
    header = (f"{'size':>5} | {'fedemu msgs/s':>13} | {'bare msgs/s':>11} | {'fedemu MB/s':>11} | "
              f"{'bare MB/s':>9} | {'ratio':>5} | {'relay CPU us/msg fedemu / bare':>30} | {'CPU ratio':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        cpu = f"{r['fedemu_relay_cpu_us_per_msg']:.1f} / {r['bare_relay_cpu_us_per_msg']:.1f}"
        print(f"{r['size']:>5} | {r['fedemu_msgs_per_s']:13,.0f} | {r['bare_msgs_per_s']:11,.0f} | "
              f"{r['fedemu_mb_per_s']:11.1f} | {r['bare_mb_per_s']:9.1f} | {r['ratio']:5.0%} | {cpu:>30} | "
              f"{r['cpu_ratio']:9.0%}")
    print()
    print("ratio = fedemu / bare msgs/s. CPU ratio = bare / fedemu relay CPU per message (user+sys of the relay")
    print("process, all threads): the relay's own capacity ratio; on 2 cores the clients share the CPU, so the")
    print("throughput ratio understates the broker's extra cost per message.")
    print("aim: ratio above 70%: " + ", ".join(
        f"{r['size']} {'met' if r['ratio'] > 0.70 else 'NOT met'}" for r in rows))

    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "broker_throughput", "cores": cores, "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(), "repeats": args.repeats, "load_average": [load_before, load_after],
            "results": rows,
            "trials": [asdict(t) for t in trials],
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
