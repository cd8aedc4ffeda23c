"""Link-emulation fidelity: measured delivery time through a real broker against the model.

Issue 3 (acceptance): on loopback, for a grid of latency (0, 10, 100 ms), bandwidth
(1 MB/s, 10 MB/s, unlimited), message size (1 KB, 800 KB, 6.6 MB) and concurrency
(1 and 100 simultaneous transfers), the measured delivery time against the model's,
as median and p99 error. Target: p99 error under 2 ms + 2% of the model time, also
while worker nodes train at full CPU (``--load``).

Processes (each a separate OS process, as in a real run):

* the broker: ``python -m fedemu.launch broker --network NET.json``, one per
  (latency, bandwidth), that profile being the network's ``default_profile``;
* a sender node (this script, ``--role sender``): 100 behaviour processes registered
  ``client/k`` with link k, so every message travels *up* client k's own link and the
  links share nothing. Behaviours on the node's one pool thread are how fedemu's
  worker nodes host clients (100 thread processes would add a 100-thread GIL convoy
  in the sender that a real run does not have). It sends on orders from this process
  (stdin, one JSON line per burst), so its CPU work never runs in the measuring one;
* the receiver node, in this process: one thread process registered ``bench/rx``
  (no link) that stamps ``time.monotonic()`` as ``receive`` returns each message,
  i.e. when a fedemu process (the server) actually gets it.
* with ``--load``: 2 trainer processes (``--role trainer``), each what a default
  worker node does on 2 cores: 1 torch thread running ``client_update`` (MNIST 2NN,
  E=1, B=10, lr 0.1) on one IID shard after another, without pause.

One message: ``{"seq", "link", "t_send", "data": float32 array}``. ``t_send`` is the
sender's ``time.monotonic()`` right before ``send``; CLOCK_MONOTONIC is one clock for
the whole machine on Linux, so receiver minus sender time is the delivery time.
Sizes are the arrays' bytes: 1,000 B (1 KB), 796,840 B (the 2NN model, 800 KB) and
6,653,480 B (the CNN, 6.6 MB). The model's time for an isolated message is
``(S_wire + overhead_bytes) / bandwidth + latency`` (no jitter in this grid), S_wire
being every frame of the message (header, body, array), computed by encoding it with
``fedemu.node.wire.encode`` exactly as the sender did. Error = measured - model.

* concurrency 1: client/0 sends one message, waits until it arrived, then the next:
  there is never a queue on the link, so each message is isolated;
* concurrency 100: client/0..99 each send one message at the same moment, each on
  its own link: the model's time is again that of an isolated message.

With latency 0 and unlimited bandwidth the model says 0 s (the broker then skips the
model altogether): that row measures fedemu's relay and pickup cost. Each condition
also measures the *floor* under it: isolated 1 KB and 800 KB messages through
``bench/bare_relay.py`` (a minimal pyzmq ROUTER relay) between two processes, with one
thread hand-off on each side and nothing of fedemu's. No relay through these
processes on this machine delivers faster; a p99 target below the floor's p99 is out
of any such relay's reach.

How fedemu delivers on time: the sender stamps its send time (in the broker's clock)
in the header; the broker starts the model's clock there, decides the verdict and
forwards the message at once with the time it is due; the receiving node's I/O
thread holds it until then. So the relay (two loopback hops) overlaps the modelled
delay instead of adding to it, and is only visible where it takes longer.

``--diagnose`` stamps every message at each hand-over (sender process -> its node's
I/O thread -> broker loop -> broker sends -> receiving node's I/O thread -> receiving
process), with stamping sockets and an instrumented copy of the broker (fedemu's
Broker with three hooks, in its own process), and splits each error into three
parts that add up to it: ``clock`` (where the model's clock started, minus the
sender's stamp: the clock-offset estimate), ``late`` (how far past its due time
the message reached the receiving node: relay time the model's delay did not
cover) and ``release`` (from due, or arrival if later, to the receiving process:
the hold timer and the thread hand-over). The relay's hops are shown too.
``--transport ipc`` puts the broker on a Unix socket instead of TCP.

    /work/venv/bin/python bench/link_fidelity.py [--quick] [--load] [--diagnose] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgpack
import numpy as np
import zmq

from fedemu.launch import config as configuration
from fedemu.node import TIMEOUT, Behaviour, Broker, Node
from fedemu.node.net.network_spec import NetworkSpec
from fedemu.node.wire import USER, encode, link_size

RX_NAME = "bench/rx"
NUM_LINKS = 100
OVERHEAD_BYTES = 0  # link overhead per message; in the model's formula, so any value is fair

LATENCIES_MS = (0, 10, 100)
BANDWIDTHS = (1e6, 1e7, math.inf)  # bytes/s: 1 MB/s, 10 MB/s, unlimited
SIZES = {"1KB": 250, "800KB": 199_210, "6.6MB": 1_663_370}  # float32 elements
CONCURRENCIES = (1, NUM_LINKS)

QUICK_LATENCIES_MS = (0, 100)
QUICK_BANDWIDTHS = (1e7, math.inf)
QUICK_SIZES = ("1KB", "800KB")

TARGET_FIXED_MS = 2.0
TARGET_RELATIVE = 0.02

MAX_SAMPLES_SERIAL = 200  # concurrency 1: enough for a p99 where it is cheap
MIN_SAMPLES_SERIAL = 5  # 6.6 MB at 1 MB/s takes 6.7 s a message: a handful only
MAX_BURSTS = 3  # concurrency 100: each burst already gives 100 samples
WARMUP_MESSAGES = 2  # first messages on fresh sockets pay for connection buffers
WARMUP_UNDER_S = 1.0  # ...but not worth 2 x 6.7 s: slower ones follow warm sockets anyway
LOOPBACK_BYTES_PER_S = 3e8  # rough relay rate, only to plan how many bursts fit the budget


def load_average() -> float:
    """The 1-minute load average: other work on the machine skews every figure here."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (all its threads)."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def bandwidth_text(rate: float) -> str:
    return "unlimited" if math.isinf(rate) else f"{rate / 1e6:g} MB/s"


