"""Per-message cost of fedemu's wire codec: encode and decode, in microseconds.

Every user message is encoded once by its sender and decoded once by its receiver
(the broker unpacks only the header), so in a burst of small messages these costs,
not the bytes, set how many messages a node moves per second.

    /work/venv/bin/python bench/wire_codec.py [--number 20000]
"""
from __future__ import annotations

import argparse
import timeit

import numpy as np

from fedemu.node.wire import USER, Pid, decode, encode, unpack_header

MESSAGES = {
    "control-like map (no array)": {"op": "train", "round": 12, "lr": 0.1, "deadline_s": 30.0},
    "1 KB array (250 float32)": {"seq": 1, "link": 3, "t_send": 12.5, "data": np.ones(250, np.float32)},
    "2NN model (199,210 float32)": {"round": 12, "weights": np.ones(199_210, np.float32)},
    "CNN model (1,663,370 float32)": {"round": 12, "weights": np.ones(1_663_370, np.float32)},
}


def microseconds(fn, number: int) -> float:
    """Best of 5 repeats, per call: the least disturbed figure on a shared machine."""
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000, help="calls per repeat (5 repeats, best kept)")
    args = parser.parse_args()
    src, dst = Pid("worker-0", 7), "server"
    print("| message | frames | bytes | encode µs | decode µs | of which header µs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, body in MESSAGES.items():
        frames = [bytes(f) for f in encode(USER, src, dst, body, 1.0)]
        size = sum(len(f) for f in frames)
        enc = microseconds(lambda: encode(USER, src, dst, body, 1.0), args.number)
        dec = microseconds(lambda: decode(frames), args.number)
        head = microseconds(lambda: unpack_header(frames[0]), args.number)
        print(f"| {name} | {len(frames)} | {size:,} | {enc:.1f} | {dec:.1f} | {head:.1f} |")


if __name__ == "__main__":
    main()
