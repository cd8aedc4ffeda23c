"""Many members' copies of one model, stacked: which models can be, and each layer's
forward and backward run once for all members (cohort.py trains with them).

**Exact.** Every member's weights, gradient and losses are bit for bit what
``training.client_update`` (``local_gradient``) computes for that client
alone, so a member's update depends on nothing else in its cohort, and ``run.cohort``
does not change a run's weights. That holds because each batched kernel runs, slice by
slice, the per-client kernel's own arithmetic: a Linear layer is ``baddbmm`` (one
``addmm`` per member, as ``F.linear``), its gradients ``bmm`` (one ``mm`` per member, as
autograd's), the loss and the backward are the very ops autograd records
(``log_softmax``, ``nll_loss``'s gradient, ``_log_softmax_backward_data``,
``threshold_backward``, ``max_pool2d_with_indices_backward``), elementwise steps are
elementwise, and a convolution is the per-client call once per member (its cost is
its arithmetic, not its dispatch). ``torch.func.vmap`` would not do: its batching rule
splits a Linear layer into a matmul and an add, which round differently from the
fused ``addmm``, and folding the members into one matrix product rounds each row by
the product's size, which depends on who else is in it. ``tests/test_cohort.py``
checks the equality for each task.

**Which models.** An ``nn.Sequential`` (nested ones allowed) of ``Flatten``, ``Linear``,
``ReLU``, ``Conv2d`` and ``MaxPool2d``, without buffers or hooks, trained on the data
set's own loss (cross-entropy, one label per example, none ignored): McMahan et al.'s
2NN and CNN. Anything else (batch norm's running statistics, a module of its own, an
LSTM, a plug-in loss) is not vectorised: :func:`problem` says why, and its clients
train one by one. An algorithm with a pass of its own vectorises it with the
primitives here (``plan_of``, ``chunks``, ``stacked_starts``, ``member_rows``,
``consecutive_runs``, ``each``), as FSVRG's module does for SVRG's pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .datasets import Dataset
from .models import parameters_of

aten = torch.ops.aten

LINEAR, _RELU, _FLATTEN, _CONV, _POOL = "linear", "relu", "flatten", "conv", "pool"
_ALIGN = 16  # floats: 64 bytes
INEXACT = ("its batched steps do not give its per-client steps' bits on this device (torch computes some "
           "of its layer sizes or layouts by other kernels when batched)")


@dataclass(frozen=True)
class _Layer:
    kind: str
    module: nn.Module | None = None
    weight: int = -1  # index in parameters_of(model)
    bias: int = -1


@dataclass
class Plan:
    """A vectorisable model's layers and its flat layout."""

    layers: list[_Layer]
    shapes: list[torch.Size]
    offsets: list[int]
    size: int  # parameters in all
    activation_floats: int  # per example: every layer's output, kept for the backward pass
    first_with_parameters: int  # layers up to it need no input gradient

    @property
    def row(self) -> int:
        """Floats between two members' weights: ``size`` rounded up to 64 bytes, so each
        member's parameters lie as a client's own tensors do (the CPU allocator aligns
        them to 64 bytes), where MKL's matrix-vector kernels round by alignment."""
        return -(-self.size // _ALIGN) * _ALIGN

    def stacked(self, members: int, device: torch.device) -> torch.Tensor:
        """An uninitialised (members, size) tensor whose rows are 64-byte aligned."""
        return torch.empty(members, self.row, device=device)[:, :self.size]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's (members, *shape) view of a (members, size) tensor."""
        return [flat[:, offset:offset + math.prod(shape)].view(flat.shape[0], *shape)
                for offset, shape in zip(self.offsets, self.shapes)]

    def expanded(self, start: torch.Tensor, members: int) -> list[torch.Tensor]:
        """One flat weight vector, viewed as every member's (stride 0 across members)."""
        return [start[offset:offset + math.prod(shape)].view(shape).expand(members, *shape)
                for offset, shape in zip(self.offsets, self.shapes)]


# --- which models ------------------------------------------------------------------------


def _leaves(module: nn.Module):
    if type(module) is nn.Sequential:
        for child in module:
            yield from _leaves(child)
    else:
        yield module


def _layer_problem(m: nn.Module) -> str | None:
    if any(True for _ in m.buffers(recurse=False)):
        return f"its {type(m).__name__} keeps buffers (running statistics) that training updates"
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return f"its {type(m).__name__} has hooks"
    kind = type(m)
    if kind is nn.Flatten and (m.start_dim, m.end_dim) != (1, -1):
        return "its Flatten does not flatten everything but the batch"
    if kind is nn.Conv2d and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
        return "its Conv2d pads by mode or by name"
    if kind is nn.MaxPool2d and m.return_indices:
        return "its MaxPool2d returns indices"
    if kind not in (nn.Flatten, nn.Linear, nn.ReLU, nn.Conv2d, nn.MaxPool2d):
        return f"it has a {kind.__name__}, which cohort training does not batch"
    return None


def layout(model: nn.Module, dataset: Dataset) -> Plan | str:
    if type(model) is not nn.Sequential:
        return f"it is a {type(model).__name__}, not an nn.Sequential of the layers cohort training batches"
    if dataset.ignore_label is not None or type(dataset).loss is not Dataset.loss:
        return f"data set {dataset.name!r} scores training with a loss of its own"
    parameters = parameters_of(model)
    if not parameters or any(p.dtype != torch.float32 for p in parameters):
        return "its parameters are not all float32"
    index = {id(p): i for i, p in enumerate(parameters)}
    layers: list[_Layer] = []
    for m in _leaves(model):
        why = _layer_problem(m)
        if why:
            return why
        kind = {nn.Flatten: _FLATTEN, nn.Linear: LINEAR, nn.ReLU: _RELU, nn.Conv2d: _CONV,
                nn.MaxPool2d: _POOL}[type(m)]
        weight = index[id(m.weight)] if kind in (LINEAR, _CONV) else -1
        bias = index[id(m.bias)] if kind in (LINEAR, _CONV) and m.bias is not None else -1
        layers.append(_Layer(kind, m, weight, bias))
    used = sorted(i for layer in layers for i in (layer.weight, layer.bias) if i >= 0)
    if used != list(range(len(parameters))):
        return "its parameters are not all in its layers, in order"
    shapes = [p.shape for p in parameters]
    offsets = list(np.cumsum([0] + [p.numel() for p in parameters[:-1]]).tolist())
    plan = Plan(layers, shapes, offsets, sum(p.numel() for p in parameters), 0,
                 min(i for i, layer in enumerate(layers) if layer.weight >= 0))
    # Check the plan against the model itself, on blank examples: the same logits, bit
    # for bit, and Linear layers that see one feature vector per example.
    device = parameters[0].device
    blank = dataset.inputs(dataset.blank(2), train=True).to(device)
    with torch.no_grad():
        expected = model(blank)
        a = blank.unsqueeze(0)
        floats = 0
        params = plan.expanded(flat_of(parameters), 1)
        for layer in layers:
            if layer.kind == LINEAR and a.dim() != 3:
                return "a Linear layer in it sees more than one feature vector per example"
            a, _ = _forward_layer(layer, params, a)
            floats += a[0, 0].numel()
        if expected.dim() != 2:
            return "its outputs are not one row of logits per example"
        exact = torch.equal(a[0], expected)
    plan.activation_floats = floats
    return plan if exact else INEXACT


def flat_of(parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in parameters])


