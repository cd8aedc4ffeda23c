"""Node-to-node bursts: how fast a node's runtime moves many small messages.

A thread process on node ``tx`` (its own OS process) sends a burst of N messages of
1 KB (a 250-float32 array) at once to a thread process on node ``rx`` (this process),
through a real ``fedemu broker`` with no link emulation. Reported per burst size: the
time from the order to send to the last receive, divided by N (µs a message), the
median and the best of the repeats. Every stage runs in Python: the sender's codec and
I/O thread, the broker, the receiving node's I/O thread and its hand-over to the
process, so this is the runtime's own per-message cost when messages queue up (a
server broadcasting, 100 clients answering at once).

    /work/venv/bin/python bench/node_burst.py [--sizes 100 2000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from fedemu.node import TIMEOUT, Node

RX_NAME = "bench/burst-rx"


def run_sender(endpoint: str) -> None:
    """`--role sender`: on each stdin line N, one process sends N messages at once."""
    node = Node("burst-tx", endpoint).start()
    while node.whereis(RX_NAME) is None:
        time.sleep(0.05)
    data = np.ones(250, np.float32)

    def sender(proc) -> None:
        for line in sys.stdin:
            for i in range(int(line)):
                proc.send(RX_NAME, {"i": i, "data": data})
        node.close("input ended")

    node.spawn(sender)
    print("ready", flush=True)
    node.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 2000], help="messages per burst")
    parser.add_argument("--repeats", type=int, default=7, help="bursts per size (after one warm-up burst)")
    parser.add_argument("--role", choices=("bench", "sender"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "sender":
        return run_sender(args.endpoint)

    with tempfile.TemporaryDirectory(prefix="node-burst-") as tmp:
        endpoint_file = Path(tmp) / "broker.endpoint"
        broker = subprocess.Popen([sys.executable, "-m", "fedemu.launch", "broker", "--bind", "tcp://127.0.0.1:0",
                                   "--endpoint-file", str(endpoint_file), "--log-dir", tmp],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sender = None
        node = None
        try:
            deadline = time.monotonic() + 30
            while not endpoint_file.exists():
                if broker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the broker did not start")
                time.sleep(0.02)
            endpoint = endpoint_file.read_text().strip()
            node = Node("burst-rx", endpoint).start()
            arrivals: list[float] = []
            complete = threading.Event()
            wanted = [0]

            def receiver(proc) -> None:
                proc.register(RX_NAME)
                while True:
                    if proc.receive(timeout=1.0) is TIMEOUT:
                        continue
                    arrivals.append(time.monotonic())
                    if len(arrivals) >= wanted[0]:
                        complete.set()

            node.spawn(receiver)
            sender = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", "sender",
                                       "--endpoint", endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
            if sender.stdout.readline().strip() != "ready":
                raise RuntimeError("the sender node did not start")
            print("| burst | median µs a message | best µs a message | repeats |")
            print("| ---: | ---: | ---: | ---: |")
            for size in args.sizes:
                per_message = []
                for repeat in range(args.repeats + 1):
                    arrivals.clear()
                    wanted[0] = size
                    complete.clear()
                    started = time.monotonic()
                    sender.stdin.write(f"{size}\n")
                    sender.stdin.flush()
                    if not complete.wait(120):
                        raise RuntimeError(f"only {len(arrivals)} of {size} messages arrived")
                    if repeat:  # the first burst warms connections and buffers up
                        per_message.append((arrivals[-1] - started) / size * 1e6)
                    time.sleep(0.2)
                print(f"| {size} | {statistics.median(per_message):.1f} | {min(per_message):.1f} | {args.repeats} |")
        finally:
            if node is not None:  # first: the sender's leaving is no news to report
                node.close("benchmark done")
            if sender is not None:
                sender.stdin.close()
                sender.wait(30)
            broker.terminate()
            broker.wait(30)


if __name__ == "__main__":
    main()
