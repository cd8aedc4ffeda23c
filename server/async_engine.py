"""Asynchronous aggregation: CO-OP (Nilsson et al. 2018, Algorithm 3), FedAsync (Xie et
al. 2019) and FedBuff (Nguyen et al. 2022) on one engine.

Every client loops on its own (train E epochs, then what its rule's client policy
decides: upload, or ask the server's age first); the server answers each message as it
comes. A rule (``fedemu.common.algorithms``: ``coop``, ``fedasync``, ``fedbuff``) says how
an upload is merged and, for its clients, what they decide. Evaluation runs every
``eval_every`` uploads (Nilsson evaluated every 10th: as many uploads as one FedAvg
round at C = 0.1) and each evaluation is written as a ``round`` event, so tools read
synchronous and asynchronous runs alike.

A rule can deadlock: CO-OP when every live client is over-active (Nilsson's Theorem
A.1). The server knows every client's age a_k exactly (a_k only changes through the
server's replies), so after each message it asks the rule (``AsyncRule.deadlock``)
whether no upload can ever be merged again. It then stops with a ``deadlock`` event, or
recovers (``recovered_age``) if the config asks for that.

With [compression], every rule's clients send the delta from the last model they received
(the n-th, ``Upload.base``), encoded with the seed of (run seed, n, client). FedBuff merges
the decoded delta; CO-OP and FedAsync merge weights, so the server keeps the model it last
sent each client and adds it back. A sketch is unbiased in the delta, hence in the weights.

Messages can be lost (link loss, a client offline). Each client request carries an id and
the client resends it until the reply with that id comes (after ``retry_s``, then twice as
long each time, up to 8x: ``protocol.retry_wait``); the server answers
a request it has answered already again (with compression, the very same model), without
merging or counting it again, and resends AsyncStart to a client it has not heard from. Models are numbered by the
server (``sent``) and the number travels with the model, so both sides agree on an
upload's base whatever was lost. Each evaluation event counts the repeats the server saw.

Concurrency (``algorithm.concurrency``, FedBuff's and Papaya's): at most that many
clients hold a task at once. A task is one local update from the model the client's
AsyncStart carries, ended by the server's TaskDone once the upload is in; the server
then starts another client, chosen uniformly from the live clients without a task
(stream ``concurrency``), or, with ``arrival_rate`` > 0, starts one at each arrival of
a Poisson process (FLSim's asynchronous trainer; stream ``arrivals``) if a place is
free. The server does not see devices go offline (a start sent to an offline device
is lost, and resent as any AsyncStart): ``client_timeout_s`` gives a task's place to
another client when its upload has not come in time, and the server stops choosing
that client until it checks in (``CheckIn``: a device that comes back online says so,
as real devices check in with their server). Every task is a row of ``tasks.csv``
(client, started, ended, how). The default, 0, starts every client at once, each
looping on its own, as before.
"""
from __future__ import annotations

import collections
import heapq
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from fedemu.common import algorithms
from fedemu.common.algorithms.asynchronous import AsyncRule
from fedemu.common.messages import (AgeReply, AgeRequest, AsyncStart, AsyncStop, CheckIn, FetchRequest, ModelReply,
                                    TaskDone, TaskStart, Upload, WorkerReady, retry_wait)
from fedemu.common.ml.data import Data
from fedemu.common.ml.models import ModelSpec
from fedemu.node import TIMEOUT, Down, Message, Pid, ThreadProcess, streams

from .engine import Engine, Settings
from .runlog import RunLog

log = logging.getLogger("fedemu.server")


@dataclass(frozen=True)
class Concurrency:
    """How many clients train at once and how new ones start (algorithm.concurrency,
    arrival_rate, client_timeout_s); the default: every client at once, for ever."""

    limit: int = 0  # at most this many clients hold a task; 0: no limit
    arrival_rate: float = 0.0  # > 0: a client starts at each arrival (per emulated second); 0: as one ends
    timeout_s: float = 0.0  # a task's place goes to another client after this long without its upload; 0: never

    @classmethod
    def from_config(cls, algorithm: dict) -> Concurrency:
        return cls(algorithm.get("concurrency", 0), algorithm.get("arrival_rate", 0.0),
                   algorithm.get("client_timeout_s", 0.0))

    @property
    def tasks(self) -> bool:
        """Whether clients run tasks the server starts, rather than all looping at once."""
        return self.limit > 0 or self.arrival_rate > 0