# --- --diagnose: where a delivery's time goes ---------------------------------------------------
#
# Each benchmark message is stamped at every hand-over, keyed by its seq:
#   t_send (sender process) -> ship (sender's I/O thread hands it to zmq) -> broker in
#   (the broker's loop picked it up) -> broker out (handed to zmq towards the receiver)
#   -> receiver I/O (the receiving node's I/O thread got it) -> t_recv (the process),
# and the broker notes when the model says it is due. The sockets are subclasses that
# only add the stamp; the broker is fedemu's Broker with its router's on_message, send and
# the link model's transmit wrapped, in its own process like `fedemu broker`.

HOPS = ("sender", "to_broker", "broker", "to_receiver")  # the relay; overlaps the model's delay
PARTS = ("clock", "late", "release")  # add up to the error
STAGES = HOPS + PARTS


def seq_of(body: bytes) -> int | None:
    """The seq of a benchmark message from its body frame; None for anything else."""
    try:
        value = msgpack.unpackb(body, ext_hook=lambda code, data: None, raw=False, strict_map_key=False)
    except Exception:
        return None
    return value.get("seq") if isinstance(value, dict) and "t_send" in value else None


def stamping_socket_class(stamps: dict[int, float]) -> type:
    """A DEALER socket class that notes when each benchmark message is sent or received
    (by its body frame)."""

    class StampingSocket(zmq.Socket):
        def send_multipart(self, msg_parts, *args, **kwargs):
            now = time.monotonic()
            seq = seq_of(bytes(msg_parts[1])) if len(msg_parts) > 2 else None
            if seq is not None:
                stamps[seq] = now
            return super().send_multipart(msg_parts, *args, **kwargs)

        frame_index = 0  # of the next frame within its message (the node reads frame by frame)

        def recv(self, flags=0, copy=True, track=False):
            frame = super().recv(flags, copy=copy, track=track)
            now = time.monotonic()
            if self.frame_index == 1:  # a body: the message's frames arrive together
                seq = seq_of(frame.bytes if isinstance(frame, zmq.Frame) else frame)
                if seq is not None:
                    stamps[seq] = now
            more = frame.more if isinstance(frame, zmq.Frame) else self.get(zmq.RCVMORE)
            self.frame_index = self.frame_index + 1 if more else 0
            return frame

    return StampingSocket


def instrumented_node(name: str, endpoint: str, stamps: dict[int, float] | None) -> Node:
    node = Node(name, endpoint)
    if stamps is not None:
        node._ctx._socket_class = stamping_socket_class(stamps)  # diagnostics only
    return node.start()


