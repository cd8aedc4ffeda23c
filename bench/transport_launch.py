"""The TCP transport in real runs: what a ``fedemu launch`` records against the model alone and ns-3.

    python bench/transport_launch.py [--rows lte 100mbit-50ms lte-loss-1pc 3g] [--rounds 2]
        [--seeds 1 2 3] [--json bench/results/transport-launch.json] [--keep DIR] [--no-ns3]

For each row (a link profile from bench/transport_fidelity.py's grid): ``fedemu launch``
of the default job cut to one client (MNIST 2NN, FedAvg, all of MNIST on that client,
C = 1, virtual time, ``--rounds`` rounds, transport ``tcp``, every client on the row's
link), once per seed for rows with loss (the seed decides which packets are lost), once
for the rest. Each transfer the run recorded (timeline.csv: the round's download and its
upload, payload bytes, entry and arrival in emulated time) is set beside:

* *replay*: node/net/tcp.py alone, given the run's own network (network.json, read as the
  broker reads it) and the run's sends at their times: one connection carrying every
  round, as in the run. In virtual time the broker hands the model exactly these inputs,
  so this must equal the run to the timeline's microsecond (``same``);
* *fresh*: the model alone for one message of the same size on a new connection (what
  bench/transport_fidelity.py measures). A run's first transfer each way is on a new
  connection; later ones meet a connection that remembers (slow-start threshold, RTT
  estimate, and which packets its loss stream draws next), so they may differ;
* *ns-3*: ns-3 3.37 (bench/ns3/tcp_reference.cc, as in transport_fidelity.py) for the
  same size on that direction's rate, one-way latency and buffer, with, where the link
  loses packets, the same segments losing their first transmission as in the replay
  (ns-3 retransmits whatever it loses: a retransmission the model loses again is not
  lost again in ns-3; the column ``relost`` counts them). ns-3's answers are cached
  beside its binary; ``--no-ns3`` leaves the column out where ns-3 is not installed;
* *pipe*: the ``message`` transport's time for the same message (serialization, then
  latency), for scale.

The events' ``transfer_s_up`` (the round's upload time, summed over its uploads) is
checked against the timeline's upload too.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import transport_fidelity as fidelity  # noqa: E402  (ns-3's program, its cache and runner)

from fedemu.node.net import tcp  # noqa: E402
from fedemu.node.net.links import Network  # noqa: E402
from fedemu.node.net.network_spec import NetworkSpec  # noqa: E402
from fedemu.node.net.profiles import DOWN, UP, LinkProfile  # noqa: E402

# Rows of transport_fidelity.py's grid, as network overrides of a run (issue 42's table).
ROWS = {
    "lte": ("`lte` (12 Mbit/s, 35 ms)", ["network.default_profile=lte"], False),
    "100mbit-50ms": ("100 Mbit/s, 50 ms", ['network.profiles.fast={latency_ms = 50, bandwidth = "100Mbit"}',
                                          "network.default_profile=fast"], False),
    "lte-loss-1pc": ("`lte`, 1% packet loss", ['network.profiles.lossy={latency_ms = 35, bandwidth = "12Mbit", '
                                              'loss = 0.01}', "network.default_profile=lossy"], True),
    "3g": ("`3g` (750 kbit/s up, 1.6 Mbit/s down, 75 ms)", ["network.default_profile=3g"], False),
}
# timeline.csv and the events keep emulated times to the microsecond (a difference of two
# rounded times is within two roundings of the rounded difference).
TIMELINE_EXACT_S = 1.5e-6


def launch(out: Path, row: str, seed: int, rounds: int) -> None:
    command = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(out),
               "--set", "data.clients=1", "--set", "algorithm.C=1", "--set", f"run.rounds={rounds}",
               "--set", "run.target_accuracy=0", "--set", f"run.seed={seed}", "--set", "network.transport=tcp",
               # Every upload counts in its own round: over 3g the default 60 s deadline falls
               # before the one client's upload (4.3 s down, 52.8 s training, 8.9 s up).
               "--set", "algorithm.deadline_s=600"]
    for item in ROWS[row][1]:
        command += ["--set", item]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run of row {row}, seed {seed} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def transfers(run_dir: Path) -> list[dict]:
    """The run's downloads and uploads, in the order they entered their links."""
    with open(run_dir / "timeline.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] in ("download", "upload")]
    for r in rows:
        r["direction"] = UP if r["kind"] == "upload" else DOWN
        for key in ("start_s", "end_s"):
            r[key] = float(r[key])
        for key in ("round", "client", "bytes", "wire_bytes", "retransmitted_bytes"):
            r[key] = int(r[key])
    return sorted(rows, key=lambda r: (r["start_s"], r["direction"]))


def network_of(run_dir: Path) -> Network:
    """The run's network, as the broker builds it from network.json."""
    spec = json.loads((run_dir / "network.json").read_text())
    return NetworkSpec.from_config(spec["network"], spec["num_clients"], spec["seed"], spec["time_scale"]).build()


class _Recording(tcp.TcpTransport):
    """The model, noting which segments of each connection were lost on the link (and
    which of those were retransmissions), for ns-3 to lose the same ones. It reads the
    model's rounds as they are queued; it changes nothing in them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lost_first: dict[tuple[int, int], set[int]] = {}
        self.lost_again: dict[tuple[int, int], list[int]] = {}

    def _queue_round(self, flow, rnd, t, profile, dropped, rtx_at):
        retransmitted = set(rnd.segments[0])
        first = self.lost_first.setdefault((flow.link, flow.direction), set())
        for seg in rnd.lost:
            if seg in retransmitted or seg in first:
                self.lost_again.setdefault((flow.link, flow.direction), []).append(seg)
            else:
                first.add(seg)
        return super()._queue_round(flow, rnd, t, profile, dropped, rtx_at)


def server_links(network: Network) -> dict[int, float]:
    return {d: (b.bandwidth if b is not None else math.inf) for d, b in network.server_links.items()}


def replay(network: Network, sends: list[dict]) -> tuple[list[float], _Recording]:
    """The model alone, given the run's sends at their times (one connection per client,
    as in the run): each message's arrival, in the order of ``sends``. It also gives
    each message its first segment in its direction's byte stream and its segments
    (``seg0``, ``nseg``)."""
    model = _Recording(network.seed, network.profile, server_links(network))
    arrival = [math.nan] * len(sends)
    next_seg: dict[tuple[int, int], int] = {}
    for i, s in enumerate(sends):
        for a in model.arrivals(s["start_s"]):
            arrival[a.token] = a.arrival
        profile = network.profile(s["client"], s["direction"])
        key = (s["client"], s["direction"])
        s["seg0"] = next_seg.get(key, 0)
        s["nseg"] = max(1, -(-(s["bytes"] + profile.overhead_bytes) // profile.mss_bytes))
        next_seg[key] = s["seg0"] + s["nseg"]
        model.send(s["start_s"], s["client"], s["direction"], s["bytes"], i)
    while (t := model.next_arrival()) < math.inf:
        for a in model.arrivals(t):
            arrival[a.token] = a.arrival
    return arrival, model


def fresh(network: Network, link: int, direction: int, size: int, drop: list[int] | None = None) -> float:
    """The model alone: one message of ``size`` on a new connection of the run's link;
    given ``drop``, losing exactly those segments' first transmissions instead of the
    link's own random loss (as ns-3 is given them)."""
    profile = network.profile
    if drop is not None:
        def profile(link_: int, direction_: int) -> LinkProfile:
            return replace(network.profile(link_, direction_), loss=0.0, ge_p=0.0)
    model = tcp.TcpTransport(network.seed, profile, server_links(network))
    if drop:
        model.forced_losses[link, direction] = set(drop)
    model.send(0.0, link, direction, size, None)
    while (t := model.next_arrival()) < math.inf:
        for a in model.arrivals(t):
            return a.arrival - a.entry
    return math.inf