class AsyncEngine(Engine):
    synchronous = False

    def __init__(self, settings: Settings, rule: AsyncRule, model: ModelSpec, data: Data, runlog: RunLog,
                 lr: float, lr_decay: float = 0.0, on_deadlock: str = "stop", concurrency: Concurrency = Concurrency()):
        super().__init__(settings, model, data, runlog)
        self.rule = rule
        self.concurrency = concurrency
        # Tasks (concurrency): the clients holding one, each with (started, its number);
        # when each one's place is given up ((due, client, number), soonest first); when
        # the next arrival comes; the ended tasks' rows for tasks.csv, written at each
        # evaluation.
        self.tasks: dict[int, tuple[float, int]] = {}
        self.unavailable: set[int] = set()  # a task timed out, and the client has not checked in since
        self._task_count = 0
        self._task_timeouts: list[tuple[float, int, int]] = []
        self._next_arrival = math.inf
        self._arrivals = 0
        self._task_rows: list[tuple] = []
        self.late_uploads = 0  # uploads from clients whose task had been given away
        self.algorithm = rule.name
        self._rule_reference = algorithms.reference(type(rule))  # how the clients find its client half
        self.lr, self.lr_decay = lr, lr_decay
        self.on_deadlock = on_deadlock
        self.age = rule.server_age_start()
        self.ages: dict[int, int] = {}  # a_k as the server last set it
        self.doing: dict[int, str] = {}  # what each client was last seen doing, for diagnostics
        self.sent: dict[int, int] = {}  # models sent to each client: an upload's `base` must match
        # With compression, CO-OP and FedAsync clients send the delta from the last model
        # they received; the server keeps that model (a reference: the global model is
        # never changed in place, so clients holding the same version share one array).
        self.bases: dict[int, np.ndarray] = {}
        self._keep_bases = self.codec is not None and not rule.uploads_delta
        # Exactly once: the id of the last request answered per client, and (compressed
        # runs) the ModelReply it got, to send again; see _reply_model.
        self.answered: dict[int, int] = {}
        self.replies: dict[int, ModelReply | None] = {}
        # Clients not heard from since their AsyncStart: that message, when to resend it,
        # and how many times it was resent (each wait is longer: protocol.retry_wait).
        self.unheard: dict[int, tuple[AsyncStart, float, int]] = {}  # due: emulated seconds
        # (due, client) of every entry above, soonest first; an entry whose client has been
        # heard from (or resent since) is skipped when it surfaces: no scan of all clients
        # per message, which was quadratic while 10,000s of clients had not answered yet.
        self._start_dues: list[tuple[float, int]] = []
        # With settings.merge_s > 0 the server serves fetches and uploads one at a time,
        # each taking merge_s emulated seconds: those waiting queue here, in arrival order.
        self._queue: collections.deque[Message] = collections.deque()
        self._busy_until = 0.0  # emulated time the request at the head of the queue is served
        self._evaluation = 0
        # CO-OP's age filter since the last evaluation: checks asked, and fetches (outdated
        # clients); uploads are the normal ones, the rest were over-active.
        self.age_requests = self.fetches = 0
        self.duplicates = 0  # repeated requests seen since the last evaluation
        self.starts_resent = 0  # AsyncStarts resent since the last evaluation

    def main(self, proc: ThreadProcess) -> tuple[str, str]:
        if not self.concurrency.tasks:
            self._start_clients(proc, sorted(self.live))
        elif self.concurrency.arrival_rate > 0:
            self._schedule_arrival(proc.now())
        else:
            self._fill(proc)
        try:
            return self._serve(proc)
        finally:
            self._task_rows += [(n, k, round(started, 6), None, "unfinished") for k, (started, n) in self.tasks.items()]
            self._write_tasks(proc.now())
            for k in self.live:
                proc.send(self.pids[k], AsyncStop("the run ended"))

    # --- tasks: concurrency -------------------------------------------------------------------

    def _fill(self, proc: ThreadProcess) -> None:
        """Start clients until ``concurrency`` hold a task (or none is free)."""
        while len(self.tasks) < self.concurrency.limit and self._start_task(proc):
            pass

    def _start_task(self, proc: ThreadProcess) -> bool:
        """Start one client chosen uniformly from the live ones without a task."""
        free = sorted(self.live - set(self.tasks) - self.unavailable)
        if not free:
            return False
        self._task_count += 1
        n = self._task_count
        k = free[int(streams.generator(self.settings.seed, "concurrency", n).integers(len(free)))]
        now = proc.now()
        self.tasks[k] = (now, n)
        if self.concurrency.timeout_s > 0:
            heapq.heappush(self._task_timeouts, (now + self.concurrency.timeout_s, k, n))
        s = self.settings
        start = TaskStart(
            rule=self._rule_reference, weights=self.weights, age=self.age, epochs=s.epochs, batch_size=s.batch_size,
            lr=self.lr, lr_decay=self.lr_decay, seed=s.seed, extra=self.rule.client_payload(),
            compression=s.compression if self.codec else None, retry_s=s.retry_s)
        self.ages[k] = self.age
        self.doing[k] = "training (a task)"
        self._send_model(proc, k, self.pids[k], start)  # numbers the model: a start resent later is recognised
        self._await_start(k, start, now + s.retry_s, 0)
        return True

    def _end_task(self, proc: ThreadProcess, k: int, outcome: str) -> None:
        """Client k's task is over (uploaded, down, timeout): record it, free its place."""
        started, n = self.tasks.pop(k)
        self._task_rows.append((n, k, round(started, 6), round(proc.now(), 6), outcome))
        self.unheard.pop(k, None)
        self.ages.pop(k, None)
        self.doing[k] = f"idle (task {outcome})"
        if self.concurrency.arrival_rate == 0:
            self._fill(proc)

    def _schedule_arrival(self, after: float) -> None:
        self._arrivals += 1
        gap = streams.generator(self.settings.seed, "arrivals", self._arrivals).exponential(
            1.0 / self.concurrency.arrival_rate)
        self._next_arrival = after + gap

    def _task_timers(self, proc: ThreadProcess) -> float:
        """Arrivals and timeouts due by now; returns when the next one is due."""
        now = proc.now()
        while self._next_arrival <= now:
            if not self.concurrency.limit or len(self.tasks) < self.concurrency.limit:
                self._start_task(proc)
            self._schedule_arrival(self._next_arrival)
        timeouts = self._task_timeouts
        while timeouts and timeouts[0][0] <= now:
            _, k, n = heapq.heappop(timeouts)
            if self.tasks.get(k, (0, None))[1] == n:  # else that task ended already
                log.info("client %d: no upload within client_timeout_s; its place goes to another client", k)
                proc.send(self.pids[k], TaskDone(0, "timeout"))
                self.unavailable.add(k)
                self._end_task(proc, k, "timeout")
        while timeouts and self.tasks.get(timeouts[0][1], (0, None))[1] != timeouts[0][2]:
            heapq.heappop(timeouts)  # stale: that task ended before its timeout
        return min(self._next_arrival, timeouts[0][0] if timeouts else math.inf)

    def _write_tasks(self, now: float) -> None:
        """The tasks' rows recorded since the last call, to tasks.csv."""
        rows, self._task_rows = sorted(self._task_rows), []
        if rows:
            self.runlog.tasks(rows)

    def _start_clients(self, proc: ThreadProcess, ks: list[int]) -> None:
        """Start the asynchronous loops of clients ``ks`` from the current global model: one
        AsyncStart for all of them, sent as one copy per worker node (``send_many``)."""
        s = self.settings
        start = AsyncStart(
            rule=self._rule_reference, weights=self.weights, age=self.rule.client_age_start, epochs=s.epochs,
            batch_size=s.batch_size, lr=self.lr, lr_decay=self.lr_decay, seed=s.seed,
            extra=self.rule.client_payload(), compression=s.compression if self.codec else None,
            retry_s=s.retry_s, model=1)  # each client's first model from this server (see _send_model)
        self.totals.asked.update(ks)
        for k in ks:
            self.ages[k] = self.rule.client_age_start
            self.doing[k] = "training"
            self.sent[k] = 1  # a restarted client is a new process: models and requests count anew
            self.answered[k] = 0
            self.replies.pop(k, None)
            if self._keep_bases:
                self.bases[k] = start.weights
            self._await_start(k, start, proc.now() + s.retry_s, 0)
        if ks:
            proc.send_many([self.pids[k] for k in ks], start)

    def _await_start(self, k: int, start: AsyncStart, due: float, resends: int) -> None:
        self.unheard[k] = (start, due, resends)
        heapq.heappush(self._start_dues, (due, k))

    def _resend_starts(self, proc: ThreadProcess) -> float:
        """Resend AsyncStart (the same message: same model number) to every client not
        heard from within the retry interval; returns when the next one is due. Also
        handles the tasks' arrivals and timeouts (concurrency)."""
        next_task_event = self._task_timers(proc) if self.concurrency.tasks else math.inf
        return min(next_task_event, self._resend_due_starts(proc))

    def _resend_due_starts(self, proc: ThreadProcess) -> float:
        now, dues = proc.now(), self._start_dues
        while dues:
            due, k = dues[0]
            entry = self.unheard.get(k)
            if entry is None or entry[1] != due:  # heard from, or rescheduled since: stale
                heapq.heappop(dues)
                continue
            if due > now:
                return due
            heapq.heappop(dues)
            start, _, resends = entry
            proc.send(self.pids[k], start)
            self._await_start(k, start, now + retry_wait(self.settings.retry_s, resends + 1), resends + 1)
            self.starts_resent += 1
            log.info("client %d not heard from since its start: AsyncStart resent", k)
        return math.inf

    def _serve(self, proc: ThreadProcess) -> tuple[str, str]:
        s = self.settings
        self._evaluation, self._merges, self._uploads_at_eval = 0, 0, 0
        self._period_started = proc.now()  # emulated: when the evaluation period began
        self._period_uploads: list[int] = []
        last_progress = time.monotonic()  # wall
        while True:
            next_start = self._resend_starts(proc)
            wake = min(next_start, self._busy_until if self._queue else math.inf)
            msg = self._receive(proc, (AgeRequest, FetchRequest, Upload, Down, WorkerReady, CheckIn),
                                timeout=None if wake == math.inf else max(0.0, wake - proc.now()),
                                wall_timeout=last_progress + s.progress_timeout_s
                                - time.monotonic())  # wall
            uploads_before = self.totals.uploads
            if msg is not TIMEOUT:
                outcome = self._handle(proc, msg)
                if outcome is not None:
                    return outcome
            # The queue (settings.merge_s > 0): serve every request whose service is over.
            while self._queue and proc.now() >= self._busy_until - 1e-9:
                served = self._queue.popleft()
                if self._queue:
                    self._busy_until += s.merge_s
                reason = self._serve_request(proc, served)
                if reason:
                    return "completed", reason
            if self.totals.uploads > uploads_before:  # progress: something was merged
                last_progress = time.monotonic()  # wall
            if msg is TIMEOUT:
                if time.monotonic() >= last_progress + s.progress_timeout_s:  # wall
                    self._stall(self._evaluation)
                    last_progress = time.monotonic()  # wall
                continue
            cause = self.rule.deadlock(self.age, self.ages, self.live)
            if cause is not None:
                if self.on_deadlock != "recover":
                    self.runlog.event("deadlock", round=self._evaluation, cause=cause, age=self.age,
                                      ages={k: self.ages[k] for k in sorted(self.live)})
                    return "failed", f"deadlock: {cause}"
                new_age = self.rule.recovered_age(self.age, self.ages, self.live)
                self.runlog.event("recovered", round=self._evaluation, cause=cause, age_before=self.age,
                                  age_after=new_age)
                self.age = new_age

    def _handle(self, proc: ThreadProcess, msg: Message) -> tuple[str, str] | None:
        """One message; the run's (status, reason) if it ends the run."""
        body = msg.body
        if isinstance(body, (AgeRequest, FetchRequest, Upload)) and not self._new_request(proc, msg):
            return None
        if isinstance(body, Upload):  # the local work behind it, into the timeline
            self.timeline.reply(self._evaluation + 1, body.client, body.started_s, body.ended_s, body.compute_s)
        if isinstance(body, CheckIn):
            if self.pids.get(body.client) == msg.sender and body.client in self.unavailable:
                self.unavailable.discard(body.client)
                if self.concurrency.arrival_rate == 0:
                    self._fill(proc)
        elif isinstance(body, WorkerReady):
            restarted = self._rejoin(proc, msg, self._evaluation)
            if not self.concurrency.tasks:
                self._start_clients(proc, restarted)
            elif self.concurrency.arrival_rate == 0:  # live again, to be chosen like any other
                self._fill(proc)
        elif isinstance(body, Down):
            lost = self._client_down(proc, body, self._evaluation)
            k = self.client_of.get(body.pid)
            if lost is not None and lost in self.tasks:
                self._end_task(proc, lost, "down")
            for table in (self.ages, self.bases, self.unheard, self.replies):
                table.pop(k, None)
            if any(queued.body.client == k for queued in self._queue):  # a dead client's request goes unserved
                self._queue = collections.deque(q for q in self._queue if q.body.client != k)
            if not self.live:
                cause = self._every_client_lost()
                self.runlog.event("deadlock", round=self._evaluation, cause=cause)
                return "failed", cause
        elif isinstance(body, AgeRequest):
            self.age_requests += 1
            # Answered at once, even while the server is busy: Nilsson et al.'s server
            # kept the age in a process of its own (server.erl, track_age).
            self.doing[body.client] = "asked the age"
            proc.send(msg.sender, AgeReply(self.age, body.request))
        elif self.settings.merge_s:
            if not self._queue:
                self._busy_until = proc.now() + self.settings.merge_s
            self._queue.append(msg)
            self.doing[body.client] = f"queued its {type(body).__name__} at the server"
        else:
            reason = self._serve_request(proc, msg)
            if reason:
                return "completed", reason
        return None

    def _serve_request(self, proc: ThreadProcess, msg: Message) -> str | None:
        """Answer a fetch or merge an upload; the reason the run ends, if it does."""
        body = msg.body
        if isinstance(body, FetchRequest):
            self.fetches += 1
            self.ages[body.client] = self.age
            self.doing[body.client] = "fetched (outdated)"
            self._reply_model(proc, msg)
            return None
        if self.concurrency.tasks and body.client not in self.tasks:
            # Its task was given to another client meanwhile (client_timeout_s): not merged.
            self.late_uploads += 1
            self._reply_task_done(proc, msg, "late")
            return None
        if ((body.encoded is not None and not self._decode(body, self._evaluation))
                or not self._usable(body.update, body.client, self._evaluation, self.lr)):
            if self.concurrency.tasks:  # the update is lost; the task is over all the same
                self._reply_task_done(proc, msg, "refused")
                self._end_task(proc, body.client, "refused")
                return None
            # The update is lost, not the client: give it the model to go on from.
            self.ages[body.client] = self.age
            self.doing[body.client] = "sent an update that was refused"
            self._reply_model(proc, msg)
            return None
        self.totals.uploads += 1
        self._period_uploads.append(body.client)
        staleness = self.age - body.age
        self.weights, self.age, merged = self.rule.merge(self.weights, self.age, body)
        self._merges += merged
        self.totals.aggregations += merged
        if self.concurrency.tasks:
            self._reply_task_done(proc, msg, "uploaded")
            self._end_task(proc, body.client, "uploaded")
        else:
            self.ages[body.client] = self.age
            self.doing[body.client] = f"uploaded (staleness {staleness})"
            self._reply_model(proc, msg)
        if self.totals.uploads - self._uploads_at_eval >= self.settings.eval_every:
            self._uploads_at_eval = self.totals.uploads
            self._evaluation += 1
            reason = self._evaluation_event(proc, self._evaluation, self._merges, self._period_uploads)
            self._period_uploads = []
            return reason
        return None

    def _new_request(self, proc: ThreadProcess, msg: Message) -> bool:
        """Whether a request is new; a repeat of the last one answered gets that answer
        again (a stored ModelReply, or the age now), an older one nothing."""
        body, k = msg.body, msg.body.client
        if self.pids.get(k) != msg.sender:
            log.info("ignoring %s from %s: client %d is now %s", type(body).__name__, msg.sender, k, self.pids.get(k))
            return False
        self.unheard.pop(k, None)
        last = self.answered.get(k, 0)
        if body.request > last:
            self.answered[k], self.replies[k] = body.request, None
            return True
        self.duplicates += 1
        self.doing[k] = f"resent {type(body).__name__} {body.request}"
        if any(q.body.client == k and q.body.request == body.request for q in self._queue):
            return False  # still queued: its answer comes when it is served
        if body.request == last:
            if isinstance(body, AgeRequest):
                proc.send(msg.sender, AgeReply(self.age, body.request))
            elif self.replies.get(k) is not None:
                # The same numbered model (a compressed upload's base), or a task's end.
                proc.send(msg.sender, self.replies[k])
            else:
                self._reply_model(proc, msg)  # uncompressed: the model as it is now serves as well
        return False

    def _reply_task_done(self, proc: ThreadProcess, msg: Message, reason: str) -> None:
        """End the task whose upload this is; a repeat of the upload gets the same answer."""
        reply = TaskDone(msg.body.request, reason)
        self.replies[msg.body.client] = reply
        proc.send(msg.sender, reply)

    def _reply_model(self, proc: ThreadProcess, msg: Message) -> None:
        """Answer a fetch or upload with the global model. With compression the reply is
        kept for a repeat of the request: the client's next upload is encoded against that
        very model (``bases`` keeps the same array, so this costs no memory). Without, a
        repeat gets the model as it is then, and no old model is kept per client (K of
        them would be K model versions held)."""
        k = msg.body.client
        reply = ModelReply(self.weights, self.age, request=msg.body.request)
        self.replies[k] = reply if self.codec is not None else None
        self._send_model(proc, k, msg.sender, reply)

    def _send_model(self, proc: ThreadProcess, k: int, pid: Pid, message: AsyncStart | ModelReply) -> None:
        self.sent[k] = self.sent.get(k, 0) + 1
        message.model = self.sent[k]
        if self._keep_bases:
            self.bases[k] = message.weights
        proc.send(pid, message)

    def _decode(self, upload: Upload, evaluation: int) -> bool:
        """Decode an encoded delta into ``upload.update`` in place: the delta itself for
        FedBuff, base + delta for the rules that merge weights. The seed is the one the
        client used, from (run seed, base, client)."""
        k = upload.client
        unknown_base = None
        if upload.base != self.sent.get(k):
            unknown_base = (f"it was trained from model #{upload.base} from the server, which sent this client "
                            f"{self.sent.get(k, 0)}: its base is unknown")
        elif not upload.is_delta and k not in self.bases:
            unknown_base = "the client was lost and its base dropped"
        delta = self._decoded_delta(upload.encoded, upload.base, k, evaluation, unusable=unknown_base)
        if delta is None:
            return False
        upload.update = delta if upload.is_delta else (self.bases[k] + delta).astype(np.float32)
        upload.encoded = None
        return True

    def _what_became_of_the_replies(self) -> str:
        t = self.totals
        return f"{t.uploads:,} uploads, none merged; {len(t.faults):,} clients lost"

    def _evaluation_event(self, proc: ThreadProcess, evaluation: int, merges: int, uploaders: list[int]) -> str | None:
        accuracy, loss = self._evaluate()
        traffic, broker, _ = self._traffic_since_last(proc, evaluation)
        self._record(evaluation, accuracy)
        staleness = [self.age - self.ages[k] for k in self.live if k in self.ages]
        self.runlog.event(
            "round", round=evaluation, accuracy=accuracy, loss=loss, participants=len(uploaders),
            uploads=len(uploaders), total_uploads=self.totals.uploads, merges=merges, age=self.age,
            uploaders=sorted(set(uploaders)), **traffic,
            staleness_min=min(staleness, default=None), staleness_max=max(staleness, default=None),
            offline=broker.get("offline", []), emulated_s=broker["emulated_s"],
            round_emulated_s=round(proc.now() - self._period_started, 6),
            duplicate_requests=self.duplicates, starts_resent=self.starts_resent,
            **({"age_requests": self.age_requests, "fetches": self.fetches} if self.rule.client.asks_age else {}),
            **({"training": len(self.tasks), "tasks_started": self._task_count, "late_uploads": self.late_uploads}
               if self.concurrency.tasks else {}),
        )
        self.duplicates = self.starts_resent = self.age_requests = self.fetches = self.late_uploads = 0
        now = proc.now()
        self._write_tasks(now)
        self.timeline.round_span(evaluation, self._period_started, now, "evaluated")
        self.timeline.flush()
        self._period_started = now
        return self._finished(evaluation, accuracy)

    def waiting_for(self) -> str:
        return "an age request, fetch or upload from any client (" + "; ".join(
            f"{state}: {len(ks)}" for state, ks in self._clients_by_state().items()) + ")"

    def _clients_by_state(self) -> dict[str, list[int]]:
        by_state: dict[str, list[int]] = {}
        for k in sorted(self.live):
            by_state.setdefault(self.doing.get(k, "unknown"), []).append(k)
        return by_state

    def _stall(self, evaluation: int) -> None:
        """The watchdog: nothing was aggregated for progress_timeout_s. Say what everyone
        was last seen doing, and keep going (a provable deadlock stops the run instead)."""
        by_state = self._clients_by_state()
        self.runlog.event("stall", round=evaluation, waiting_s=self.settings.progress_timeout_s,
                          server="waiting for an age request, fetch or upload", clients=by_state, age=self.age,
                          duplicate_requests=self.duplicates, starts_resent=self.starts_resent)
        log.warning("no progress for %.0fs; clients by last known state: %s",
                    self.settings.progress_timeout_s, {s: len(v) for s, v in by_state.items()})