def run_instrumented_broker(bind: str, endpoint_file: Path, network_file: Path, stamps_file: Path) -> None:
    """`fedemu broker --network`, noting per benchmark message when it came in, when the
    model said it is due and when it went out; written to ``stamps_file`` on SIGTERM."""
    raw = json.loads(network_file.read_text())
    spec = NetworkSpec.from_config(raw["network"], raw["num_clients"], raw["seed"], raw["time_scale"])
    came_in: dict[int, float] = {}
    due: dict[int, float] = {}
    went_out: dict[int, float] = {}

    class InstrumentedBroker(Broker):
        current: int | None = None

        def send(self, identity, msg, node):
            body = msg[1] if len(msg) > 2 else None
            seq = seq_of(body.bytes if isinstance(body, zmq.Frame) else bytes(body)) if body is not None else None
            if seq is not None:
                went_out[seq] = time.monotonic()
            super().send(identity, msg, node)

    broker = InstrumentedBroker(bind, network=spec)
    on_message = broker.router.on_message

    def noting_on_message(identity, frames):
        broker.current = seq_of(frames[1].bytes) if len(frames) > 2 else None
        if broker.current is not None:
            came_in[broker.current] = time.monotonic()
        on_message(identity, frames)

    broker.router.on_message = noting_on_message
    transmit = broker.links.network.transmit
    wall_of = broker.time._wall  # diagnostics only: the wall time of an emulated instant

    def noting_transmit(link, direction, size, now):
        verdict = transmit(link, direction, size, now)
        if broker.current is not None and verdict.arrival is not None:
            due[broker.current] = wall_of(verdict.arrival)
        return verdict

    broker.links.network.transmit = noting_transmit
    tmp = endpoint_file.with_suffix(".tmp")
    tmp.write_text(broker.endpoint + "\n")
    os.replace(tmp, endpoint_file)
    signal.signal(signal.SIGTERM, lambda *_: broker.stop())
    broker.serve_forever()
    stamps_file.write_text(json.dumps({"in": came_in, "due": due, "out": went_out}))


# --- the sender node (a helper process: `link_fidelity.py --role sender`) ---------------------


class Uploader(Behaviour):
    """client/k: on each order [seq, floats], sends one message up its own link."""

    def __init__(self, link: int, payloads: dict[int, np.ndarray]):
        self.link = link
        self.payloads = payloads

    def handle(self, proc, msg) -> None:
        seq, floats = msg.body
        array = self.payloads[floats]
        t_send = time.monotonic()
        proc.send(RX_NAME, {"seq": seq, "link": self.link, "t_send": t_send, "data": array})


def run_sender(endpoint: str, stamps_file: Path | None) -> None:
    """client/0..99 as behaviour processes on one node, as fedemu's worker nodes host
    clients (one pool thread runs them all). Each stdin line {"links", "floats",
    "seq0"} orders the named clients to send one message each, all at once."""
    ship: dict[int, float] | None = {} if stamps_file else None
    node = instrumented_node("bench-tx", endpoint, ship)
    payloads: dict[int, np.ndarray] = {}  # one array per size, sent by every client (zero-copy)
    clients = [node.spawn_behaviour(Uploader(k, payloads), name=f"client/{k}", link=k) for k in range(NUM_LINKS)]
    # The registrations went out before this request on the same socket, and the
    # receiver registered before this process started: once whereis answers, the
    # broker knows every name the benchmark uses.
    while node.whereis(RX_NAME) is None:
        time.sleep(0.05)
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job["floats"] not in payloads:
            payloads[job["floats"]] = np.ones(job["floats"], np.float32)
        for i, link in enumerate(job["links"]):
            node.send(clients[link], [job["seq0"] + i, job["floats"]])  # local: never crosses a link
    node.close("benchmark done")
    if stamps_file:
        stamps_file.write_text(json.dumps(ship))


# --- a CPU-bound trainer (a helper process: `link_fidelity.py --role trainer`) ---------------


def run_trainer(index: int) -> None:
    """What a default worker node does on 2 cores (2 workers x 1 torch thread): FedAvg's
    ClientUpdate on one IID MNIST shard after another, never idle."""
    import torch

    from fedemu.common.ml import data, models, partition
    from fedemu.common.ml.training import client_update

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dataset = data.load("mnist", progress=lambda *_: None)
    shards = partition.iid(len(dataset.train_y), 100, seed=index)
    generator = torch.Generator().manual_seed(index)
    updates = 0
    while True:
        shard = shards[updates % len(shards)]
        model = models.build("2nn", (1, 28, 28), 10, seed=index)
        client_update(model, dataset.train_x[shard], dataset.train_y[shard],
                      epochs=1, batch_size=10, lr=0.1, generator=generator)
        updates += 1
        if updates == 1:
            print("ready", flush=True)


# --- one (latency, bandwidth) setting: broker, sender and receiver ----------------------------


@dataclass
class Arrival:
    seq: int
    link: int
    t_send: float
    t_recv: float
    wire_bytes: int


class Collector:
    """What a receiving thread got, handed to the measuring thread once a whole step has
    arrived: one wake-up per step, not per message, so in a burst the measuring thread
    does not compete with the receiving ones (a server gets no such extra work)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list = []
        self._wanted = 0
        self._complete = threading.Event()

    def expect(self, count: int) -> None:
        """Start a step of ``count`` items (before ordering them sent)."""
        with self._lock:
            self._items, self._wanted = [], count
            self._complete.clear()

    def add(self, item) -> None:
        with self._lock:
            self._items.append(item)
            if len(self._items) >= self._wanted:
                self._complete.set()

    def wait(self, timeout_s: float) -> list:
        """The step's items once all arrived, or what arrived within ``timeout_s``."""
        self._complete.wait(timeout_s)
        with self._lock:
            items, self._items = self._items, []
        return items


