"""Moved to fedemu.common.algorithms, one module per algorithm (issue 51): this old path still imports, with a DeprecationWarning."""
from fedemu.common import moved

__getattr__ = moved.forward(__name__, "fedemu.common.algorithms.tasks", "fedemu.common.algorithms.fedavg", "fedemu.common.algorithms.fedsgd", "fedemu.common.algorithms.fsvrg")
