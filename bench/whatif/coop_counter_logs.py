"""Nilsson et al.'s CO-OP counter logs, per client: how often each client's age check came
back over-active per upload, clients 1-32 against 33-100 (docs/results.md, "CO-OP's IID gap",
the non-IID paragraph: evidence of two device groups in their testbed).

    python bench/whatif/coop_counter_logs.py --theirs PATH [--folder cross_validations]

PATH: a checkout of FraunhoferChalmersCentre/fl-performance-evaluation. Each log has a line
per client, "Car K - outdated: A, overactive: B, normal: C" (C: its uploads).
"""
from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

LINE = re.compile(r"Car (\d+) - outdated: (\d+), overactive: (\d+), normal: (\d+)")
FIRST_GROUP = 32  # clients 1..32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--theirs", type=Path, required=True, help="a checkout of their repository")
    parser.add_argument("--folder", default="cross_validations", help="under benchmark_results/coop/")
    args = parser.parse_args()
    logs = sorted((args.theirs / "benchmark_results" / "coop" / args.folder).glob("complete_counter_log_*.txt"))
    if not logs:
        raise SystemExit(f"no complete_counter_log_*.txt under {args.theirs}/benchmark_results/coop/{args.folder}")
    print("over-active checks per upload: all clients | median client of 1-32 | median of 33-100 | least of 1-32 | log")
    separated = 0
    for log in logs:
        counts = [(int(k), int(over), int(normal)) for k, _, over, normal in LINE.findall(log.read_text())]
        rates = {k: over / normal for k, over, normal in counts if normal > 0}
        overall = sum(over for _, over, _ in counts) / max(1, sum(normal for *_, normal in counts))
        first = [r for k, r in rates.items() if k <= FIRST_GROUP]
        rest = [r for k, r in rates.items() if k > FIRST_GROUP]
        if not first or not rest:
            print(f"  (no clients of both groups in {log.name})")
            continue
        separated += min(first) > statistics.median(rest)
        print(f"  {overall:.2f} | {statistics.median(first):.2f} | {statistics.median(rest):.2f} | {min(first):.2f} | {log.name}")
    print(f"logs where the least over-active of 1-32 is above the median of 33-100: {separated} of {len(logs)}")


if __name__ == "__main__":
    main()