# --- one layer, forward and backward, for all members ----------------------------------



def _forward_layer(layer: _Layer, params: list[torch.Tensor], a: torch.Tensor):
    """(output, what the backward pass needs) for activations ``a`` of shape
    (members, examples, *features)."""
    kind = layer.kind
    if kind == LINEAR:
        weight = params[layer.weight].transpose(1, 2)
        if layer.bias >= 0:
            return torch.baddbmm(params[layer.bias].unsqueeze(1), a, weight), a
        return torch.bmm(a, weight), a
    if kind == _RELU:
        out = torch.relu(a)
        return out, out
    if kind == _FLATTEN:
        return a.reshape(a.shape[0], a.shape[1], -1), a.shape
    if kind == _CONV:
        m = layer.module
        weight, bias = params[layer.weight], params[layer.bias] if layer.bias >= 0 else None
        out = torch.stack([F.conv2d(a[k], weight[k], None if bias is None else bias[k], m.stride, m.padding,
                                    m.dilation, m.groups) for k in range(a.shape[0])])
        return out, a
    m = layer.module  # _POOL
    folded = a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    out, indices = aten.max_pool2d_with_indices(folded, *_pool_args(m))
    return out.view(a.shape[0], a.shape[1], *out.shape[1:]), (folded, indices)


