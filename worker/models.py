"""The two MNIST models of McMahan et al. (2017), and flat-vector weights.

Both take (n, 1, 28, 28) float images and return (n, 10) logits; softmax is
left to the cross-entropy loss. Weights cross the wire as one float32 vector
in ``model.parameters()`` order, which is fixed by the module definitions.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch
from torch import nn

MODEL_NAMES = ("2nn", "cnn")


def _two_layer_mlp() -> nn.Module:
    # "2NN": two hidden layers of 200 units, 199,210 parameters.
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(28 * 28, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, 10),
    )


def _cnn() -> nn.Module:
    # Padding 2 keeps 28x28 through each 5x5 conv, so after two 2x2 pools the
    # feature map is 7x7x64 = 3136; 1,663,370 parameters in all.
    return nn.Sequential(
        nn.Conv2d(1, 32, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(7 * 7 * 64, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


_BUILDERS = {"2nn": _two_layer_mlp, "cnn": _cnn}


INITS = ("torch", "normal")


def build(name: str, seed: int | None = None, init: str = "torch", init_std: float = 0.0) -> nn.Module:
    """A fresh model; with ``seed``, its initial weights are deterministic.

    ``init = "torch"`` keeps PyTorch's per-layer defaults; ``"normal"`` draws every weight
    and bias from N(0, init_std^2), as Nilsson et al.'s server did (``random_fc_model``
    in their server.erl: Erlang's ``rand:normal(0, 0.003)``, whose second argument is the
    variance, so init_std = sqrt(0.003))."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODEL_NAMES)}")
    if init not in INITS:
        raise ValueError(f"unknown model init {init!r}; allowed: {', '.join(INITS)}")
    # With a seed, a forked RNG: building a model leaves the caller's global torch RNG as it was.
    with torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext():
        if seed is not None:
            torch.manual_seed(seed)
        model = _BUILDERS[name]()
        if init == "normal":
            _normal_init(model, init_std)
    return model


def _normal_init(model: nn.Module, std: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, std)


def num_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def get_flat(model: nn.Module) -> np.ndarray:
    """All parameters as one new contiguous float32 vector (one copy)."""
    with torch.no_grad():
        flat = torch.cat([parameter.reshape(-1) for parameter in model.parameters()])
    # .numpy() shares the freshly concatenated buffer: no second copy.
    return flat.to(torch.float32).numpy()


def set_flat(model: nn.Module, vec: np.ndarray) -> None:
    """Overwrite all parameters from a vector laid out as ``get_flat`` makes it."""
    vec = np.ascontiguousarray(vec)  # no copy when it already is
    expected = num_parameters(model)
    if vec.ndim != 1 or vec.shape[0] != expected:
        raise ValueError(f"weight vector has shape {vec.shape}, model needs ({expected},)")
    with warnings.catch_warnings():
        # Vectors decoded from the wire are often read-only views of the
        # message buffer; torch warns about that, but we only read from it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(vec)
    offset = 0
    with torch.no_grad():
        for parameter in model.parameters():
            count = parameter.numel()
            parameter.copy_(source[offset : offset + count].view_as(parameter))
            offset += count
