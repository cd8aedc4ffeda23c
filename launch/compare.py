"""Moved to fedemu.launch.studies.compare (issue 51): this old path still imports, with a DeprecationWarning."""
from fedemu.common import moved

moved.alias(__name__, "fedemu.launch.studies.compare")
