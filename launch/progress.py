"""Moved to fedemu.launch.running.progress (issue 51): this old path still imports, with a DeprecationWarning."""
from fedemu.common import moved

moved.alias(__name__, "fedemu.launch.running.progress")
