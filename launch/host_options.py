"""Moved to fedemu.launch.running.host_options (issue 51): this old path still imports, with a DeprecationWarning."""
from fedemu.common import moved

moved.alias(__name__, "fedemu.launch.running.host_options")
