"""fedemu.common — what the server and the worker both speak and compute, owned by
neither: the message vocabulary (``messages``), the algorithms with both their halves
(``algorithms``), the machine-learning library (``ml``: data sets, partitions, models,
training, compression, the device model) and the straggler groups.

It is a top-level folder of its own, beside ``server/`` and ``worker/``, because the two
sides of one conversation are siblings: ``server/`` and ``worker/`` import this package
and never each other (tests/test_layers.py checks it). It imports ``fedemu.node`` and
nothing above it.
"""
