"""Local tasks: what a client computes when a round-based algorithm asks it to.

A strategy's ``run_phase(task, lr, ...)`` sends every selected client a TrainRequest
naming a task; the client runs that task on its own data and replies with the update.
fedemu's tasks live with the algorithms that ask for them (``fedavg.Train``,
``fedsgd.Gradient``, ``fsvrg.Svrg``, ``fedprox.Proximal``), registered under the names
``messages.TRAIN``, ``GRADIENT``, ``SVRG`` and ``"fedprox"``. An algorithm's own inputs
ride in the request's ``extra`` (FedProx's mu, FSVRG's full gradient), so the message
types never change for one algorithm. A plug-in algorithm that needs other local work (control variates, a
different objective) writes a :class:`LocalTask` subclass and passes the class itself to
``run_phase``: it travels as ``package.module:Class`` and the worker imports it there,
so the package must be importable on every worker host, as a plug-in model's must.

A task may keep per-client state between rounds (``TaskInput.state``): it lives with
the client's process, so a client restarted after a crash starts again with none.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from torch import nn

from fedemu.node import plugins, wire

from fedemu.common.messages import TrainRequest
from fedemu.common.ml.compression import UpdateCodec, make_codec, parameter_shapes
from fedemu.common.ml.datasets import Dataset
from fedemu.common.ml.models import ModelSpec

ENTRY_POINT_GROUP = "fedemu.tasks"
# Imported on first lookup: each files the tasks of its algorithm.
BUILT_IN_MODULES = tuple(f"fedemu.common.algorithms.{module}" for module in ("fedavg", "fedsgd", "fsvrg", "fedprox"))


@dataclass
class TaskInput:
    """What a task works with. ``model`` holds the weights the request sent (w_t) and may
    be trained in place."""

    model: nn.Module
    model_spec: ModelSpec
    x: np.ndarray
    y: np.ndarray
    request: TrainRequest  # its ``extra`` carries a plug-in task's own inputs from the server
    generator: torch.Generator  # this client's stream for this round (batch order, augmentation)
    dataset: Dataset
    client: int
    iterations: int  # local SGD steps this client took before (Keras' decay counts them)
    state: dict[str, Any]  # this client's, kept between its tasks while its process lives
    anchor: nn.Module | None = None  # a second model of the same kind, for a task that needs one


@dataclass
class TaskOutput:
    update: np.ndarray | None  # flat float32: weights or a gradient; None only with ``encoded``
    loss: float
    steps: int = 0  # local SGD steps taken (added to the client's count)
    encoded: dict | None = None  # the update, compressed (the train task with [compression])
    extra: dict[str, Any] = field(default_factory=dict)  # sent to the server beside the update


class LocalTask:
    """One kind of local work. ``passes`` is what virtual time charges: training passes
    (a forward and backward) per example, over E epochs when ``per_epoch``, else once."""

    name: ClassVar[str] = ""
    passes: ClassVar[float] = 1.0
    per_epoch: ClassVar[bool] = True
    needs_anchor: ClassVar[bool] = False  # TaskInput.anchor: a second model (SVRG holds w_t in it)
    # The update may travel encoded ([compression]): it is a model trained from w_t, whose
    # delta a codec can sketch (FedAvg's Train and what subclasses it).
    encodes_update: ClassVar[bool] = False

    def run(self, task: TaskInput) -> TaskOutput:
        raise NotImplementedError

    @classmethod
    def cohort_problem(cls, request: TrainRequest, model: nn.Module, dataset: Dataset) -> str | None:
        """Why clients cannot run this request as a cohort (``run_cohort``), or None when
        they can. A task that does not override ``run_cohort`` trains one client at a time."""
        if cls.run_cohort is LocalTask.run_cohort:
            return "it has no run_cohort"
        return None

    def run_cohort(self, tasks: list[TaskInput], stops: list[Callable[[], bool]]) -> list[TaskOutput | None]:
        """Each of ``tasks`` run at once (common/ml/cohort.py): the output ``run`` would give
        for each alone, or None for one whose ``stops`` entry turned true before one of its
        steps (its device went offline, its round closed). Each input's ``model`` gives the
        architecture and the device, with no weights loaded: its weights are its request's."""
        raise NotImplementedError

    @classmethod
    def example_passes(cls, request: TrainRequest, examples: int) -> float:
        """Training passes over single examples this request costs a client of ``examples``."""
        return cls.passes * examples * (request.epochs if cls.per_epoch else 1)


class UnknownTask(plugins.PluginNotFound):
    pass


class BadTaskOutput(TypeError):
    """A task returned what cannot travel in a reply; the message names the task and why."""


def checked(task: type[LocalTask], output: TaskOutput) -> TaskOutput:
    """``output``, once it is known to fit in a reply: an update that is a flat array (or
    an encoding), and an ``extra`` of what the wire carries (numbers, strings, lists,
    dicts, NumPy arrays). A plug-in's mistake then fails its client with this message,
    not the reply's delayed send on a node thread, where no one would see it."""
    if output.update is None and output.encoded is None:
        raise BadTaskOutput(f"local task {reference(task)!r} returned no update")
    if output.update is not None and (not isinstance(output.update, np.ndarray) or output.update.ndim != 1):
        raise BadTaskOutput(f"local task {reference(task)!r} returned an update of type {type(output.update).__name__}"
                            f"{'' if not isinstance(output.update, np.ndarray) else f' and shape {output.update.shape}'}"
                            "; it must be a flat NumPy array (models.get_flat)")
    if output.extra:
        try:
            wire.pack_body(output.extra)  # arrays by reference: no copy
        except (TypeError, ValueError) as exc:
            raise BadTaskOutput(f"local task {reference(task)!r} returned an extra that cannot be sent: "
                                f"{exc}") from None
    return output


_registry = plugins.Registry("local task", ENTRY_POINT_GROUP, BUILT_IN_MODULES, LocalTask, "LocalTask")


def register(cls: type[LocalTask]) -> type[LocalTask]:
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no name")
    _registry.file(cls, cls.name)
    return cls


def get(name: str) -> type[LocalTask]:
    try:
        return _registry.find(name, lambda cls: None)
    except plugins.PluginNotFound as exc:
        raise UnknownTask(str(exc)) from None


def reference(task: str | type[LocalTask]) -> str:
    """What a request calls ``task``: a built-in's name, a plug-in's ``module:Class``. A
    name that names no task here raises UnknownTask (the server finds it before any
    client is asked)."""
    if isinstance(task, str):
        get(task)
        return task
    if _registry.classes.get(task.name) is task and task.__module__ in BUILT_IN_MODULES:
        return task.name
    return f"{task.__module__}:{task.__qualname__}"


_CODECS: dict[tuple, UpdateCodec] = {}
_CODECS_LOCK = threading.Lock()


def codec_for(model_spec: ModelSpec, spec: dict, model: nn.Module) -> UpdateCodec:
    """One codec per (model, spec) per process: its layer plan is the same for every client."""
    key = (model_spec, tuple(sorted(spec.items())))
    with _CODECS_LOCK:
        if key not in _CODECS:
            _CODECS[key] = make_codec(spec, parameter_shapes(model))
        return _CODECS[key]
