"""A worker node's cohort trainer (``run.cohort = "auto"``): the local work its clients
have in hand at once, computed together (common/ml/cohort.py computes it).

A client whose TrainRequest names a task that can run as a cohort does not train at
once: it hands the job to its node's trainer (``Process.hand``: no message, no link)
and is done with the request. The trainer is a behaviour process of the node: it
collects jobs as they come and, when its mailbox runs empty (``Behaviour.drained``),
runs every job in hand as one computation, then finishes each as its client would
have, from the client's own process: the reply, its compute charge and hold, the
update kept at the node, the books of a training stopped part-way.

Which jobs are in hand at once: the node's pool runs one thing at a time in the order
things became runnable, so the trainer runs after every client whose request had
arrived by the time the first job reached it; requests that arrive while it trains make
the next cohort, and no cohort waits for a request still on its way. In virtual time
all of it happens within the instant the requests arrived: the node is busy while the
trainer holds work, so the clock cannot move, and each reply is held from that instant
for its own device's time, as a client training alone holds it. Each member's update
is bit for bit its per-client one (ml/cohort.py), so who shares a cohort, and so the
gathering's timing and the clients' placement, change nothing but speed.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fedemu.node import Behaviour, BehaviourProcess, Message, Pid

from fedemu.common.algorithms import tasks
from fedemu.common.ml import cohort
from fedemu.common.messages import TrainRequest

if TYPE_CHECKING:
    from .client import Client, ModelCache

log = logging.getLogger("fedemu.worker")

ASYNC = "async"  # an asynchronous rule's local update (a job without a request)


@dataclass
class Job:
    """A client's request, handed to its node's trainer."""

    client: Client
    proc: BehaviourProcess  # the client's process: the reply leaves from it
    sender: Pid
    request: TrainRequest | None  # None: an asynchronous rule's local update
    went_offline: Callable[[], bool]  # since the request arrived
    # The round closed without it (a Cancel waits in its mailbox); for an asynchronous
    # rule's update, its task ended meanwhile (algorithm.concurrency's TaskDone).
    cancelled: Callable[[], bool]
    started: float  # emulated: when the work arrived (its span in the run's timeline starts there)

    def unwanted(self) -> bool:
        """Its training must stop at its next step."""
        return self.went_offline() or self.cancelled()


@dataclass
class TrainAlone:
    """The trainer's word to a client (handed, never sent): run this job on your own.
    For a cohort whose computation failed: each client then meets its own error, as it
    would have, and crashes with it."""

    job: Job


@dataclass
class Failed:
    """The trainer's word to a client whose work it computed but could not finish (its
    reply cannot be made or sent): the client raises ``error``, and crashes with it as
    it would have training alone."""

    error: BaseException


class CohortTrainer(Behaviour):
    """The node's trainer; ``pid`` is set once it is spawned."""

    def __init__(self, cache: ModelCache) -> None:
        self.cache = cache  # the pool thread's models: the trainer runs on that thread too
        self.pid: Pid | None = None
        self._jobs: list[Job] = []
        self._said: set[str] = set()  # reasons already logged
        self.cohorts = 0  # computations run, and the members in them (for the log and tests)
        self.members = 0

    # --- the clients' side ------------------------------------------------------------------

    def takes(self, task: type[tasks.LocalTask], client: Client, request: TrainRequest) -> bool:
        """Whether ``request``'s work can run in a cohort; if not, why is logged once."""
        return self._allowed(f"task {tasks.reference(task)}",
                             task.cohort_problem(request, self.cache.get(client.model), client.data.dataset))

    def _allowed(self, work: str, why: str | None) -> bool:
        if why is None:
            return True
        reason = f"{work}: {why}"
        if reason not in self._said:
            self._said.add(reason)
            log.info("clients train one by one for %s", reason)
        return False

    def takes_async(self, client: Client) -> bool:
        """Whether an asynchronous rule's local update (plain SGD from the client's own
        weights) can run in a cohort; if not, why is logged once."""
        spec = client.async_compression
        why = ("a structured update trains each client in a restricted space of its own"
               if spec and spec.get("structured", "none") != "none"
               else cohort.problem(self.cache.get(client.model), client.data.dataset))
        return self._allowed("asynchronous local update", why)

    def submit(self, job: Job) -> None:
        job.proc.hand(self.pid, job)

    # --- the trainer's process ----------------------------------------------------------------

    def handle(self, proc: BehaviourProcess, msg: Message) -> None:
        self._jobs.append(msg.body)

    def drained(self, proc: BehaviourProcess) -> None:
        jobs, self._jobs = self._jobs, []
        while jobs:
            # One job per client per cohort: a second one starts from what the first leaves
            # (its step count, its task state), so it waits for the next.
            now, later, seen = [], [], set()
            for job in jobs:
                (later if job.client.client_id in seen else now).append(job)
                seen.add(job.client.client_id)
            self._run(proc, now)
            jobs = later

    def _run(self, proc: BehaviourProcess, jobs: list[Job]) -> None:
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault((job.request.task if job.request else ASYNC, job.client.model), []).append(job)
        for (name, spec), group in groups.items():
            if name == ASYNC:  # a task that ended while its job waited has nothing left to train
                group = [job for job in group if not job.cancelled()]
                if not group:
                    continue
            group.sort(key=lambda job: job.client.client_id)
            model = self.cache.get(spec)
            started, started_cpu = time.perf_counter(), time.thread_time()  # wall: measured compute
            try:
                if name == ASYNC:
                    members = [job.client.async_member(job) for job in group]
                    outputs = cohort.train(model, members, group[0].client.data.dataset)
                else:
                    task = tasks.get(name)
                    inputs = [job.client.task_input(task, job.request, model) for job in group]
                    outputs = task().run_cohort(inputs, [job.unwanted for job in group])
            except Exception:
                log.exception("a cohort of %d clients for %s failed; each trains alone", len(group), name)
                for job in group:
                    proc.hand(job.proc.pid, TrainAlone(job))
                continue
            self.cohorts += 1
            self.members += len(group)
            if self.cohorts == 1:
                log.info("clients train in cohorts: the first, task %s, had %d", name, len(group))
            log.debug("a cohort of %d clients, task %s", len(group), name)
            # Each member's share of the computation: what measured compute charges it.
            measured_s = (time.perf_counter() - started) / len(group)  # wall
            cpu_s = (time.thread_time() - started_cpu) / len(group)
            for job, output in zip(group, outputs):
                if not job.proc.alive:
                    continue
                try:
                    if name == ASYNC:
                        job.client.async_done(job, output, measured_s, cpu_s)
                    else:
                        job.client.cohort_done(job, task, output, measured_s, cpu_s)
                except Exception as exc:  # the client crashes with it, as it would have alone
                    proc.hand(job.proc.pid, Failed(exc))
