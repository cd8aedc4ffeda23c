"""Where a sweep's points run: how many at once, with how many worker nodes (and torch
threads) each, and with --machines the hosts of each concurrent point."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .sweep_spec import Spec, SweepError

if TYPE_CHECKING:
    from ..running.machines import Machines


@dataclass
class Layout:
    """Where the points run: how many at once, worker nodes each, and with --machines
    the hosts of each concurrent point (disjoint groups, one per slot)."""

    parallel: int
    workers_per_point: int | None  # with machines: slots of a host without slots= (None: its cores)
    host_groups: list[Machines] | None = None

    def describe(self) -> str:
        if self.host_groups is None:
            return f"{self.parallel} at a time, {self.workers_per_point} worker node(s) each"
        slots = f"{self.workers_per_point} per host" if self.workers_per_point else "each host's slots or cores"
        return (f"{self.parallel} at a time, on hosts " + " | ".join(",".join(map(str, g.hosts)) for g in self.host_groups)
                + f", worker nodes: {slots}")

    def point_config(self, config: dict) -> dict:
        """A copy of a point's config with its worker nodes, and on this machine torch
        threads that share the cores between the points running at once."""
        config = json.loads(json.dumps(config))  # a deep copy
        config["run"]["workers"] = self.workers_per_point or 0
        if self.host_groups is None and not config["run"]["torch_threads"] and config["run"]["clock"] == "wall":
            # Points share the cores: torch's default (all cores per node) would oversubscribe.
            config["run"]["torch_threads"] = max(1, (os.cpu_count() or 1) // (self.parallel * self.workers_per_point))
        return config


def plan(spec: Spec, parallel: int | None, workers_per_point: int | None,
         machines: Machines | None = None) -> Layout:
    wpp = workers_per_point or spec.workers_per_point
    par = parallel if parallel is not None else spec.parallel
    if machines is None:
        wpp = wpp or 1
        # One worker node keeps about one core busy; the server and broker mostly wait.
        return Layout(par or max(1, (os.cpu_count() or 1) // wpp), wpp)
    # A point spans its share of the hosts; by default all of them, as one launch would.
    par = par or 1
    hosts = machines.hosts
    if par > len(hosts):
        raise SweepError(f"--parallel {par} with --machines needs at least {par} hosts (each running point "
                         f"gets hosts of its own); {len(hosts)} given")
    size, extra = divmod(len(hosts), par)
    groups, start = [], 0
    for i in range(par):  # consecutive hosts, group sizes differing by at most one
        end = start + size + (1 if i < extra else 0)
        groups.append(replace(machines, hosts=hosts[start:end]))
        start = end
    return Layout(par, wpp, groups)