class Helpers:
    """The helper processes of one measurement (a relay, a sender), logs in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen] = []

    def _start(self, name: str, argv: list[str], stdin=subprocess.DEVNULL) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, *argv], stdin=stdin, stdout=subprocess.PIPE,
                                    stderr=log, text=True)
        self.processes.append(proc)
        return proc

    def _endpoint(self, relay: subprocess.Popen, endpoint_file: Path) -> str:
        """The address the relay wrote once it listens."""
        deadline = time.monotonic() + 30
        while not endpoint_file.exists():
            if relay.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the relay did not start; see {self.workdir}")
            time.sleep(0.02)
        return endpoint_file.read_text().strip()

    def _start_sender(self, role: str, endpoint: str, *extra: str) -> subprocess.Popen:
        sender = self._start("sender", [str(Path(__file__).resolve()), "--role", role, "--endpoint", endpoint,
                                        *extra], stdin=subprocess.PIPE)
        if sender.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"the {role} did not start; see {self.workdir / 'sender.log'}")
        return sender

    def _stop_processes(self) -> None:
        for proc in reversed(self.processes):  # sender first, relay last
            if proc.poll() is None:
                if proc.stdin:
                    proc.stdin.close()  # the sender ends at the end of its input
                else:
                    proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()

    def close(self) -> None:
        self._stop_processes()


class Setting(Helpers):
    """A broker emulating one link profile on all 100 links, the sender helper
    process and the receiver node in this process."""

    def __init__(self, workdir: Path, latency_ms: float, bandwidth: float, diagnose: bool = False,
                 transport: str = "tcp"):
        self.latency_ms = latency_ms
        self.bandwidth = bandwidth
        tag = f"lat{latency_ms:g}-bw{'inf' if math.isinf(bandwidth) else f'{bandwidth:g}'}"
        super().__init__(workdir / tag)
        profile = {"latency_ms": latency_ms, "overhead_bytes": OVERHEAD_BYTES,
                   "bandwidth": "unlimited" if math.isinf(bandwidth) else bandwidth}
        network_file = self.workdir / "network.json"
        # The pipe, whose arrivals model_s() gives (under tcp, the default, the broker holds
        # a message until the model says it arrived: another relay, not measured here).
        network_file.write_text(json.dumps({"num_clients": NUM_LINKS, "seed": 0, "time_scale": 1.0, "network": {
            "transport": "message", "default_profile": "bench", "profiles": {"bench": profile}}}))
        endpoint_file = self.workdir / "broker.endpoint"
        self.diagnose = diagnose
        # ipc: a Unix socket instead of TCP on loopback, to see what the transport costs.
        bind = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{self.workdir / 'broker.ipc'}"
        if diagnose:
            self.broker = self._start("broker", [
                str(Path(__file__).resolve()), "--role", "broker", "--bind", bind, "--endpoint", str(endpoint_file),
                "--network-file", str(network_file), "--stamps", str(self.workdir / "broker-stamps.json")])
        else:
            self.broker = self._start("broker", [
                "-m", "fedemu.launch", "broker", "--bind", bind, "--endpoint-file",
                str(endpoint_file), "--log-dir", str(self.workdir), "--network", str(network_file)])
        endpoint = self._endpoint(self.broker, endpoint_file)
        self.arrivals = Collector()  # (t_recv, message)
        self.receiver_io: dict[int, float] | None = {} if diagnose else None
        self.receiver_node = instrumented_node("bench-rx", endpoint, self.receiver_io)
        self._receiving = True
        self.receiver_node.spawn(self._receive, name=RX_NAME)
        stamps = ["--stamps", str(self.workdir / "sender-stamps.json")] if diagnose else []
        self.sender = self._start_sender("sender", endpoint, *stamps)
        self._seq = 0

    def _receive(self, proc) -> None:
        while self._receiving:
            msg = proc.receive(timeout=0.5)
            if msg is TIMEOUT:
                continue
            t_recv = time.monotonic()  # first thing: what follows must not count
            # Nothing else here: in a burst, work done now would delay the next stamp.
            self.arrivals.add((t_recv, msg))

    def model_s(self, wire_bytes: int) -> float:
        return (wire_bytes + OVERHEAD_BYTES) / self.bandwidth + self.latency_ms / 1000

    def send(self, links: list[int], floats: int, timeout_s: float) -> list[Arrival]:
        """One message from each of ``links`` at the same moment; their arrivals."""
        seq0 = self._seq
        self._seq += len(links)
        self.arrivals.expect(len(links))
        self.sender.stdin.write(json.dumps({"links": links, "floats": floats, "seq0": seq0}) + "\n")
        self.sender.stdin.flush()
        # anything older belongs to an earlier, failed step
        got = [(t_recv, msg) for t_recv, msg in self.arrivals.wait(timeout_s) if msg.body["seq"] >= seq0]
        if len(got) < len(links):
            raise RuntimeError(f"{len(links) - len(got)} of {len(links)} messages did not arrive "
                               f"within {timeout_s:.0f}s; see {self.workdir}")
        # Exactly the bytes the broker counted: the sender's frames, re-encoded (after
        # the whole step arrived, so it never delays a receive).
        return [Arrival(msg.body["seq"], msg.body["link"], msg.body["t_send"], t_recv,
                        link_size(encode(USER, msg.sender, RX_NAME, msg.body))) for t_recv, msg in got]

    def close(self) -> None:
        self._receiving = False
        if getattr(self, "receiver_node", None) is not None:
            self.receiver_node.close("benchmark done")
        self._stop_processes()

    def stage_stamps(self) -> dict[str, dict[int, float]]:
        """After close: every hand-over time of every message, by stage boundary."""
        broker = json.loads((self.workdir / "broker-stamps.json").read_text())
        sender = json.loads((self.workdir / "sender-stamps.json").read_text())

        def by_seq(stamps: dict) -> dict[int, float]:
            return {int(k): v for k, v in stamps.items()}

        return {"ship": by_seq(sender), "in": by_seq(broker["in"]), "out": by_seq(broker["out"]),
                "due": by_seq(broker["due"]), "receiver_io": dict(self.receiver_io)}


# --- one grid point -------------------------------------------------------------------------


@dataclass
class Point:
    condition: str
    latency_ms: float
    bandwidth: str
    size: str
    concurrency: int
    n: int
    model_ms: float
    median_error_ms: float
    p99_error_ms: float
    min_error_ms: float
    max_error_ms: float
    target_ms: float
    ok: bool
    errors_ms: list[float] = field(repr=False)
    # The floor's p99 delivery for this size and concurrency, and whether it fits in
    # model time + target. A relay needs that to meet the target here; on a busy machine
    # it is not enough, as releasing a held message on time takes wake-ups of its own.
    floor_p99_ms: float | None = None
    floor_fits: bool | None = None
    # --diagnose: median and p99 ms of each hop and each part of the error (the parts
    # add up to the error per message)
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    arrivals: list[Arrival] = field(default_factory=list, repr=False)  # kept for the stages

    def add_stages(self, stamps: dict[str, dict[int, float]], model_s) -> None:
        """The time each hand-over took, and each message's error split into where the
        model's clock started (clock), how late it reached the receiving node (late)
        and how long from then, or from due, to the receiving process (release)."""
        per_stage: dict[str, list[float]] = {stage: [] for stage in STAGES}
        for a in self.arrivals:
            ship, came_in, went_out, due, rx_io = (
                stamps[k].get(a.seq) for k in ("ship", "in", "out", "due", "receiver_io"))
            if None in (ship, came_in, went_out, due, rx_io):
                continue
            hops = (ship - a.t_send, came_in - ship, went_out - came_in, rx_io - went_out)
            parts = (due - a.t_send - model_s(a.wire_bytes), max(0.0, rx_io - due), a.t_recv - max(due, rx_io))
            for stage, seconds in zip(STAGES, hops + parts):
                per_stage[stage].append(seconds * 1000)
        self.stages = {stage: {"median": round(float(np.median(v)), 3), "p99": round(float(np.percentile(v, 99)), 3)}
                       for stage, v in per_stage.items() if v}


def measure(setting: Setting, condition: str, size: str, concurrency: int, budget_s: float) -> Point:
    floats = SIZES[size]
    approx_model_s = setting.model_s(floats * 4)
    timeout_s = 60 + 3 * approx_model_s
    arrivals: list[Arrival] = []
    if concurrency == 1:
        samples = int(budget_s / (approx_model_s + 0.005))
        samples = max(MIN_SAMPLES_SERIAL, min(MAX_SAMPLES_SERIAL, samples))
        warmup = WARMUP_MESSAGES if approx_model_s < WARMUP_UNDER_S else 0
        for i in range(warmup + samples):
            got = setting.send([0], floats, timeout_s)
            if i >= warmup:
                arrivals += got
    else:
        links = list(range(concurrency))
        setting.send(links, SIZES["1KB"], timeout_s)  # warm-up: every client and link once
        relay_s = concurrency * floats * 4 / LOOPBACK_BYTES_PER_S
        bursts = max(1, min(MAX_BURSTS, int(budget_s / (approx_model_s + relay_s + 0.05))))
        for _ in range(bursts):
            arrivals += setting.send(links, floats, timeout_s)
            time.sleep(0.1)  # let the receiver free the burst before the next
    model_ms = np.array([setting.model_s(a.wire_bytes) * 1000 for a in arrivals])
    measured_ms = np.array([(a.t_recv - a.t_send) * 1000 for a in arrivals])
    errors = measured_ms - model_ms
    model_median = float(np.median(model_ms))
    target = TARGET_FIXED_MS + TARGET_RELATIVE * model_median
    p99 = float(np.percentile(errors, 99))
    return Point(condition, setting.latency_ms, bandwidth_text(setting.bandwidth), size, concurrency,
                 len(errors), round(model_median, 3), round(float(np.median(errors)), 3), round(p99, 3),
                 round(float(errors.min()), 3), round(float(errors.max()), 3), round(target, 3),
                 # Early delivery would be as wrong as late: check both tails.
                 bool(p99 <= target and float(np.percentile(errors, 1)) >= -target),
                 [round(float(e), 4) for e in errors], arrivals=arrivals)


# --- the floor: the same relay path with none of fedemu's work -------------------------------
#
# bench/bare_relay.py (a minimal pyzmq ROUTER relay) between two processes, with the
# thread hand-offs any actor runtime with an I/O thread has: the sending thread stamps
# and hands the message to an I/O thread; the receiving I/O thread hands it to the
# thread that stamps it. No codec, no link model, no holding. What a fedemu delivery
# with a zero model time costs beyond this is fedemu's; the rest is the machine's.

FLOOR_BUDGET_S = 2.0  # per size at concurrency 1 (6.6 MB: ~80 messages)
FLOOR_RX, FLOOR_TX = b"floor-rx", b"floor-tx"
FLOOR_STAMP = struct.Struct("<qd")  # seq, t_send


def run_floor_sender(endpoint: str) -> None:
    """`--role floor-sender`: for each stdin line {"seq0", "count", "floats"}, stamp and
    hand ``count`` messages, one after the other, to the I/O thread, which sends them to
    the receiver through the bare relay."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, FLOOR_TX)
    sock.connect(endpoint)
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def io() -> None:
        while (frames := outbox.get()) is not None:
            sock.send_multipart(frames, copy=False)

    thread = threading.Thread(target=io, name="floor-io")
    thread.start()
    payloads: dict[int, np.ndarray] = {}
    print("ready", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        data = payloads.setdefault(job["floats"], np.ones(job["floats"], np.float32))
        for seq in range(job["seq0"], job["seq0"] + job["count"]):  # as many clients, each stamping its own
            outbox.put([FLOOR_RX, FLOOR_STAMP.pack(seq, time.monotonic()), data])
    outbox.put(None)
    thread.join()
    sock.close(linger=1000)
    ctx.term()


class Floor(Helpers):
    """The bare relay and the floor sender as processes; the receiver in this process."""

    def __init__(self, workdir: Path):
        super().__init__(workdir / "floor")
        endpoint_file = self.workdir / "relay.endpoint"
        relay = self._start("relay", [str(Path(__file__).resolve().parent / "bare_relay.py"),
                                      "--endpoint-file", str(endpoint_file)])
        endpoint = self._endpoint(relay, endpoint_file)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, FLOOR_RX)
        self._sock.connect(endpoint)
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()
        self.arrivals = Collector()  # (seq, t_send, t_recv)
        self._threads = [threading.Thread(target=self._io, name="floor-rx-io", daemon=True),
                         threading.Thread(target=self._process, name="floor-rx", daemon=True)]
        for thread in self._threads:
            thread.start()
        self.sender = self._start_sender("floor-sender", endpoint)
        self._seq = 0

    def _io(self) -> None:
        try:
            while True:
                self._handoff.put(self._sock.recv_multipart(copy=False))
        except zmq.ContextTerminated:  # close(): the socket is this thread's to close
            self._sock.close(linger=0)
            self._handoff.put(None)

    def _process(self) -> None:
        while (frames := self._handoff.get()) is not None:
            t_recv = time.monotonic()
            seq, t_send = FLOOR_STAMP.unpack(frames[0].bytes)
            self.arrivals.add((seq, t_send, t_recv))

    def deliveries_s(self, floats: int, count: int, timeout_s: float) -> list[float]:
        """Send ``count`` messages at once and wait for them; their delivery times (fewer
        if the relay dropped some: it does until the receiver's connection is up)."""
        seq0 = self._seq
        self._seq += count
        self.arrivals.expect(count)
        self.sender.stdin.write(json.dumps({"seq0": seq0, "count": count, "floats": floats}) + "\n")
        self.sender.stdin.flush()
        return [t_recv - t_send for seq, t_send, t_recv in self.arrivals.wait(timeout_s) if seq >= seq0]

    def close(self) -> None:
        self._stop_processes()
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()


