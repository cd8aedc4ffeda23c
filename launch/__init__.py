"""fedemu.launch: the `fedemu` command (cli.py) and the Python API (api.py), over three
jobs, one sub-package each (issue 51): ``config`` (the configuration, at the bottom),
``running`` (starting runs and seeing them through) and ``studies`` (sweeps, reports,
comparisons). The modules at this level besides cli, api and __main__ are the old flat
paths, kept for now with a DeprecationWarning."""
