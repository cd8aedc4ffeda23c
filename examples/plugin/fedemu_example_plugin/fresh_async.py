"""FedAsync with staleness-aware clients, as a fedemu plug-in: an asynchronous rule that
brings its own client policy beside its server rule, in one file.

The server merges as FedAsync does (Xie et al. 2019: w <- (1 - alpha_t) w + alpha_t w_k,
alpha_t = alpha * S(t - tau)). Its clients do not upload every update: after each local
update a client asks the server's age t, and if its model is more than
``max_staleness`` versions old (t - tau > max_staleness) it skips this upload, fetches
the current global model and trains again from it; otherwise it uploads. Staleness
weighting discounts old updates on the server; this client spares the uplink the
updates that would be discounted most.

    algorithm.name = "fedemu_example_plugin.fresh_async:FreshFedAsync"
    algorithm.max_staleness = 4
"""
from __future__ import annotations

from fedemu.common.algorithms import ASK_AGE, FETCH, UPLOAD, AsyncClient
from fedemu.common.algorithms.fedasync import FedAsync
from fedemu.node.schema import Key, interval


class FreshClient(AsyncClient):
    """Ask the age after each update; upload only a model at most max_staleness old."""

    asks_age = True

    def after_training(self):
        return ASK_AGE

    def on_age(self, server_age, client_age):
        return FETCH if server_age - client_age > self.payload["max_staleness"] else UPLOAD


class FreshFedAsync(FedAsync):
    name = "fresh-fedasync"
    label = "FedAsync (fresh)"
    client = FreshClient
    options = {
        **FedAsync.options,
        "max_staleness": Key(int, "fresh FedAsync: a client uploads an update only if its model is at most this "
                             "many versions old, else it fetches the current model and trains again",
                             **interval("[0, 1000000]"), default=4),
    }

    def __init__(self, alpha: float, staleness: str, a: float, b: float, max_staleness: int = 4) -> None:
        super().__init__(alpha, staleness, a, b)
        self.max_staleness = max_staleness

    @classmethod
    def from_config(cls, algorithm):
        return cls(algorithm["alpha"], algorithm["staleness"], algorithm["staleness_a"], algorithm["staleness_b"],
                   algorithm["max_staleness"])

    def client_payload(self):
        return {"max_staleness": self.max_staleness}
