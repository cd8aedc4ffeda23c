"""Emulated clients: many per worker node, each a cheap behaviour process.

An idle client holds only its shard's indices; the model weights exist only while it
trains, in a model instance owned by the pool thread that runs it.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from fedemu.common import algorithms
from fedemu.common.algorithms import tasks
from fedemu.common.algorithms.asynchronous import ASK_AGE, FETCH, RETRAIN, TRAIN_ON, UPLOAD, AsyncClient
from fedemu.common.algorithms.tasks import codec_for
from fedemu.common.messages import (
    AgeReply, AgeRequest, AsyncStart, AsyncStop, Cancel, CheckIn, FetchRequest, ModelReply, RetryDue, TaskDone,
    TaskStart, TrainAgain, TrainReply, TrainRequest, Upload, retry_wait, update_problem,
)
from fedemu.common.ml import cohort, models, training
from fedemu.common.ml.compression import UpdateCodec, update_seed
from fedemu.common.ml.data import Data
from fedemu.common.ml.devices import ComputeModel
from fedemu.common.ml.models import ModelSpec
from fedemu.common.ml.structured import compressed_client_update
from fedemu.common.stragglers import StragglerGroups, StragglerSpec
from fedemu.node import Behaviour, BehaviourProcess, Message, Pid, streams

from .cohorts import CohortTrainer, Failed, Job, TrainAlone
from .node_sums import KeptUpdates

log = logging.getLogger("fedemu.worker")


def client_generator(seed: int, round_: int, client: int) -> torch.Generator:
    """The shuffling RNG of one client in one round (or its n-th asynchronous update),
    independent of thread timing."""
    return torch.Generator().manual_seed(streams.seed64(seed, "shuffle", client, round_))


class ModelCache(threading.local):
    """One model instance per pool thread, on the node's device: weights are loaded into it
    per request."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.device = device

    def get(self, spec: ModelSpec) -> torch.nn.Module:
        built = self.__dict__.setdefault("models", {})
        if spec not in built:
            built[spec] = spec.build(device=self.device)
        return built[spec]