def measure_floor(workdir: Path, sizes) -> dict[tuple[str, int], dict[str, float]]:
    """Median and p99 ms of a delivery through the floor, per size and concurrency
    (at concurrency 100, one sender sends 100 messages at once)."""
    floor = Floor(workdir)
    try:
        warm_until = time.monotonic() + 30
        while not floor.deliveries_s(SIZES["1KB"], 1, timeout_s=0.2):
            if time.monotonic() > warm_until:
                raise RuntimeError(f"nothing crossed the bare relay within 30 s; see {floor.workdir}")
        result = {}
        for size in sizes:
            floats = SIZES[size]
            relay_s = floats * 4 / LOOPBACK_BYTES_PER_S
            for concurrency in CONCURRENCIES:
                timeout_s = 60 + 10 * concurrency * relay_s
                floor.deliveries_s(floats, concurrency, timeout_s)  # warm-up
                steps = MAX_BURSTS if concurrency > 1 else max(MIN_SAMPLES_SERIAL, min(
                    MAX_SAMPLES_SERIAL, int(FLOOR_BUDGET_S / (relay_s + 0.002))))
                ms = [1000 * d for _ in range(steps) for d in floor.deliveries_s(floats, concurrency, timeout_s)]
                result[(size, concurrency)] = {"n": len(ms), "median_ms": round(float(np.median(ms)), 3),
                                               "p99_ms": round(float(np.percentile(ms, 99)), 3)}
        return result
    finally:
        floor.close()


