"""Cohort training: the local work of many clients as one batched computation.

A worker node's clients that start local work at one instant (worker/cohorts.py
gathers them) are the *members* of a cohort; this module computes their work together.
Each member keeps everything that makes its update its own: its examples, its batch
order and augmentation (drawn from its own generator, in the order the per-client loop
draws them), its learning rate and decay, its number of steps (a member with fewer
examples finishes earlier and leaves the batch), its algorithm's gradient term (FedProx's
proximal term, a ``GradientTerm``), and its stop
condition (a device that goes offline stops its member at its next step; the others go
on). Their weights sit side by side in one (members, parameters) tensor, and each step
runs each layer once for all of them (stacked.py: which models can, and the layers'
batched forward and backward, bit for bit each member's own).

**Memory.** Members are split into chunks whose stacked weights, gradients and
activations fit ``memory_bytes``: 1,000 clients of the CNN do not need 1,000 copies at
once. Each member's result is a row of its chunk's weights, so the chunk's tensor lives
as long as any of its results.

**Devices.** Everything runs where the model's parameters are: on a GPU the members'
weights stay on the device for the whole cohort, and only the results cross to the
host. Batch orders and augmentation are drawn on the CPU, as per client.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from .datasets import Dataset
from .models import parameters_of, set_flat
from .stacked import INEXACT, Plan, backward, flat_of, forward, layout, loss_and_grad
from .training import FULL_PASS_CHUNK, TrainResult, check_local_data, client_update, device_of


# Stacked weights and activations of one chunk of members. On the CPU, 30 MiB keeps a
# chunk's weights under glibc's mmap threshold as worker nodes set it (32 MiB,
# lifecycle.retain_freed_memory), so each round reuses freed memory instead of faulting
# in fresh pages (which cost more than the training of one-example clients); it holds
# 34-38 members of the 2NN, 2 of the CNN with minibatches of 10. A GPU takes a quarter of
# its free memory.
CPU_MEMORY_BYTES = 30 * 2**20
GPU_MEMORY_FRACTION = 0.25



@dataclass
class Member:
    """One client's share of a cohort: what its per-client call would be given.

    ``start`` is the flat float32 weights it starts from (w_t); members sent the same
    model share one array, which the first step then reads once for all of them.
    ``stop`` is checked before each of its steps (as ``training.stop_when`` is): once
    true, the member stops and its result is None."""

    x: np.ndarray
    y: np.ndarray
    start: np.ndarray
    generator: torch.Generator | None = None
    stop: Callable[[], bool] | None = None
    # train
    epochs: int = 1
    batch_size: int | None = None
    lr: float = 0.0
    lr_decay: float = 0.0
    start_iteration: int = 0
    # An algorithm's own values for this member, read by its GradientTerm or its own
    # batched pass (FedProx's mu; FSVRG's full gradient and stepsize).
    extra: dict = field(default_factory=dict)

    def stopped(self) -> bool:
        return self.stop is not None and self.stop()


class GradientTerm:
    """What an algorithm adds to its members' minibatch gradients before each step of
    ``train``, batched (FedProx's proximal term): ``add`` is called for each parameter
    and each block of members, with their gradient, their current weights and (when
    ``reads_start``) their start weights w_t, as rows, and the members themselves. It
    must do, row by row, what its per-client hook does (``training.client_update``'s
    ``after_backward``), so that the cohort's bits stay each client's own."""

    reads_start = True  # keep each member's w_t beside its weights (one more copy in memory)

    def add(self, grad: torch.Tensor, weights: torch.Tensor, starts: torch.Tensor | None,
            members: list[Member]) -> None:
        raise NotImplementedError


# --- which models ------------------------------------------------------------------------


def plan_of(model: nn.Module, dataset: Dataset) -> Plan | str:
    """The model's plan for batched training, or why it cannot have one; kept on the
    model (one instance per pool thread)."""
    key = ("_fedemu_cohort_plan", dataset.name)
    cached = model.__dict__.get(key[0])
    if cached is None or cached[0] != key[1]:
        cached = model.__dict__[key[0]] = (key[1], _exact_plan(model, dataset))
    return cached[1]


def problem(model: nn.Module, dataset: Dataset) -> str | None:
    """Why ``model``'s clients cannot train as a cohort on ``dataset`` (None: they can)."""
    plan = plan_of(model, dataset)
    return plan if isinstance(plan, str) else None


def _exact_plan(model: nn.Module, dataset: Dataset) -> Plan | str:
    plan = layout(model, dataset)
    if isinstance(plan, str) or _reproduces(model, plan, dataset):
        return plan
    return INEXACT


def _reproduces(model: nn.Module, plan: Plan, dataset: Dataset) -> bool:
    """Whether the batched steps give, bit for bit, what training.client_update gives each
    client alone, on random examples: members of 1, 3 and 2 examples in minibatches of
    2 (so steps of one and of two examples, side by side), from one shared model and
    from models of their own. Kernels are chosen by shape, layout and device, so this
    is asked of the model at hand, once per process."""
    rng = np.random.default_rng(0)
    sizes = (1, 3, 2)
    stored = [dataset.blank(n) for n in sizes]
    xs = [rng.integers(0, 256, size=x.shape).astype(x.dtype) if np.issubdtype(x.dtype, np.integer)
          else rng.random(x.shape).astype(x.dtype) for x in stored]
    ys = [rng.integers(0, dataset.num_classes, size=n) for n in sizes]
    alone = copy.deepcopy(model)
    base = flat_of(parameters_of(model)).cpu().numpy()
    for shared in (True, False):
        starts = [base if shared else base + np.float32(0.01 * (k + 1)) for k in range(len(sizes))]
        members = [Member(x=x, y=y, start=start, generator=torch.Generator().manual_seed(k), epochs=1,
                          batch_size=2, lr=0.1)
                   for k, (x, y, start) in enumerate(zip(xs, ys, starts))]
        together = _train_chunk(plan, members, dataset, device_of(model), term=None)
        for k, member in enumerate(members):
            set_flat(alone, member.start)
            own = client_update(alone, member.x, member.y, epochs=1, batch_size=2, lr=0.1,
                                generator=torch.Generator().manual_seed(k), dataset=dataset)
            if not np.array_equal(own.weights, together[k].weights) or own.train_loss != together[k].train_loss:
                return False
    return True


# --- chunks ----------------------------------------------------------------------------


def memory_budget(device: torch.device) -> int:
    """Bytes a chunk of members may take on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_MEMORY_FRACTION)
    return CPU_MEMORY_BYTES


def chunks(plan: Plan, members: list[Member], examples_per_step: Callable[[Member], int], copies: int,
           memory_bytes: int) -> list[list[int]]:
    """Members' indices in chunks that fit ``memory_bytes``: ``copies`` model-sized tensors
    per member, and its step's activations and their gradients."""
    out: list[list[int]] = []
    chunk: list[int] = []
    used = 0
    for i, member in enumerate(members):
        need = 4 * (copies * plan.size + 2 * plan.activation_floats * examples_per_step(member))
        if chunk and used + need > memory_bytes:
            out.append(chunk)
            chunk, used = [], 0
        chunk.append(i)
        used += need
    if chunk:
        out.append(chunk)
    return out


def _shared_start(members: list[Member]) -> bool:
    """Whether every member starts from one array (a model sent to many, decoded from one
    buffer, gives each its own array over the same memory)."""
    first = members[0].start
    where = first.__array_interface__["data"][0]
    return all(m.start is first or (m.start.__array_interface__["data"][0] == where and m.start.shape == first.shape
                                    and m.start.strides == first.strides and m.start.dtype == first.dtype)
               for m in members[1:])


def _start_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).to(device)


