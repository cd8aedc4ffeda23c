"""fedemu.common.algorithms — every algorithm as one module with both halves, and the
contract a plug-in writes against.

A round-based algorithm subclasses :class:`Strategy` and names the :class:`LocalTask`
its clients run; an asynchronous one subclasses :class:`AsyncRule`. ``@register`` files
either under its name; :func:`get` finds a built-in, an installed plug-in or a
``package.module:Class``. The built-ins (``fedavg``, ``fedsgd``, ``fsvrg``,
``centralised``, ``fedprox``, ``fedopt``, ``coop``, ``fedasync``, ``fedbuff``) are
imported on first lookup, not here: importing this contract costs no algorithm.
"""
from .asynchronous import CONCURRENCY_OPTIONS, AsyncRule
from .base import (AGGREGATIONS, Algorithm, Finding, UnknownAlgorithm, aggregation_problem, all_options, built_in,
                   get, installed, register)
from .rounds import Replies, RunPhase, Strategy, WeightedMean, average, selected_per_round, weighted_average
from .tasks import BadTaskOutput, LocalTask, TaskInput, TaskOutput, UnknownTask

__all__ = ["AGGREGATIONS", "CONCURRENCY_OPTIONS", "Algorithm", "AsyncRule", "BadTaskOutput", "Finding", "LocalTask",
           "Replies", "RunPhase", "Strategy", "TaskInput", "TaskOutput", "UnknownAlgorithm", "UnknownTask",
           "WeightedMean", "aggregation_problem", "all_options", "average", "built_in", "get", "installed",
           "register", "selected_per_round", "weighted_average"]
