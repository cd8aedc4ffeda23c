"""Local computation of a client, as in McMahan et al. (2017).

``client_update`` is Algorithm 1's ClientUpdate (FedAvg), ``local_gradient``
is what a client sends in FedSGD, ``evaluate`` scores a model on a set.
Images arrive as uint8 (n, 28, 28) arrays, typically slices of a
memory-mapped data set; labels as integer arrays.

The thread count is deliberately left alone: the node decides it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .models import get_flat

# Chunk size for full-data passes: bounds activation memory on big clients.
_FULL_PASS_CHUNK = 2000


@dataclass
class TrainResult:
    weights: np.ndarray  # flat float32, laid out as models.get_flat
    num_samples: int
    train_loss: float  # mean of the last epoch's minibatch losses
    steps: int  # SGD steps taken over all epochs


def to_tensor_images(images_uint8: np.ndarray) -> torch.Tensor:
    """uint8 images (n, 28, 28) or (n, 784) -> float32 (n, 1, 28, 28) in [0, 1]."""
    images = np.asarray(images_uint8)
    # One allocation: astype copies into a fresh writable buffer (also off
    # any read-only memory map), then the division happens in place.
    floats = images.astype(np.float32)
    np.divide(floats, 255.0, out=floats)
    return torch.from_numpy(floats).view(-1, 1, 28, 28)


def _to_tensor_labels(labels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(labels).astype(np.int64))


def _check_local_data(images_u8: np.ndarray, labels: np.ndarray) -> int:
    count = len(labels)
    if count == 0:
        raise ValueError("a client needs at least one sample")
    if len(images_u8) != count:
        raise ValueError(f"{len(images_u8)} images but {count} labels")
    return count


def client_update(
    model: nn.Module,
    images_u8: np.ndarray,
    labels: np.ndarray,
    *,
    epochs: int,
    batch_size: int | None,
    lr: float,
    generator: torch.Generator,
) -> TrainResult:
    """Run E epochs of minibatch SGD on the local data, starting from ``model``.

    Each epoch draws a fresh permutation from ``generator`` and cuts it into
    batches of ``batch_size`` (the last one may be smaller); None or 0 means
    one batch of all local data. The model is trained in place; its final
    weights are also returned flat.
    """
    count = _check_local_data(images_u8, labels)
    if epochs <= 0:
        raise ValueError(f"epochs must be positive, got {epochs}")
    if batch_size is not None and batch_size < 0:
        raise ValueError(f"batch_size must be None, 0 or positive, got {batch_size}")
    batch = count if not batch_size else min(batch_size, count)

    inputs = to_tensor_images(images_u8)
    targets = _to_tensor_labels(labels)
    # Plain SGD, as in the paper: no momentum, no weight decay.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=0.0)
    model.train()

    steps = 0
    epoch_losses: list[float] = []
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator)
        epoch_losses = []
        for start in range(0, count, batch):
            chosen = order[start : start + batch]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs[chosen]), targets[chosen])
            loss.backward()
            optimizer.step()
            epoch_losses.append(loss.item())
            steps += 1

    return TrainResult(
        weights=get_flat(model),
        num_samples=count,
        train_loss=float(np.mean(epoch_losses)),
        steps=steps,
    )


def local_gradient(
    model: nn.Module, images_u8: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, float]:
    """The flat gradient of the mean loss over all local data, and that loss.

    Computed in chunks whose summed losses are backpropagated, so gradients
    accumulate to exactly the full-batch sum before the one division by n.
    """
    count = _check_local_data(images_u8, labels)
    targets = _to_tensor_labels(labels)
    model.train()
    model.zero_grad(set_to_none=True)
    total_loss = 0.0
    for start in range(0, count, _FULL_PASS_CHUNK):
        stop = min(start + _FULL_PASS_CHUNK, count)
        inputs = to_tensor_images(images_u8[start:stop])
        loss_sum = F.cross_entropy(model(inputs), targets[start:stop], reduction="sum")
        loss_sum.backward()
        total_loss += loss_sum.item()

    parameters = list(model.parameters())
    gradient = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
    gradient.div_(count)
    # Leave no gradients behind: a later optimizer step must not reuse them.
    model.zero_grad(set_to_none=True)
    return gradient.numpy(), total_loss / count


def evaluate(
    model: nn.Module, images_u8: np.ndarray, labels: np.ndarray, batch_size: int = 2000
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on the given set."""
    count = _check_local_data(images_u8, labels)
    was_training = model.training
    model.eval()
    correct = 0
    total_loss = 0.0
    try:
        with torch.no_grad():
            for start in range(0, count, batch_size):
                stop = min(start + batch_size, count)
                # Converted per batch: a test set may be a large memory map.
                logits = model(to_tensor_images(images_u8[start:stop]))
                targets = _to_tensor_labels(labels[start:stop])
                total_loss += F.cross_entropy(logits, targets, reduction="sum").item()
                correct += int((logits.argmax(dim=1) == targets).sum())
    finally:
        model.train(was_training)
    return correct / count, total_loss / count
