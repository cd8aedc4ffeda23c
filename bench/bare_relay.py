"""The baseline for broker_throughput.py: the least a ZeroMQ ROUTER relay can do.

Frames in:  [sender identity, destination identity, *rest]
Frames out: [destination identity, *rest]

Received and sent frame by frame with int flags, as the fedemu broker does.

No header parsing, no hello, no accounting, no liveness: only what any relay must do
(receive, pick the destination from a fixed frame, send), on a ROUTER with the same
socket options as the fedemu broker, so the comparison measures fedemu's own work.

Usage: bare_relay.py --bind tcp://127.0.0.1:0 --endpoint-file F
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import zmq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="tcp://127.0.0.1:0")
    parser.add_argument("--endpoint-file", type=Path, required=True)
    args = parser.parse_args()

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    # Same options as fedemu's Broker: a fair comparison of the per-message work.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if args.bind.endswith(":0"):
        port = sock.bind_to_random_port(args.bind[: -len(":0")])
        endpoint = f"{args.bind[:-2]}:{port}"
    else:
        sock.bind(args.bind)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    tmp = args.endpoint_file.with_suffix(".tmp")
    tmp.write_text(endpoint + "\n")
    os.replace(tmp, args.endpoint_file)  # the reader never sees half an address

    # SIGTERM ends the blocking recv with an exception instead of killing mid-send.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Frame by frame with plain int flags, as the fedemu broker does: recv_multipart
    # and send_multipart spend more per frame on flag handling than the relay itself,
    # and the comparison is meant to measure fedemu's own work.
    recv, send = sock.recv, zmq.backend.Socket.send.__get__(sock)  # the C send, as the broker
    more = int(zmq.SNDMORE)
    try:
        while True:
            recv(0)  # the sender's identity (small bytes, as the broker reads it): not needed
            destination = recv(0, copy=False)
            frames = []
            frame = destination
            while frame.more:  # a multipart message arrives whole: the rest is here
                frame = recv(0, copy=False)
                frames.append(frame)
            if not frames:  # nothing after the destination: nothing to relay
                continue
            try:
                send(destination, more)
                for frame in frames[:-1]:
                    send(frame, more)
                send(frames[-1])
            except zmq.ZMQError:  # destination not connected: drop, like the broker
                pass
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main()