class Client(Behaviour):
    """One emulated client. Synchronous algorithms send it a TrainRequest per round;
    asynchronous ones an AsyncStart, after which it loops on its own (it then holds its
    local model w_k and age a_k between messages)."""

    def __init__(self, client_id: int, indices: np.ndarray, data: Data, model: ModelSpec, cache: ModelCache,
                 stragglers: StragglerSpec | StragglerGroups = StragglerSpec(), compute: ComputeModel = ComputeModel(),
                 anchors: ModelCache | None = None, kept: KeptUpdates | None = None,
                 trainer: CohortTrainer | None = None):
        self.client_id = client_id
        self.kept = kept  # the node's kept updates (aggregation on the nodes)
        self.trainer = trainer  # the node's cohort trainer (run.cohort = "auto")
        self.indices = indices
        self.data = data
        self.model = model
        self._cache = cache
        self._anchors = anchors or ModelCache(cache.device)  # FSVRG holds w_t fixed beside the model it updates
        self.stragglers = stragglers
        self.compute = compute  # what local work costs in emulated time (devices.py)
        self.iterations = 0  # local SGD steps over the client's life (Keras-style decay)
        self.task_state: dict = {}  # a local task's state between rounds (common.algorithms.tasks.TaskInput.state)
        self._async: AsyncStart | None = None
        self._policy: AsyncClient | None = None  # the rule's client half, from the AsyncStart
        self._server: Pid | None = None
        self._task_server: Pid | None = None  # who starts this client's tasks (algorithm.concurrency)
        self._weights: np.ndarray | None = None  # w_k, asynchronous rules only
        self._age = 0
        self._base: np.ndarray | None = None  # the last model received: deltas are taken from it
        self._bases = 0  # the server's number of that model; names the base of an upload
        self._request_id = 0  # ids of this process's requests, increasing
        self._pending: AgeRequest | FetchRequest | Upload | None = None  # the request awaiting its reply
        self._held_replies: dict = {}  # round -> the held-back TrainReply's timer (a slow device)
        self._retry_timer = None  # the pending request's RetryDue, cancelled when it is answered
        self.retries = 0  # requests resent for want of a reply
        self._resends = 0  # of the pending request: each further wait for its reply is longer
        self.trainings_stopped = 0  # local updates cut short: the device went offline, or a Cancel came
        self._closed_rounds: set[int] = set()  # rounds a Cancel said closed without this client
        self._stopped = False  # asynchronous: the last local update was lost; redo it when back online
        self._untrained: np.ndarray | None = None  # w_k before the local update in progress
        self._send_timer = None  # a request held back for a slow device's extra compute time
        self.stale_replies = 0  # replies ignored: duplicates, or answers to an earlier request
        self._updates = 0  # local updates run in asynchronous mode (its "round" counter)
        self._trainings = 0  # local updates since the base (CO-OP: more than one when over-active)
        self._encoded: dict | None = None  # a structured training's exact encoding of the delta
        self._loss = 0.0
        self._measured = (0.0, 0.0)  # the last local update's wall and CPU seconds
        self._span: tuple[float | None, float | None] = (None, None)  # its emulated start and end (CO-OP)

    def handle(self, proc: BehaviourProcess, msg: Message) -> None:
        body = msg.body
        if isinstance(body, TrainRequest):
            self._train_request(proc, msg.sender, body)
        elif isinstance(body, TrainAlone):
            job = body.job
            if job.request is not None:
                self._train_request(proc, job.sender, job.request, started=job.started, deferred=job)
            elif not job.cancelled():
                self._update_alone(proc, self._offline_since(proc), job.started)
        elif isinstance(body, Failed):
            raise body.error
        elif isinstance(body, Cancel):
            # A job of that round may still wait at the node's trainer: it checks this.
            self._closed_rounds.add(body.round)
            held = self._held_replies.pop(body.round, None)
            if held is not None:
                held.cancel()
                log.info("client %d: round %d closed without it; its held reply is not sent", self.client_id,
                         body.round)
        elif isinstance(body, AsyncStart):
            if self._async is not None or (isinstance(body, TaskStart) and body.model <= self._bases):
                # The server resends it until it hears from us; a task's start may also come
                # again after the task ended (its number is not new then).
                log.debug("client %d has started already; ignores a repeated AsyncStart", self.client_id)
                return
            self._async, self._server = body, msg.sender
            self._policy = self._policy_for(body)
            if isinstance(body, TaskStart):
                self._task_server = msg.sender
            self._new_base(body.weights, body.age, body.model)
            self._train_async(proc)
        elif isinstance(body, TaskDone):
            if self._async is not None and (body.request == 0 or self._answers(body.request, Upload, body)):
                self._end_task(body.reason)
        elif isinstance(body, TrainAgain) and self._async is not None:
            self._train_async(proc)
        elif isinstance(body, RetryDue) and self._async is not None:
            self._retry(proc, body.request)
        elif isinstance(body, AgeReply) and self._async is not None:
            if self._answers(body.request, AgeRequest, body):
                self._act(proc, self._policy.on_age(body.age, self._age))
        elif isinstance(body, ModelReply) and self._async is not None:
            if self._answers(body.request, (FetchRequest, Upload), body):
                self._new_base(body.weights, body.age, body.model)
                self._train_async(proc)
        elif isinstance(body, AsyncStop):
            proc.stop()
        else:
            log.warning("client %d ignores %r from %s", self.client_id, type(body).__name__, msg.sender)

    def _end_task(self, reason: str) -> None:
        """A task is over (algorithm.concurrency): drop the work and wait for a new start."""
        for timer in (self._retry_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._async, self._pending, self._retry_timer, self._send_timer = None, None, None, None
        self._weights = self._base = self._untrained = None
        self._stopped = False
        log.debug("client %d: task over (%s)", self.client_id, reason)

    # --- the device going offline and coming back -------------------------------------------

    def link_changed(self, proc: BehaviourProcess, offline: bool) -> None:
        """Training stops at its next step once the device is offline (see _offline_since);
        a reply held back for a slow device is never sent (send_after's unless_offline).
        Asynchronous rules pick up where they were when the device is back."""
        log.debug("client %d is %s", self.client_id, "offline" if offline else "back online")
        if not offline and self._task_server is not None:  # available for a task again
            proc.send(self._task_server, CheckIn(self.client_id))
        if self._async is None:
            return
        if offline:
            if self._send_timer is not None and self._send_timer.cancel():
                self._lose_local_update("while its slower device was still computing")
        elif self._stopped:
            self._stopped = False
            self._train_async(proc)
        elif self._pending is not None:  # reconnected: no need to wait for the retry timer
            log.info("client %d is back online and resends %s %d", self.client_id, type(self._pending).__name__,
                     self._pending.request)
            self._resend(proc, backoff=False)  # the silence was the device's, not a congested server's

    @staticmethod
    def _offline_since(proc: BehaviourProcess):
        """True once the device has been offline at any time since this call."""
        count = proc.offline_count
        return lambda: proc.offline or proc.offline_count != count

    def _lose_local_update(self, when: str) -> None:
        self.trainings_stopped += 1
        self._stopped = True
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        self._pending, self._retry_timer, self._send_timer = None, None, None
        self._weights, self._encoded = self._untrained, None
        self._trainings -= 1
        log.info("client %d went offline %s: local update %d lost; it trains again when back online",
                 self.client_id, when, self._updates)

    # --- synchronous rounds ---------------------------------------------------------------

    def _train_request(self, proc: BehaviourProcess, sender: Pid, request: TrainRequest,
                       started: float | None = None, deferred: Job | None = None) -> None:
        """``started``: given for a request its node's trainer handed back to train alone
        (when it arrived, emulated); else now. ``deferred``: that job, if the trainer
        held it (it trains as at its arrival, and its reply goes as client._send_reply says)."""
        alone = started is not None
        if deferred is not None and deferred.due is not None:
            reply, hold = self._run_task(request)
            self._send_reply(proc, sender, request, reply, hold, started, deferred)
            return
        went_offline = self._offline_since(proc)
        if started is None:
            started = proc.now()  # emulated: the local work's span goes into the run's timeline

        def cancels_this_round(body: object) -> bool:
            return isinstance(body, Cancel) and body.round == request.round

        def cancelled() -> bool:  # over-selected, and the round closed without this client
            return request.round in self._closed_rounds or proc.has_message(cancels_this_round)

        def unwanted() -> bool:
            return went_offline() or cancelled()

        task = tasks.get(request.task)
        if not alone and self.trainer is not None and self.trainer.takes(task, self, request):
            # Trained with the node's other clients of this instant (worker/cohorts.py),
            # which finishes it through cohort_done.
            self.trainer.submit(Job(self, proc, sender, request, went_offline, cancelled, started))
            return
        try:
            with training.stop_when(unwanted):
                reply, hold = self._run_task(request)
                if went_offline():
                    raise training.TrainingStopped
        except training.TrainingStopped:
            self._stopped_training(request, cancelled())
            return
        self._send_reply(proc, sender, request, reply, hold, started)

    def _stopped_training(self, request: TrainRequest, cancelled: bool) -> None:
        self.trainings_stopped += 1
        log.info("client %d stops round %d's training and sends nothing: %s", self.client_id, request.round,
                 "the round closed without it" if cancelled else "it went offline")

    def _send_reply(self, proc: BehaviourProcess, sender: Pid, request: TrainRequest, reply: TrainReply,
                    hold: float, started: float, job: Job | None = None) -> None:
        """``started``: the emulated instant the request arrived (the local work's span
        goes into the run's timeline). ``job``: a job its node's trainer deferred
        (worker/cohorts.py), finished now as at its arrival: its reply goes at the
        instant it was due from then, or not at all if it was cancelled or its device
        went offline since (as the reply held from then would have been)."""
        if (request.keep_at_node and reply.update is not None and self.kept is not None
                and update_problem(reply.update, request.weights.size) is None):
            self.kept.keep(reply)  # (an unfit update goes to the server whole: it refuses it, naming why)
        if job is None:
            reply.started_s, reply.ended_s = started, proc.now() + hold
            # The device's compute time (modelled, or what real time has not covered yet).
            held = proc.send_after(hold, sender, reply, unless_offline=True)
        else:
            reply.started_s, reply.ended_s = started, job.due
            held = None
            if job.cancelled():
                log.info("client %d: round %d closed without it; its held reply is not sent", self.client_id,
                         request.round)
            elif job.went_offline():
                log.info("client %d: its device went offline before its round %d reply was due; the reply is lost",
                         self.client_id, request.round)
            else:
                held = proc.send_at(job.due, sender, reply, unless_offline=True)
        self._held_replies = {request.round: held} if held is not None else {}  # only the latest can be due

    def cohort_done(self, job: Job, task: type[tasks.LocalTask], output: tasks.TaskOutput | None,
                    measured_s: float, cpu_s: float) -> None:
        """The node's trainer has run this client's job in a cohort: ``output`` is what its
        task gave it (None: its stop condition turned true), ``measured_s`` and ``cpu_s``
        its share of the computation. Finished as _train_request finishes its own."""
        if output is None or (job.due is None and job.unwanted()):
            self._stopped_training(job.request, job.cancelled())
            return
        reply, hold = self._reply(task, job.request, tasks.checked(task, output), measured_s, cpu_s)
        self._send_reply(job.proc, job.sender, job.request, reply, hold, job.started,
                         job if job.due is not None else None)

    def reply_due(self, task: type[tasks.LocalTask], job: Job) -> float:
        """When ``job``'s reply is due: its arrival plus its device's time, known before it
        trains where that time is modelled (``compute.known_in_advance``)."""
        return job.started + self._times_of(task, job.request, 0.0, 0.0)[1]

    def task_input(self, task: type[tasks.LocalTask], request: TrainRequest, model: torch.nn.Module
                   ) -> tasks.TaskInput:
        """What ``task`` works with for ``request`` (the weights are loaded by the caller)."""
        x, y = self._data()
        return tasks.TaskInput(
            model=model, model_spec=self.model, x=x, y=y, request=request,
            generator=client_generator(request.seed, request.round, self.client_id), dataset=self.data.dataset,
            client=self.client_id, iterations=self.iterations, state=self.task_state,
            anchor=self._anchors.get(self.model) if task.needs_anchor else None)

    def _run_task(self, request: TrainRequest) -> tuple[TrainReply, float]:
        """The local work a request asks for (common.algorithms.tasks), and how long to hold its reply back."""
        started, started_cpu = time.perf_counter(), time.thread_time()  # wall: measured compute
        task = tasks.get(request.task)
        model = self._cache.get(self.model)
        models.set_flat(model, request.weights)
        result = tasks.checked(task, task().run(self.task_input(task, request, model)))
        measured_s, cpu_s = time.perf_counter() - started, time.thread_time() - started_cpu  # wall
        return self._reply(task, request, result, measured_s, cpu_s)

    def _reply(self, task: type[tasks.LocalTask], request: TrainRequest, result: tasks.TaskOutput,
               measured_s: float, cpu_s: float) -> tuple[TrainReply, float]:
        """The reply to ``request`` carrying ``result``, and how long to hold it back."""
        self.iterations += result.steps
        compute_s, hold, slowdown = self._times_of(task, request, measured_s, cpu_s)
        reply = TrainReply(
            round=request.round, client=self.client_id, task=request.task, update=result.update,
            num_samples=len(self.indices), train_loss=float(result.loss), compute_s=compute_s, slowdown=slowdown,
            encoded=result.encoded, extra=result.extra or None,
        )
        return reply, hold

    def _times_of(self, task: type[tasks.LocalTask], request: TrainRequest, measured_s: float, cpu_s: float
                  ) -> tuple[float, float, float]:
        """(compute seconds, emulated seconds to hold the reply back, straggler factor)."""
        slowdown = self.stragglers.slowdown(self.client_id, request.round)
        if self._cache.device.type != "cpu":
            cpu_s = measured_s  # the GPU's time: the update is on the host already, so its kernels are done
        compute_s, hold = self.compute.times(self.model, task.example_passes(request, len(self.indices)), slowdown,
                                             measured_s, cpu_s, self.client_id)
        return compute_s, hold, slowdown

    def _data(self) -> tuple[np.ndarray, np.ndarray]:
        indices = np.asarray(self.indices)  # a sampled share is drawn here, when the client trains
        return self.data.train_x[indices], self.data.train_y[indices]

    # --- asynchronous rules ---------------------------------------------------------------------

    def _new_base(self, weights: np.ndarray, age: int, model: int) -> None:
        self._weights, self._age, self._base = weights.copy(), age, weights
        self._bases = model  # the server's number, not a count: a lost reply cannot skew it
        self._trainings, self._encoded = 0, None

    # --- requests: resent until answered; the server answers a repeat without acting twice ---

    def _request(self, proc: BehaviourProcess, request: AgeRequest | FetchRequest | Upload, hold: float = 0.0) -> None:
        self._request_id += 1
        request.request = self._request_id
        self._pending, self._resends = request, 0
        self._send_timer = proc.send_after(hold, self._server, request, unless_offline=True)
        self._arm(proc, hold)

    def _arm(self, proc: BehaviourProcess, hold: float) -> None:
        if self._async.retry_s > 0:
            wait = retry_wait(self._async.retry_s, self._resends)
            self._retry_timer = proc.send_after(hold + wait, proc.pid, RetryDue(self._pending.request))

    def _retry(self, proc: BehaviourProcess, request: int) -> None:
        pending = self._pending
        if pending is None or pending.request != request:
            return  # answered in time
        if proc.offline:  # nothing can leave the device now; it resends when back online
            self._arm(proc, 0.0)
            return
        log.info("client %d resends %s %d: no reply within %gs (emulated)", self.client_id, type(pending).__name__,
                 request, retry_wait(self._async.retry_s, self._resends))
        self._resend(proc)

    def _resend(self, proc: BehaviourProcess, backoff: bool = True) -> None:
        self.retries += 1
        self._resends = self._resends + 1 if backoff else 0
        if self._retry_timer is not None:
            self._retry_timer.cancel()
        proc.send(self._server, self._pending)
        self._arm(proc, 0.0)

    def _answers(self, request: int, kinds: type | tuple, reply: object) -> bool:
        """Whether ``reply`` answers the pending request; if so it is no longer pending."""
        pending = self._pending
        if pending is None or pending.request != request or not isinstance(pending, kinds):
            self.stale_replies += 1
            log.debug("client %d ignores %s to request %d (pending: %s)", self.client_id, type(reply).__name__,
                      request, pending and pending.request)
            return False
        self._pending = None
        if self._retry_timer is not None:  # answered: the node need not keep the timer
            self._retry_timer.cancel()
            self._retry_timer = None
        return True

    @property
    def async_compression(self) -> dict | None:
        """The [compression] spec of the asynchronous rule this client runs (None: none)."""
        return self._async.compression

    def _codec(self, model: torch.nn.Module) -> UpdateCodec | None:
        spec = self._async.compression
        return codec_for(self.model, spec, model) if spec else None

    def _base_seed(self) -> int:
        # Per base, not per training: a CO-OP client that trains several times before
        # uploading keeps one mask or basis, so its summed delta stays in that space.
        return update_seed(self._async.seed, self._bases, self.client_id)

    def _train_async(self, proc: BehaviourProcess) -> None:
        went_offline = self._offline_since(proc)
        started = proc.now()  # emulated
        self._untrained = self._weights
        self._updates += 1
        self._trainings += 1
        if self.trainer is not None and self.trainer.takes_async(self):
            # With the node's other clients training now (an asynchronous rule's start).
            start = self._async

            def task_over() -> bool:  # algorithm.concurrency: a TaskDone came while the job waited
                return self._async is not start

            self.trainer.submit(Job(self, proc, self._server, None, went_offline, task_over, started))
            return
        self._update_alone(proc, went_offline, started)

    def _update_alone(self, proc: BehaviourProcess, went_offline, started: float) -> None:
        try:
            with training.stop_when(went_offline):
                self._local_update()
                if went_offline():
                    raise training.TrainingStopped
        except training.TrainingStopped:
            self._lose_local_update("during training")
            return
        self._after_local_update(proc, started)

    def async_member(self, job: Job) -> cohort.Member:
        """This client's local update (``_local_update``) as a cohort's member."""
        start = self._async
        x, y = self._data()
        return cohort.Member(x=x, y=y, start=self._weights, stop=job.went_offline,
                             generator=client_generator(start.seed, self._updates, self.client_id),
                             epochs=start.epochs, batch_size=start.batch_size, lr=start.lr, lr_decay=start.lr_decay,
                             start_iteration=self.iterations)

    def async_done(self, job: Job, result: training.TrainResult | None, measured_s: float, cpu_s: float) -> None:
        """The node's trainer has run this client's local update in a cohort (None: it
        stopped); it goes on as after its own."""
        if job.cancelled():  # its task is over: the work is dropped, as _end_task drops it
            return
        if result is None or job.went_offline():
            self._lose_local_update("during training")
            if not job.proc.offline:
                # Back online already: the comeback was handled while the job waited at the
                # trainer, so nothing else would start the next training.
                self._stopped = False
                self._train_async(job.proc)
            return
        self.iterations += result.steps
        self._weights, self._loss = result.weights, result.train_loss
        self._measured = (measured_s, cpu_s)
        self._after_local_update(job.proc, job.started)

    def _after_local_update(self, proc: BehaviourProcess, started: float) -> None:
        """What follows a local update (begun at ``started``, emulated): what the rule's
        client policy decides, an upload or a question for the server's age (CO-OP)."""
        slowdown = self.stragglers.slowdown(self.client_id, self._updates)
        measured_s, cpu_s = self._measured
        decision = self._policy.after_training()
        if decision == ASK_AGE:  # e.g. CO-OP, Algorithm 3, line 6: ask the server's age first
            _, hold = self._times(slowdown, measured_s, cpu_s)
            self._span = (started, proc.now() + hold)  # its upload, after the age check, carries it
            self._request(proc, AgeRequest(self.client_id, self._age), hold)
            return
        if decision != UPLOAD:
            raise ValueError(f"{type(self._policy).__qualname__}.after_training decided {decision!r}; "
                             f"it may decide {UPLOAD!r} or {ASK_AGE!r}")
        model = self._cache.get(self.model)
        started_wall, started_cpu = time.perf_counter(), time.thread_time()  # wall
        upload = self._upload(model, 0.0, slowdown)
        # Encoding is the client's work too (measured; the device model charges training).
        upload.compute_s, hold = self._times(slowdown, measured_s + time.perf_counter() - started_wall,  # wall
                                             cpu_s + time.thread_time() - started_cpu)
        upload.started_s, upload.ended_s = started, proc.now() + hold
        self._request(proc, upload, hold)

    def _times(self, slowdown: float, measured_s: float, cpu_s: float) -> tuple[float, float]:
        """An asynchronous local update's (compute seconds, hold): E epochs of n_k."""
        return self.compute.times(self.model, self._async.epochs * len(self.indices), slowdown, measured_s, cpu_s,
                                  self.client_id)

    def _local_update(self) -> None:
        """One local update of w_k (E epochs from the current weights); sets _measured."""
        start = self._async
        started, started_cpu = time.perf_counter(), time.thread_time()  # wall
        model = self._cache.get(self.model)
        models.set_flat(model, self._weights)
        x, y = self._data()
        dataset = self.data.dataset
        generator = client_generator(start.seed, self._updates, self.client_id)
        codec = self._codec(model)
        if codec is not None and codec.structured:
            # Train in the restricted space, as FedAvg's clients do.
            result = compressed_client_update(
                model, x, y, codec=codec, seed=self._base_seed(), epochs=start.epochs,
                batch_size=start.batch_size, lr=start.lr, generator=generator, lr_decay=start.lr_decay,
                start_iteration=self.iterations, dataset=dataset)
            weights = models.get_flat(model)
            # Exact for the delta from the base only if this was the first training from it.
            self._encoded = result.encoded if self._trainings == 1 else None
        else:
            result = training.client_update(
                model, x, y, epochs=start.epochs, batch_size=start.batch_size, lr=start.lr,
                generator=generator, lr_decay=start.lr_decay, start_iteration=self.iterations, dataset=dataset)
            weights = result.weights
        self.iterations += result.steps
        self._weights, self._loss = weights, result.train_loss
        self._measured = (time.perf_counter() - started, time.thread_time() - started_cpu)  # wall

    def _upload(self, model: torch.nn.Module, compute_s: float, slowdown: float = 1.0) -> Upload:
        """FedBuff sends the delta from its base; CO-OP and FedAsync their weights. With
        compression every rule sends the delta from the base, encoded: sketching weights
        themselves would be meaningless, and the server holds the base to add it back."""
        is_delta = self._policy.uploads_delta
        codec = self._codec(model)
        update, encoded = None, None
        if codec is not None:
            encoded = self._encoded
            if encoded is None:
                encoded = codec.encode(self._weights - self._base, self._base_seed())
        else:
            update = (self._weights - self._base) if is_delta else self._weights
        return Upload(client=self.client_id, update=update, is_delta=is_delta, age=self._age,
                      num_samples=len(self.indices), train_loss=self._loss, compute_s=compute_s,
                      slowdown=slowdown, base=self._bases, encoded=encoded)

    def _policy_for(self, start: AsyncStart) -> AsyncClient:
        """The client half of the start's rule (a plug-in's is imported here, on the client's host)."""
        rule = algorithms.get(start.rule)
        return rule.client(rule, start.extra or {})

    def _act(self, proc: BehaviourProcess, decision: str) -> None:
        """Carry out the policy's decision once the server said its age."""
        if decision == FETCH:
            self._request(proc, FetchRequest(self.client_id))
        elif decision in (RETRAIN, TRAIN_ON):
            if decision == RETRAIN:
                # The model just trained is thrown away (Nilsson et al.'s CO-OP); the next
                # training starts from the last model received, so its encoding is exact.
                self._weights = self._base.copy()
                self._trainings = 0
            proc.send(proc.pid, TrainAgain())
        elif decision == UPLOAD:
            upload = self._upload(self._cache.get(self.model), compute_s=0.0)
            upload.started_s, upload.ended_s = self._span  # the training that passed the age check
            self._request(proc, upload)
        else:
            raise ValueError(f"{type(self._policy).__qualname__}.on_age decided {decision!r}; it may decide "
                             f"{', '.join(map(repr, (UPLOAD, FETCH, RETRAIN, TRAIN_ON)))}")


# Where these lived before issue 51 gave hosting a node's clients a module of its own.
_MOVED_TO = {"placement": "placement", "warm_up": "hosting", "host_clients": "hosting"}


def __getattr__(name: str):
    if name in _MOVED_TO:
        # lazy: only an old import path gets here
        import importlib
        import warnings

        warnings.warn(f"fedemu.worker.client.{name} has moved to fedemu.worker.{_MOVED_TO[name]}; import it from "
                      "there (the old path will go in a later release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"{__package__}.{_MOVED_TO[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
