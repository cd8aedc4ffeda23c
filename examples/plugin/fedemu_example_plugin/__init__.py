"""An example fedemu plug-in (see algorithms.py)."""
