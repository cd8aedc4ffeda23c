"""Models: McMahan et al. (2017)'s two MNIST models, any model a plug-in brings, and
flat-vector weights.

A model is a builder, ``builder(input_shape, num_classes) -> nn.Module``, filed with
``@register(name)`` as algorithms and data sets are, and found by ``model.name``: a
built-in (``2nn``, ``cnn``, ``cifar-cnn``, ``char-lstm``), a builder a plug-in's module
registered, an installed package's ``fedemu.models`` entry point, or
``package.module:function``. It is built for the run's data set, whose
declaration gives the input shape and the number of classes (:class:`ModelSpec`).
Every process that trains or evaluates builds it (the server and each worker node), so
over ``--machines`` each host's preflight checks that it can import it. A model takes
the data set's input tensors, (n, *input_shape), and returns (n, num_classes) logits (or
(n, T, num_classes) for a sequence of targets); softmax is left to the cross-entropy
loss. Weights cross the wire as one float32 vector in ``model.parameters()`` order,
which is fixed by the module definitions.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from fedemu.node import plugins, streams

if TYPE_CHECKING:
    from torch import nn

    from .datasets import Dataset

# torch is imported inside the functions that use it: resolving a model's name
# (config validation in the launcher) must not cost the launcher torch's import.

ENTRY_POINT_GROUP = "fedemu.models"

Builder = Callable[..., "nn.Module"]  # builder(input_shape=(C, H, W), num_classes=N)

# Builders by model.name: the built-ins below file themselves, plug-ins once found.
_builders: dict[str, Builder] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator: file a builder under ``name`` (what ``model.name`` says), as
    ``algorithms.register`` and ``datasets.register`` file theirs. A plug-in's module may
    use it too; a name another builder holds is refused (ValueError)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
        raise ValueError(f"model name {name!r}: lower-case letters, digits, '.', '_' or '-'")

    def file(fn: Builder) -> Builder:
        known = _builders.get(name)
        if known is not None and known is not fn:
            raise ValueError(f"model {name!r} is registered already, by {known.__module__}.{known.__qualname__}")
        _builders[name] = fn
        return fn
    return file


@register("2nn")
def _two_layer_mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    # torch where it is used: this module is read without it, where a config is checked
    from torch import nn

    # "2NN": two hidden layers of 200 units; on MNIST 199,210 parameters.
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, num_classes),
    )


@register("cnn")
def _cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    # torch where it is used: this module is read without it, where a config is checked
    from torch import nn

    if len(input_shape) != 3:
        raise ValueError(f"the CNN takes images (channels, height, width), not inputs of shape {input_shape}")
    # Padding 2 keeps H x W through each 5x5 conv, so after two 2x2 pools the feature
    # map is H/4 x W/4 x 64 (MNIST: 7x7x64 = 3136; 1,663,370 parameters in all).
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear((height // 4) * (width // 4) * 64, 512),
        nn.ReLU(),
        nn.Linear(512, num_classes),
    )


@register("cifar-cnn")
def _cifar_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """McMahan et al.'s CIFAR-10 model, the TensorFlow tutorial's (cifar10.py): two 5x5
    convolutions of 64 with 3x3 max-pooling (stride 2, padded) and local response
    normalisation, fully connected layers of 384 and 192, and a linear layer to the
    logits; on 24x24 crops 1,068,298 parameters ("about 10^6")."""
    # torch where it is used: this module is read without it, where a config is checked
    from torch import nn

    if len(input_shape) != 3:
        raise ValueError(f"the CIFAR CNN takes images (channels, height, width), not inputs of shape {input_shape}")
    channels, height, width = input_shape
    # tf.nn.lrn(depth_radius=4, bias=1, alpha=0.001/9, beta=0.75) sums alpha * x^2 over 9
    # channels; torch divides its alpha by the window size, so it gets 9 * 0.001 / 9.
    lrn = dict(size=9, alpha=0.001, beta=0.75, k=1.0)
    pooled = lambda size: (size - 1) // 2 + 1  # a 3x3, stride-2 pool padded by 1 ('SAME')
    return nn.Sequential(
        nn.Conv2d(channels, 64, kernel_size=5, padding=2), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1), nn.LocalResponseNorm(**lrn),
        nn.Conv2d(64, 64, kernel_size=5, padding=2), nn.ReLU(),
        nn.LocalResponseNorm(**lrn), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(pooled(pooled(height)) * pooled(pooled(width)) * 64, 384), nn.ReLU(),
        nn.Linear(384, 192), nn.ReLU(),
        nn.Linear(192, num_classes),
    )


@register("char-lstm")
def _char_lstm(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """McMahan et al.'s Shakespeare model: each character embedded in 8 dimensions, two
    LSTM layers of 256, a softmax over the characters at every one of the unrolled
    positions (logits (n, T, classes)). For 258 classes, 867,090 parameters: PyTorch's
    LSTM has two bias vectors and no peepholes, TensorFlow's cell one and three peephole
    vectors per layer, hence 2 x (1,024 - 768) = 512 more than the paper's 866,578."""
    # torch where it is used: this module is read without it, where a config is checked
    import torch
    # torch where it is used: this module is read without it, where a config is checked
    from torch import nn

    if len(input_shape) != 1:
        raise ValueError(f"the char LSTM takes sequences of token ids, not inputs of shape {input_shape}")

    class CharLSTM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(num_classes, 8)
            self.lstm = nn.LSTM(8, 256, num_layers=2, batch_first=True)
            self.out = nn.Linear(256, num_classes)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            states, _ = self.lstm(self.embed(tokens))
            return self.out(states)

    return CharLSTM()


