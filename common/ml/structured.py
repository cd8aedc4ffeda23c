"""ClientUpdate under a compression codec: the client-side entry point.

For structured codecs (Konečný et al. 2016, Section 2) SGD runs in the
restricted space: random_mask layers take steps only on their masked entries,
low_rank layers train only B in W = W_global + A B with A fixed by the seed.
Everything else about the loop is ``training.client_update``'s: the same
optimizer and learning-rate decay, batches cut from one ``randperm`` of
``generator`` per epoch, and small layers and biases trained in full. For codecs without structure the update
is plain ``client_update`` followed by ``codec.encode`` (a sketch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from .compression import LOW_RANK, RANDOM_MASK, UpdateCodec, low_rank_product
from .models import get_flat
from .datasets import Dataset
from .training import IMAGES, client_update, device_of, prepared, sgd_epochs


class _Mask(NamedTuple):
    parameter: torch.Tensor
    pattern: np.ndarray  # bool, the entries that train
    weights: torch.Tensor  # the pattern as 0/1 floats, to multiply gradients by


class _Factor(NamedTuple):
    name: str
    parameter: torch.Tensor
    base: torch.Tensor  # w_global's value, fixed
    basis: np.ndarray  # A
    basis_t: torch.Tensor  # A on the training device (on the CPU it shares A's memory)
    factor: torch.Tensor  # B, the trained leaf


@dataclass
class CompressedResult:
    encoded: dict  # wire-ready; the server calls codec.decode(encoded, seed)
    # The update H = w_local - w_global the training produced (flat float32).
    # codec.decode(encoded, seed) equals it exactly unless the codec sketches.
    delta: np.ndarray
    num_samples: int
    train_loss: float  # mean of the last epoch's minibatch losses
    steps: int
    encode_s: float  # seconds spent encoding (part of the client's compute)


def compressed_client_update(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    codec: UpdateCodec,
    seed: int,
    epochs: int,
    batch_size: int | None,
    lr: float,
    generator: torch.Generator,
    lr_decay: float = 0.0,
    start_iteration: int = 0,
    dataset: Dataset = IMAGES,
    after_backward: Callable[[], None] | None = None,
) -> CompressedResult:
    """Train from the weights ``model`` holds (w_global) and return the encoded update.

    ``seed`` is ``compression.update_seed(run_seed, round, client)``; the other
    arguments mean what they mean for ``client_update``. The model is trained in
    place and ends at w_global + delta (low_rank layers within float32 rounding of
    it), as ``client_update`` leaves it at its trained weights.
    """
    start_weights = get_flat(model)
    if not codec.structured:
        result = client_update(model, x, y, epochs=epochs, batch_size=batch_size,
                               lr=lr, generator=generator, lr_decay=lr_decay,
                               start_iteration=start_iteration, dataset=dataset, after_backward=after_backward)
        delta = result.weights - start_weights
        started = time.perf_counter()  # wall: the encoding's measured compute
        encoded = codec.encode(delta, seed)
        return CompressedResult(encoded, delta, result.num_samples, result.train_loss, result.steps,
                                time.perf_counter() - started)  # wall
    if after_backward is not None:  # FedProx's check_config refuses it with structured updates
        raise ValueError("a structured update trains in a restricted space of its own, where a gradient hook "
                         "(FedProx's proximal term) does not apply; use sketched compression")
    return _restricted_update(model, x, y, codec, seed, start_weights,
                              epochs, batch_size, lr, generator, lr_decay, start_iteration, dataset)


def _restricted_update(model, x, y, codec, seed, start_weights,
                       epochs, batch_size, lr, generator, lr_decay, start_iteration, dataset) -> CompressedResult:
    device = device_of(model)
    count, batch, inputs, targets = prepared(x, y, epochs, batch_size, dataset, device)

    named = list(model.named_parameters())
    if len(named) != len(codec.layers):
        raise ValueError(f"model has {len(named)} parameters, codec was made for {len(codec.layers)}")
    trainable: list[torch.Tensor] = []
    masks: dict[int, _Mask] = {}  # by layer index
    factors: dict[int, _Factor] = {}
    for plan, (name, parameter) in zip(codec.layers, named):
        if tuple(parameter.shape) != plan.shape:
            raise ValueError(f"parameter {name} has shape {tuple(parameter.shape)}, codec expects {plan.shape}")
        if plan.kind == RANDOM_MASK:
            pattern = codec.mask(plan.index, seed)
            masks[plan.index] = _Mask(parameter, pattern, torch.from_numpy(pattern.astype(np.float32)).to(device))
            trainable.append(parameter)
        elif plan.kind == LOW_RANK:
            basis = codec.basis(plan.index, seed)
            # B starts at zero, so training starts from w_global exactly.
            factor = torch.zeros(plan.rank, plan.cols, device=device, requires_grad=True)
            factors[plan.index] = _Factor(name, parameter, parameter.detach().clone(), basis,
                                          torch.from_numpy(basis).to(device), factor)
            trainable.append(factor)
        else:
            trainable.append(parameter)

    model.train()

    def forward(batch_inputs: torch.Tensor) -> torch.Tensor:
        if not factors:
            return model(batch_inputs)
        weights = dict(named)
        for f in factors.values():
            weights[f.name] = f.base + (f.basis_t @ f.factor).view_as(f.base)
        return functional_call(model, weights, (batch_inputs,))

    def mask_gradients() -> None:
        for m in masks.values():
            # A zero gradient leaves an entry bit-for-bit unchanged under plain SGD.
            m.parameter.grad.mul_(m.weights)

    steps, epoch_losses = sgd_epochs(forward, trainable, inputs, targets, batch=batch, epochs=epochs, lr=lr,
                                     generator=generator, lr_decay=lr_decay, start_iteration=start_iteration,
                                     after_backward=mask_gradients, dataset=dataset)

    # The low_rank delta is defined by the same product the server computes, and
    # the model is left at w_global + that delta.
    products = {}
    with torch.no_grad():
        for index, f in factors.items():
            products[index] = low_rank_product(f.basis, f.factor.detach().cpu().numpy())
            f.parameter.copy_(f.base + torch.from_numpy(products[index]).to(device).view_as(f.base))

    started = time.perf_counter()  # wall: the encoding's measured compute
    delta = get_flat(model) - start_weights
    coordinates = []
    for plan in codec.layers:
        block = delta[plan.offset : plan.offset + plan.size]
        if plan.kind == LOW_RANK:
            block[:] = products[plan.index].reshape(-1)  # exact, not w_local - w_global's rounding
            coordinates.append(factors[plan.index].factor.detach().cpu().numpy().reshape(-1))
        elif plan.kind == RANDOM_MASK:
            coordinates.append(block[masks[plan.index].pattern.reshape(-1)])
        else:
            coordinates.append(block)
    encoded = codec.encode_restricted(coordinates, seed)
    return CompressedResult(encoded, delta, count, float(np.mean(epoch_losses)), steps,
                            time.perf_counter() - started)  # wall
