"""Local computation of a client, as in McMahan et al. (2017).

``client_update`` is Algorithm 1's ClientUpdate (FedAvg), ``local_gradient``
is what a client sends in FedSGD, ``evaluate`` scores a model on a set.
Examples ``x`` and targets ``y`` arrive as stored in the cache, typically slices of a
memory-mapped data set; ``dataset`` (its declaration, ``datasets.Dataset``) says how
they become tensors, how a training batch is augmented and how the loss is scored.
Without one they are uint8 images of any size (``IMAGES``).

The thread count is deliberately left alone: the node decides it. So is the device:
every function computes where ``model``'s parameters are (``run.device``, see
``devices.torch_device``), moving the examples there; random draws (batch order,
augmentation) come from CPU generators either way, so a GPU sees the same batches.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .datasets import Dataset, ImageDataset
from .models import get_flat, parameters_of

# Chunk size for full-data passes: bounds activation memory on big clients.
FULL_PASS_CHUNK = 2000


class TrainingStopped(Exception):
    """Raised from a training loop inside :func:`stop_when` once its condition holds."""


_stop = threading.local()  # a pool thread trains one client at a time


@contextlib.contextmanager
def stop_when(should_stop: Callable[[], bool]):
    """Within this block, training on this thread raises :class:`TrainingStopped` at
    its next step once ``should_stop()`` is true: a client whose device went offline
    stops there, as a real one would."""
    previous = getattr(_stop, "check", None)
    _stop.check = should_stop
    try:
        yield
    finally:
        _stop.check = previous


def stop_point() -> None:
    check = getattr(_stop, "check", None)
    if check is not None and check():
        raise TrainingStopped


@dataclass
class TrainResult:
    weights: np.ndarray  # flat float32, laid out as models.get_flat
    num_samples: int
    train_loss: float  # mean of the last epoch's minibatch losses
    steps: int  # SGD steps taken over all epochs


class _Images(ImageDataset):
    """uint8 grey or colour images of any size: (n, H, W) -> (n, 1, H, W), (n, C, H, W) as
    is, in [0, 1]. Not registered: the conversion for callers that name no data set."""

    def inputs(self, x: np.ndarray, train: bool = False) -> torch.Tensor:
        x = np.asarray(x)
        if x.ndim < 3:
            raise ValueError(f"images of shape {x.shape[1:]}: name the data set, whose input_shape says "
                             "how to lay them out")
        floats = x.astype(np.float32)
        np.divide(floats, 255.0, out=floats)
        return torch.from_numpy(floats).view(len(x), -1, *x.shape[-2:])


IMAGES = _Images()


def device_of(model: nn.Module) -> torch.device:
    """Where ``model`` computes: its parameters' device."""
    parameters = parameters_of(model)
    return parameters[0].device if parameters else torch.device("cpu")


def check_local_data(x: np.ndarray, y: np.ndarray) -> int:
    count = len(y)
    if count == 0:
        raise ValueError("a client needs at least one sample")
    if len(x) != count:
        raise ValueError(f"{len(x)} examples but {count} targets")
    return count


def prepared(x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int | None, dataset: Dataset,
              device: torch.device):
    """Checked arguments of a ClientUpdate: (n, batch size, input tensor, target tensor),
    the tensors on ``device``."""
    count = check_local_data(x, y)
    if epochs <= 0:
        raise ValueError(f"epochs must be positive, got {epochs}")
    if batch_size is not None and batch_size < 0:
        raise ValueError(f"batch_size must be None, 0 or positive, got {batch_size}")
    batch = count if not batch_size else min(batch_size, count)
    # Converted (and moved) once per call, not per batch.
    return count, batch, dataset.inputs(x, train=True).to(device), dataset.targets(y).to(device)


def sgd_epochs(
    forward: Callable[[torch.Tensor], torch.Tensor],
    parameters,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    batch: int,
    epochs: int,
    lr: float,
    generator: torch.Generator,
    lr_decay: float = 0.0,
    start_iteration: int = 0,
    after_backward: Callable[[], None] | None = None,
    dataset: Dataset = IMAGES,
) -> tuple[int, list[float]]:
    """Algorithm 1's inner loops: E epochs, each a fresh permutation from ``generator``
    cut into minibatches; one plain SGD step (no momentum, no weight decay) per batch.
    ``after_backward`` may edit gradients (a structured update's mask). A data set that
    augments transforms each batch with draws from ``generator`` too. Returns the
    steps taken and the last epoch's minibatch losses."""
    # The step by hand, as torch.optim.SGD does it on CPU (param += -lr * grad): its first
    # use imports torch._dynamo, seconds of start-up in every node process.
    params = list(parameters)
    count = len(targets)
    augments = dataset.augments
    steps = 0
    epoch_losses: list[float] = []
    for _ in range(epochs):
        order = torch.randperm(count, generator=generator).to(inputs.device)
        losses = []
        for start in range(0, count, batch):
            stop_point()
            chosen = order[start : start + batch]
            step_lr = lr / (1.0 + lr_decay * (start_iteration + steps)) if lr_decay else lr
            for p in params:
                p.grad = None
            batch_inputs = inputs[chosen]
            if augments:
                batch_inputs = dataset.augment(batch_inputs, generator)
            loss = dataset.loss(forward(batch_inputs), targets[chosen])
            loss.backward()
            if after_backward is not None:
                after_backward()
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-step_lr)
            losses.append(loss.detach())
            steps += 1
        # Read once per epoch: on a GPU, a read per step would wait for every step's kernels.
        epoch_losses = torch.stack(losses).tolist() if losses else []
    return steps, epoch_losses


