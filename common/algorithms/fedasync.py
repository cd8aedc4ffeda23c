"""FedAsync (Xie et al. 2019): each upload mixed into the model at once, with a weight that
a staleness function of its age scales."""
from __future__ import annotations

import numpy as np

from fedemu.node.schema import Key, fraction, interval

from .asynchronous import CONCURRENCY_OPTIONS, AsyncRule
from .base import register


def staleness_weight(kind: str, s: int, a: float, b: float) -> float:
    """FedAsync's staleness functions of s = t - tau."""
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return (s + 1) ** -a
    if kind == "hinge":
        return 1.0 if s <= b else 1.0 / (a * (s - b) + 1)
    raise ValueError(f"unknown staleness function {kind!r}; use constant, polynomial or hinge")


@register
class FedAsync(AsyncRule):
    """w <- (1 - alpha_t) w + alpha_t w_k with alpha_t = alpha * S(t - tau)."""

    name = "fedasync"
    label = "FedAsync"
    options = {
        "alpha": Key(float, "FedAsync mixing weight", check=fraction, rule="in (0, 1]", default=0.6),
        "staleness": Key(str, "FedAsync staleness function", choices=("constant", "polynomial", "hinge"),
                         default="polynomial"),
        "staleness_a": Key(float, "FedAsync staleness parameter a", **interval("[0, 100]"), default=0.5),
        "staleness_b": Key(float, "FedAsync hinge parameter b", **interval("[0, 1e9]"), default=4.0),
        **CONCURRENCY_OPTIONS,
    }

    def __init__(self, alpha: float, staleness: str, a: float, b: float) -> None:
        self.alpha, self.staleness, self.a, self.b = alpha, staleness, a, b
        staleness_weight(staleness, 0, a, b)  # an unknown function fails here, not mid-run

    @classmethod
    def from_config(cls, algorithm):
        return cls(algorithm["alpha"], algorithm["staleness"], algorithm["staleness_a"], algorithm["staleness_b"])

    def merge(self, weights, age, upload):
        mix = self.alpha * staleness_weight(self.staleness, age - upload.age, self.a, self.b)
        return ((1 - mix) * weights + mix * upload.update).astype(np.float32), age + 1, True
