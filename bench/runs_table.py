"""Print a Markdown table of finished runs: the figures the README quotes.

    python bench/runs_table.py RUN_DIR [RUN_DIR ...] [--at-emulated-s 60 120]

Reads each run directory's summary.json and events.jsonl (the run-directory contract),
so it works on any run, local or not.
"""
from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path


def accuracy_at(rounds: list[dict], emulated: float) -> float | None:
    """Best accuracy evaluated at or before ``emulated`` seconds since the first round began."""
    start = rounds[0]["emulated_s"] - rounds[0].get("round_s", 0.0)
    seen = [e["accuracy"] for e in rounds if e.get("accuracy") is not None and e["emulated_s"] - start <= emulated]
    return max(seen) if seen else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--at-emulated-s", type=float, nargs="*", default=[])
    args = parser.parse_args()
    head = ["run", "algorithm", "rounds", "uploads", "final acc", "best acc", "MB up", "emulated s",
            "mean round s", "stragglers per round"]
    head += [f"best acc by {t:g} s" for t in args.at_emulated_s]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for run in args.runs:
        summary = json.loads((run / "summary.json").read_text())
        config = tomllib.loads((run / "config.toml").read_text())
        events = [json.loads(line) for line in (run / "events.jsonl").open() if line.endswith("\n")]
        rounds = [e for e in events if e["event"] == "round"]
        start = rounds[0]["emulated_s"] - rounds[0].get("round_s", 0.0) if rounds else 0.0
        row = [run.name, config["algorithm"]["name"], summary["rounds"], summary.get("uploads", ""),
               f"{summary['final_accuracy']:.4f}", f"{summary['best_accuracy']:.4f}",
               f"{summary['bytes_up'] / 1e6:.0f}", f"{rounds[-1]['emulated_s'] - start:.0f}" if rounds else ""]
        # Synchronous rounds only: an asynchronous run's "rounds" are evaluation points.
        synchronous = rounds and "stragglers" in rounds[0]
        row.append(f"{sum(e['round_s'] for e in rounds) / len(rounds):.2f}" if synchronous else "")
        row.append(f"{sum(len(e['stragglers']) for e in rounds) / len(rounds):.2f}" if synchronous else "")
        for t in args.at_emulated_s:
            acc = accuracy_at(rounds, t) if rounds else None
            row.append("" if acc is None else f"{acc:.4f}")
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