MODEL_NAMES = tuple(_builders)  # the built-ins, as filed above


class UnknownModel(plugins.PluginNotFound):
    pass


def builder(name: str) -> Builder:
    """The builder ``model.name`` names (module docstring); UnknownModel says why not."""
    if name in _builders:
        return _builders[name]
    try:
        found = plugins.load(name, "model", ENTRY_POINT_GROUP, "function", list(MODEL_NAMES))
    except plugins.PluginNotFound as exc:
        raise UnknownModel(str(exc)) from None
    if not callable(found):
        raise UnknownModel(f"model {name!r} is {found!r}, not a builder(input_shape, num_classes)")
    _builders[name] = found  # also under the name the config used
    return found


INITS = ("torch", "normal", "glorot")


@functools.lru_cache(maxsize=64)
def fits(name: str, dataset_name: str) -> str | None:
    """Why model ``name`` cannot train on data set ``dataset_name`` (None if it can): it is
    built for the data set's declared input shape and classes and run, with the data
    set's loss, on a blank batch of its examples, so a mismatch is found before anything
    starts, plug-ins included. Cached: a sweep checks each point."""
    # torch where it is used: this module is read without it, where a config is checked
    import torch

    # models.py is imported by datasets/ (a data set names its models)
    from .datasets import get

    dataset = get(dataset_name)
    inputs = dataset.inputs(dataset.blank(2))
    what = _describe_inputs(inputs)
    advice = f"; use model.name = {dataset.model!r}, made for {dataset_name}" if dataset.model not in ("", name) else ""
    try:
        model = build(name, dataset.input_shape, dataset.num_classes, seed=0)
        with torch.no_grad():
            logits = model(inputs)
        if (not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3) or logits.shape[0] != 2
                or logits.shape[-1] != dataset.num_classes):
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"for 2 examples it returns {shape}, not logits (2, {dataset.num_classes}) or "
                             f"(2, T, {dataset.num_classes})")
        dataset.loss(logits, torch.zeros(logits.shape[:-1], dtype=torch.int64))
    except Exception as exc:  # whatever the model raises is the mismatch, in its words
        return (f"model.name = {name!r} does not fit data.dataset = {dataset_name!r}, whose examples are {what}: "
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}{advice}")
    return None


def _describe_inputs(batch) -> str:
    """One example of a model's input batch in words: '80 token ids (int64)', '1x28x28 floats'."""
    shape = "x".join(map(str, batch.shape[1:])) or "1"
    kind = "floats" if batch.is_floating_point() else f"token ids ({str(batch.dtype).removeprefix('torch.')})"
    return f"{shape} {kind}"


@dataclass(frozen=True)
class ModelSpec:
    """The model a run trains: ``model.name`` built for the run's data set (its input shape
    and classes), initialised by ``model.init``. Built once from the config; every process
    that trains or evaluates builds its model from it."""

    name: str
    dataset: Dataset
    init: str = "torch"
    init_std: float = 0.0

    def build(self, seed: int | None = None, device=None) -> nn.Module:
        """The model, on ``device`` (a torch device; None: the CPU). Initialised on the CPU
        and then moved, so the initial weights are the same on any device."""
        model = build(self.name, self.dataset.input_shape, self.dataset.num_classes, seed=seed,
                      init=self.init, init_std=self.init_std)
        return model if device is None else model.to(device)


def build(name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int | None = None,
          init: str = "torch", init_std: float = 0.0) -> nn.Module:
    """A fresh model for inputs of ``input_shape`` and ``num_classes`` classes; with
    ``seed``, its initial weights are deterministic.

    ``init = "torch"`` keeps PyTorch's per-layer defaults; ``"normal"`` draws every weight
    and bias from N(0, init_std^2), as Nilsson et al.'s server did (``random_fc_model``
    in their server.erl: Erlang's ``rand:normal(0, 0.003)``, whose second argument is the
    variance, so init_std = sqrt(0.003)); ``"glorot"`` is TensorFlow's default for dense
    and convolution layers, which McMahan et al.'s models had: weights Glorot-uniform,
    biases zero (other layers keep PyTorch's defaults)."""
    # torch where it is used: this module is read without it, where a config is checked
    import torch
    # torch where it is used: this module is read without it, where a config is checked
    from torch import nn

    make = builder(name)
    if init not in INITS:
        raise ValueError(f"unknown model init {init!r}; allowed: {', '.join(INITS)}")
    # With a seed, a forked RNG: building a model leaves the caller's global torch RNG as it was.
    with torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext():
        if seed is not None:
            torch.manual_seed(streams.seed64(seed, "model.init"))
        model = make(input_shape=tuple(input_shape), num_classes=num_classes)
        if not isinstance(model, nn.Module):
            raise UnknownModel(f"model {name!r} built {type(model).__name__}, not a torch.nn.Module")
        if init == "normal":
            _normal_init(model, init_std)
        elif init == "glorot":
            _glorot_init(model)
    return model


