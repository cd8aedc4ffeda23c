"""What a run's faults and summary say about how it went: the cause of a lost worker
node, the clients a run lost and why, and whether a run that aggregated nothing may
call itself completed. Both engines use it (engine.py, async_engine.py)."""
from __future__ import annotations

import collections
import time
from pathlib import Path

from .runlog import read_node_exit

# A cause is named with this many of its clients' reasons; the rest are counted.
REASONS_NAMED = 3


class NodeExits:
    """How lost worker nodes' processes ended, as their launcher recorded it
    (``runlog.NODE_EXIT``), so that a client lost with its node names the cause:
    "noconnection: worker-1 killed by SIGBUS (...)". The launcher sees a process end
    within a fraction of a second, the server sees its node lost only after the
    heartbeat timeout, so the record is normally there already; otherwise the server
    waits up to ``wait_s`` for it, once per node (0: nobody records them, e.g. a server
    run without a launcher; a node that is stopped, not dead, has none)."""

    def __init__(self, run_dir: str | Path, wait_s: float = 0.0) -> None:
        self.run_dir = Path(run_dir)
        self.wait_s = wait_s
        self._known: dict[str, str] = {}
        self._waited: set[str] = set()

    def cause(self, node: str) -> str | None:
        """How ``node``'s process ended, if its launcher has said."""
        if node in self._known:
            return self._known[node]
        deadline = time.monotonic() + (0.0 if node in self._waited else self.wait_s)  # wall: a real process
        self._waited.add(node)
        while True:
            how = read_node_exit(self.run_dir, node)
            if how is not None:
                self._known[node] = how
                return how
            if time.monotonic() >= deadline:  # wall
                return None
            time.sleep(0.05)  # wall: polling the launcher's record

    def reason(self, down_reason: str, node: str) -> str:
        """A lost client's fault reason: its DOWN's, with its node's end when that is why."""
        if down_reason != "noconnection":
            return down_reason
        how = self.cause(node)
        return f"noconnection: {node} {how}" if how else down_reason

    def gone(self, nodes: list[str]) -> tuple[str, str] | None:
        """The first of ``nodes`` whose process has ended, and how (start-up: a worker
        node that dies before it reports need not be waited for)."""
        for node in nodes:
            how = read_node_exit(self.run_dir, node)
            if how is not None:
                return node, how
        return None


def losses(faults: list[dict]) -> str:
    """The clients ``faults`` lost, by reason, most common first: "100 clients: 50
    noconnection: worker-0 killed by SIGBUS (...); 50 crash: MemoryError: ..."."""
    lost = {f["client"]: f["reason"] for f in faults}  # a restarted client's latest loss
    if not lost:
        return "no client was lost"
    counts = collections.Counter(lost.values()).most_common()
    named = "; ".join(f"{n:,} {reason}" for reason, n in counts[:REASONS_NAMED])
    others = sum(n for _, n in counts[REASONS_NAMED:])
    return f"{len(lost):,} client{'s' if len(lost) != 1 else ''} lost: {named}" + (
        f"; {others:,} for {len(counts) - REASONS_NAMED} other reasons" if others else "")


def nothing_aggregated(reason: str, asked: set[int], faults: list[dict], detail: str) -> tuple[str, str]:
    """The (status, reason) of a run that ran its course but aggregated nothing: its
    final model is the initial one, and the reason says so and why (``detail``: what
    became of the replies). If every client it asked was lost (crashed, its node dead)
    before answering, nothing was trained at all: ``failed``, not ``completed``."""
    faulted = {f["client"] for f in faults}
    if asked and asked <= faulted:
        return "failed", (f"no client answered: every client asked ({len(asked):,}) was lost before it could; "
                          f"{losses(faults)}")
    return "completed", f"{reason}; nothing was aggregated, the final model is the initial one ({detail})"


def no_answer_hint(round_: int, outcomes: list[str], deadline_s: float) -> tuple[str, str] | None:
    """What to say of a round in which no selected client answered (``outcomes``: each
    unanswered one's, timeline.OUTCOMES), naming the cause the emulator knows rather
    than the server's view, where an offline device looks like a straggler: a longer
    deadline helps only clients that straggled. Returns (cause, message), the cause
    "offline", "deadline" or "mixed"; None if none straggled, went offline or lost a
    message (the lost ones have fault events of their own)."""
    counts = collections.Counter(outcomes)
    offline, straggled, failed = counts["offline"], counts["straggler"], counts["failed_transfer"]
    n = offline + straggled + failed
    if not n:
        return None
    head = f"round {round_}: none of the {n} selected clients answered"
    offline_help = ("their devices' availability comes from network.traces, network.dropout or "
                    "network.time_of_day; more clients per round (algorithm.C, algorithm.over_select) or devices "
                    "online more of the time would help")
    if offline == n:
        return "offline", (f"{head}: every selected client was offline, so the model was kept; a longer "
                           f"algorithm.deadline_s would not help: {offline_help}")
    deadline = ("if their training takes longer on the emulated device (run.device_flops), raise "
                "algorithm.deadline_s or set it to 0 (wait for every answer)")
    if straggled == n:
        return "deadline", (f"{head} within algorithm.deadline_s = {deadline_s:g} emulated s, so the model was kept; "
                            f"{deadline}")
    parts = [f"{k} {what}" for k, what in ((offline, "was offline" if offline == 1 else "were offline"),
                                           (failed, "lost a message on their link"),
                                           (straggled, "straggled (still training or uploading at the deadline)"))
             if k]
    advice = []
    if straggled:
        advice.append(f"for the {straggled} that straggled, {deadline}")
    if offline:
        advice.append(f"for the {offline} offline, a longer deadline would not help: {offline_help}")
    if failed:
        advice.append(f"for the {failed} whose message was lost, see the links' loss and queue settings "
                      "(network.profiles)")
    return "mixed", (f"{head} within algorithm.deadline_s = {deadline_s:g} emulated s, so the model was kept: "
                     f"{', '.join(parts)}; " + "; ".join(advice))
