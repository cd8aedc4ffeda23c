"""What virtual time costs, and what it saves.

    python bench/virtual_time.py [--repeats 3] [--json out.json]

1. **Overhead**: the default job (MNIST 2NN, FedAvg, IID, K = 100, C = 0.1, E = 1,
   B = 10) for 20 rounds, ``run.clock = "wall"`` against ``"virtual"``, alternating,
   ``--repeats`` times each: wall seconds of ``fedemu launch`` from start to exit, and
   of the run itself (the server's ``wall_s``). The difference is virtual time's
   synchronisation: quiescence reports and the broker's batches at every instant.
2. **Slow links**: the same job with every client on the ``3g`` preset (750 kbit/s up,
   1.6 Mbit/s down, 75 ms) for 280 rounds in virtual time, whose emulated duration is
   over an hour, against the same 280 rounds on ideal links (its compute and the
   runtime's own work): emulated seconds, wall seconds, and emulated / wall. On the wall
   clock the 3g run would take its emulated hour (or, with ``time_scale``, a scaled
   wait whose compute would then count k times over).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def launch(run_dir: Path, *sets: str) -> dict:
    argv = [sys.executable, "-m", "fedemu.launch", "launch", "--out", str(run_dir), "--set", "run.target_accuracy=0"]
    for item in sets:
        argv += ["--set", item]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    launcher_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"launcher_s": round(launcher_s, 3), "run_wall_s": summary["wall_s"], "emulated_s": summary["emulated_s"],
            "final_accuracy": summary["final_accuracy"], "weights_sha256": summary.get("weights_sha256")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow-rounds", type=int, default=280)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict = {"overhead": {"wall": [], "virtual": []}}
    with tempfile.TemporaryDirectory(prefix="fedemu-vt-") as tmp:
        root = Path(tmp)
        for i in range(args.repeats):
            for clock in ("wall", "virtual"):
                r = launch(root / f"{clock}-{i}", "run.rounds=20", f"run.clock={clock}")
                results["overhead"][clock].append(r)
                print(f"20 rounds, {clock:7s}: launcher {r['launcher_s']:.2f} s, run {r['run_wall_s']:.2f} s, "
                      f"accuracy {r['final_accuracy']}", file=sys.stderr, flush=True)
        slow = launch(root / "3g", f"run.rounds={args.slow_rounds}", "run.clock=virtual", "network.default_profile=3g")
        print(f"3g: {slow}", file=sys.stderr, flush=True)
        ideal = launch(root / "ideal", f"run.rounds={args.slow_rounds}", "run.clock=virtual")
        print(f"ideal: {ideal}", file=sys.stderr, flush=True)
        results["slow_links"] = {"3g": slow, "ideal": ideal}
    med = {clock: {key: statistics.median(r[key] for r in runs) for key in ("launcher_s", "run_wall_s")}
           for clock, runs in results["overhead"].items()}
    print("\n**Overhead** (default job, 20 rounds, median of", args.repeats, "each, alternating):\n")
    print("| clock | launcher wall s | run wall s | final accuracy |\n| --- | ---: | ---: | ---: |")
    for clock in ("wall", "virtual"):
        print(f"| {clock} | {med[clock]['launcher_s']:.2f} | {med[clock]['run_wall_s']:.2f} | "
              f"{results['overhead'][clock][0]['final_accuracy']} |")
    print(f"\nvirtual / wall: launcher {med['virtual']['launcher_s'] / med['wall']['launcher_s']:.3f}, "
          f"run {med['virtual']['run_wall_s'] / med['wall']['run_wall_s']:.3f}")
    print(f"\n**Slow links** ({args.slow_rounds} rounds, virtual clock):\n")
    print("| links | emulated s | run wall s | emulated / wall |\n| --- | ---: | ---: | ---: |")
    for name, r in results["slow_links"].items():
        print(f"| {name} | {r['emulated_s']:.0f} | {r['run_wall_s']:.1f} | {r['emulated_s'] / r['run_wall_s']:.1f} |")
    s3g, sid = results["slow_links"]["3g"], results["slow_links"]["ideal"]
    print(f"\nthe 3g run's wall time is {s3g['run_wall_s'] / sid['run_wall_s']:.2f}x that of the same rounds on ideal "
          f"links; its final weights {'equal' if s3g['weights_sha256'] == sid['weights_sha256'] else 'differ from'} "
          "the ideal run's (no client misses the 60 s deadline: the network changes time, not the model)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
