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
the next cohort, and no cohort waits for a request still on its way. On the wall clock,
or where the devices' time is measured, all of it happens within the instant the
requests arrived, and each reply is held from that instant for its own device's time,
as a client training alone holds it.

On the virtual clock with the devices' time modelled (the default), a round's work may
wait: its reply's due instant (arrival plus the device's time) is known before it runs.
The trainer holds each wanted job and sets a timer for the earliest due one; the clock
moves on meanwhile (the node is idle), so downloads that arrive at different instants
(lossy or unequal links) join the held jobs, and at the earliest due instant all of
them train as one cohort. Each finishes as it would have at its arrival: trained
without a stop condition (it was wanted then), its reply sent at its own due instant
exactly (``send_at``), or not at all if its round was cancelled or its device went
offline since, as the reply held from its arrival would have been. A client with new
work makes the held jobs run first (its earlier job leaves the step count and the
task's state). Each member's update is bit for bit its per-client one (ml/cohort.py),
so who shares a cohort, and so the gathering's timing and the clients' placement,
change nothing but speed (tests/test_cohort.py compares whole runs, cohorts off and on).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from fedemu.node import Behaviour, BehaviourProcess, Message, Pid
from fedemu.node.runtime.clock import TimerRef

from fedemu.common.algorithms import tasks
from fedemu.common.ml import cohort
from fedemu.common.messages import TrainerDue, TrainRequest

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
    # Deferred by the trainer: the emulated instant its reply is due (arrival plus the
    # device's modelled time); it trains by then, as it would have at its arrival.
    due: float | None = None

    def unwanted(self) -> bool:
        """Its training must stop at its next step."""
        return self.went_offline() or self.cancelled()

    def stop(self) -> bool:
        """The stop condition it trains under: a deferred job's was its arrival's, when it
        was wanted (whatever happened since, its reply's send decides: client.py)."""
        return self.due is None and self.unwanted()


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

    def __init__(self, cache: ModelCache, defer: bool = False) -> None:
        self.cache = cache  # the pool thread's models: the trainer runs on that thread too
        self.pid: Pid | None = None
        self._jobs: list[Job] = []
        # Round jobs wait for their replies' due instants (the module's docstring): on
        # the virtual clock, with the devices' time modelled (known before the work runs).
        self.defer = defer
        self._held: list[Job] = []
        self._timer: tuple[float, TimerRef | None] | None = None  # (instant, timer) for the earliest held job
        self._joined_instants = False  # logged once
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
        if not isinstance(msg.body, TrainerDue):  # the timer only wakes drained
            self._jobs.append(msg.body)

    def drained(self, proc: BehaviourProcess) -> None:
        jobs, self._jobs = self._jobs, []
        if self.defer:
            jobs = self._due_now(proc, jobs)
        while jobs:
            # One job per client per cohort: a second one starts from what the first leaves
            # (its step count, its task state), so it waits for the next.
            now, later, seen = [], [], set()
            for job in jobs:
                (later if job.client.client_id in seen else now).append(job)
                seen.add(job.client.client_id)
            self._run(proc, now)
            jobs = later

    def _due_now(self, proc: BehaviourProcess, jobs: list[Job]) -> list[Job]:
        """The jobs to run now; the others are held, with a timer for the earliest. A
        round's job that is wanted is held until its reply is due (the instant its device
        is emulated to finish), so jobs that arrive at different instants but are due
        after them all train together. All held ones run at the earliest due instant,
        and at once when one of their clients has new work (its earlier job first: it
        leaves the step count and the task's state). What is not a wanted round's job
        (an asynchronous update, one unwanted as it arrives) runs now."""
        held_clients = {id(job.client) for job in self._held}
        flush, now = False, []
        for job in jobs:
            flush = flush or id(job.client) in held_clients
            if job.request is None or job.unwanted():
                now.append(job)
            else:
                job.due = job.client.reply_due(tasks.get(job.request.task), job)
                self._held.append(job)
        if flush or any(job.due <= proc.now() for job in self._held):
            now, self._held = self._held + now, []
        earliest = min((job.due for job in self._held), default=None)
        if self._timer is not None and self._timer[0] != earliest:
            if self._timer[1] is not None:
                self._timer[1].cancel()
            self._timer = None
        if earliest is not None and self._timer is None:
            self._timer = (earliest, proc.send_at(earliest, proc.pid, TrainerDue()))
        return now

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
                    outputs = task().run_cohort(inputs, [job.stop for job in group])
            except Exception:
                log.exception("a cohort of %d clients for %s failed; each trains alone", len(group), name)
                for job in group:
                    proc.hand(job.proc.pid, TrainAlone(job))
                continue
            self.cohorts += 1
            self.members += len(group)
            if self.cohorts == 1:
                log.info("clients train in cohorts: the first, task %s, had %d", name, len(group))
            instants = len({job.started for job in group})
            if instants > 1 and not self._joined_instants:
                self._joined_instants = True
                log.info("clients whose work arrived at different instants train together (held until due): "
                         "the first such cohort had %d from %d instants", len(group), instants)
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
