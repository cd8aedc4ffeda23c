"""CPU of a job's whole process tree, zygote included.

With local nodes forked from the zygote (launch/running/zygote.py), a node is the
zygote's child, not the launcher's, and the zygote outlives the launcher by a moment: a
benchmark's RUSAGE_CHILDREN counts the nodes' CPU only if the benchmark adopts the
orphaned zygote (a child subreaper) and reaps it."""
from __future__ import annotations

import ctypes
import os
import resource

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Become the subreaper of every process this one starts (Linux)."""
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def reap_orphans() -> None:
    """Wait for every child left, the orphaned zygote among them, so its CPU counts."""
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every reaped descendant so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