# --- the train task ----------------------------------------------------------------------


@dataclass
class _Trainee:
    """A member's progress through its epochs."""

    member: Member
    inputs: torch.Tensor
    targets: torch.Tensor
    count: int
    batch: int
    steps_total: int
    steps: int = 0
    order: torch.Tensor | None = None
    losses: list = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    stopped: bool = False

    def next_batch(self, dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        """Its next minibatch, drawn as sgd_epochs draws it: a fresh permutation at each
        epoch's start, then augmentation per batch, all from its own generator."""
        per_epoch = -(-self.count // self.batch)
        within = self.steps % per_epoch
        if within == 0:
            self.order = torch.randperm(self.count, generator=self.member.generator).to(self.inputs.device)
        chosen = self.order[within * self.batch:(within + 1) * self.batch]
        batch_inputs = self.inputs[chosen]
        if dataset.augments:
            batch_inputs = dataset.augment(batch_inputs, self.member.generator)
        return batch_inputs, self.targets[chosen]

    def batch_size_now(self) -> int:
        """The size of its next minibatch (an epoch's last may be smaller)."""
        per_epoch = -(-self.count // self.batch)
        return min(self.batch, self.count - (self.steps % per_epoch) * self.batch)

    def lr(self) -> float:
        m = self.member
        return m.lr / (1.0 + m.lr_decay * (m.start_iteration + self.steps)) if m.lr_decay else m.lr

    def stepped(self, loss: torch.Tensor) -> None:
        self.losses.append(loss)
        self.steps += 1
        if self.steps % -(-self.count // self.batch) == 0:
            # Read once per epoch: on a GPU, a read per step would wait for every step's kernels.
            self.epoch_losses = torch.stack(self.losses).tolist()
            self.losses = []


def train(model: nn.Module, members: list[Member], dataset: Dataset,
          memory_bytes: int | None = None, term: GradientTerm | None = None) -> list[TrainResult | None]:
    """Each member's ``training.client_update`` (E epochs of B-minibatch SGD from its
    start weights, with the algorithm's ``term`` added to its gradients), computed
    together; a member that stopped gets None. ``model`` gives the architecture and the
    device; its weights are neither read nor changed."""
    plan = _checked_plan(model, dataset)
    device = device_of(model)
    budget = memory_bytes if memory_bytes is not None else memory_budget(device)
    results: list[TrainResult | None] = [None] * len(members)
    # Per member: its weights, and its start for the term; gradients are made a block of
    # members at a time (_backward), not per member.
    reads_start = term is not None and term.reads_start
    for chunk in chunks(plan, members, lambda m: min(m.batch_size or len(m.y), len(m.y)),
                        2 if reads_start else 1, budget):
        for i, result in zip(chunk, _train_chunk(plan, [members[i] for i in chunk], dataset, device, term)):
            results[i] = result
    return results


def _checked_plan(model: nn.Module, dataset: Dataset) -> Plan:
    plan = plan_of(model, dataset)
    if isinstance(plan, str):
        raise ValueError(f"cannot train this model as a cohort: {plan}")
    return plan


def _train_chunk(plan: Plan, members: list[Member], dataset: Dataset, device: torch.device,
                 term: GradientTerm | None):
    trainees = []
    for m in members:
        count = check_local_data(m.x, m.y)
        if m.epochs <= 0:
            raise ValueError(f"epochs must be positive, got {m.epochs}")
        if m.batch_size is not None and m.batch_size < 0:
            raise ValueError(f"batch_size must be None, 0 or positive, got {m.batch_size}")
        batch = count if not m.batch_size else min(m.batch_size, count)
        trainees.append(_Trainee(m, dataset.inputs(m.x, train=True).to(device), dataset.targets(m.y).to(device),
                                 count, batch, m.epochs * -(-count // batch)))
    size = len(members)
    flat = plan.stacked(size, device)
    weights = plan.views(flat)
    shared = _shared_start(members)
    starts: list[torch.Tensor] | None = None  # each member's w_t: the first step's and the term's
    if shared:
        starts = plan.expanded(_start_tensor(members[0].start, device), size)
    else:
        for k, m in enumerate(members):
            flat[k] = torch.from_numpy(np.asarray(m.start, dtype=np.float32)).to(device)
        if term is not None and term.reads_start:
            starts = plan.views(plan.stacked(size, device).copy_(flat))
    first = True
    while True:
        groups: dict[int, list[int]] = {}  # members by the size of their next minibatch
        for k, t in enumerate(trainees):
            if t.stopped or t.steps >= t.steps_total:
                continue
            if t.member.stopped():
                t.stopped = True
                continue
            groups.setdefault(t.batch_size_now(), []).append(k)
        if not groups:
            break
        for rows in groups.values():
            for lo, hi in consecutive_runs(rows):
                _train_step(plan, weights, starts, lo, hi, trainees[lo:hi], dataset, term,
                            from_start=shared and first)
        first = False
    out = []
    for k, t in enumerate(trainees):
        if t.stopped or t.member.stopped():
            out.append(None)
            continue
        out.append(TrainResult(weights=flat[k].cpu().numpy(), num_samples=t.count,
                               train_loss=float(np.mean(t.epoch_losses)), steps=t.steps))
    return out


def consecutive_runs(rows: list[int]) -> list[tuple[int, int]]:
    """Increasing indices as [lo, hi) runs of consecutive ones: each run's rows are one
    view of the stacked weights, with no gathering."""
    runs = []
    lo = prev = rows[0]
    for k in rows[1:]:
        if k != prev + 1:
            runs.append((lo, prev + 1))
            lo = k
        prev = k
    runs.append((lo, prev + 1))
    return runs


def member_rows(params: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Members lo..hi-1 of each stacked parameter (of a shared one, expanded: any rows)."""
    return [p[:hi - lo] if p.stride(0) == 0 else p[lo:hi] for p in params]


def _train_step(plan: Plan, weights: list[torch.Tensor], starts: list[torch.Tensor] | None, lo: int, hi: int,
                trainees: list[_Trainee], dataset: Dataset, term: GradientTerm | None, from_start: bool) -> None:
    """One SGD step of members lo..hi-1, whose minibatches have one size, as sgd_epochs
    takes it for each: forward, the loss's gradient, the algorithm's term, then
    param += -lr * grad. ``from_start``: they all stand at one shared model (their first
    step), which is read, not copied, and the step writes their own weights."""
    batches = [t.next_batch(dataset) for t in trainees]
    x = torch.stack([b[0] for b in batches])
    y = torch.stack([b[1] for b in batches])
    target = member_rows(weights, lo, hi)
    source = member_rows(starts, lo, hi) if from_start else target
    anchors = member_rows(starts, lo, hi) if starts is not None else None
    rates = [-t.lr() for t in trainees]
    members = [t.member for t in trainees]

    def spend(index: int, first: int, end: int, grad: torch.Tensor) -> None:
        if term is not None:
            term.add(grad, source[index][first:end], None if anchors is None else anchors[index][first:end],
                     members[first:end])
        each(target[index][first:end], (source[index][first:end], grad), rates[first:end],
              lambda out, pair, rate: torch.add(pair[0], pair[1], alpha=rate, out=out))

    with torch.no_grad():
        logits, saved = forward(plan, source, x)
        losses, grad = loss_and_grad(logits, y, mean=True)
        backward(plan, source, saved, grad, spend)
    for t, loss in zip(trainees, losses):
        t.stepped(loss)


def each(target: torch.Tensor, other, scalars: list[float], op) -> None:
    """``op(target, other, scalar)`` for members' rows: once for all when their scalars
    agree (the usual case), else member by member (an elementwise op gives the same
    bits either way)."""
    if all(s == scalars[0] for s in scalars):
        op(target, other, scalars[0])
        return
    for k, scalar in enumerate(scalars):
        op(target[k], tuple(o[k] for o in other) if isinstance(other, tuple) else other[k], scalar)


# --- the gradient task -------------------------------------------------------------------


def gradients(model: nn.Module, members: list[Member], dataset: Dataset,
              memory_bytes: int | None = None) -> list[tuple[np.ndarray, float] | None]:
    """Each member's ``training.local_gradient`` at its start weights: (the flat gradient
    of its mean loss, that loss), computed together; None for a member that stopped."""
    plan = _checked_plan(model, dataset)
    device = device_of(model)
    budget = memory_bytes if memory_bytes is not None else memory_budget(device)
    results: list = [None] * len(members)
    for chunk in chunks(plan, members, lambda m: min(len(m.y), FULL_PASS_CHUNK), 2, budget):
        for i, result in zip(chunk, _gradient_chunk(plan, [members[i] for i in chunk], dataset, device)):
            results[i] = result
    return results


def _gradient_chunk(plan: Plan, members: list[Member], dataset: Dataset, device: torch.device) -> list:
    counts = [check_local_data(m.x, m.y) for m in members]
    targets = [dataset.targets(m.y).to(device) for m in members]
    size = len(members)
    sums = plan.stacked(size, device)  # each member's gradient of its summed loss
    sum_views = plan.views(sums)
    weights = stacked_starts(plan, members, device)
    losses = [0.0] * size
    stopped = [False] * size
    for start in range(0, max(counts), FULL_PASS_CHUNK):
        groups: dict[int, list[int]] = {}  # members by the size of this piece of their data
        for k, m in enumerate(members):
            if stopped[k] or counts[k] <= start:
                continue
            if m.stopped():
                stopped[k] = True
                continue
            groups.setdefault(min(FULL_PASS_CHUNK, counts[k] - start), []).append(k)
        for piece, rows in groups.items():
            for lo, hi in consecutive_runs(rows):
                x = torch.stack([dataset.inputs(members[k].x[start:start + piece]).to(device) for k in range(lo, hi)])
                y = torch.stack([targets[k][start:start + piece] for k in range(lo, hi)])
                target = member_rows(sum_views, lo, hi)

                def spend(index: int, first: int, end: int, grad: torch.Tensor, target=target) -> None:
                    # The first piece's gradient is the gradient; later ones add to it (autograd's accumulation).
                    (target[index][first:end].copy_ if start == 0 else target[index][first:end].add_)(grad)

                with torch.no_grad():
                    logits, saved = forward(plan, member_rows(weights, lo, hi), x)
                    piece_losses, grad = loss_and_grad(logits, y, mean=False)
                    backward(plan, member_rows(weights, lo, hi), saved, grad, spend)
                for k, loss in zip(range(lo, hi), piece_losses):
                    losses[k] += loss.item()
    out = []
    for k, m in enumerate(members):
        if stopped[k] or m.stopped():
            out.append(None)
            continue
        gradient = sums[k].div_(counts[k])  # over the scored targets: every one (no ignored label here)
        out.append((gradient.cpu().numpy(), losses[k] / counts[k]))
    return out


def stacked_starts(plan: Plan, members: list[Member], device: torch.device) -> list[torch.Tensor]:
    """Each member's start weights as (members, *shape) parameters: one model expanded
    when they share it, else their own rows."""
    if _shared_start(members):
        return plan.expanded(_start_tensor(members[0].start, device), len(members))
    flat = plan.stacked(len(members), device)
    for k, m in enumerate(members):
        flat[k] = torch.from_numpy(np.asarray(m.start, dtype=np.float32)).to(device)
    return plan.views(flat)
