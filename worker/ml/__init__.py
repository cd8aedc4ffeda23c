"""Moved to fedemu.common.ml (issue 51): this old path still imports, with a DeprecationWarning."""
from fedemu.common import moved

moved.alias_package(__name__, "fedemu.common.ml")
