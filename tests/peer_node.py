"""A node in its own OS process for the runtime tests.

It hosts one process registered as ``<node name>/echo`` that answers every message
with the same body, exits normally on "exit", crashes on "crash", and reports a
second process on request ("spawn-idle" -> the idle pid).
"""
import argparse
import logging
import sys

from fedemu.node import Node
from fedemu.node.security import RunKeys


def echo(proc):
    while True:
        msg = proc.receive()
        if msg.body == "exit":
            return
        if msg.body == "crash":
            raise RuntimeError("asked to crash")
        if msg.body == "spawn-idle":
            proc.send(msg.sender, proc.spawn(lambda p: p.receive()))
            continue
        proc.send(msg.sender, msg.body)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--heartbeat-interval", type=float, default=0.1)
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0)
    parser.add_argument("--keys", help="a run key file: connect as one of the run's nodes")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    keys = RunKeys.load(args.keys) if args.keys else None
    node = Node(args.name, args.broker, heartbeat_interval=args.heartbeat_interval,
                heartbeat_timeout=args.heartbeat_timeout, keys=keys).start()
    node.spawn(echo, name=f"{args.name}/echo")
    print("ready", flush=True)
    node.wait()


if __name__ == "__main__":
    main()
