"""FSVRG (Konečný et al. 2016; Nilsson et al. 2018, Algorithm 2), both halves: a round of
two phases, full gradients (FedSGD's ``Gradient`` task) and then one SVRG pass per
client (``Svrg``), whose models the server averages. The pass itself lives here too, per
client (``svrg_pass``) and for a cohort of clients at once (``svrg_cohort``), bit for bit
the same (tests/test_cohort.py)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedemu.common.messages import GRADIENT, SVRG
from fedemu.common.ml import cohort, models, stacked, training
from fedemu.common.ml.datasets import Dataset
from fedemu.node.schema import Key, interval

from . import tasks
from .base import register
from .rounds import Strategy, average
from .tasks import LocalTask, TaskOutput


@register
class FSVRG(Strategy):
    """Nilsson et al. 2018, Algorithm 2: every client uploads its full local gradient at
    w_t; the server forms grad f(w_t) = sum n_k/n g_k and sends it back; each client
    runs one SVRG pass with h_k = h / n_k; the server averages the models by n_k / n.
    Two uploads per client per round."""

    name = "fsvrg"
    label = "FSVRG"
    keeps_updates = False
    selects_all = True
    uploads = "a full gradient and then an SVRG-trained model per round"
    options = {"h": Key(float, "FSVRG stepsize h (clients use h / n_k)", **interval("(0, 1e6]"), default=4.0)}

    def __init__(self, lr: float, lr_decay: float = 0.0, h: float = 4.0) -> None:
        super().__init__(lr, lr_decay)
        self.h = h

    def run_round(self, run_phase, weights, round_):
        gradients = run_phase(GRADIENT, 0.0)
        if gradients is None:
            return None
        replies = run_phase(SVRG, self.h, extra={"full_gradient": average(gradients)})
        return None if replies is None else average(replies)


@tasks.register
class Svrg(LocalTask):
    """FSVRG's second phase (Nilsson et al., Algorithm 2): one variance-reduced pass with
    stepsize h / n_k (the request's lr is h); each step takes two gradients, at the
    current weights and at w_t. The full gradient grad f(w_t) comes in the request's
    ``extra``."""

    name = SVRG
    passes = 2.0
    per_epoch = False
    needs_anchor = True

    def run(self, task):
        r = task.request
        models.set_flat(task.anchor, r.weights)
        result = svrg_pass(task.model, task.x, task.y, anchor=task.anchor, full_gradient=r.extra["full_gradient"],
                           stepsize=r.lr, generator=task.generator, dataset=task.dataset)
        return TaskOutput(result.weights, result.train_loss)

    @classmethod
    def cohort_problem(cls, request, model, dataset):
        return cohort_problem(model, dataset)

    def run_cohort(self, tasks, stops):
        members = [cohort.Member(x=t.x, y=t.y, start=t.request.weights, generator=t.generator, stop=stop,
                                 extra={"full_gradient": t.request.extra["full_gradient"], "stepsize": t.request.lr})
                   for t, stop in zip(tasks, stops)]
        return [None if result is None else TaskOutput(result.weights, result.train_loss)
                for result in svrg_cohort(tasks[0].model, members, tasks[0].dataset)]


# --- the pass, for one client ----------------------------------------------------------------


def svrg_pass(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    anchor: nn.Module,
    full_gradient: np.ndarray,
    stepsize: float,
    generator: torch.Generator,
    dataset: Dataset = training.IMAGES,
) -> training.TrainResult:
    """One FSVRG client pass (Nilsson et al. 2018, Algorithm 2, lines 7-11).

    ``model`` starts at w_t and is updated in place; ``anchor`` holds w_t fixed. Over a
    random permutation of the n_k local samples, one update per sample:
    w <- w - h_k * (grad f_i(w) - grad f_i(w_t) + grad f(w_t)), with h_k = stepsize / n_k.
    """
    count = training.check_local_data(x, y)
    # Un-augmented, like the full gradient it corrects: the pass's one update per sample
    # compares gradients at w and w_t on the same input.
    device = training.device_of(model)
    inputs = dataset.inputs(x).to(device)
    targets = dataset.targets(y).to(device)
    params = list(model.parameters())
    full = torch.from_numpy(np.asarray(full_gradient, dtype=np.float32)).to(device)
    # The full gradient, split into views shaped like each parameter.
    full_views, offset = [], 0
    for p in params:
        full_views.append(full[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    if offset != full.numel():
        raise ValueError(f"full gradient has {full.numel()} values, the model {offset}")
    h_k = stepsize / count
    order = torch.randperm(count, generator=generator).tolist()
    model.train()
    anchor.train()
    # The by-hand fast path computes the cross-entropy's gradient itself.
    linears = training.plain_mlp(model) if dataset.plain_classification else None
    if linears is not None:
        losses = _svrg_mlp(linears, training.plain_mlp(anchor), inputs, targets, order, full_views, h_k)
    else:
        losses = _svrg_autograd(model, anchor, inputs, targets, order, full_views, h_k, dataset)
    return training.TrainResult(weights=models.get_flat(model), num_samples=count,
                       train_loss=float(np.mean(losses)), steps=count)


def _svrg_autograd(model, anchor, inputs, targets, order, full_views, h_k, dataset: Dataset) -> list[float]:
    params, anchor_params = list(model.parameters()), list(anchor.parameters())
    losses = []
    for i in order:
        training.stop_point()
        x, y = inputs[i : i + 1], targets[i : i + 1]
        loss = dataset.loss(model(x), y)
        grads = torch.autograd.grad(loss, params)
        anchor_grads = torch.autograd.grad(dataset.loss(anchor(x), y), anchor_params)
        with torch.no_grad():
            for p, g, g0, G in zip(params, grads, anchor_grads, full_views):
                p.sub_(h_k * (g - g0 + G))
        losses.append(loss.item())
    return losses


def _mlp_backward(linears: list[nn.Linear], x: torch.Tensor, y: torch.Tensor):
    """Batched forward and backward of mean-free per-sample cross-entropy: returns the
    layer inputs a_l (n, d_in) and output gradients dz_l (n, d_out), so that sample i's
    gradient is dW_l = outer(dz_l[i], a_l[i]), db_l = dz_l[i]; and the losses."""
    inputs, pre = [], []
    a = x.reshape(x.shape[0], -1)
    for layer_index, layer in enumerate(linears):
        inputs.append(a)
        z = F.linear(a, layer.weight, layer.bias)
        pre.append(z)
        a = torch.relu(z) if layer_index < len(linears) - 1 else z
    losses = F.cross_entropy(a, y, reduction="none")
    dz = torch.softmax(a, dim=1)
    dz[torch.arange(len(y), device=y.device), y] -= 1.0
    grads = [None] * len(linears)
    for layer_index in range(len(linears) - 1, -1, -1):
        grads[layer_index] = dz
        if layer_index:
            dz = (dz @ linears[layer_index].weight) * (pre[layer_index - 1] > 0)
    return inputs, grads, losses


def _svrg_mlp(linears, anchor_linears, inputs, targets, order, full_views, h_k) -> list[float]:
    """The same pass, exactly, for a plain ReLU MLP: per-sample gradients are outer
    products, so each update is two rank-1 BLAS updates and the full-gradient term
    (no autograd graph per sample: about 8x faster on the 2NN)."""
    with torch.no_grad():
        anchor_a, anchor_dz, _ = _mlp_backward(anchor_linears, inputs, targets)  # at w_t, all at once
        views = [(layer.weight, layer.bias, full_views[2 * j], full_views[2 * j + 1])
                 for j, layer in enumerate(linears)]
        losses = []
        for i in order:
            training.stop_point()
            a, dz, loss = _mlp_backward(linears, inputs[i : i + 1], targets[i : i + 1])
            for (weight, bias, G_w, G_b), a_l, dz_l, a0, dz0 in zip(views, a, dz, anchor_a, anchor_dz):
                weight.add_(G_w, alpha=-h_k).addr_(dz_l[0], a_l[0], alpha=-h_k).addr_(dz0[i], a0[i], alpha=h_k)
                bias.add_(G_b, alpha=-h_k).sub_(dz_l[0], alpha=h_k).add_(dz0[i], alpha=h_k)
            losses.append(float(loss))
    return losses


# --- the same pass for a cohort of clients at once (common/ml/cohort.py) ----------------------


def cohort_problem(model: nn.Module, dataset: Dataset) -> str | None:
    """Why SVRG's pass cannot be batched for ``model`` (None: it can): as the per-client
    fast path, it needs a plain ReLU MLP and a plain classification data set."""
    if not dataset.plain_classification:
        return f"data set {dataset.name!r} augments or scores with a loss of its own"
    if training.plain_mlp(model) is None:
        return "SVRG's pass is batched for a plain ReLU MLP only"
    return cohort.problem(model, dataset)


def svrg_cohort(model: nn.Module, members: list[cohort.Member], dataset: Dataset,
                memory_bytes: int | None = None) -> list[training.TrainResult | None]:
    """Each member's ``svrg_pass`` (one variance-reduced pass, a step per example in its
    own order, stepsize ``extra['stepsize']`` / n_k, full gradient ``extra['full_gradient']``),
    computed together; None for a member that stopped. Members of one size take their
    steps side by side."""
    why = cohort_problem(model, dataset)
    if why:
        raise ValueError(f"cannot run SVRG's pass as a cohort: {why}")
    plan = cohort.plan_of(model, dataset)
    device = training.device_of(model)
    budget = memory_bytes if memory_bytes is not None else cohort.memory_budget(device)
    results: list = [None] * len(members)
    by_size: dict[int, list[int]] = {}
    for i, m in enumerate(members):
        by_size.setdefault(training.check_local_data(m.x, m.y), []).append(i)
    for count, indices in by_size.items():
        for chunk in cohort.chunks(plan, [members[i] for i in indices], lambda m: count, 3, budget):
            chosen = [indices[i] for i in chunk]
            for i, result in zip(chosen, _svrg_chunk(plan, [members[i] for i in chosen], count, dataset, device)):
                results[i] = result
    return results


def _mlp_pass(plan: stacked.Plan, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor):
    """_mlp_backward for each member: the Linear layers' inputs and output
    gradients of the per-example cross-entropy (not averaged), and the losses."""
    linears = [layer for layer in plan.layers if layer.kind == stacked.LINEAR]
    members, examples = x.shape[:2]
    inputs, pre = [], []
    a = x.reshape(members, examples, -1)
    for j, layer in enumerate(linears):
        inputs.append(a)
        z = torch.baddbmm(params[layer.bias].unsqueeze(1), a, params[layer.weight].transpose(1, 2))
        pre.append(z)
        a = torch.relu(z) if j < len(linears) - 1 else z
    classes = a.shape[-1]
    losses = F.cross_entropy(a.reshape(-1, classes), y.reshape(-1), reduction="none").view(members, examples)
    dz = torch.softmax(a, dim=2)
    dz.view(-1, classes)[torch.arange(members * examples, device=dz.device), y.reshape(-1)] -= 1.0
    grads: list = [None] * len(linears)
    for j in range(len(linears) - 1, -1, -1):
        grads[j] = dz
        if j:
            dz = torch.bmm(dz, params[linears[j].weight]) * (pre[j - 1] > 0)
    return linears, inputs, grads, losses


def _svrg_chunk(plan: stacked.Plan, members: list[cohort.Member], count: int, dataset: Dataset,
                device: torch.device):
    size = len(members)
    inputs = torch.stack([dataset.inputs(m.x).to(device) for m in members])
    targets = torch.stack([dataset.targets(m.y).to(device) for m in members])
    starts = cohort.stacked_starts(plan, members, device)
    full = cohort.stacked_starts(plan, [cohort.Member(m.x, m.y, _checked_full_gradient(m, plan.size)) for m in members],
                                 device)
    rates = [m.extra["stepsize"] / count for m in members]  # h_k = stepsize / n_k
    orders = torch.stack([torch.randperm(count, generator=m.generator) for m in members]).to(device)
    with torch.no_grad():
        # Each member's per-example gradients at w_t, for all its examples at once.
        linears, anchor_a, anchor_dz, _ = _mlp_pass(plan, starts, inputs, targets)
        flat = plan.stacked(size, device)
        weights = plan.views(flat)
        for target, start in zip(weights, starts):
            target.copy_(start)
        losses: list[list] = [[] for _ in members]
        stopped = [False] * size
        every = torch.arange(size, device=device)
        for step in range(count):
            rows = [k for k in range(size) if not stopped[k]]
            for k in rows:
                if members[k].stopped():
                    stopped[k] = True
            rows = [k for k in rows if not stopped[k]]
            if not rows:
                break
            chosen = orders[:, step]
            for lo, hi in cohort.consecutive_runs(rows):
                picked = chosen[lo:hi]
                x = inputs[every[lo:hi], picked].unsqueeze(1)
                y = targets[every[lo:hi], picked].unsqueeze(1)
                params = cohort.member_rows(weights, lo, hi)
                _, a, dz, loss = _mlp_pass(plan, params, x, y)
                for j, layer in enumerate(linears):
                    weight, bias = params[layer.weight], params[layer.bias]
                    a0 = anchor_a[j][every[lo:hi], picked]
                    dz0 = anchor_dz[j][every[lo:hi], picked]
                    full_rows = cohort.member_rows(full, lo, hi)
                    full_w, full_b = full_rows[layer.weight], full_rows[layer.bias]
                    h = rates[lo:hi]
                    # As _svrg_mlp: w += -h G, then w += -h outer(dz, a) and w += h outer(dz0, a0) by
                    # addr_ itself, member by member: no batched op rounds its tails as it does.
                    cohort.each(weight, full_w, [-r for r in h], lambda w, g, r: w.add_(g, alpha=r))
                    for k in range(hi - lo):
                        weight[k].addr_(dz[j][k, 0], a[j][k, 0], alpha=-h[k]).addr_(dz0[k], a0[k], alpha=h[k])
                    cohort.each(bias, full_b, [-r for r in h], lambda b, g, r: b.add_(g, alpha=r))
                    cohort.each(bias, dz[j][:, 0], h, lambda b, d, r: b.sub_(d, alpha=r))
                    cohort.each(bias, dz0, h, lambda b, d, r: b.add_(d, alpha=r))
                for k, value in zip(range(lo, hi), loss[:, 0].tolist()):
                    losses[k].append(value)
    out = []
    for k, m in enumerate(members):
        if stopped[k] or m.stopped():
            out.append(None)
            continue
        out.append(training.TrainResult(weights=flat[k].cpu().numpy(), num_samples=count,
                               train_loss=float(np.mean(losses[k])), steps=count))
    return out


def _checked_full_gradient(member: cohort.Member, size: int) -> np.ndarray:
    full = np.asarray(member.extra["full_gradient"], dtype=np.float32)
    if full.shape != (size,):
        raise ValueError(f"full gradient has {full.size} values, the model {size}")
    return full
