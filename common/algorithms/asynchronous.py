"""The asynchronous contract: ``AsyncRule``, how the asynchronous engine
(``fedemu.server.async_engine``) merges each upload as it comes, and the concurrency
options of the rules that run a fixed number of clients at once. Each built-in rule is
a module of its own beside this one (``coop.py``, ``fedasync.py``, ``fedbuff.py``)."""
from __future__ import annotations

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
