"""The Linux kernel's TCP as a second reference for fedemu's TCP model (issue 52).

A small userspace link emulator in the manner of Mahimahi's mm-delay / mm-link / mm-loss:
two network namespaces (``lr<pid>a`` holds the sender at 10.52.0.1, ``lr<pid>b`` the
receiver at 10.52.0.2), a TUN device in each, and one forwarder process (this script,
``--role forwarder``) that moves IP packets between them. Each direction is one link:

* a drop-tail queue of ``buffer`` bytes (wire bytes: the whole IP packet), a packet that
  does not fit is dropped on arrival;
* serialisation at ``rate`` bytes/s of the whole IP packet (the model counts 52 header
  bytes per 1,448-byte segment too), packets leave the queue one after another;
* then a one-way delay of ``latency_ms``;
* loss, on packets that carry TCP payload (the model loses data segments, not ACKs):
  ``bernoulli`` (each with probability p, from ``numpy.random.default_rng([52, seed,
  direction])``), or ``paired``: the first transmissions of exactly the segments
  bench/transport_fidelity.py's ``draw_losses`` picks, so the model is given the same
  losses (its paired comparison with ns-3, here with Linux).

Departure times come from the schedule, not from when the forwarder got round to a
packet, so a late wake-up delays packets (jitter) without lowering the rate; the
forwarder reports how late it wrote each packet, which is how far to trust a run.

The kernel's TCP runs unmodified: CUBIC (or Reno) set in each namespace,
``tcp_no_metrics_save = 1`` (no ssthresh carried from one flow to the next), socket
buffers large enough that the receive window never limits, ``tcp_slow_start_after_idle``
left at Linux's 1. The TUN devices offer no TSO/GSO offload (none is asked for with
TUNSETOFFLOAD), so the kernel segments in software before the device and every packet
read is at most the 1,500-byte MTU (checked: the forwarder reports its largest packet).

Parts (``--parts``): ``calibrate`` (ping RTT against the configured delay, idle and
with full-size packets; a bulk transfer's goodput against the rate, per rate),
``single`` (one flow on a dozen of transport_fidelity.py's points, without loss and
with paired losses, median over seeds), ``longlived`` (one connection uploading and
downloading the 2NN update each round, 0.5-5 s idle between, at 0, 1 and 2% loss,
against the model's long-lived connection, round by round), ``shared`` (10 and 100
flows on `lte` access links through one bottleneck with a deep, a BDP and a shallow
queue: the mean completion, and the share of flows done by Linux's median),
``longloss`` (not in the default parts: transport_fidelity.py's 5%-loss points on 75 and
300 ms round trips, CUBIC and Reno, paired losses for Linux, the model and ns-3, with
Linux's timeouts and loss probes counted).

    sudo python bench/linux_reference.py [--parts calibrate single longlived shared longloss] [--seeds 5]
        [--json bench/results/linux-reference.json]

Needs root, /dev/net/tun and network namespaces (``ip netns``); without them it says
which is missing and exits with status 2. Traffic stays inside the two namespaces; they
and every process started are removed on exit, Ctrl-C included.
"""
from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MSS = 1448
MTU = 1500
PAYLOAD_SHARE = MSS / MTU  # goodput over wire rate for full segments
ADDR = ("10.52.0.1", "10.52.0.2")  # sender side, receiver side
PORT = 5252
MBIT = 1e6 / 8
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


# --- the forwarder ------------------------------------------------------------------------------

