"""CO-OP (Wang 2017, as Nilsson et al. 2018 ran it): every client loops, the server merges
each upload at once with a weight that falls with its age, and an age filter [b_l, b_u]
keeps over-active and stale clients out; ``findings`` is Nilsson et al.'s deadlock
analysis."""
from __future__ import annotations

import numpy as np

from fedemu.node.schema import Key, non_negative

from .asynchronous import FETCH, RETRAIN, TRAIN_ON, UPLOAD, AsyncClient, AsyncRule
from .base import Finding, register

# What an over-active CO-OP client (a - a_k < b_l) does with the model it just trained.
# "retrain": discard it and train again from the last model the server sent, age
# unchanged, as Nilsson et al.'s code does (clients.erl, edge_handler_indef: too_often
# recurses with the old Model). "continue": keep training from the trained model, the
# literal reading of the paper's Algorithm 3 ("continue // Client is overactive").
OVER_ACTIVE = ("retrain", "continue")


class CoopClient(AsyncClient):
    """CO-OP's client (Nilsson et al. 2018, Algorithm 3): after each local update it asks
    the server's age a, then uploads if b_l <= a - a_k <= b_u, fetches the global model if
    it is outdated (a - a_k > b_u), and trains again if over-active (a - a_k < b_l)."""

    asks_age = True

    def on_age(self, server_age, client_age):
        gap = server_age - client_age
        if gap > self.payload["b_u"]:  # outdated: reconcile with the global model
            return FETCH
        if gap < self.payload["b_l"]:  # over-active
            return RETRAIN if self.payload["over_active"] == "retrain" else TRAIN_ON
        return UPLOAD


@register
class Coop(AsyncRule):
    """Merge at once: alpha = (a - a_k + 1)^(-1/2), w <- (1 - alpha) w + alpha w_k, a <- a + 1.
    Server age starts at b_l, client ages at 0; clients apply the age filter [b_l, b_u]."""

    name = "coop"
    label = "CO-OP"
    client = CoopClient
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
        self.over_active = over_active  # what an over-active client does: OVER_ACTIVE

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

    def client_payload(self):
        return {"b_l": self.b_l, "b_u": self.b_u, "over_active": self.over_active}

    def server_age_start(self) -> int:
        return self.b_l

    def deadlock(self, age, ages, live):
        # Asked after every message: the all() stops at the first client that may upload.
        if not live or not all(age - ages[k] < self.b_l for k in live):
            return None
        gaps = sorted(age - ages[k] for k in live)
        return (f"every live client is over-active: a - a_k ranges {gaps[0]}..{gaps[-1]}, all below "
                f"b_l = {self.b_l}, so no upload can pass the age filter and a cannot grow "
                f"(a = {age}, {len(live)} live clients, b_u = {self.b_u})")

    def recovered_age(self, age, ages, live):
        """Just enough that the stalest live client passes the lower bound again."""
        return age + (self.b_l - max(age - ages[k] for k in live))

    def merge(self, weights, age, upload):
        alpha = (age - upload.age + 1) ** -0.5
        return ((1 - alpha) * weights + alpha * upload.update).astype(np.float32), age + 1, True
