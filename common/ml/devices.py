"""What a client's local work costs in emulated time: the device model.

On the wall clock, local work takes the time it really takes on this host, and a
straggler with factor f holds its reply back (f - 1) x that time. In virtual time
nothing waits on the host: the work is charged instead.

* ``compute = "model"`` (the default): the training FLOPs of the work (counted from the
  model's architecture by ``torch.utils.flop_counter``: matrix multiplies and
  convolutions, forward and backward, per example) times the examples processed,
  divided by the device's speed, times the client's straggler factor. The same on any
  host: bit-reproducible. A device's speed is ``run.device_flops`` unless the client
  has its own (a device class or a trace, ``[network.devices]``, ``[network.traces]``):
  FLOP/s, or seconds per example (FedScale's form, optionally per model:
  ``example_s:cnn``), which charges examples x that, whatever the model's FLOPs.
* ``compute = "measured"``: the training thread's CPU time (on a GPU: the task's time,
  the device synchronised), times the straggler factor: the real code's cost, but it
  varies from run to run and host to host (so runs are not bit-reproducible).

Which hardware the real training runs on is ``run.device`` (``torch_device`` below): the
CPU, or a GPU shared by every client of a node (one CUDA context per node process).

While a client computes, its node is busy and the virtual clock waits; then the
client's reply is held for the charged duration, as a slower device would hold it.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from .models import ModelSpec

COMPUTE_CHARGES = ("model", "measured")

_FLOPS: dict[ModelSpec, float] = {}
_FLOPS_LOCK = threading.Lock()


def training_flops_per_example(model: ModelSpec) -> float:
    """FLOPs of one example's forward and backward pass through ``model``, counted once
    per process on a batch of 8 of its data set's blank examples, as
    ``torch.utils.flop_counter`` counts them (matrix multiplies and convolutions)."""
    with _FLOPS_LOCK:
        if model not in _FLOPS:
            built = model.build(seed=0)
            inputs = model.dataset.inputs(model.dataset.blank(8))
            flops = layer_flops(built, inputs)
            _FLOPS[model] = (flops if flops is not None else counted_flops(built, inputs)) / len(inputs)
        return _FLOPS[model]


def counted_flops(model: torch.nn.Module, inputs: torch.Tensor) -> float:
    """Forward and backward FLOPs of ``model`` on ``inputs`` by torch's own counter
    (any architecture; its first use in a process costs about a second of imports)."""
    # torch where it is used: this module is read without it, where a config is checked
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        logits = model(inputs)
        # Any targets do: the count depends on the shapes, not the values.
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                        torch.zeros(logits.numel() // logits.shape[-1], dtype=torch.long)).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def layer_flops(model: torch.nn.Module, inputs: torch.Tensor) -> float | None:
    """The same count by hand, for models whose parameters are all in Linear and Conv2d
    layers (None otherwise): each layer's forward multiply-adds x 2, the same again for
    its weight gradient, and again for its input gradient except at the first layer
    (the data needs none). Instant, where torch's counter costs a second to start."""
    layers = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if not all(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in layers):
        return None
    forward: list[float] = []

    def hook(module, args, output) -> None:
        if isinstance(module, torch.nn.Linear):
            forward.append(2.0 * output.numel() * module.in_features)
        else:
            k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
            forward.append(2.0 * output.numel() * k)

    handles = [m.register_forward_hook(hook) for m in layers]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return 3 * sum(forward) - (forward[0] if forward else 0.0)


@dataclass(frozen=True)
class ComputeModel:
    """How a client's local work is charged: ``clock`` is the run's clock."""

    clock: str = "wall"
    charge: str = "model"
    device_flops: float = 1e9
    # Clients with their own device: client -> {"flops": FLOP/s} or {"example_s": s per
    # example, "example_s:MODEL": s for that model} (node.net.population.Population.compute).
    speeds: dict[int, dict[str, float]] = field(default_factory=dict, compare=False, hash=False)

    @property
    def known_in_advance(self) -> bool:
        """Whether local work's emulated time is known before it runs (modelled, on the
        virtual clock), so that it may run later than it is emulated to start."""
        return self.clock == "virtual" and self.charge == "model"

    def prepare(self, model: ModelSpec) -> None:
        """Pay the FLOP count's one-time cost (about a second on first use) before the
        run, not inside its first round."""
        if self.known_in_advance:
            training_flops_per_example(model)

    def times(self, model: ModelSpec, example_passes: float, slowdown: float, measured_s: float,
              cpu_s: float, client: int | None = None) -> tuple[float, float]:
        """(compute seconds the device spends, excluding its straggler factor; emulated
        seconds to hold the reply back). ``example_passes``: training passes over single
        examples (E x n_k for FedAvg's training; each task says its own, worker.tasks)."""
        if self.clock == "wall":
            # Real time has passed already: a slower device adds the rest.
            return measured_s, (slowdown - 1.0) * measured_s
        if self.charge == "measured":
            compute_s = cpu_s
        else:
            compute_s = self.model_seconds(model, example_passes, client)
        return compute_s, slowdown * compute_s

    def model_seconds(self, model: ModelSpec, example_passes: float, client: int | None = None) -> float:
        """What ``example_passes`` cost on ``client``'s device (its own speed, else
        run.device_flops), before any straggler factor."""
        speed = self.speeds.get(client) if client is not None else None
        if speed is not None:
            per_example = speed.get(f"example_s:{model.name}", speed.get("example_s"))
            if per_example is not None:
                return per_example * example_passes
            if "flops" in speed:
                return training_flops_per_example(model) * example_passes / speed["flops"]
        return training_flops_per_example(model) * example_passes / self.device_flops


# --- the torch device clients train on ------------------------------------------------


class DeviceUnavailable(RuntimeError):
    """``run.device`` names a device this host does not have; the message says which."""


def torch_device(setting: str) -> torch.device:
    """The device ``run.device`` means on this host: ``auto`` is the first CUDA GPU torch
    sees, else the CPU; ``cuda`` is GPU 0; ``cuda:N`` GPU N. A GPU the host lacks is an
    error that names it, not a silent fall-back to the CPU."""
    if setting == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise DeviceUnavailable(f"run.device = {setting!r} is not a device; use 'auto', 'cpu', 'cuda' or "
                                "'cuda:N'") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceUnavailable(f"run.device = {setting!r}: fedemu trains on 'cpu' or 'cuda' devices")
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
               else "torch sees no CUDA GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)")
        raise DeviceUnavailable(f"run.device = {setting!r}, but {why} on this host; set run.device = 'auto' "
                                "(the GPU where there is one) or 'cpu'")
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise DeviceUnavailable(f"run.device = {setting!r}, but this host has {torch.cuda.device_count()} "
                                f"CUDA GPU(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return torch.device("cuda", index)


def use_device(device: torch.device) -> str:
    """Prepare this process to train on ``device``; returns how the run log names it.
    On a GPU, kernels are made deterministic where torch can (cuBLAS's fixed workspace,
    no cuDNN autotuning) and compute in full float32 (no TF32): reruns on the same GPU,
    driver and torch repeat; a GPU's numbers differ from a CPU's in the last bits."""
    if device.type != "cuda":
        return "cpu"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    # Full float32, as on the CPU: torch lets cuDNN's convolutions and LSTMs round their
    # inputs to TF32 (a 10-bit mantissa) on Ampere and later GPUs by default, which moved
    # a CNN's weights 1e-3 from the CPU's within ten steps on an H200.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn, not fail, where an op has no such kernel
    torch.cuda.set_device(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run behind the Python thread)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
