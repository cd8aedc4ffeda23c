"""Straggler emulation: per-client compute slowdown factors.

A client measures its real training time t and holds its reply back by (f - 1) * t
(divided by the run's time scale), so it looks like a device f times slower. Factors
are drawn from the run seed and the client (and the round, when ``per_round``), so a
rerun gives every client the same factors.

``[network.stragglers]`` is one group; ``[[network.stragglers]]``, several (device classes
by client, say, and a per-round jitter for everyone): a client's factor is the product
of the factors of the groups that cover it, each group drawing from its own stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fedemu.node import streams
from fedemu.node.net.availability import parse_ids
from fedemu.node.net.profiles import LinkConfigError
from fedemu.node.schema import did_you_mean, did_you_mean_key

DISTRIBUTIONS = ("none", "fixed", "lognormal", "pareto", "classes")


@dataclass(frozen=True)
class StragglerSpec:
    distribution: str = "none"
    factor: float = 1.0  # fixed
    sigma: float = 0.5  # lognormal: f = max(1, exp(sigma * Z))
    alpha: float = 2.0  # pareto with scale 1: f = (1 - u)^(-1/alpha) >= 1
    classes: tuple = ()  # ((fraction, factor), ...) a device-class mix, fractions sum to 1
    clients: frozenset[int] | None = None  # None: every client
    per_round: bool = False  # draw a new factor each round
    seed: int = 0
    group: int = 0  # its place among [[network.stragglers]]: its own random stream

    @classmethod
    def from_config(cls, section: dict, num_clients: int, seed: int, group: int = 0,
                    where: str = "network.stragglers") -> StragglerSpec:
        allowed = {"distribution", "factor", "sigma", "alpha", "classes", "clients", "per_round"}
        unknown = set(section) - allowed
        if unknown:
            key = sorted(unknown)[0]
            raise LinkConfigError(f"unknown key {where}.{key}{did_you_mean_key(where, key, allowed)}; "
                                  f"[{where}] has {', '.join(sorted(allowed))}")
        dist = section.get("distribution", "none")
        if dist not in DISTRIBUTIONS:
            raise LinkConfigError(f"{where}.distribution = {dist!r}{did_you_mean(dist, DISTRIBUTIONS)}: "
                                  f"choose one of {', '.join(DISTRIBUTIONS)}")

        def number(key: str, default: float, low: float, rule: str) -> float:
            value = section.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
                raise LinkConfigError(f"{where}.{key} = {value!r} must be {rule}")
            return float(value)

        classes = section.get("classes", [])
        if dist == "classes":
            if (not isinstance(classes, list) or not classes
                    or not all(isinstance(c, list) and len(c) == 2 and all(isinstance(x, (int, float)) for x in c) for c in classes)):
                raise LinkConfigError(f"{where}.classes must be [[fraction, factor], ...], e.g. [[0.7, 1], [0.3, 4]]")
            if abs(sum(c[0] for c in classes) - 1) > 1e-6 or any(c[0] < 0 or c[1] < 1 for c in classes):
                raise LinkConfigError(f"{where}.classes: fractions must be >= 0 and sum to 1, factors >= 1")
        clients = parse_ids(section["clients"], f"{where}.clients", num_clients) if "clients" in section else None
        per_round = section.get("per_round", False)
        if not isinstance(per_round, bool):
            raise LinkConfigError(f"{where}.per_round = {per_round!r} must be true or false")
        return cls(distribution=dist, factor=number("factor", 1.0, 1.0, ">= 1"),
                   sigma=number("sigma", 0.5, 0.0, ">= 0"), alpha=number("alpha", 2.0, 1e-9, "> 0"),
                   classes=tuple(tuple(map(float, c)) for c in classes), clients=clients,
                   per_round=per_round, seed=seed, group=group)

    def slowdown(self, client: int, round_: int) -> float:
        """The factor f >= 1 for ``client`` in ``round_`` (1: not a straggler)."""
        if self.distribution == "none" or (self.clients is not None and client not in self.clients):
            return 1.0
        if self.distribution == "fixed":
            return self.factor
        draw = (client, round_ if self.per_round else 0) + ((self.group,) if self.group else ())  # group 0: as one table always drew
        rng = streams.generator(self.seed, "stragglers", *draw)
        if self.distribution == "lognormal":
            return max(1.0, math.exp(self.sigma * rng.standard_normal()))
        if self.distribution == "pareto":
            return (1.0 - rng.random()) ** (-1.0 / self.alpha)
        u, total = rng.random(), 0.0
        for fraction, factor in self.classes:
            total += fraction
            if u < total:
                return factor
        return self.classes[-1][1]


@dataclass(frozen=True)
class StragglerGroups:
    """Several groups (``[[network.stragglers]]``): a client's factor is the product of
    its groups' factors."""

    groups: tuple[StragglerSpec, ...]

    def slowdown(self, client: int, round_: int) -> float:
        factor = 1.0
        for group in self.groups:
            factor *= group.slowdown(client, round_)
        return factor


def stragglers_from_config(value: dict | list, num_clients: int, seed: int) -> StragglerSpec | StragglerGroups:
    """``network.stragglers``: a table (one group) or an array of tables (several)."""
    if isinstance(value, dict):
        return StragglerSpec.from_config(value, num_clients, seed)
    if not isinstance(value, list) or not value or not all(isinstance(entry, dict) for entry in value):
        raise LinkConfigError("network.stragglers must be a table, or an array of tables ([[network.stragglers]])")
    return StragglerGroups(tuple(StragglerSpec.from_config(entry, num_clients, seed, group=i,
                                                           where=f"network.stragglers[{i}]")
                                 for i, entry in enumerate(value)))