def _normal_init(model: nn.Module, std: float) -> None:
    # torch where it is used: this module is read without it, where a config is checked
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, std)


def _glorot_init(model: nn.Module) -> None:
    # torch where it is used: this module is read without it, where a config is checked
    import torch
    # torch where it is used: this module is read without it, where a config is checked
    from torch import nn

    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                nn.init.xavier_uniform_(layer.weight)  # TensorFlow's glorot_uniform: the same bound
                if layer.bias is not None:
                    layer.bias.zero_()


def parameters_of(model: nn.Module) -> list:
    """``list(model.parameters())``, kept on the model: walking its modules costs tens of
    microseconds, which a client of one example paid several times a task (a quarter of
    its training). Weights change in place (``set_flat``, the optimizer step, ``.to()``),
    so the parameters, and the list, stay the same objects."""
    cached = model.__dict__.get("_fedemu_parameters")  # __dict__: not a submodule or buffer
    if cached is None:
        cached = model.__dict__["_fedemu_parameters"] = list(model.parameters())
    return cached


def num_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in parameters_of(model))


def _host_views(model: nn.Module) -> list[np.ndarray] | None:
    """NumPy views of the parameters' storage when they are on the CPU, else None: a
    client of one example loads its weights every task, and six torch copies
    (each a dispatch, and a warnings filter for the wire's read-only buffers) cost three
    times the copying itself. Kept on the model while the first parameter's storage is
    the one viewed (a move to another device replaces it)."""
    parameters = parameters_of(model)
    if not parameters or parameters[0].device.type != "cpu":
        return None
    cached = model.__dict__.get("_fedemu_host_views")
    if cached is None or cached[0] != parameters[0].data_ptr():
        views = [parameter.detach().numpy() for parameter in parameters]
        if not all(view.flags.c_contiguous for view in views):
            return None
        cached = model.__dict__["_fedemu_host_views"] = (parameters[0].data_ptr(), views)
    return cached[1]


def get_flat(model: nn.Module) -> np.ndarray:
    """All parameters as one new contiguous float32 vector (one copy; from a GPU, the
    concatenation is made there and crosses to the host once)."""
    # torch where it is used: this module is read without it, where a config is checked
    import torch

    with torch.no_grad():
        flat = torch.cat([parameter.reshape(-1) for parameter in parameters_of(model)])
    # .numpy() shares the freshly concatenated buffer: no second copy (.cpu() is a no-op on the CPU).
    return flat.to(torch.float32).cpu().numpy()


def split_flat(model: nn.Module, vec: np.ndarray) -> list:
    """``vec``, laid out as ``get_flat`` makes it, as one tensor per parameter, shaped and
    placed as that parameter (for a task that adds a flat vector to the gradients)."""
    # torch where it is used: this module is read without it, where a config is checked
    import torch

    if vec.ndim != 1 or vec.shape[0] != num_parameters(model):
        raise ValueError(f"vector has shape {vec.shape}, model needs ({num_parameters(model)},)")
    source = torch.from_numpy(np.array(vec, dtype=np.float32))  # a copy: the caller's array may change
    parameters = parameters_of(model)
    out, offset = [], 0
    for parameter in parameters:
        count = parameter.numel()
        out.append(source[offset : offset + count].view_as(parameter).to(parameter.device))
        offset += count
    return out


def set_flat(model: nn.Module, vec: np.ndarray) -> None:
    """Overwrite all parameters from a vector laid out as ``get_flat`` makes it."""
    # torch where it is used: this module is read without it, where a config is checked
    import torch

    vec = np.ascontiguousarray(vec)  # no copy when it already is
    expected = num_parameters(model)
    if vec.ndim != 1 or vec.shape[0] != expected:
        raise ValueError(f"weight vector has shape {vec.shape}, model needs ({expected},)")
    views = _host_views(model)
    if views is not None:
        # In place through NumPy (the same values a torch copy_ writes). Weights are only
        # ever loaded between tasks, with no autograd graph alive that could have saved them.
        offset = 0
        for view in views:
            np.copyto(view, vec[offset : offset + view.size].reshape(view.shape), casting="same_kind")
            offset += view.size
        return
    with warnings.catch_warnings():
        # Vectors decoded from the wire are often read-only views of the
        # message buffer; torch warns about that, but we only read from it.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        source = torch.from_numpy(vec)
    parameters = parameters_of(model)
    if parameters and parameters[0].device.type != "cpu":
        source = source.to(parameters[0].device)  # one transfer to the GPU, not one per layer
    offset = 0
    with torch.no_grad():
        for parameter in parameters:
            count = parameter.numel()
            parameter.copy_(source[offset : offset + count].view_as(parameter))
            offset += count
