"""What keeping strangers out of a local run's broker costs: four ways it could listen.

* ``tcp``: loopback TCP, no keys, no token (local runs before issue 41: any local user
  could connect, stop the run or hold its virtual clock);
* ``ipc+token``: a unix socket in a directory only this user can enter (mode 0700), and
  the run's token in every hello (what a local run does now);
* ``tcp+curve+token``: loopback TCP with the run's CURVE keys, as ``--machines`` runs
  (every byte encrypted and authenticated), and the token;
* ``ipc+curve+token``: both.

Two measurements, the variants alternating within each repetition so that drift in a
shared machine's load hits them alike; reported: the median of the repetitions.

1. Relay throughput (bench/broker_throughput.py's trial: a sender and a receiver in this
   process, one ``fedemu broker`` process per variant): 800 KB (a 2NN model) and 100-byte
   messages per second, and the broker's CPU per message.
2. A round of 1,000 clients: ``fedemu launch`` of the default job (MNIST 2NN, FedAvg,
   virtual time, two worker nodes) with 1,000 one-example clients, all of them every
   round (``data.partition = "sample"``, C = 1), every update crossing the broker to
   the server; the median wall seconds of rounds 2..R (round 1 warms up).

    python bench/broker_transport.py [--repeats 3] [--rounds 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_throughput import Relay, load_average, trial  # noqa: E402

from fedemu.launch.running import launcher  # noqa: E402
from fedemu.launch.running.local import LocalRun  # noqa: E402
from fedemu.node.security import RunKeys, new_token, private_ipc_endpoint, save_private  # noqa: E402

VARIANTS = ("tcp", "ipc+token", "tcp+curve+token", "ipc+curve+token")


def relay(variant: str, workdir: Path) -> tuple[Relay, RunKeys | None, str | None, Path | None]:
    """A broker listening as ``variant`` says; with what a node must bring (keys, token)
    and the socket's directory to remove."""
    folder, bind = private_ipc_endpoint() if variant.startswith("ipc") else (None, "tcp://127.0.0.1:0")
    extra: list[str] = []
    keys = token = None
    if "curve" in variant:
        keys = RunKeys.generate()
        extra += ["--keys", str(keys.save(workdir / f"{variant}.keys"))]
    if "token" in variant:
        token = new_token()
        extra += ["--token-file", str(save_private(workdir / f"{variant}.token", token))]
    return Relay("fedemu", workdir, bind, tuple(extra), label=variant), keys and keys.for_nodes(), token, folder


class VariantRun(LocalRun):
    """A local run whose broker listens as ``variant`` says (``ipc+token``: as LocalRun)."""

    variant = "ipc+token"

    def start(self) -> None:
        if self.variant == "ipc+token":
            return super().start()
        self._check_device()
        if "token" in self.variant:
            self._make_token()
        if self.variant.startswith("ipc"):
            self.socket_dir, bind = private_ipc_endpoint()
        else:
            bind = "tcp://127.0.0.1:0"
        keys = None
        if "curve" in self.variant:  # as MachinesRun: the broker holds the full keys, the nodes theirs
            keys = RunKeys.generate()
            self.keys_file = keys.save(self.run_dir / "run.keys")
        endpoint = self._start_broker(bind)
        if keys is not None:
            self.keys_file = keys.for_nodes().save(self.run_dir / "node.keys")
        self._start_server(endpoint)
        for i in range(self.workers):
            self._start(f"worker-{i}", "node", "worker", "--index", str(i), *self._node_args(endpoint))


