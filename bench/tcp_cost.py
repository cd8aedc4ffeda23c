"""What the TCP model (node/net/tcp.py) costs: CPU microseconds per message, the model alone.

A round of federated learning as the broker would drive it: 1,000 clients each get the
model (797,015 bytes, the 2NN) at the same instant and upload an update of the same
size when their (seeded, 1-3 s) training ends, on `lte` links (12 Mbit/s, 35 ms), with and
without the server's links shared (1 Gbit/s each way). The driver asks the model what is
due as a scheduler would: ``next_arrival()`` then ``arrivals(t)``; with ``--until``, it
passes the time of its next other event (``next_arrival(until=...)``), as a virtual-time
scheduler can. Today's ``message`` transport (``Network.transmit``) is timed on the same
messages for scale. Figures are CPU time of this process (``time.process_time``).

    python bench/tcp_cost.py [--clients 1000] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import time

from fedemu.node.net.links import Network

from fedemu.node.net.profiles import DOWN, UP, LinkProfile
from fedemu.node.net.tcp import TcpTransport

SIZE = 797_015


def fl_round(model: TcpTransport, clients: int, start: float, seed: int, until: bool) -> tuple[float, int]:
    """One round: broadcast, training, uploads. Returns when the last update arrived."""
    rng = random.Random(seed)
    for k in range(clients):
        model.send(start, k, DOWN, SIZE, ("model", k))
    pending: list = []  # (time, client): training ends
    uploads = 0
    delivered = 0
    last = start
    while delivered < 2 * clients:
        other = pending[0][0] if pending else math.inf
        t = model.next_arrival(until=other) if until else model.next_arrival()
        if t <= other and t < math.inf:
            for a in model.arrivals(t):
                delivered += 1
                last = a.arrival
                kind, k = a.token
                if kind == "model":
                    heapq.heappush(pending, (a.arrival + rng.uniform(1.0, 3.0), k))
        else:
            when, k = heapq.heappop(pending)
            model.arrivals(when)
            model.send(when, k, UP, SIZE, ("update", k))
            uploads += 1
    return last, uploads


def run_model(clients: int, rounds: int, shared: bool, until: bool) -> dict:
    profile = LinkProfile(transport="tcp", latency_ms=35, bandwidth=12e6 / 8)
    server = {UP: 1e9 / 8, DOWN: 1e9 / 8} if shared else {}
    model = TcpTransport(1, lambda link, direction: profile, server)
    cpu = time.process_time()
    t = 0.0
    for r in range(rounds):
        t, _ = fl_round(model, clients, t, r, until)
    cpu = time.process_time() - cpu
    messages = 2 * clients * rounds
    return dict(shared=shared, until=until, clients=clients, rounds=rounds, messages=messages,
                cpu_s=cpu, us_per_message=1e6 * cpu / messages, emulated_s=t)


def run_pipe(clients: int, rounds: int) -> dict:
    network = Network(seed=1, default=LinkProfile(latency_ms=35, bandwidth=12e6 / 8))
    cpu = time.process_time()
    for r in range(rounds):
        for k in range(clients):
            network.transmit(k, DOWN, SIZE, float(r))
            network.transmit(k, UP, SIZE, float(r) + 1)
    cpu = time.process_time() - cpu
    messages = 2 * clients * rounds
    return dict(transport="message", messages=messages, cpu_s=cpu, us_per_message=1e6 * cpu / messages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [run_pipe(args.clients, args.rounds)]
    for shared in (False, True):
        for until in (False, True):
            rows.append(run_model(args.clients, args.rounds, shared, until))
    print("| transport | server links | next_arrival | µs CPU per message | CPU s | messages | emulated s |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r.get("transport") == "message":
            print(f"| message (today's pipe) | - | - | {r['us_per_message']:.1f} | {r['cpu_s']:.3f} | {r['messages']} | |")
        else:
            print(f"| tcp | {'shared, 1 Gbit/s' if r['shared'] else 'unlimited'} | {'until' if r['until'] else 'plain'} | "
                  f"{r['us_per_message']:.1f} | {r['cpu_s']:.3f} | {r['messages']} | {r['emulated_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