def pipe(network: Network, link: int, direction: int, size: int) -> float:
    """The ``message`` transport's time for the message (no loss): serialization, then latency."""
    profile = replace(network.profile(link, direction), transport="message", loss=0.0, ge_p=0.0)
    return Network(seed=1, default=profile).transmit(link, direction, size, 0.0).transfer_s


def reference(network: Network, link: int, direction: int, size: int, drop: list[int]) -> float:
    """ns-3 for the message on that direction's rate, latency and buffer, losing ``drop``."""
    profile = network.profile(link, direction)
    reverse = network.profile(link, 1 - direction)
    if profile.latency_ms != reverse.latency_ms:
        raise ValueError("ns-3's reference has one delay both ways")
    point = dict(rate=profile.bandwidth, latency_ms=profile.latency_ms, size=size,
                 buffer=tcp.default_buffer(profile, reverse), cc=profile.congestion)
    (seconds,) = fidelity.ns3(point, drop=drop or None)
    return seconds


def measure(row: str, seed: int, rounds: int, out: Path, use_ns3: bool) -> list[dict]:
    started = time.monotonic()
    launch(out, row, seed, rounds)
    wall = time.monotonic() - started
    sends = transfers(out)
    network = network_of(out)
    arrivals, model = replay(network, sends)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    transfer_up = {e["round"]: e["transfer_s_up"] for e in events if e["event"] == "round"}
    results = []
    for s, replayed in zip(sends, arrivals):
        link, direction, size = s["client"], s["direction"], s["bytes"]
        mine = range(s["seg0"], s["seg0"] + s["nseg"])
        drop = sorted(seg - s["seg0"] for seg in model.lost_first.get((link, direction), ()) if seg in mine)
        relost = sum(seg in mine for seg in model.lost_again.get((link, direction), ()))
        run_s = s["end_s"] - s["start_s"]
        result = dict(row=row, label=ROWS[row][0], seed=seed, round=s["round"], direction=s["kind"], bytes=size,
                      wire_bytes=s["wire_bytes"], retransmitted_bytes=s["retransmitted_bytes"], run_s=run_s,
                      replay_s=replayed - s["start_s"], same=abs(replayed - s["end_s"]) <= TIMELINE_EXACT_S,
                      fresh_s=fresh(network, link, direction, size), pipe_s=pipe(network, link, direction, size),
                      fresh_same_losses_s=fresh(network, link, direction, size, drop) if drop else None,
                      lost_first=len(drop), relost=relost, launch_wall_s=wall)
        if s["kind"] == "upload":
            result["events_transfer_s_up"] = transfer_up.get(s["round"])
        if use_ns3:
            result["ns3_s"] = reference(network, link, direction, size, drop)
        results.append(result)
    return results


