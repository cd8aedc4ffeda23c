"""Which clients each worker node hosts. Apart from the client code, so the launcher can
place clients without importing torch."""
from __future__ import annotations


def placement(num_clients: int, num_workers: int) -> list[range]:
    """Which clients each worker node hosts: contiguous blocks, as even as possible.

    Stated and reproducible, since placement can change asynchronous behaviour.
    """
    if num_workers < 1:
        raise ValueError(f"need at least one worker node, got {num_workers}")
    bounds = [k * num_clients // num_workers for k in range(num_workers + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(num_workers)]
