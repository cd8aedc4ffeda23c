"""A model from outside fedemu: a builder(input_shape, num_classes) returning a
torch.nn.Module. Named ``fedemu_example_plugin.models:mlp``, or ``mlp100`` once the
package is installed (its entry point in the ``fedemu.models`` group)."""
from __future__ import annotations

import math

from torch import nn


def mlp(input_shape=(1, 28, 28), num_classes=10, hidden=100) -> nn.Module:
    """One hidden layer of ``hidden`` ReLU units (on MNIST, 79,510 parameters)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))