def table(results: list[dict]) -> str:
    heads = ["link", "seed", "round", "direction", "payload B", "wire B", "retransmitted B", "run, s", "replay",
             "fresh connection, s", "lost / relost", "fresh, same losses, s", "ns-3, s", "run / ns-3",
             "fresh, same losses / ns-3", "pipe, s", "events' transfer_s_up"]
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * 4 + " ---: |" * (len(heads) - 4)]
    for r in results:
        ns3, same_losses = r.get("ns3_s"), r.get("fresh_same_losses_s")
        up = r.get("events_transfer_s_up")
        lines.append(" | ".join([
            "", r["label"], str(r["seed"]), str(r["round"]), r["direction"], f"{r['bytes']:,}", f"{r['wire_bytes']:,}",
            f"{r['retransmitted_bytes']:,}", f"{r['run_s']:.6f}", "same" if r["same"] else f"**{r['replay_s']:.6f}**",
            f"{r['fresh_s']:.6f}", f"{r['lost_first']} / {r['relost']}",
            "" if same_losses is None else f"{same_losses:.6f}", "" if ns3 is None else f"{ns3:.6f}",
            "" if ns3 is None else f"{r['run_s'] / ns3:.3f}",
            "" if ns3 is None or same_losses is None else f"{same_losses / ns3:.3f}", f"{r['pipe_s']:.4f}",
            "" if up is None else ("same" if abs(up - r["run_s"]) <= TIMELINE_EXACT_S else f"**{up:.6f}**"), ""]).strip())
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="run seeds of rows with loss")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "transport-launch.json")
    parser.add_argument("--keep", type=Path, help="keep the runs under this folder")
    parser.add_argument("--no-ns3", action="store_true", help="leave ns-3 out (it is not installed)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("need --rounds >= 1")
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="fedemu-transport-launch-") as tmp:
        where = args.keep or Path(tmp)
        for row in args.rows:
            for seed in (args.seeds if ROWS[row][2] else args.seeds[:1]):
                print(f"  {row}, seed {seed} ...", file=sys.stderr, flush=True)
                results += measure(row, seed, args.rounds, where / f"{row}-seed{seed}", not args.no_ns3)
    if not args.no_ns3:
        fidelity.save_ns3_cache()
    print(f"transport in real runs: MNIST 2NN, FedAvg, 1 client, C = 1, virtual time, {args.rounds} round(s); "
          f"{os.cpu_count()} cores; 1-min load average at end {os.getloadavg()[0]:.2f}")
    print(table(results))
    same = sum(r["same"] for r in results)
    print(f"\nreplay equals the run: {same} of {len(results)} transfers", file=sys.stderr)
    uploads = [r for r in results if r["direction"] == "upload" and "ns3_s" in r]
    if uploads:
        print("uploads, run / ns-3: median {:.3f}, range {:.3f}-{:.3f}".format(
            statistics.median(r["run_s"] / r["ns3_s"] for r in uploads),
            min(r["run_s"] / r["ns3_s"] for r in uploads), max(r["run_s"] / r["ns3_s"] for r in uploads)),
            file=sys.stderr)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(rounds=args.rounds, wall_s=time.monotonic() - started, rows=results),
                                    indent=1) + "\n")
    sys.exit(0 if same == len(results) else 1)  # in virtual time a run must be the model, exactly


if __name__ == "__main__":
    main()
