"""The heterogeneous-population study's table and figures, from its sweep folder.

    fedemu sweep examples/sweeps/heterogeneous-fedavg-fedbuff.toml --out sweeps/hetero
    python bench/heterogeneous_study.py sweeps/hetero [--images docs/images/heterogeneous]

Per run: emulated time and uploads to the sweep's target accuracy, best accuracy, and
what the population did (FedAvg: updates per round in time; FedBuff: tasks that timed
out); figures of accuracy against emulated time and of the clients online at each
evaluation (round events' ``offline``).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import tomllib
from pathlib import Path


def runs(sweep: Path) -> list[dict]:
    out = []
    for run_dir in sorted((sweep / "runs").iterdir()):
        config = tomllib.loads((run_dir / "config.toml").read_text())
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        rounds = [e for e in events if e["event"] == "round"]
        tasks = []
        if (run_dir / "tasks.csv").exists():
            with open(run_dir / "tasks.csv", newline="") as f:
                tasks = list(csv.DictReader(f))
        out.append({"dir": run_dir, "algorithm": config["algorithm"]["name"], "seed": config["run"]["seed"],
                    "clients": config["data"]["clients"], "rounds": rounds, "tasks": tasks})
    return out


def to_target(run: dict, target: float) -> tuple[float | None, int | None]:
    """(emulated seconds, uploads) at the first evaluation at or above ``target``."""
    uploads = 0
    for e in run["rounds"]:
        uploads += e["uploads"]
        if e["accuracy"] is not None and e["accuracy"] >= target:
            return e["emulated_s"], uploads
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--images", type=Path, help="where to draw the figures (PNG)")
    args = parser.parse_args()
    results = runs(args.sweep)
    print(f"| algorithm | seed | emulated s to {args.target:.0%} | uploads to {args.target:.0%} | best accuracy | "
          "evaluations | per round / task |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    by_algorithm: dict[str, list[float]] = {}
    for run in results:
        seconds, uploads = to_target(run, args.target)
        best = max(e["accuracy"] for e in run["rounds"] if e["accuracy"] is not None)
        if run["algorithm"] == "fedavg":
            detail = f"{statistics.mean(e['participants'] for e in run['rounds']):.1f} of 10 updates in time"
        else:
            outcomes = [t["outcome"] for t in run["tasks"]]
            detail = (f"{outcomes.count('uploaded')} tasks uploaded, {outcomes.count('timeout')} timed out")
        by_algorithm.setdefault(run["algorithm"], []).append(seconds if seconds is not None else float("nan"))
        print(f"| {run['algorithm']} | {run['seed']} | {seconds if seconds is not None else 'not reached'} | "
              f"{uploads if uploads is not None else '-'} | {best:.4f} | {len(run['rounds'])} | {detail} |")
    for name, values in by_algorithm.items():
        print(f"{name}: emulated seconds to target, mean {statistics.mean(values):.1f}, "
              f"median {statistics.median(values):.1f}")
    if args.images:
        draw(results, args.images, args.target)


def draw(results: list[dict], out: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    colours = {"fedavg": "tab:blue", "fedbuff": "tab:orange"}
    labels = {"fedavg": "FedAvg, 60 s deadline", "fedbuff": "FedBuff, concurrency 20"}
    fig, (ax, ax_log) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in results:
        xs = [e["emulated_s"] for e in run["rounds"]]
        ys = [e["accuracy"] for e in run["rounds"]]
        label = labels[run["algorithm"]] if run["seed"] == 1 else None
        for axis in (ax, ax_log):
            axis.plot(xs, ys, color=colours[run["algorithm"]], alpha=0.8, label=label, lw=1)
    for axis in (ax, ax_log):
        axis.axhline(target, color="grey", ls=":", lw=1)
        axis.set_xlabel("emulated seconds")
        axis.set_ylabel("test accuracy")
        axis.set_ylim(0.3, 1.0)
        axis.grid(alpha=0.3)
    ax_log.set_xscale("log")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("accuracy against emulated time, seeds 1-3", fontsize=9)
    ax_log.set_title("the same, log time", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "accuracy-vs-time.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for run in results:
        if run["algorithm"] != "fedavg":
            continue
        xs = [e["emulated_s"] / 3600 for e in run["rounds"]]
        ax.plot(xs, [1 - len(e["offline"]) / run["clients"] for e in run["rounds"]], color="tab:green",
                alpha=0.8, lw=1, label="clients online" if run["seed"] == 1 else None)
        ax.plot(xs, [e["participants"] / 10 for e in run["rounds"]], color="tab:blue", alpha=0.5, lw=1,
                label="share of a round's 10 in time" if run["seed"] == 1 else None)
    ax.set_xlabel("emulated hours from 21:00 UTC")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title("FedAvg's rounds: who was there", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "fedavg-rounds.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
