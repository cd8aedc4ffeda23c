"""FedBuff (Nguyen et al. 2022): clients upload deltas, the server buffers them and steps
the model once ``buffer_size`` are in."""
from __future__ import annotations

import math

import numpy as np

from fedemu.node.schema import MAX_LEARNING_RATE, Key, interval, positive

from .asynchronous import CONCURRENCY_OPTIONS, AsyncRule
from .base import register


@register
class FedBuff(AsyncRule):
    """Buffer uploaded deltas, each weighted 1/sqrt(1 + s); when ``buffer_size`` are in,
    w <- w + server_lr * mean(weighted deltas), and the version t grows by one."""

    name = "fedbuff"
    label = "FedBuff"
    uploads_delta = True
    options = {
        "buffer_size": Key(int, "FedBuff: uploads per aggregation", check=positive, rule="> 0", default=10),
        "server_lr": Key(float, "FedBuff server learning rate", **interval(f"(0, {MAX_LEARNING_RATE:g}]"),
                         default=1.0),
        **CONCURRENCY_OPTIONS,
    }

    def __init__(self, buffer_size: int, server_lr: float) -> None:
        self.buffer_size, self.server_lr = buffer_size, server_lr
        self._buffer: list[np.ndarray] = []

    @classmethod
    def from_config(cls, algorithm):
        return cls(algorithm["buffer_size"], algorithm["server_lr"])

    def merge(self, weights, age, upload):
        if not upload.is_delta:
            raise ValueError(f"FedBuff needs model deltas; client {upload.client} sent weights")
        self._buffer.append(upload.update / math.sqrt(1 + (age - upload.age)))
        if len(self._buffer) < self.buffer_size:
            return weights, age, False
        step = np.mean(self._buffer, axis=0)
        self._buffer.clear()
        return (weights + self.server_lr * step).astype(np.float32), age + 1, True
