"""The broker's link model computed apart from any broker: what the tests that check a
real broker to the last bit compare against, for either transport."""
from __future__ import annotations

import math

from fedemu.node.net.emulator import PENDING, LinkEmulator
from fedemu.node.net.network_spec import NetworkSpec


def model_arrivals(network: dict, num_clients: int, seed: int,
                   sends: list[tuple[float, int, int, int]]) -> list[float | None]:
    """Each message's arrival (None: lost) for messages (entry, link, direction, size),
    fed to a fresh link model in entry order (ties in list order), as a broker feeds its
    own; the model collects what arrived before each entry, as the broker does."""
    emulator = LinkEmulator(NetworkSpec.from_config(network, num_clients=num_clients, run_seed=seed))
    arrivals: dict[int, float | None] = {}

    def collect(until: float) -> None:
        while (due := emulator.next_due()) <= until and due < math.inf:
            for token, arrival, _, _ in emulator.due(due):
                arrivals[token] = arrival

    for index, (entry, link, direction, size) in sorted(enumerate(sends), key=lambda s: s[1][0]):
        collect(entry)
        arrival = emulator.transmit(link, direction, size, entry, index)
        if arrival is not PENDING:
            arrivals[index] = arrival
    collect(math.inf)
    return [arrivals[i] for i in range(len(sends))]
