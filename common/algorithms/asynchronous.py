"""The asynchronous contract: ``AsyncRule``, how the asynchronous engine
(``fedemu.server.async_engine``) merges each upload as it comes, and the concurrency
options of the rules that run a fixed number of clients at once. Each built-in rule is
a module of its own beside this one (``coop.py``, ``fedasync.py``, ``fedbuff.py``)."""
from __future__ import annotations

from typing import ClassVar

import numpy as np

from fedemu.common.messages import Upload
from fedemu.node.schema import Key, interval, non_negative

from .base import Algorithm

# How many clients train at once (fedemu.server.async_engine, Concurrency): options of the
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


# What a client does once a local update is done, or once the server told it its age:
UPLOAD = "upload"  # send the update (FedAsync, FedBuff; CO-OP within its age filter)
ASK_AGE = "ask_age"  # ask the server's age a first; the answer goes to AsyncClient.on_age
FETCH = "fetch"  # drop the update and ask for the current global model (CO-OP: outdated)
RETRAIN = "retrain"  # drop the update and train again from the last model received (CO-OP: over-active)
TRAIN_ON = "train_on"  # train again from the model just trained, uploading nothing yet
DECISIONS = (UPLOAD, ASK_AGE, FETCH, RETRAIN, TRAIN_ON)


class AsyncClient:
    """An asynchronous rule's client half: what a client decides between its local
    updates. The framework owns the loop (train, then act on the decision, resend until
    answered); the policy owns the decisions. Made on the client from its AsyncStart,
    with ``payload`` the rule's ``client_payload()``. This default is FedAsync's and
    FedBuff's: upload every update."""

    asks_age: ClassVar[bool] = False  # ask the server's age after each update (the books count the requests)

    def __init__(self, rule: type[AsyncRule], payload: dict) -> None:
        self.payload = payload
        self.uploads_delta = rule.uploads_delta

    def after_training(self) -> str:
        """The decision once a local update is done: UPLOAD or ASK_AGE."""
        return ASK_AGE if self.asks_age else UPLOAD

    def on_age(self, server_age: int, client_age: int) -> str:
        """The decision once the server said its age a (the client's is a_k): UPLOAD,
        FETCH, RETRAIN or TRAIN_ON."""
        return UPLOAD


class AsyncRule(Algorithm):
    """Every client loops on its own (train E epochs, then what its policy ``client``
    decides: upload, or as CO-OP's does, ask the server's age first); ``merge`` folds one
    upload into the global model. A rule may have its clients upload deltas, as FedBuff
    does."""

    synchronous = False
    client_age_start = 0
    uploads_delta = False  # clients upload w_k - (the model they trained from), not w_k
    client: ClassVar[type[AsyncClient]] = AsyncClient  # the client half

    def client_payload(self) -> dict | None:
        """What the clients' policy needs of this rule's options, sent in each start."""
        return None

    def server_age_start(self) -> int:
        return 0

    def deadlock(self, age: int, ages: dict[int, int], live: set[int]) -> str | None:
        """Why no upload can ever be merged again, given the global age a and the ages a_k
        of the live clients, or None (the asynchronous engine asks after each message)."""
        return None

    def recovered_age(self, age: int, ages: dict[int, int], live: set[int]) -> int:
        """The global age that ends a deadlock (``on_deadlock = "recover"``)."""
        raise NotImplementedError(f"{self.name} has no recovery from a deadlock")

    def merge(self, weights: np.ndarray, age: int, upload: Upload) -> tuple[np.ndarray, int, bool]:
        """(new weights, new age, whether the global model changed)."""
        raise NotImplementedError
