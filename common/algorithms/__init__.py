"""fedemu.common.algorithms — every algorithm as one module with both halves, and the
contract a plug-in writes against.

A round-based algorithm subclasses :class:`Strategy` and names the :class:`LocalTask`
its clients run; an asynchronous one subclasses :class:`AsyncRule` and, where its
clients decide more than "upload each update", gives them an :class:`AsyncClient`. ``@register`` files
either under its name; :func:`get` finds a built-in, an installed plug-in or a
``package.module:Class``. The built-ins (``fedavg``, ``fedsgd``, ``fsvrg``,
``centralised``, ``fedprox``, ``fedopt``, ``coop``, ``fedasync``, ``fedbuff``) are
imported on first lookup, not here: importing this contract costs no algorithm.
"""
from .asynchronous import (ASK_AGE, CONCURRENCY_OPTIONS, DECISIONS, FETCH, RETRAIN, TRAIN_ON, UPLOAD, AsyncClient,
                           AsyncRule)
from .base import (AGGREGATIONS, Algorithm, Finding, UnknownAlgorithm, aggregation_problem, all_options, built_in,
                   get, installed, reference, register)
from .rounds import Replies, RunPhase, Strategy, WeightedMean, average, selected_per_round, weighted_average
from .tasks import BadTaskOutput, LocalTask, TaskInput, TaskOutput, UnknownTask

__all__ = ["AGGREGATIONS", "ASK_AGE", "CONCURRENCY_OPTIONS", "DECISIONS", "FETCH", "RETRAIN", "TRAIN_ON", "UPLOAD",
           "Algorithm", "AsyncClient", "AsyncRule", "BadTaskOutput", "Finding", "LocalTask",
           "Replies", "RunPhase", "Strategy", "TaskInput", "TaskOutput", "UnknownAlgorithm", "UnknownTask",
           "WeightedMean", "aggregation_problem", "all_options", "average", "built_in", "get", "installed",
           "reference", "register", "selected_per_round", "weighted_average"]