def floor_line(condition: str, floor: dict[tuple[str, int], dict[str, float]]) -> str:
    cells = "; ".join(f"{size} x{conc}: median {f['median_ms']:.2f}, p99 {f['p99_ms']:.2f} ms (n={f['n']})"
                      for (size, conc), f in floor.items())
    return (f"{condition} floor (bench/bare_relay.py between two processes, one thread hand-off each side, "
            f"no emulation: the delivery times a relay with nothing of fedemu's reaches here): {cells}")



# --- the grid ---------------------------------------------------------------------------------


class Trainers:
    """Processes that keep every core busy training, as worker nodes do in a run."""

    def __init__(self, workdir: Path, count: int, nice: int = 0):
        self.procs = []
        for i in range(count):
            with open(workdir / f"trainer-{i}.log", "ab") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--role", "trainer", "--index", str(i)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
                    preexec_fn=(lambda: os.nice(nice)) if nice else None))
        for proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError(f"a trainer did not start; see {workdir}/trainer-*.log")
        self.started = time.monotonic()
        self.cpu_at_start = sum(cpu_seconds(p.pid) for p in self.procs)

    def cores_used(self) -> float:
        """Cores the trainers kept busy since they started training, on average."""
        cpu = sum(cpu_seconds(p.pid) for p in self.procs) - self.cpu_at_start
        return cpu / (time.monotonic() - self.started)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def run_grid(condition: str, workdir: Path, latencies, bandwidths, sizes, budget_s: float,
             diagnose: bool, transport: str) -> list[Point]:
    points = []
    for latency in latencies:
        for bandwidth in bandwidths:
            setting = Setting(workdir / condition, latency, bandwidth, diagnose, transport)
            measured = []
            try:
                for size in sizes:
                    for concurrency in CONCURRENCIES:
                        started = time.monotonic()
                        point = measure(setting, condition, size, concurrency, budget_s)
                        measured.append(point)
                        print(f"  [{condition}] {latency:>3g} ms {bandwidth_text(bandwidth):>9} {size:>5} "
                              f"x{concurrency:<3}: n={point.n:<3} median {point.median_error_ms:+.2f} ms, "
                              f"p99 {point.p99_error_ms:+.2f} ms (target {point.target_ms:.2f}) "
                              f"[{time.monotonic() - started:.0f}s]", file=sys.stderr, flush=True)
            finally:
                setting.close()
            if diagnose:
                stamps = setting.stage_stamps()  # complete only once every process wrote its own
                for point in measured:
                    point.add_stages(stamps, setting.model_s)
            points += measured
    return points