def round_seconds(variant: str, out: Path, rounds: int, clients: int) -> float:
    """The median wall seconds of rounds 2..R of a run whose broker listens as ``variant``."""
    VariantRun.variant = variant
    opened = launcher.open_run
    launcher.open_run = lambda config, run_dir, workers, echo, *_, **__: VariantRun(config, run_dir, workers, echo)
    try:
        _, summary = launcher.launch(None, [f"data.clients={clients}", "algorithm.C=1.0", "data.partition=sample",
                                            "data.examples_per_client=1", f"run.rounds={rounds}",
                                            "run.target_accuracy=0"], str(out), 2, echo=lambda _: None)
    finally:
        launcher.open_run = opened
    if summary["status"] != "completed":
        raise RuntimeError(f"{variant}: the run ended {summary['status']}: {summary.get('reason')}")
    timed = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return statistics.median(e["round_s"] for e in timed if e["event"] == "round" and e["round"] > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--large-count", type=int, default=2000, help="800 KB messages per relay trial")
    parser.add_argument("--small-count", type=int, default=30_000, help="100-byte messages per relay trial")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (round 1 is not timed); 0: no runs")
    parser.add_argument("--clients", type=int, default=1000, help="clients, every one of them in every round")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    load_before = load_average()
    relay_trials: list[dict] = []
    rounds: dict[str, list[float]] = {v: [] for v in args.variants}
    ctx = zmq.Context(io_threads=1)
    with tempfile.TemporaryDirectory(prefix="fedemu-bench-") as tmp:
        workdir = Path(tmp)
        made = {v: relay(v, workdir) for v in args.variants}
        trial_no = 0
        try:
            for size, count, window in (("800KB", args.large_count, 8), ("100B", args.small_count, 500)):
                for rep in range(args.repeats):
                    for variant in args.variants:
                        relay_proc, keys, token, _ = made[variant]
                        trial_no += 1
                        t = trial(ctx, relay_proc, trial_no, size, count, window, keys, token)
                        relay_trials.append(vars(t))
                        print(f"  relay {size:>5} {variant:16} #{rep + 1}: {t.msgs_per_s:9,.0f} msgs/s "
                              f"{t.mb_per_s:8.1f} MB/s, broker CPU {t.relay_cpu_us_per_msg:.1f} us/msg",
                              file=sys.stderr, flush=True)
        finally:
            for relay_proc, _, _, folder in made.values():
                relay_proc.close()
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
        ctx.term()
        for rep in range(args.repeats if args.rounds else 0):
            for variant in args.variants:
                seconds = round_seconds(variant, workdir / f"run-{variant}-{rep}", args.rounds, args.clients)
                rounds[variant].append(seconds)
                print(f"  round of {args.clients} clients, {variant:16} #{rep + 1}: {seconds:.3f} s",
                      file=sys.stderr, flush=True)
    load_after = load_average()

    def median(variant: str, size: str, key: str) -> float:
        return statistics.median(t[key] for t in relay_trials if t["relay"] == variant and t["size"] == size)

    rows = [{"variant": v,
             "large_msgs_per_s": median(v, "800KB", "msgs_per_s"), "large_mb_per_s": median(v, "800KB", "mb_per_s"),
             "large_broker_cpu_us": median(v, "800KB", "relay_cpu_us_per_msg"),
             "small_msgs_per_s": median(v, "100B", "msgs_per_s"),
             "small_broker_cpu_us": median(v, "100B", "relay_cpu_us_per_msg"),
             "round_s": statistics.median(rounds[v]) if rounds[v] else None, "round_s_all": rounds[v]}
            for v in args.variants]
    print(f"broker transports; {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
          f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}; median of {args.repeats}, variants alternating")
    print(f"1-min load average at start {load_before:.2f}, at end {load_after:.2f}")
    print()
    header = (f"{'variant':16} | {'800 KB msgs/s':>13} | {'MB/s':>7} | {'broker CPU us/msg':>17} | "
              f"{'100 B msgs/s':>12} | {'broker CPU us/msg':>17} | {f'round of {args.clients} (s)':>17}")
    print(header)
    print("-" * len(header))
    for r in rows:
        round_s = f"{r['round_s']:.3f}" if r["round_s"] is not None else "-"
        print(f"{r['variant']:16} | {r['large_msgs_per_s']:13,.0f} | {r['large_mb_per_s']:7.0f} | "
              f"{r['large_broker_cpu_us']:17.0f} | {r['small_msgs_per_s']:12,.0f} | {r['small_broker_cpu_us']:17.1f} | "
              f"{round_s:>17}")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "broker_transport", "cores": os.cpu_count(),
                                         "load_average": [load_before, load_after], "repeats": args.repeats,
                                         "results": rows, "relay_trials": relay_trials}, indent=2) + "\n")


if __name__ == "__main__":
    main()