def client_update(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch_size: int | None,
    lr: float,
    generator: torch.Generator,
    lr_decay: float = 0.0,
    start_iteration: int = 0,
    dataset: Dataset = IMAGES,
    after_backward: Callable[[], None] | None = None,
) -> TrainResult:
    """Run E epochs of minibatch SGD on the local data, starting from ``model``.

    Each epoch draws a fresh permutation from ``generator`` and cuts it into
    batches of ``batch_size`` (the last one may be smaller); None or 0 means
    one batch of all local data. The model is trained in place; its final
    weights are also returned flat.

    ``lr_decay`` is Keras' time-based decay, as Nilsson et al. used it: step i (counted
    over the client's life, from ``start_iteration``) uses lr / (1 + lr_decay * i).

    ``after_backward`` may edit the gradients before each step, as an algorithm's
    correction does (FedProx's proximal term, SCAFFOLD's control variates).
    """
    count, batch, inputs, targets = prepared(x, y, epochs, batch_size, dataset, device_of(model))
    if not model.training:  # model.train() walks every module, even when all are training already
        model.train()
    params = parameters_of(model)
    steps, epoch_losses = sgd_epochs(model, params, inputs, targets, batch=batch, epochs=epochs,
                                     lr=lr, generator=generator, lr_decay=lr_decay,
                                     start_iteration=start_iteration,
                                     after_backward=after_backward, dataset=dataset)
    return TrainResult(
        weights=get_flat(model),
        num_samples=count,
        train_loss=float(np.mean(epoch_losses)),
        steps=steps,
    )


def local_gradient(
    model: nn.Module, x: np.ndarray, y: np.ndarray, dataset: Dataset = IMAGES
) -> tuple[np.ndarray, float]:
    """The flat gradient of the mean loss over all local data, and that loss (the mean
    over scored targets: every example's, or every unpadded position's).

    Computed in chunks whose summed losses are backpropagated, so gradients
    accumulate to exactly the full-batch sum before the one division by n.
    """
    count = check_local_data(x, y)
    device = device_of(model)
    targets = dataset.targets(y).to(device)
    scored = int(dataset.scored(targets).sum())
    if scored == 0:
        raise ValueError("no scored target in the local data (all padding)")
    model.train()
    model.zero_grad(set_to_none=True)
    total_loss = 0.0
    for start in range(0, count, FULL_PASS_CHUNK):
        stop_point()
        stop = min(start + FULL_PASS_CHUNK, count)
        loss_sum = dataset.loss(model(dataset.inputs(x[start:stop]).to(device)), targets[start:stop],
                                reduction="sum")
        loss_sum.backward()
        total_loss += loss_sum.item()

    parameters = parameters_of(model)
    gradient = torch.cat([parameter.grad.reshape(-1) for parameter in parameters])
    gradient.div_(scored)
    # Leave no gradients behind: a later optimizer step must not reuse them.
    model.zero_grad(set_to_none=True)
    return gradient.cpu().numpy(), total_loss / scored


def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 2000, dataset: Dataset = IMAGES
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``model`` on the given set, over its scored
    targets (every example's; for sequences, every position but padding)."""
    count = check_local_data(x, y)
    device = device_of(model)
    was_training = model.training
    model.eval()
    correct = scored = 0
    total_loss = 0.0
    try:
        with torch.no_grad():
            for start in range(0, count, batch_size):
                stop = min(start + batch_size, count)
                # Converted per batch: a test set may be a large memory map.
                logits = model(dataset.inputs(x[start:stop]).to(device))
                targets = dataset.targets(y[start:stop]).to(device)
                keep = dataset.scored(targets)
                total_loss += dataset.loss(logits, targets, reduction="sum").item()
                correct += int(((logits.argmax(dim=-1) == targets) & keep).sum())
                scored += int(keep.sum())
    finally:
        model.train(was_training)
    if scored == 0:
        raise ValueError("no scored target in the evaluation set (all padding)")
    return correct / scored, total_loss / scored


def plain_mlp(model: nn.Module) -> list[nn.Linear] | None:
    """The Linear layers of a [Flatten,] Linear, ReLU, ..., Linear stack, else None."""
    layers = list(model.children()) if isinstance(model, nn.Sequential) else []
    if layers and isinstance(layers[0], nn.Flatten):
        layers = layers[1:]
    if not layers or len(layers) % 2 == 0:
        return None
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.ReLU if i % 2 else nn.Linear):
            return None
    return layers[::2]
