"""Write a tiny, synthetic pair of FedScale trace pickles beside this script, so the
README's trace example runs without FedScale's own (large) files:

* ``client_device_capacity``: client id -> {'computation': ms of inference per sample,
  'communication': kbit/s};
* ``client_behave_trace``: client id -> {'duration', 'inactive', 'finish_time',
  'active', 'model'}, times in s, online from each active[i] to inactive[i], repeating
  every finish_time.

The structure is FedScale's documented one ("Device Trace File Formats",
SymbioticLab/FedScale, benchmark/dataset/data/device_info/README.md); fedemu reads it
as node/net/trace_files.py says. The figures are made up, not measured: 20 clients,
computation 10-80 ms, communication 500-20,000 kbit/s, and each client online in two
sessions of a one-hour cycle, the even ones from t = 0. Deterministic (a fixed seed): rerunning writes the same
bytes. Run: python examples/traces/make_synthetic_fedscale.py
"""
from __future__ import annotations

import pickle
import random
from pathlib import Path

CLIENTS = 20
CYCLE_S = 3600  # each client's availability repeats every hour
SEED = 54


def device_capacity(rng: random.Random) -> dict:
    return {k: {"computation": round(rng.uniform(10.0, 80.0), 1), "communication": round(rng.uniform(500.0, 20000.0), 1)}
            for k in range(CLIENTS)}


def behave_trace(rng: random.Random) -> dict:
    trace = {}
    for k in range(CLIENTS):
        first = 0 if k % 2 == 0 else rng.randrange(60, 600)  # half online from the start: a run begins at once
        first_end = first + rng.randrange(600, 1200)
        second = first_end + rng.randrange(300, 600)
        second_end = min(second + rng.randrange(300, 900), CYCLE_S)
        trace[k] = {"duration": (first_end - first) + (second_end - second), "inactive": [first_end, second_end],
                    "finish_time": CYCLE_S, "active": [first, second], "model": "synthetic"}
    return trace


def main() -> None:
    here = Path(__file__).resolve().parent
    rng = random.Random(SEED)
    for name, content in (("client_device_capacity", device_capacity(rng)), ("client_behave_trace", behave_trace(rng))):
        # protocol 4: what FedScale's Python 3 tools write; plain dicts, lists and numbers only
        (here / name).write_bytes(pickle.dumps(content, protocol=4))
        print(f"{here / name}: {len(content)} clients")


if __name__ == "__main__":
    main()