def _pool_args(m: nn.MaxPool2d) -> tuple:
    pair = lambda v: list(v) if isinstance(v, (tuple, list)) else [v, v]
    return (pair(m.kernel_size), pair(m.stride if m.stride is not None else m.kernel_size), pair(m.padding),
            pair(m.dilation), m.ceil_mode)


def forward(plan: Plan, params: list[torch.Tensor], x: torch.Tensor):
    saved = []
    a = x
    for layer in plan.layers:
        a, keep = _forward_layer(layer, params, a)
        saved.append(keep)
    return a, saved


# Members whose Linear weight gradients are made at once: a weight's gradient is
# made and spent block by block, so a step never holds one per member (a fresh
# model-sized tensor per member was most of a step of one-example members).
_BLOCK_BYTES = 4 * 2**20


def backward(plan: Plan, params: list[torch.Tensor], saved: list, grad: torch.Tensor,
              spend: Callable[[int, int, int, torch.Tensor], None]) -> None:
    """The backward pass from the logits' gradient, with the ops and operands autograd
    uses for one client, per member. Each parameter's gradient, as soon as it is known
    (after its layer's input gradient, which reads the parameters as they were), goes
    to ``spend(parameter index, first member, end member, gradient)`` in blocks of
    members, so ``spend`` may update the parameters in place."""
    g = grad
    members = grad.shape[0]
    for i in range(len(plan.layers) - 1, -1, -1):
        layer, keep = plan.layers[i], saved[i]
        needs_input = i > plan.first_with_parameters
        if layer.kind == LINEAR:
            weight = params[layer.weight]
            bias = g.sum(1) if layer.bias >= 0 else None
            below = torch.bmm(g, weight) if needs_input else None
            block = max(1, _BLOCK_BYTES // (4 * weight[0].numel()))
            scratch = torch.empty(min(block, members), *weight.shape[1:], device=g.device)
            for lo in range(0, members, block):
                hi = min(lo + block, members)
                spend(layer.weight, lo, hi, torch.bmm(g[lo:hi].transpose(1, 2), keep[lo:hi], out=scratch[:hi - lo]))
            if bias is not None:
                spend(layer.bias, 0, members, bias)
            g = below
        elif layer.kind == _RELU:
            g = aten.threshold_backward(g, keep, 0)
        elif layer.kind == _FLATTEN:
            g = g.reshape(keep)
        elif layer.kind == _CONV:
            m = layer.module
            weight = params[layer.weight]
            has_bias = layer.bias >= 0
            parts = [aten.convolution_backward(g[k], keep[k], weight[k], [m.out_channels] if has_bias else None,
                                               list(m.stride), list(m.padding), list(m.dilation), False, [0, 0],
                                               m.groups, [needs_input, True, has_bias])
                     for k in range(members)]
            below = torch.stack([p[0] for p in parts]) if needs_input else None
            spend(layer.weight, 0, members, torch.stack([p[1] for p in parts]))
            if has_bias:
                spend(layer.bias, 0, members, torch.stack([p[2] for p in parts]))
            g = below
        else:  # _POOL
            folded, indices = keep
            examples = g.shape[1]
            g = aten.max_pool2d_with_indices_backward(g.reshape(members * examples, *g.shape[2:]), folded,
                                                      *_pool_args(layer.module), indices)
            g = g.view(members, examples, *g.shape[1:])
        if i == plan.first_with_parameters:
            break  # nothing before it has parameters


def loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, mean: bool):
    """Each member's cross-entropy (mean or sum over its examples) and the logits'
    gradient, as F.cross_entropy and its backward compute them for one client."""
    members, examples, classes = logits.shape
    logp = torch.log_softmax(logits.reshape(members * examples, classes), 1)
    flat_targets = targets.reshape(-1)
    seed = torch.zeros_like(logp)
    # nll_loss's gradient: -(grad / total weight) at each target, the division in float32.
    value = -(torch.tensor(1.0) / torch.tensor(float(examples))) if mean else torch.tensor(-1.0)
    seed[torch.arange(members * examples, device=logp.device), flat_targets] = value.to(logp.device)
    grad = aten._log_softmax_backward_data(seed, logp, 1, logp.dtype).view(members, examples, classes)
    with torch.no_grad():
        if examples == 1:  # the mean or sum of one value is the value
            losses = list(-logp.gather(1, flat_targets.unsqueeze(1)).view(members))
        else:
            per_member = logp.view(members, examples, classes)
            losses = [F.nll_loss(per_member[k], targets[k], reduction="mean" if mean else "sum")
                      for k in range(members)]
    return losses, grad