class Link:
    """One direction: drop-tail queue, serialisation, delay, loss."""

    def __init__(self, cfg: dict, direction: int):
        self.rate, self.delay = cfg["rate"], cfg["latency_ms"] / 1000.0
        self.buffer = cfg["buffer"]
        self.loss = cfg.get("loss", 0.0) if cfg.get("loss_dirs", [0]).count(direction) else 0.0
        self.rng = np.random.default_rng([52, cfg.get("seed", 1), direction])
        self.drop = set(cfg.get(("drop", "drop_back")[direction], []))
        # A message's segments are numbered from its first byte, as the model's are.
        self.message = cfg.get("message_bytes", 1 << 62)
        self.nseg = -(-self.message // MSS)
        self.isn, self.highest = None, 0
        self.busy_until = 0.0
        self.backlog = collections.deque()  # (finish, size) of packets queued or in service
        self.backlog_bytes = 0
        self.pending = collections.deque()  # (due, packet); due times only grow
        self.stats = collections.Counter()
        self.late = []

    def lose(self, pkt: bytes) -> bool:
        if len(pkt) < 40 or pkt[0] >> 4 != 4 or pkt[9] != 6:
            return False
        ihl = (pkt[0] & 15) * 4
        seq = struct.unpack_from("!I", pkt, ihl + 4)[0]
        if pkt[ihl + 13] & 0x02:  # SYN: the stream's bytes count from isn + 1
            self.isn = seq
        payload = len(pkt) - ihl - (pkt[ihl + 12] >> 4) * 4
        if payload <= 0 or self.isn is None:
            return False
        if self.loss and self.rng.random() < self.loss:
            return True
        offset = (seq - self.isn - 1) % (1 << 32)
        if offset >= self.highest:  # a first transmission
            self.highest = offset + payload
            index = (offset // self.message) * self.nseg + (offset % self.message) // MSS
            if index in self.drop:
                self.drop.discard(index)
                return True
        return False

    def arrive(self, now: float, pkt: bytes) -> None:
        size = len(pkt)
        self.stats["packets"] += 1
        self.stats["max_packet"] = max(self.stats["max_packet"], size)
        while self.backlog and self.backlog[0][0] <= now:
            self.backlog_bytes -= self.backlog.popleft()[1]
        if (self.drop or self.loss) and self.lose(pkt):
            self.stats["lost"] += 1
            return
        if self.backlog_bytes + size > self.buffer:
            self.stats["overflow"] += 1
            return
        self.busy_until = max(now, self.busy_until) + size / self.rate
        self.backlog.append((self.busy_until, size))
        self.backlog_bytes += size
        self.pending.append((self.busy_until + self.delay, pkt))


def forwarder(cfg: dict) -> None:
    """Create the two TUNs, say so on stdout, then forward until stdin closes; print stats."""
    fds = []
    for name in cfg["tuns"]:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        fds.append(fd)
    links = [Link(cfg, 0), Link(cfg, 1)]  # 0: a -> b (the sender's data), 1: b -> a
    shared = cfg.get("shared")
    access: dict[int, Link] = {}  # with a shared bottleneck: each flow's own access link, by source port
    if shared:
        # The data direction becomes the bottleneck: each flow's packets cross its own
        # access link (the flow's rate and buffer, no delay), then the shared queue
        # (the bottleneck's rate and buffer) and the one-way delay, as ns-3's dumbbell.
        links[0] = Link(dict(cfg, rate=shared["rate"], buffer=shared["buffer"]), 0)
    out = {fds[0]: 0, fds[1]: 1}
    print("ready", flush=True)
    stdin = sys.stdin.fileno()
    clock = time.monotonic
    while True:
        now = clock()
        if access:  # what left the access links by now enters the bottleneck, in time order
            through = sorted((item for link in access.values() for item in _due(link.pending, now)),
                             key=lambda item: item[0])
            for due, pkt in through:
                links[0].arrive(due, pkt)
        for d, link in enumerate(links):
            pending = link.pending
            while pending and pending[0][0] <= now:
                due, pkt = pending.popleft()
                try:
                    os.write(fds[1 - d], pkt)
                except OSError:  # the device is not up yet, or its queue is full
                    link.stats["write_error"] += 1
                link.late.append(now - due)
        heads = [link.pending[0][0] for link in (*links, *access.values()) if link.pending]
        timeout = max(0.0, min(heads) - clock()) if heads else 0.5
        ready, _, _ = select.select([fds[0], fds[1], stdin], [], [], timeout)  # µs resolution
        for fd in ready:
            if fd == stdin:
                if not os.read(stdin, 4096):
                    report(links)
                    return
                continue
            link = links[out[fd]]
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if shared and out[fd] == 0:
                    port = _source_port(pkt)
                    if port not in access:
                        access[port] = Link(dict(rate=cfg["rate"], latency_ms=0.0, buffer=cfg["buffer"]), 0)
                    access[port].arrive(clock(), pkt)
                else:
                    link.arrive(clock(), pkt)


def _due(pending: collections.deque, now: float):
    while pending and pending[0][0] <= now:
        yield pending.popleft()


def _source_port(pkt: bytes) -> int:
    """A TCP packet's source port (0 for anything else: one access link for the rest)."""
    if len(pkt) < 24 or pkt[0] >> 4 != 4 or pkt[9] != 6:
        return 0
    return struct.unpack_from("!H", pkt, (pkt[0] & 15) * 4)[0]


def report(links: list[Link]) -> None:
    stats = []
    for link in links:
        late = sorted(link.late) or [0.0]
        stats.append(dict(link.stats, late_median_ms=1e3 * late[len(late) // 2],
                          late_p90_ms=1e3 * late[int(len(late) * 0.9)],
                          late_p99_ms=1e3 * late[int(len(late) * 0.99)], late_max_ms=1e3 * late[-1]))
    print(json.dumps(stats), flush=True)


# --- the endpoints (run inside the namespaces) ---------------------------------------------------

def tcp_socket(cc: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
    return s


def connect_to_sink(cc: str) -> socket.socket:
    """A connection to the sink (or server), retried while it may still be starting."""
    for _ in range(200):
        conn = tcp_socket(cc)
        try:
            conn.connect((ADDR[1], PORT))
        except OSError:  # refused: not listening yet
            conn.close()
            time.sleep(0.02)
            continue
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn
    raise ConnectionError("could not connect to the sink")


def recv_exactly(conn: socket.socket, size: int, half: list | None = None) -> float:
    got = 0
    while got < size:
        chunk = conn.recv_into(BUF, min(len(BUF), size - got))
        if not chunk:
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        got += chunk
        if half is not None and not half and got >= size // 2:
            half.append(time.monotonic())
    return time.monotonic()


BUF = memoryview(bytearray(1 << 20))

# The sender namespace's counters of how its TCP recovered (its own namespace: only this
# benchmark's connections count), read before and after a transfer.
RECOVERY_COUNTERS = ("TCPTimeouts", "TCPLossProbes", "TCPSpuriousRTOs", "TCPSackRecovery", "TCPRenoRecovery",
                     "TCPLostRetransmit")


def _proc_counters(path: str, prefix: str) -> dict:
    """One table of /proc/net/netstat or /proc/net/snmp: a line of names, then its values."""
    lines = Path(path).read_text().splitlines()
    for names, numbers in zip(lines[::2], lines[1::2]):
        if names.startswith(prefix):
            return dict(zip(names.split()[1:], map(int, numbers.split()[1:])))
    return {}


def recovery_counters() -> dict:
    values = _proc_counters("/proc/self/net/netstat", "TcpExt:")
    values["RetransSegs"] = _proc_counters("/proc/self/net/snmp", "Tcp:").get("RetransSegs", 0)
    return {k: values.get(k, 0) for k in (*RECOVERY_COUNTERS, "RetransSegs")}


def endpoint(args) -> None:
    """``sink``/``source``: one bulk transfer; ``server``/``client``: the long-lived
    connection, ``rounds`` uploads each answered by a download, the client idle between."""
    signal.alarm(args.deadline)  # a stuck transfer must not outlive the benchmark
    data = b"\x5a" * args.bytes
    result = {}
    if args.role in ("sink", "server"):
        lsock = tcp_socket(args.cc)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((ADDR[1], PORT))
        lsock.listen(1)
        print("listening", flush=True)
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, args.cc.encode())
        result["cc"] = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
        if args.role == "sink":
            half = []
            result["done"] = recv_exactly(conn, args.bytes, half)
            result["half"] = half[0]
        else:
            result["up_done"], result["down_start"] = [], []
            for _ in range(args.rounds):
                result["up_done"].append(recv_exactly(conn, args.bytes))
                result["down_start"].append(time.monotonic())
                conn.sendall(data)
        conn.close()
    else:
        before = recovery_counters()
        conn = connect_to_sink(args.cc)
        result["cc"] = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
        time.sleep(0.2)  # the handshake's last ACK is through; data starts a flow's clock
        if args.role == "source":
            result["start"] = time.monotonic()
            conn.sendall(data)
        else:
            idle = json.loads(args.idle)
            result["up_start"], result["down_done"] = [], []
            for r in range(args.rounds):
                result["up_start"].append(time.monotonic())
                conn.sendall(data)
                result["down_done"].append(recv_exactly(conn, args.bytes))
                if r < args.rounds - 1:
                    time.sleep(idle[r])
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        conn.close()
        after = recovery_counters()
        result["recovery"] = {k: after[k] - before[k] for k in after}
    print(json.dumps(result), flush=True)


def many(args) -> None:
    """``many-sink``/``many-source``: ``count`` connections, each sending ``bytes`` once,
    flow k starting ``spacing`` * k after the first; times by the source's port."""
    signal.alarm(args.deadline)
    result = {}
    if args.role == "many-sink":
        lsock = tcp_socket(args.cc)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((ADDR[1], PORT))
        lsock.listen(args.count)
        print("listening", flush=True)
        done: dict[int, float] = {}

        def take(conn: socket.socket, port: int) -> None:
            buf = bytearray(1 << 16)
            got = 0
            while got < args.bytes:
                n = conn.recv_into(buf, min(len(buf), args.bytes - got))
                if not n:
                    raise ConnectionError(f"flow {port} closed after {got} bytes")
                got += n
            done[port] = time.monotonic()
            conn.close()

        threads = []
        for _ in range(args.count):
            conn, (_, port) = lsock.accept()
            threads.append(threading.Thread(target=take, args=(conn, port)))
            threads[-1].start()
        for t in threads:
            t.join()
        result["done"] = done
    else:
        data = b"\x5a" * args.bytes
        conns = [connect_to_sink(args.cc) for _ in range(args.count)]
        time.sleep(0.3)  # every handshake through; data starts the flows' clocks
        origin = time.monotonic()
        start: dict[int, float] = {}

        def send(k: int, conn: socket.socket) -> None:
            time.sleep(max(0.0, origin + k * args.spacing - time.monotonic()))
            start[conn.getsockname()[1]] = time.monotonic()
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)

        threads = [threading.Thread(target=send, args=(k, c)) for k, c in enumerate(conns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result["start"] = start
    print(json.dumps(result), flush=True)


def ping(count: int, size: int, gap: float) -> list[float]:
    """ICMP echo RTTs in ms (raw socket: the receiver's kernel answers)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    s.settimeout(2.0)
    rtts = []
    for seq in range(count):
        body = struct.pack("!HH", 0x5252, seq) + b"\0" * (size - 4)
        header = struct.pack("!BBH", 8, 0, 0)
        total = sum(struct.unpack(f"!{(len(header + body)) // 2}H", header + body))
        total = (total >> 16) + (total & 0xFFFF)
        checksum = ~(total + (total >> 16)) & 0xFFFF
        sent = time.monotonic()
        s.sendto(struct.pack("!BBH", 8, 0, checksum) + body, (ADDR[1], 0))
        while True:
            reply = s.recv(65536)
            ihl = (reply[0] & 15) * 4
            if reply[ihl] == 0 and struct.unpack_from("!HH", reply, ihl + 4) == (0x5252, seq):
                break
        rtts.append(1e3 * (time.monotonic() - sent))
        time.sleep(gap)
    return rtts


# --- the lab: namespaces, devices, processes ----------------------------------------------------

class Missing(Exception):
    pass


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise Missing("needs root (network namespaces and TUN devices): run it as root")
    if not os.path.exists("/dev/net/tun"):
        raise Missing("needs /dev/net/tun (the TUN driver): none on this machine")
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as e:
        raise Missing(f"cannot open /dev/net/tun: {e}")
    probe = f"lr{os.getpid()}probe"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise Missing("needs iproute2's `ip` for network namespaces: not found")
    except subprocess.CalledProcessError as e:
        raise Missing(f"cannot create a network namespace: {e.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Lab:
    """Two namespaces for the whole run; a forwarder (and its TUNs) per experiment."""

    def __init__(self):
        tag = f"lr{os.getpid()}"
        self.ns = (f"{tag}a", f"{tag}b")
        self.tuns = (f"{tag}ta", f"{tag}tb")
        self.children: list[subprocess.Popen] = []
        self.forwarder: subprocess.Popen | None = None
        self.made: list[str] = []

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self) -> None:
        for ns in self.ns:
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # The namespace's default congestion control cannot be set from here
            # (EPERM); every socket sets its own with TCP_CONGESTION instead.
            for key, value in [("net.ipv4.tcp_no_metrics_save", "1"), ("net.ipv6.conf.all.disable_ipv6", "1"),
                               ("net.ipv4.tcp_rmem", "4096 131072 134217728"),
                               ("net.ipv4.tcp_wmem", "4096 16384 134217728")]:
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}")

    def __exit__(self, *exc):
        self.stop_forwarder()
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        return False

    def start_forwarder(self, cfg: dict) -> None:
        cfg = dict(cfg, tuns=self.tuns)
        self.forwarder = subprocess.Popen([sys.executable, __file__, "--role", "forwarder", "--config", json.dumps(cfg)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.forwarder.stdout.readline().strip() != "ready":
            raise RuntimeError("the forwarder did not start")
        for tun, ns, mine, peer in [(self.tuns[0], self.ns[0], *ADDR), (self.tuns[1], self.ns[1], *ADDR[::-1])]:
            sh("ip", "link", "set", tun, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", mine, "peer", peer, "dev", tun)
            sh("ip", "-n", ns, "link", "set", tun, "mtu", str(MTU), "up")

    def stop_forwarder(self) -> list[dict] | None:
        f, self.forwarder = self.forwarder, None
        if f is None or f.poll() is not None:
            return None
        f.stdin.close()  # the forwarder reports and exits; its TUNs go with it
        try:
            out = f.stdout.read()
            f.wait(timeout=10)
        except subprocess.TimeoutExpired:
            f.kill()
            f.wait()
            return None
        return json.loads(out.strip().splitlines()[-1])

    def spawn(self, side: int, *args: str) -> subprocess.Popen:
        child = subprocess.Popen(["ip", "netns", "exec", self.ns[side], sys.executable, __file__, *args],
                                 stdout=subprocess.PIPE, text=True)
        self.children.append(child)
        return child

    def collect(self, child: subprocess.Popen, timeout: float) -> dict:
        out, _ = child.communicate(timeout=timeout)
        if child.returncode != 0:
            raise RuntimeError(f"an endpoint failed (exit {child.returncode})")
        return json.loads(out.strip().splitlines()[-1])

    def transfer(self, cfg: dict, size: int, cc: str = "cubic") -> dict:
        """One bulk transfer; its time from the first data to the last byte received."""
        self.start_forwarder(cfg)
        deadline = int(60 + 3 * size * 8 / (cfg["rate"] * 8) + 20 * cfg["latency_ms"] / 1e3 * 100)
        common = ["--bytes", str(size), "--cc", cc, "--deadline", str(deadline)]
        sink = self.spawn(1, "--role", "sink", *common)
        sink.stdout.readline()  # listening
        source = self.spawn(0, "--role", "source", *common)
        done = self.collect(sink, deadline)
        start = self.collect(source, deadline)
        links = self.stop_forwarder()
        if {done["cc"], start["cc"]} != {cc}:
            raise RuntimeError(f"asked for {cc}, the sockets ran {done['cc']} and {start['cc']}")
        return dict(seconds=done["done"] - start["start"],
                    goodput=(size - size // 2) / (done["done"] - done["half"]), links=links,
                    recovery=start["recovery"])

    def transfers(self, cfg: dict, flows: int, size: int, spacing: float = 0.0) -> dict:
        """``flows`` bulk transfers through the shared bottleneck; each flow's time from
        its first data to its last byte received, in the order the flows started."""
        self.start_forwarder(cfg)
        deadline = int(120 + 3 * flows * size / cfg["shared"]["rate"] + flows * spacing)
        common = ["--bytes", str(size), "--count", str(flows), "--spacing", str(spacing), "--deadline", str(deadline)]
        sink = self.spawn(1, "--role", "many-sink", *common)
        sink.stdout.readline()  # listening
        source = self.spawn(0, "--role", "many-source", *common)
        done = self.collect(sink, deadline)["done"]
        start = self.collect(source, deadline)["start"]
        links = self.stop_forwarder()
        order = sorted(start, key=lambda port: start[port])
        return dict(seconds=[done[port] - start[port] for port in order], links=links)

    def ping(self, cfg: dict, count: int, size: int) -> tuple[list[float], list[dict]]:
        self.start_forwarder(cfg)
        child = self.spawn(0, "--role", "ping", "--count", str(count), "--bytes", str(size), "--deadline", "120")
        rtts = self.collect(child, 120)["rtts"]
        return rtts, self.stop_forwarder()


# --- the model ------------------------------------------------------------------------------------

def link_cfg(p: dict, **extra) -> dict:
    cfg = dict(rate=p["rate"], latency_ms=p["latency_ms"], buffer=int(p["buffer"]))
    cfg.update(extra)
    return cfg


def model_long_lived(p: dict, rounds: int, idle: list[float], loss: float, seed: int,
                     drops: tuple[list[int], list[int]] | None = None) -> list[tuple[float, float]]:
    """The model's long-lived connection doing what the Linux client and server do: each
    round an upload, the download as soon as it is in, then the same idle time; its own
    random ``loss``, or the forced ``drops`` (upload, download) the forwarder made."""
    from fedemu.node.net import tcp
    from fedemu.node.net.profiles import DOWN, UP
    from transport_fidelity import profile_of

    lossy = profile_of(p, loss=loss) if loss else profile_of(p)
    transport = tcp.TcpTransport(seed, lambda link, direction: lossy, {}, {})
    if drops:
        transport.forced_losses[(0, UP)], transport.forced_losses[(0, DOWN)] = set(drops[0]), set(drops[1])

    def wait_for(token) -> float:
        while (t := transport.next_arrival()) < float("inf"):
            for a in transport.arrivals(t):
                if a.token == token:
                    return a.arrival
        raise RuntimeError(f"the model never delivered {token}")

    t, times = 0.0, []
    for r in range(rounds):
        transport.send(t, 0, UP, p["size"], ("up", r))
        up_done = wait_for(("up", r))
        transport.send(up_done, 0, DOWN, p["size"], ("down", r))
        down_done = wait_for(("down", r))
        times.append((up_done - t, down_done - up_done))
        t = down_done + (idle[r] if r < rounds - 1 else 0.0)
    return times


# --- the experiments -------------------------------------------------------------------------------

def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def calibrate(lab: Lab) -> list[dict]:
    rows = []
    for rate_mbit, latency in [(1, 20), (12, 20), (50, 20), (100, 20), (200, 20), (500, 20), (1000, 20)]:
        cfg = dict(rate=rate_mbit * MBIT, latency_ms=latency, buffer=2_000_000)
        idle, idle_links = lab.ping(cfg, 20, 56)
        full, full_links = lab.ping(cfg, 20, 1472)
        expect_idle = 2 * latency + 2 * 84 / cfg["rate"] * 1e3  # 20 + 8 + 56 bytes each way
        expect_full = 2 * latency + 2 * 1500 / cfg["rate"] * 1e3
        size = int(min(20_000_000, max(2_000_000, cfg["rate"] * 4)))  # a few seconds of sending
        bulk = lab.transfer(dict(cfg, latency_ms=5, buffer=max(200_000, int(cfg["rate"] * 0.02))), size)
        row = dict(rate_mbit=rate_mbit, latency_ms=latency,
                   ping_idle_ms=statistics.median(idle), ping_idle_expect_ms=expect_idle,
                   ping_full_ms=statistics.median(full), ping_full_expect_ms=expect_full,
                   ping_full_max_ms=max(full),
                   goodput_mbit=bulk["goodput"] / MBIT, goodput_expect_mbit=rate_mbit * PAYLOAD_SHARE,
                   bulk_late_p99_ms=bulk["links"][0]["late_p99_ms"], bulk_late_max_ms=bulk["links"][0]["late_max_ms"],
                   max_packet=bulk["links"][0]["max_packet"], load=load())
        rows.append(row)
        print(f"[calibrate] {rate_mbit} Mbit/s {latency} ms: ping {row['ping_idle_ms']:.2f} (expect "
              f"{expect_idle:.2f}) / full {row['ping_full_ms']:.2f} (expect {expect_full:.2f}) ms; goodput "
              f"{row['goodput_mbit']:.2f} of {row['goodput_expect_mbit']:.2f} Mbit/s; late p99 "
              f"{row['bulk_late_p99_ms']:.2f} ms; largest packet {row['max_packet']} B; load {row['load']}",
              file=sys.stderr)
    return rows


def single_points():
    from transport_fidelity import UPDATE, point
    clean = [point(1, 15, 100_000), point(1, 14, UPDATE), point(1.6, 75, UPDATE), point(12, 15, UPDATE),
             point(12, 35, UPDATE), point(12, 50, 5_000_000), point(12, 300, UPDATE), point(50, 15, UPDATE),
             point(50, 50, 5_000_000), point(100, 50, UPDATE), point(12, 35, UPDATE, cc="reno"),
             point(12, 35, UPDATE, buffer=150_000, small_buffer=True)]
    lossy = [(point(12, 35, UPDATE), 0.01), (point(12, 35, UPDATE), 0.05), (point(1, 14, UPDATE), 0.01),
             (point(1.6, 75, UPDATE), 0.01), (point(50, 50, UPDATE), 0.01), (point(12, 300, UPDATE), 0.01)]
    return clean, lossy


def run_single(lab: Lab, seeds: int, repeats: int) -> list[dict]:
    from transport_fidelity import draw_losses, label, model
    clean, lossy = single_points()
    rows = []
    for p in clean:
        runs = [lab.transfer(link_cfg(p), p["size"], p.get("cc", "cubic")) for _ in range(repeats)]
        linux = statistics.median(r["seconds"] for r in runs)
        (fed,) = model(p)
        rows.append(dict(block="clean", point=label(p), linux_s=linux, linux_range_s=[min(r["seconds"] for r in runs),
                         max(r["seconds"] for r in runs)], model_s=fed, ratio=fed / linux,
                         late_p99_ms=max(r["links"][0]["late_p99_ms"] for r in runs),
                         overflow=sum(r["links"][0].get("overflow", 0) for r in runs) / len(runs),
                         ok=abs(fed / linux - 1) <= 0.10, load=load()))
        print(row_text(rows[-1]), file=sys.stderr)
    for p, rate in lossy:
        ratios, linux, feds, late = [], [], [], []
        for seed in range(1, seeds + 1):
            drop = draw_losses(p, dict(loss=rate), seed)
            run = lab.transfer(link_cfg(p, drop=drop), p["size"])
            (fed,) = model(p, drop=drop)
            linux.append(run["seconds"])
            feds.append(fed)
            ratios.append(fed / run["seconds"])
            late.append(run["links"][0]["late_p99_ms"])
        median = statistics.median(ratios)
        rows.append(dict(block="loss", point=f"{label(p)}, loss {rate:.0%} (paired)", linux_s=statistics.median(linux),
                         linux_range_s=[min(linux), max(linux)], model_s=statistics.median(feds), ratio=median,
                         ratio_range=[min(ratios), max(ratios)], late_p99_ms=max(late),
                         ok=abs(median - 1) <= 0.25, load=load()))
        print(row_text(rows[-1]), file=sys.stderr)
    return rows


def run_long_loss(lab: Lab, seeds: int) -> list[dict]:
    """transport_fidelity.py's ``longloss`` points (5% loss, 75 and 300 ms, CUBIC and
    Reno) with the same losses for Linux, the model and, where its binary is built,
    ns-3 3.37: the two references disagreed with each other there, and Linux decides.
    Linux's retransmission timeouts and loss probes are counted in its namespace."""
    from transport_fidelity import draw_losses, label, long_loss_points, model, ns3, reference_binary, save_ns3_cache
    try:
        reference_binary()
        have_ns3 = True
    except subprocess.CalledProcessError:  # its build failed: libns3-dev is not installed
        print("ns-3's reference did not build (apt-get install libns3-dev): its column stays empty", file=sys.stderr)
        have_ns3 = False
    rows = []
    for p in long_loss_points():
        linux, feds, refs, recovery = [], [], [], collections.Counter()
        for seed in range(1, seeds + 1):
            drop = draw_losses(p, dict(loss=0.05), seed)
            run = lab.transfer(link_cfg(p, drop=drop), p["size"], p.get("cc", "cubic"))
            (fed,) = model(p, drop=drop)
            linux.append(run["seconds"])
            feds.append(fed)
            recovery.update(run["recovery"])
            refs.append(ns3(p, drop=drop)[0] if have_ns3 else None)
        ratios = [f / x for f, x in zip(feds, linux)]
        median = statistics.median(ratios)
        ns3_ratios = [r / x for r, x in zip(refs, linux) if r is not None]
        rows.append(dict(block="longloss", point=f"{label(p)}, loss 5% (paired)", linux_s=statistics.median(linux),
                         linux_range_s=[min(linux), max(linux)], model_s=statistics.median(feds), ratio=median,
                         ratio_range=[min(ratios), max(ratios)],
                         quartiles=[round(q, 3) for q in statistics.quantiles(ratios, n=4)],
                         ns3_s=statistics.median(r for r in refs if r is not None) if ns3_ratios else None,
                         ns3_ratio=statistics.median(ns3_ratios) if ns3_ratios else None,
                         linux_recovery=dict(recovery), linux_each_s=linux, model_each_s=feds, ns3_each_s=refs,
                         ok=abs(median - 1) <= 0.25, load=load()))
        print(row_text(rows[-1]) + (f"; ns-3 / linux x{rows[-1]['ns3_ratio']:.3f}" if ns3_ratios else "")
              + f"; linux {dict(recovery)}", file=sys.stderr)
    if have_ns3:
        save_ns3_cache()
    return rows


def long_lived_losses(p: dict, rounds: int, loss: float, seed: int) -> tuple[list[int], list[int]]:
    """Which segments of the upload and the download streams lose their first
    transmission (segments numbered per message from its first byte, as the model's)."""
    nseg = -(-p["size"] // MSS)
    return tuple([int(i) for i in np.flatnonzero(np.random.default_rng([52, seed, d, 2]).random(rounds * nseg) < loss)]
                 for d in (0, 1))


def run_long_lived(lab: Lab, seeds: int, own_loss: bool, rounds: int = 5) -> list[dict]:
    from transport_fidelity import UPDATE, point
    p = point(12, 35, UPDATE)  # `lte`
    rows = []
    for loss in (0.0, 0.01, 0.02):
        per_seed = []
        for seed in range(1, (seeds if loss else 1) + 1):
            idle = [float(x) for x in np.random.default_rng([52, seed, 1]).uniform(0.5, 5.0, rounds - 1)]
            if own_loss:
                cfg, drops = link_cfg(p, loss=loss, loss_dirs=[0, 1], seed=seed), None
            else:
                drops = long_lived_losses(p, rounds, loss, seed)
                cfg = link_cfg(p, drop=drops[0], drop_back=drops[1], message_bytes=p["size"])
            lab.start_forwarder(cfg)
            common = ["--bytes", str(p["size"]), "--rounds", str(rounds), "--deadline", "300"]
            server = lab.spawn(1, "--role", "server", *common)
            server.stdout.readline()
            client = lab.spawn(0, "--role", "client", *common, "--idle", json.dumps(idle))
            s, c = lab.collect(server, 300), lab.collect(client, 300)
            links = lab.stop_forwarder()
            linux = [(s["up_done"][r] - c["up_start"][r], c["down_done"][r] - s["down_start"][r]) for r in range(rounds)]
            fed = model_long_lived(p, rounds, idle, loss if own_loss else 0.0, seed, drops)
            per_seed.append((linux, fed))
            print(f"[longlived] loss {loss:.0%} seed {seed}: idle {[round(x, 2) for x in idle]}; linux "
                  f"{[(round(u, 3), round(d, 3)) for u, d in linux]}; model {[(round(u, 3), round(d, 3)) for u, d in fed]}; "
                  f"late p99 {max(x['late_p99_ms'] for x in links):.2f} ms", file=sys.stderr)
        for r in range(rounds):
            for k, way in enumerate(("up", "down")):
                lin = statistics.median(ls[r][k] for ls, _ in per_seed)
                fed = statistics.median(fs[r][k] for _, fs in per_seed)
                ratios = [fs[r][k] / ls[r][k] for ls, fs in per_seed]
                rows.append(dict(block="longlived", point=f"`lte`, loss {loss:.0%}{' (own)' if own_loss else ' (paired)' if loss else ''}, round {r + 1} {way}",
                                 linux_s=lin, model_s=fed, ratio=fed / lin, ratio_range=[min(ratios), max(ratios)],
                                 ok=abs(fed / lin - 1) <= (0.25 if loss else 0.10), load=load()))
                print(row_text(rows[-1]), file=sys.stderr)
    return rows


def shared_points() -> list[dict]:
    """Flows through one bottleneck on `lte` access links: ten through 10 Mbit/s, a
    hundred through 100 Mbit/s, each with a deep, a bandwidth-delay-product and a
    shallow queue (BDP: the bottleneck's rate times the 70 ms round trip)."""
    from transport_fidelity import UPDATE, point
    lte = dict(rate_mbit=12, latency_ms=35)
    points = []
    for flows, rate in ((10, 10 * MBIT), (100, 100 * MBIT)):
        bdp = rate * 0.070
        for name, buffer in (("deep", 1_500_000), ("BDP", bdp), ("shallow", bdp / 10)):
            if flows == 100 and name == "deep":
                continue  # a deep queue at 100 flows is transport_fidelity's ns-3 point already
            points.append(dict(point(**lte, size=UPDATE, flows=flows, shared=rate, shared_buffer=int(buffer)),
                               queue=name))
    points.append(dict(point(**lte, size=UPDATE, flows=10, shared=10 * MBIT, shared_buffer=1_500_000, spacing=0.5),
                       queue="deep"))
    return points


def share_done(times: list[float], deadline: float) -> float:
    return sum(t <= deadline for t in times) / len(times)


def run_shared(lab: Lab, repeats: int) -> list[dict]:
    """Each point ``repeats`` times on Linux (its flows spread run to run) against the
    model once (deterministic): the mean completion (goal: within 15%), and at a deadline
    equal to Linux's median completion the share of flows done (goal: within 15 points
    of Linux's, which is about half by definition)."""
    from transport_fidelity import label, model
    rows = []
    for p in shared_points():
        cfg = dict(link_cfg(p), shared=dict(rate=p["shared"], buffer=p["shared_buffer"]))
        runs = [lab.transfers(cfg, p["flows"], p["size"], p.get("spacing", 0.0)) for _ in range(repeats)]
        linux = [t for r in runs for t in r["seconds"]]
        fed = model(p)
        median = statistics.median(linux)
        share_linux = statistics.mean(share_done(r["seconds"], median) for r in runs)
        share_model = share_done(fed, median)
        mean_ratio = statistics.mean(fed) / statistics.mean(linux)
        rows.append(dict(block="shared", point=f"{label(p)}, {p['queue']} queue", linux_mean_s=statistics.mean(linux),
                         linux_range_s=[min(linux), max(linux)], model_mean_s=statistics.mean(fed),
                         model_range_s=[min(fed), max(fed)], mean_ratio=mean_ratio, share_linux=share_linux,
                         share_model=share_model, linux_s=[r["seconds"] for r in runs], model_s=fed,
                         late_p99_ms=max(x["late_p99_ms"] for r in runs for x in r["links"]),
                         overflow=[r["links"][0].get("overflow", 0) for r in runs],
                         ok=abs(mean_ratio - 1) <= 0.15 and abs(share_model - share_linux) <= 0.15, load=load()))
        row = rows[-1]
        print(f"[shared] {row['point']}: linux mean {row['linux_mean_s']:.3f} s ({min(linux):.3f}-{max(linux):.3f}), "
              f"model mean {row['model_mean_s']:.3f} s ({min(fed):.3f}-{max(fed):.3f}), x{mean_ratio:.3f}; done by "
              f"linux's median {median:.3f} s: linux {share_linux:.0%}, model {share_model:.0%}; "
              f"{'ok' if row['ok'] else 'OUTSIDE GOAL'}", file=sys.stderr)
    return rows


def row_text(row: dict) -> str:
    return (f"[{row['block']}] {row['point']}: linux {row['linux_s']:.4g} s, model {row['model_s']:.4g} s, "
            f"x{row['ratio']:.3f} {'ok' if row['ok'] else 'OUTSIDE GOAL'}")


def cell(v) -> str:
    if isinstance(v, bool):
        return "pass" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return " - ".join(cell(x) for x in v)
    return "" if v is None else str(v)


def table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " if c == "point" else " ---: " for c in columns) + "|"]
    out += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["forwarder", "sink", "source", "server", "client", "ping", "many-sink",
                                           "many-source"])
    parser.add_argument("--spacing", type=float, default=0.0)
    parser.add_argument("--config")
    parser.add_argument("--bytes", type=int, default=0)
    parser.add_argument("--cc", default="cubic")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--idle", default="[]")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--deadline", type=int, default=600)
    parser.add_argument("--parts", nargs="+", default=["calibrate", "single", "longlived", "shared"],
                        choices=["calibrate", "single", "longlived", "shared", "longloss"])
    parser.add_argument("--seeds", type=int, default=5, help="seeds a lossy point runs (paired losses)")
    parser.add_argument("--own-loss", action="store_true",
                        help="long-lived: each its own Bernoulli loss (default: the same losses in both)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of a loss-free point (median)")
    parser.add_argument("--json", default=str(HERE / "results" / "linux-reference.json"))
    args = parser.parse_args()
    if args.role == "forwarder":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it (stdin closes)
        forwarder(json.loads(args.config))
        return 0
    if args.role == "ping":
        signal.alarm(args.deadline)
        print(json.dumps(dict(rtts=ping(args.count, args.bytes, 0.05))), flush=True)
        return 0
    if args.role in ("many-sink", "many-source"):
        many(args)
        return 0
    if args.role:
        endpoint(args)
        return 0
    try:
        check_prerequisites()
    except Missing as e:
        print(f"linux_reference.py: {e}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # leave through Lab.__exit__
    results = dict(machine=f"{os.cpu_count()} cores, {os.uname().release}", load_before=load())
    started = time.monotonic()
    try:
        with Lab() as lab:
            if "calibrate" in args.parts:
                results["calibration"] = calibrate(lab)
            if "single" in args.parts:
                results["single"] = run_single(lab, args.seeds, args.repeats)
            if "longlived" in args.parts:
                results["longlived"] = run_long_lived(lab, args.seeds, args.own_loss)
            if "shared" in args.parts:
                results["shared"] = run_shared(lab, args.repeats)
            if "longloss" in args.parts:
                results["longloss"] = run_long_loss(lab, args.seeds)
    except KeyboardInterrupt:
        print("interrupted; namespaces and processes removed", file=sys.stderr)
        return 130
    results.update(load_after=load(), wall_s=time.monotonic() - started)
    if "calibration" in results:
        print("\n### Calibration\n")
        print(table(results["calibration"], ["rate_mbit", "latency_ms", "ping_idle_ms", "ping_idle_expect_ms",
                                             "ping_full_ms", "ping_full_expect_ms", "goodput_mbit",
                                             "goodput_expect_mbit", "bulk_late_p99_ms", "max_packet", "load"]))
    if "shared" in results:
        passed = sum(r["ok"] for r in results["shared"])
        print(f"\n### shared: {passed} of {len(results['shared'])} within the goal\n")
        print(table(results["shared"], ["point", "linux_mean_s", "linux_range_s", "model_mean_s", "model_range_s",
                                        "mean_ratio", "share_linux", "share_model", "late_p99_ms", "ok", "load"]))
    if "longloss" in results:
        passed = sum(r["ok"] for r in results["longloss"])
        print(f"\n### longloss: {passed} of {len(results['longloss'])} within the goal\n")
        print(table(results["longloss"], ["point", "linux_s", "linux_range_s", "model_s", "ratio", "quartiles",
                                          "ns3_s", "ns3_ratio", "linux_recovery", "ok", "load"]))
    for part in ("single", "longlived"):
        if part in results:
            passed = sum(r["ok"] for r in results[part])
            print(f"\n### {part}: {passed} of {len(results[part])} within the goal\n")
            print(table(results[part], ["point", "linux_s", "linux_range_s", "model_s", "ratio", "ratio_range",
                                        "late_p99_ms", "ok", "load"]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nload average before {results['load_before']}, after {results['load_after']}; "
          f"{results['wall_s']:.0f} s; figures in {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