def table(points: list[Point]) -> str:
    head = ("latency", "bandwidth", "size", "conc", "n", "model ms", "median err ms", "p99 err ms",
            "min err ms", "target ms", "ok", "floor p99 ms", "floor fits")
    rows = [(f"{p.latency_ms:g} ms", p.bandwidth, p.size, str(p.concurrency), str(p.n), f"{p.model_ms:.2f}",
             f"{p.median_error_ms:+.2f}", f"{p.p99_error_ms:+.2f}", f"{p.min_error_ms:+.2f}",
             f"{p.target_ms:.2f}", "yes" if p.ok else "NO",
             "-" if p.floor_p99_ms is None else f"{p.floor_p99_ms:.2f}",
             "-" if p.floor_fits is None else ("yes" if p.floor_fits else "no")) for p in points]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def stage_table(points: list[Point]) -> str:
    """Where the error goes: median / p99 ms of each hop and of each part of the error."""
    head = ("latency", "bandwidth", "size", "conc", "error", *STAGES)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for p in points:
        cells = [f"{p.stages[s]['median']:+.2f} / {p.stages[s]['p99']:+.2f}" if s in p.stages else "-"
                 for s in STAGES]
        lines.append("| " + " | ".join([f"{p.latency_ms:g} ms", p.bandwidth, p.size, str(p.concurrency),
                                        f"{p.median_error_ms:+.2f} / {p.p99_error_ms:+.2f}", *cells]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a subset: latency 0/100 ms, 10 MB/s and unlimited, 1 KB and 800 KB, short budgets")
    parser.add_argument("--load", action="store_true",
                        help="run the grid again while one trainer process per core keeps every core busy")
    parser.add_argument("--load-only", action="store_true", help="only the loaded grid")
    parser.add_argument("--trainer-nice", type=int, default=configuration.load(None)["run"]["pool_nice"],
                        help="run the trainers at this nice level (default: run.pool_nice's default, as "
                             "fedemu runs worker nodes' training), to see what training's priority does")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds to spend per grid point (default 8, quick 2); a minimum sample "
                             "count may exceed it")
    parser.add_argument("--diagnose", action="store_true",
                        help="also split each error into stages (stamping sockets, an instrumented copy of "
                             "the broker; adds a few microseconds per message)")
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp",
                        help="how nodes reach the broker: TCP on loopback (the issue's setting, default) "
                             "or a Unix socket, for comparison")
    parser.add_argument("--json", type=Path, help="write every figure (and each error sample) here")
    parser.add_argument("--role", choices=("bench", "sender", "trainer", "broker", "floor-sender"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--bind", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stamps", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--network-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "sender":
        return run_sender(args.endpoint, args.stamps)
    if args.role == "floor-sender":
        return run_floor_sender(args.endpoint)
    if args.role == "broker":
        return run_instrumented_broker(args.bind, Path(args.endpoint), args.network_file, args.stamps)
    if args.role == "trainer":
        return run_trainer(args.index)

    latencies = QUICK_LATENCIES_MS if args.quick else LATENCIES_MS
    bandwidths = QUICK_BANDWIDTHS if args.quick else BANDWIDTHS
    sizes = QUICK_SIZES if args.quick else tuple(SIZES)
    budget_s = args.budget_s if args.budget_s is not None else (2.0 if args.quick else 8.0)
    conditions = (["load"] if args.load_only else ["quiet"] + (["load"] if args.load else []))
    started = time.monotonic()
    report: dict = {"python": platform.python_version(), "cpus": os.cpu_count(), "transport": args.transport,
                    "diagnose": args.diagnose, "trainer_nice": args.trainer_nice,
                    "load_average_at_start": load_average(), "budget_s": budget_s,
                    "target": f"p99 error <= {TARGET_FIXED_MS} ms + {TARGET_RELATIVE:.0%} of model time",
                    "conditions": {}}
    print(f"load average at start: {report['load_average_at_start']:.2f}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="link-fidelity-") as tmp:
        workdir = Path(tmp)
        for condition in conditions:
            trainers = Trainers(workdir, os.cpu_count() or 2, args.trainer_nice) if condition == "load" else None
            try:
                floor = measure_floor(workdir / condition, sizes)
                points = run_grid(condition, workdir, latencies, bandwidths, sizes, budget_s, args.diagnose,
                                  args.transport)
                cores = trainers.cores_used() if trainers else 0.0
            finally:
                if trainers:
                    trainers.close()
            for point in points:
                point.floor_p99_ms = floor[(point.size, point.concurrency)]["p99_ms"]
                point.floor_fits = point.floor_p99_ms <= point.model_ms + point.target_ms
            floor_fits = [p for p in points if p.floor_fits]
            report["conditions"][condition] = {
                "trainer_cores_busy": round(cores, 2),
                "floor": [{"size": size, "concurrency": conc, **f} for (size, conc), f in floor.items()],
                "points": [{k: v for k, v in asdict(p).items() if k != "arrivals"} for p in points]}
            passed = sum(p.ok for p in points)
            note = f", trainers at nice {args.trainer_nice} kept {cores:.2f} cores busy" if trainers else ""
            print(f"\n{condition}: {passed}/{len(points)} grid points within target{note}; "
                  f"{sum(p.ok for p in floor_fits)} of the {len(floor_fits)} where the floor's p99 fits "
                  f"in model time + target")
            print(table(points))
            print(floor_line(condition, floor))
            if args.diagnose:
                print(f"\n{condition}: where the error goes, median / p99 ms (the relay's hops, which "
                      f"overlap the model's delay -- sender: t_send to its I/O thread's zmq send; "
                      f"to_broker: to the broker's loop; broker: in the broker; to_receiver: to the "
                      f"receiving node's I/O thread -- and the error's parts, which add up to it -- "
                      f"clock: where the model's clock started minus t_send; late: arrival at the "
                      f"receiving node past due; release: from due or arrival to the receiving process)")
                print(stage_table(points))
    report["load_average_at_end"] = load_average()
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(f"\nwall time {report['wall_s']:.0f} s; load average at end {report['load_average_at_end']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
