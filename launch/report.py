"""Moved to fedemu.launch.studies.report (issue 51): this old path still imports, with a DeprecationWarning."""
from fedemu.common import moved

moved.alias(__name__, "fedemu.launch.studies.report")
