"""The centralised baseline (Nilsson et al. 2018, Table 1): FedAvg with one client that
holds all the training data."""
from __future__ import annotations

from .base import register
from .fedavg import FedAvg


@register
class Centralised(FedAvg):
    """The centralised baseline of Nilsson et al.'s Table 1: one client holds all the
    training data (data.clients = 1, partition "iid"; check_config refuses anything
    else), so a round is E epochs of B-minibatch SGD over it, with Keras' decay running
    on, and the average of its one update is the update itself."""

    name = "centralised"
    label = "Centr."
    title = "the centralised baseline"
    selects_all = True
    uploads = "one model trained on all the data (the baseline without federation)"

    @classmethod
    def check_config(cls, config):
        data = config["data"]
        if data["clients"] != 1 or data["partition"] != "iid":
            return (f"algorithm.name = 'centralised' trains one model on all the training data: it needs "
                    f"data.clients = 1 and data.partition = 'iid' (got {data['clients']} clients, partition "
                    f"{data['partition']!r}); examples/centralised-nilsson.toml sets both")
        return None
