"""CPU of a job's whole process tree, zygote included, in total or as it runs.

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


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def descendants() -> dict[int, tuple[float, float]]:
    """This process's live descendants: pid -> (its own CPU seconds, its reaped children's),
    from /proc stat's utime + stime and cutime + cstime; one that exits meanwhile is
    missed, so a sample may run a few ticks short."""
    parents, times = {}, {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks = [int(x) for x in fields[11:15]]  # stat fields 14-17
        times[pid] = ((ticks[0] + ticks[1]) * _TICK_S, (ticks[2] + ticks[3]) * _TICK_S)
    ours: dict[int, tuple[float, float]] = {}
    grew = True
    while grew:  # a child's pid may be lower than its parent's: until nothing is added
        grew = False
        for pid, parent in parents.items():
            if (parent == os.getpid() or parent in ours) and pid not in ours:
                ours[pid] = times[pid]
                grew = True
    return ours


def tree_cpu_s() -> float:
    """CPU seconds of this process's descendants so far, running or not: the reaped ones
    (children_cpu_s) and the live ones with their own reaped children."""
    return children_cpu_s() + sum(own + reaped for own, reaped in descendants().values())
