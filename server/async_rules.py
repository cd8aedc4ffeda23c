"""Asynchronous rules: how the asynchronous engine (``async_engine.py``) merges each
upload as it comes. One class per algorithm, each registered under its name
(``algorithm.py`` says what a class declares)."""
from __future__ import annotations

import math

import numpy as np

from fedemu.node.schema import MAX_LEARNING_RATE, Key, fraction, interval, non_negative, positive
from fedemu.worker.protocol import OVER_ACTIVE, Upload

from .algorithm import Algorithm, Finding, register

# How many clients train at once (server/async_engine.py, Concurrency): options of the
# rules whose papers run a fixed concurrency (FedBuff; FedAsync's clients are started by
# its scheduler, so it takes them too). CO-OP's age filter and its deadlock analysis
# (Nilsson et al.'s Theorem A.1) assume every client loops, so it has none.
CONCURRENCY_OPTIONS = {
    "concurrency": Key(int, "asynchronous rules: at most this many clients train at once; when one's upload is in "
                       "(or it is lost, or times out), another is started, chosen uniformly from the live clients "
                       "without a task (stream 'concurrency'); 0: every client at once, each looping for ever",
                       check=non_negative, rule=">= 0", default=0),
    "arrival_rate": Key(float, "asynchronous rules: > 0: a client starts at each arrival of a Poisson process of "
                        "this rate (per emulated second, stream 'arrivals'; FLSim's asynchronous trainer), if fewer "
                        "than concurrency (when > 0) train; 0: a client starts as one ends",
                        check=non_negative, rule=">= 0", default=0.0),
    "client_timeout_s": Key(float, "asynchronous rules with concurrency or arrival_rate: emulated seconds a task may "
                            "run before its place goes to another client (the server cannot see a device go offline); "
                            "0: a task keeps its place until its upload comes", **interval("[0, 1e9]"),
                            default=0.0),
}


class AsyncRule(Algorithm):
    """Every client loops on its own (train E epochs, then upload); ``merge`` folds one
    upload into the global model. A rule may give its clients an age filter, as CO-OP
    does, or have them upload deltas, as FedBuff does."""

    synchronous = False
    client_age_start = 0
    uploads_delta = False  # clients upload w_k - (the model they trained from), not w_k

    @property
    def age_filter(self) -> tuple[int, int] | None:
        """(b_l, b_u): a client uploads only if b_l <= a - a_k <= b_u (CO-OP); None: always."""
        return None

    def server_age_start(self) -> int:
        return 0

    def merge(self, weights: np.ndarray, age: int, upload: Upload) -> tuple[np.ndarray, int, bool]:
        """(new weights, new age, whether the global model changed)."""
        raise NotImplementedError


@register
class Coop(AsyncRule):
    """Merge at once: alpha = (a - a_k + 1)^(-1/2), w <- (1 - alpha) w + alpha w_k, a <- a + 1.
    Server age starts at b_l, client ages at 0; clients apply the age filter [b_l, b_u]."""

    name = "coop"
    label = "CO-OP"
    options = {
        "b_l": Key(int, "CO-OP age filter lower bound", check=non_negative, rule=">= 0", default=16),
        "b_u": Key(int, "CO-OP age filter upper bound", check=non_negative, rule=">= 0", default=51),
        "over_active": Key(str, "CO-OP: what a client does when a - a_k < b_l: 'retrain' discards the model "
                           "it trained and trains again from the last model the server sent (Nilsson et "
                           "al.'s code); 'continue' keeps training from the trained model",
                           choices=OVER_ACTIVE, default="retrain"),
        "on_deadlock": Key(str, "what CO-OP does in a detected deadlock", choices=("stop", "recover"),
                           default="stop"),
    }

    def __init__(self, b_l: int, b_u: int, over_active: str = "retrain") -> None:
        self.b_l, self.b_u = b_l, b_u
        self.over_active = over_active  # what an over-active client does: protocol.OVER_ACTIVE

    @classmethod
    def from_config(cls, algorithm):
        return cls(algorithm["b_l"], algorithm["b_u"], algorithm["over_active"])

    @classmethod
    def findings(cls, algorithm, clients):
        b_l, b_u, K = algorithm["b_l"], algorithm["b_u"], clients
        findings = []
        if b_l >= b_u:
            findings.append(Finding("coop-filter", f"CO-OP needs b_l < b_u; got b_l = {b_l}, b_u = {b_u}", True))
        if b_l >= K:
            findings.append(Finding(
                "coop-certain-deadlock",
                f"CO-OP with b_l = {b_l} >= K = {K} deadlocks for certain: at least b_l distinct clients must "
                f"upload before any client may upload again, and there are only {K} (Nilsson et al. 2018, 3.3.1)",
                True))
        elif b_u < 2 * b_l and K >= b_u - b_l + 1:
            findings.append(Finding(
                "coop-possible-deadlock",
                f"CO-OP with b_u = {b_u} < 2*b_l = {2 * b_l} and K = {K} >= b_u - b_l + 1 = {b_u - b_l + 1} can "
                f"deadlock (Nilsson et al. 2018, Theorem A.1): after b_u - b_l + 1 uploads by distinct clients, "
                f"every client can be over-active. Use b_u >= 2*b_l, or set algorithm.accept_deadlock_risk = true",
                True, waivable_by="algorithm.accept_deadlock_risk"))
        return findings

    @property
    def age_filter(self):
        return self.b_l, self.b_u

    def server_age_start(self) -> int:
        return self.b_l

    def merge(self, weights, age, upload):
        alpha = (age - upload.age + 1) ** -0.5
        return ((1 - alpha) * weights + alpha * upload.update).astype(np.float32), age + 1, True


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
