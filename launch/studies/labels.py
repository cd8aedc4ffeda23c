"""How values, config keys, algorithms and sweep points are named for people: table
cells, figure labels and legends (report, compare) and a sweep point's directory name."""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def short(key: str) -> str:
    """A readable name for a config key: its last part ("network.dropout.per_round" ->
    "per_round"), or a known label."""
    labels = {"algorithm.name": "algorithm", "run.seed": "seed", "network.dropout.per_round": "drop-out per round",
              "data.fold": "fold", "algorithm.C": "C", "algorithm.E": "E", "algorithm.B": "B",
              "network.stragglers.distribution": "stragglers"}
    if key in labels:
        return labels[key]
    parts = key.split(".")
    if parts[-1] in ("bandwidth", "latency_ms", "loss", "jitter_ms") and len(parts) >= 3:
        direction = {"up": "uplink ", "down": "downlink "}.get(parts[-2], "")
        return direction + {"bandwidth": "bandwidth", "latency_ms": "latency (ms)", "loss": "loss",
                            "jitter_ms": "jitter (ms)"}[parts[-1]]
    return parts[-1]


def algorithm_label(name: str) -> str:
    """The algorithm's label (``FedAvg``, ``CO-OP``), or its name where no class answers
    to it here (a plug-in this machine cannot import)."""
    # lazy: imports torch (~1.2 s), which the module's other paths do without
    from fedemu.common.algorithms.base import UnknownAlgorithm, get

    try:
        return get(name).label or name
    except UnknownAlgorithm:
        return name


def point_id(params: dict[str, Any]) -> str:
    """A readable directory name: "name=coop,bandwidth=1Mbit,seed=1"."""
    lasts = [k.split(".")[-1] for k in params]
    parts = []
    for (key, value), last in zip(params.items(), lasts):
        label = last if lasts.count(last) == 1 else key
        parts.append(f"{label}={fmt(value)}")
    text = re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(parts))
    if len(text) > 150:  # file names have limits; keep it readable and unique
        text = text[:130] + "," + hashlib.sha256(text.encode()).hexdigest()[:12]
    return text
