"""The server process: what every algorithm's engine shares, and the round engine.

:class:`Engine` finds the clients (worker nodes announce them), watches them (a DOWN
is a lost client), evaluates, applies the budgets (rounds, uploads per client, wall
time, target accuracy) and writes the run log. :class:`RoundEngine` runs synchronous
rounds for FedAvg, FedSGD and FSVRG; ``async_engine.AsyncEngine`` runs CO-OP,
FedAsync and FedBuff.

A round selects m = max(C*K, 1) live clients with the run seed (FSVRG: every live
client), and each of its phases sends them a request and collects until every selected
client answered, was lost, or the deadline passed; what arrived is aggregated if at
least the quorum did, else the model is kept (or, with ``on_quorum_missed =
"extend_once"``, the deadline is extended once by its own length first). With
over-selection, m + ``over_select`` clients are asked and a phase closes as soon as m
replies are in; the rest are recorded as ``discarded`` and sent a ``Cancel``, so a
slow device does not upload a reply nobody waits for. A client that never answers
cannot hang a round, and a run whose live clients fall below the quorum stops with a ``deadlock``
event that names the cause instead of waiting forever.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from fedemu.common.algorithms import tasks
from fedemu.common.algorithms.base import aggregation_problem
from fedemu.common.algorithms.rounds import Replies, Strategy, selected_per_round
from fedemu.common.messages import (Cancel, SumReply, SumRequest, TrainReply, TrainRequest, WorkerReady,
                                    as_pid_map, update_problem)
from fedemu.common.ml import models, training
from fedemu.common.ml.compression import make_codec, parameter_shapes, update_seed
from fedemu.common.ml.data import Data
from fedemu.common.ml.models import ModelSpec
from fedemu.common.stragglers import StragglerGroups, StragglerSpec
from fedemu.node import TIMEOUT, Down, NodeError, Pid, Stalled, ThreadProcess, message, streams

from .outcome import NodeExits, losses, nothing_aggregated
from .runlog import CLIENTS, RunLog, RunLogError
from .timeline import CLIENT_COLUMNS, OUTCOMES, ClientRound, Facts, Timeline

log = logging.getLogger("fedemu.server")

# Broker counters a round event reports as the difference over that round.
TRAFFIC_KEYS = ("bytes_up", "bytes_down", "msgs_up", "msgs_down", "lost_up", "lost_down",
                "transfer_s_up", "transfer_s_down", "wire_bytes_up", "wire_bytes_down",
                "retransmitted_bytes_up", "retransmitted_bytes_down")


@message
class Stop:
    """Asks the server to end the run now (Ctrl-C, or its node lost the broker)."""

    status: str  # "interrupted" or "failed"
    reason: str


@dataclass
class Settings:
    clients: int  # K
    seed: int
    rounds: int  # round limit; for asynchronous rules, evaluation points
    epochs: int = 1
    batch_size: int = 10  # 0: the full local set
    C: float = 0.1
    deadline_s: float = 60.0  # emulated seconds; 0: no deadline (wait for every answer)
    quorum: int = 1
    eval_every: int = 1  # rounds; asynchronous rules: uploads per evaluation
    target_accuracy: float = 0.0  # 0: no target
    max_uploads_per_client: float = 0.0  # Nilsson's budget; 0: none
    max_wall_s: float = 0.0  # 0: none
    progress_timeout_s: float = 300.0  # the watchdog reports a run that long without aggregation
    workers: int = 1
    startup_timeout_s: float = 120.0
    time_scale: float = 1.0  # emulated seconds per wall second (wall clock)
    clock: str = "wall"  # or "virtual": the broker's discrete-event clock
    compression: dict | None = None  # updates travel encoded (CompressionSpec.to_dict())
    over_select: int = 0  # extra clients selected beyond m; the first m replies count
    on_quorum_missed: str = "skip"  # or "extend_once"
    retry_s: float = 120.0  # asynchronous rules: emulated seconds without a reply before a resend
    merge_s: float = 0.0  # asynchronous rules: emulated seconds the server takes per fetch or upload (a queue)
    client_log: str = "auto"  # per-client detail: "events", "csv", or "auto" (see CLIENT_LOGS)
    device: str = "cpu"  # the torch device the server evaluates on (run.device as this host resolved it)
    aggregation: str = "server"  # or "nodes": each worker node sums its clients' updates (worker/node_sums.py)
    timeline: str = "all"  # or "off": no timeline.csv (the ground truth in events and clients.csv stays)
    # The clients' straggler factors, as the worker nodes draw them: the round event gives
    # each selected client's, whether or not its reply came.
    stragglers: StragglerSpec | StragglerGroups = field(default_factory=StragglerSpec)
    # Wall seconds to wait for the launcher's word on how a lost worker node's process ended
    # (outcome.NodeExits); 0: nobody gives it.
    node_exit_wait_s: float = 0.0
    traces: dict | None = None  # the run's trace files and their sha256, by trace name (population.json)

    @property
    def per_round(self) -> int:
        return selected_per_round(self.C, self.clients)


@dataclass
class _Totals:
    bytes_up: int = 0
    bytes_down: int = 0
    rounds: int = 0
    uploads: int = 0
    aggregations: int = 0  # model updates applied: rounds that aggregated, or merges
    asked: set = field(default_factory=set)  # clients ever asked to train (or started)
    straggled: int = 0  # replies past a deadline, over all rounds
    accuracy: float | None = None
    best_accuracy: float | None = None
    reached_target_round: int | None = None
    faults: list = field(default_factory=list)


class Engine:
    algorithm = ""
    synchronous = True

    def __init__(self, settings: Settings, model: ModelSpec, data: Data, runlog: RunLog):
        self.settings = settings
        self.model = model.build(seed=settings.seed, device=settings.device)  # the global model's initial weights
        self.weights = models.get_flat(self.model)
        self.codec = (make_codec(settings.compression, parameter_shapes(self.model))
                      if settings.compression else None)
        self.data = data
        self.runlog = runlog
        self.node_exits = NodeExits(runlog.run_dir, settings.node_exit_wait_s)
        self.pids: dict[int, Pid] = {}
        self.sums: dict[str, Pid] = {}  # worker node -> its NodeSums (aggregation on the nodes)
        self.client_of: dict[Pid, int] = {}
        self.live: set[int] = set()
        self.totals = _Totals()
        self._started = time.monotonic()  # wall
        self._clock_started: float | None = None  # emulated time when the run's clock started
        self._traffic: dict | None = None
        self._divergence_hinted = False
        self.timeline = Timeline(runlog, write=settings.timeline != "off")

    def _decoded_delta(self, encoded: dict, seed_index: int, client: int, event_round: int,
                       unusable: str | None = None) -> np.ndarray | None:
        """An encoded update's delta, decoded with the seed the client encoded it with
        (run seed, ``seed_index``, client); None, after a ``fault`` event, if it does not
        decode or the caller found it ``unusable`` (the reason)."""
        try:
            if self.codec is None:
                raise ValueError("this run does not compress, but the update is encoded")
            if unusable:
                raise ValueError(unusable)
            return self.codec.decode(encoded, update_seed(self.settings.seed, seed_index, client))
        except ValueError as exc:
            self._refuse_update(client, event_round, f"undecodable update: {exc}")
            return None

    def _refuse_update(self, client: int, event_round: int, reason: str, lr: float | None = None) -> None:
        """An update that must not touch the model: a ``fault`` event of its client,
        counted in the summary's faults. The first that training diverged (NaN or
        infinite values) also gets a ``hint`` naming the learning rate."""
        log.error("client %d's update refused: %s", client, reason)
        self.totals.faults.append(self.runlog.event("fault", round=event_round, client=client,
                                                    reason=f"update refused: {reason}"))
        if "NaN or infinite" in reason and not self._divergence_hinted:
            self._divergence_hinted = True
            message = (f"client {client}'s update in round {event_round} held NaN or infinite values: its training "
                       "diverged, and every such update is refused" + (f"; a smaller algorithm.lr (now {lr:g}) may "
                                                                        "help" if lr is not None else ""))
            log.warning("%s", message)
            self.runlog.event("hint", round=event_round, message=message)

    def _usable(self, update: object, client: int, event_round: int, lr: float | None = None) -> bool:
        """Whether a received update fits the model (protocol.update_problem); if not, it is
        refused, naming why (_refuse_update)."""
        problem = update_problem(update, self.weights.size)
        if problem is not None:
            self._refuse_update(client, event_round, problem, lr)
        return problem is None

    def _ready_from(self, msg) -> WorkerReady | None:
        """A WorkerReady, if its sender speaks for the node it names and every client pid
        it lists lives there (a worker node's own report); else None, logged."""
        ready = msg.body
        entries = ready.clients if isinstance(ready.clients, list) else None
        if (msg.sender.node == ready.node and entries is not None
                and all(isinstance(e, (list, tuple)) and len(e) == 2 and type(e[0]) is int and isinstance(e[1], Pid)
                        and e[1].node == ready.node for e in entries)
                and (ready.sums is None or (isinstance(ready.sums, Pid) and ready.sums.node == ready.node))):
            return ready
        log.warning("ignoring a WorkerReady for node %r from %s: not that node's own report", ready.node, msg.sender)
        return None

    # --- the server process ---------------------------------------------------------

    def run(self, proc: ThreadProcess) -> dict:
        status, reason = "completed", ""
        try:
            self._await_workers(proc)
            status, reason = self.main(proc)
        except _Stopped as stop:
            status, reason = stop.status, stop.reason
        except RunLogError as exc:  # a full disk, say: the run cannot record anything more
            log.error("%s; ending the run", exc)
            status, reason = "failed", str(exc)
        except Exception as exc:
            status, reason = self._failure(proc, exc)
        if not self.totals.aggregations and status == "completed":
            status, reason = nothing_aggregated(reason, self.totals.asked, self.totals.faults,
                                                self._what_became_of_the_replies())
        if self.runlog.failed is None:
            self._last_of_the_timeline(proc)
            try:
                self.runlog.event("end", status=status, reason=reason, rounds=self.totals.rounds,
                                  uploads=self.totals.uploads, aggregations=self.totals.aggregations,
                                  **({} if self.synchronous else {"evaluations": self.totals.rounds}))
            except RunLogError as exc:
                log.error("%s", exc)
                if status == "completed":
                    status, reason = "failed", str(exc)
        return self.runlog.summary(
            status=status,
            reason=reason,
            algorithm=self.algorithm,
            clock=self.settings.clock,
            emulated_s=round(proc.now() - self._clock_started, 6) if self._clock_started is not None else 0.0,
            # The final model's fingerprint: in virtual time, the same config and seed give
            # the same hash on any host, load or placement.
            weights_sha256=hashlib.sha256(np.ascontiguousarray(self.weights, dtype=np.float32).tobytes()).hexdigest(),
            rounds=self.totals.rounds,
            uploads=self.totals.uploads,
            aggregations=self.totals.aggregations,  # 0: the final model is the initial one
            final_accuracy=self.totals.accuracy,
            best_accuracy=self.totals.best_accuracy,
            target_accuracy=self.settings.target_accuracy or None,
            reached_target_round=self.totals.reached_target_round,
            bytes_up=self.totals.bytes_up,
            bytes_down=self.totals.bytes_down,
            faults=len(self.totals.faults),
        )

    def _last_of_the_timeline(self, proc: ThreadProcess) -> None:
        """What happened since the last round's take (a run stopped mid-round), into
        timeline.csv; nothing if the broker cannot answer any more."""
        try:
            if self._clock_started is not None and _broker_lost(proc) is None:
                self.timeline.take(proc.node.broker_stats(timeline=True), self.totals.rounds + 1)
            self.timeline.flush()
        except (NodeError, RunLogError, OSError, AttributeError) as exc:  # AttributeError: a stand-in process
            log.info("the timeline's last rows are not written: %s", exc)

    def _failure(self, proc: ThreadProcess, exc: Exception) -> tuple[str, str]:
        """Why the run ends with ``exc``: a stop asked for meanwhile (the launcher died,
        and the broker with it), a lost broker (what a call to it that timed out means),
        or the error itself."""
        if isinstance(exc, NodeError) and _broker_lost(proc) is None:
            # If the broker is gone, the node's heartbeats say so within their timeout.
            proc.node.closed.wait(proc.node.heartbeat_timeout + 1.0)
        stop = _pending_stop(proc)
        if stop is not None:
            return stop.status, stop.reason
        if _broker_lost(proc) is not None:  # the cause, not what it broke (a stats call)
            return "failed", f"lost the broker: {_broker_lost(proc)}"
        log.exception("server failed")
        return "failed", f"{type(exc).__name__}: {exc}"

    def main(self, proc: ThreadProcess) -> tuple[str, str]:
        raise NotImplementedError

    def waiting_for(self) -> str:
        """What the server is waiting for, in words (for a deadlock's cause)."""
        raise NotImplementedError

    def _what_became_of_the_replies(self) -> str:
        """For a run that aggregated nothing: what its clients' replies came to."""
        t = self.totals
        return (f"{t.uploads:,} replies in time, {t.straggled:,} after the deadline, {len(t.faults):,} clients lost, "
                f"over {t.rounds:,} rounds")

    def _every_client_lost(self) -> str:
        """The reason of a run that has no client left."""
        return f"every client is lost: {losses(self.totals.faults)}"

    def _await_workers(self, proc: ThreadProcess) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s  # wall: real processes starting
        ready_nodes: dict[str, int] = {}
        while len(ready_nodes) < self.settings.workers:
            # In slices: a worker node that died starting (out of memory, say) ends the wait.
            msg = self._receive(proc, (WorkerReady,), wall_timeout=min(0.5, deadline - time.monotonic()))  # wall
            if msg is TIMEOUT and time.monotonic() < deadline:  # wall
                gone = self.node_exits.gone([f"worker-{i}" for i in range(self.settings.workers)
                                             if f"worker-{i}" not in ready_nodes])
                if gone is not None:
                    raise _Stopped("failed", f"worker node {gone[0]} ended before it reported ({gone[1]})")
                continue
            if msg is TIMEOUT:
                raise _Stopped("failed", (
                    f"only {len(ready_nodes)} of {self.settings.workers} worker nodes reported "
                    f"within {self.settings.startup_timeout_s:.0f}s: {sorted(ready_nodes) or 'none'}"))
            ready = self._ready_from(msg)
            if ready is None:
                continue
            hosted = as_pid_map(ready.clients)
            for k, pid in hosted.items():
                self.pids[k] = pid
                self.client_of[pid] = k
            if ready.sums is not None and self.settings.aggregation == "nodes":
                self.sums[ready.node] = ready.sums
                proc.monitor(ready.sums)  # its node lost: the updates it kept are lost with it
            proc.monitor_many(list(hosted.values()))  # one control message to the node, not one per client
            ready_nodes[ready.node] = len(ready.clients)
        missing = set(range(self.settings.clients)) - set(self.pids)
        if missing:
            raise _Stopped("failed", f"{len(missing)} clients were never hosted, e.g. {sorted(missing)[:5]}")
        self.live = set(self.pids)
        self._started = time.monotonic()  # wall
        proc.node.start_clock()  # emulated time runs from here (virtual time: it stood at 0 until now)
        self._clock_started = proc.now()
        self._traffic = proc.node.broker_stats(timeline=True)
        self.timeline.take(self._traffic, 0)  # devices offline from the start, say
        self.runlog.event("start", emulated_s=self._traffic["emulated_s"], clients=len(self.pids), placement=dict(sorted(ready_nodes.items())), algorithm=self.algorithm,
                          per_round=self.settings.per_round, time_scale=self.settings.time_scale,
                          clock=self.settings.clock,
                          dataset=self.data.name, test_samples=len(self.data.test_y),
                          **({"eval_every_uploads": self.settings.eval_every} if not self.synchronous else {}),
                          **({"traces": self.settings.traces} if self.settings.traces else {}))
        self.timeline.flush()

    def _receive(self, proc: ThreadProcess, kinds: tuple, timeout: float | None = None,
                 wall_timeout: float | None = None):
        """Receive one of ``kinds`` within ``timeout`` emulated or ``wall_timeout`` real
        seconds. A Stop message ends the run from any wait; in virtual time, so does the
        broker's word that nothing can ever happen again (a deadlock, named)."""
        msg = proc.receive((*kinds, Stop, Stalled), timeout=None if timeout is None else max(timeout, 0.0),
                           wall_timeout=None if wall_timeout is None else max(wall_timeout, 0.0))
        if msg is not TIMEOUT and isinstance(msg.body, Stop):
            raise _Stopped(msg.body.status, msg.body.reason)
        if msg is not TIMEOUT and isinstance(msg.body, Stalled):
            cause = (f"the run is quiescent with nothing pending (no message in flight, no timer, no scheduled "
                     f"change) while the server waits for {self.waiting_for()}")
            self.runlog.event("deadlock", round=self.totals.rounds, cause=cause, emulated_s=msg.body.now)
            raise _Stopped("failed", f"deadlock: {cause}")
        return msg

    def _client_down(self, proc: ThreadProcess, down: Down, round_: int) -> int | None:
        if _broker_lost(proc) is not None:
            # Every remote process looks DOWN when the broker is gone: the run is lost, not
            # its clients. A stop asked for first (the launcher died, and the broker with it)
            # is the cause.
            stop = _pending_stop(proc)
            if stop is not None:
                raise _Stopped(stop.status, stop.reason)
            raise _Stopped("failed", f"lost the broker: {_broker_lost(proc)}")
        k = self.client_of.get(down.pid)
        if k is None or k not in self.live or self.pids[k] != down.pid:  # not the client's current pid
            return None
        self.live.discard(k)
        reason = self.node_exits.reason(down.reason, down.pid.node)
        # A lost node's clients come as a burst of DOWNs: one fsync for the burst.
        more = getattr(proc, "has_message", None) is not None and proc.has_message(Down)
        fault = self.runlog.event("fault", sync=not more, round=round_, client=k, pid=str(down.pid), reason=reason)
        self.totals.faults.append(fault)
        log.warning("client %d lost in round %d: %s", k, round_, reason)
        return k

    def _rejoin(self, proc: ThreadProcess, msg, round_: int) -> list[int]:
        """A worker node's supervisor restarted crashed clients (``msg``: its WorkerReady):
        watch their new pids and let them be selected again."""
        ready = self._ready_from(msg)
        if ready is None:
            return []
        restarted = []
        for k, pid in as_pid_map(ready.clients).items():
            if not 0 <= k < self.settings.clients:
                log.warning("node %s reported unknown client %d; ignored", ready.node, k)
                continue
            self.pids[k] = pid
            self.client_of[pid] = k
            proc.monitor(pid)
            self.live.add(k)
            self.runlog.event("restart", round=round_, client=k, pid=str(pid), node=ready.node)
            restarted.append(k)
        return restarted

    def _rejoin_waiting(self, proc: ThreadProcess, round_: int) -> None:
        """Take in every restart reported since the last look, without waiting."""
        while (msg := self._receive(proc, (WorkerReady,), 0)) is not TIMEOUT:
            self._rejoin(proc, msg, round_)

    def _evaluate(self) -> tuple[float, float]:
        models.set_flat(self.model, self.weights)
        return training.evaluate(self.model, self.data.test_x, self.data.test_y, dataset=self.data.dataset)

    def _traffic_since_last(self, proc: ThreadProcess, round_: int) -> tuple[dict, dict, Facts]:
        """(this period's broker counters, the broker's current view, the timeline's facts
        of the period: taken from the broker, which then forgets them)."""
        after = proc.node.broker_stats(timeline=True)
        before, self._traffic = self._traffic, after
        traffic = {key: after[key] - before[key] for key in TRAFFIC_KEYS}
        self.totals.bytes_up += traffic["bytes_up"]
        self.totals.bytes_down += traffic["bytes_down"]
        return traffic, after, self.timeline.take(after, round_)

    def _record(self, round_: int, accuracy: float | None) -> None:
        t = self.totals
        t.rounds = round_
        if accuracy is not None:
            t.accuracy = accuracy
            t.best_accuracy = accuracy if t.best_accuracy is None else max(t.best_accuracy, accuracy)
            target = self.settings.target_accuracy
            if target and accuracy >= target and t.reached_target_round is None:
                t.reached_target_round = round_

    def _finished(self, round_: int, accuracy: float | None) -> str | None:
        """Why the run ends after this round/evaluation, or None to go on."""
        s = self.settings
        if accuracy is not None and s.target_accuracy and accuracy >= s.target_accuracy:
            return f"reached target accuracy {s.target_accuracy} in round {round_}"
        if s.max_uploads_per_client and self.totals.uploads >= s.max_uploads_per_client * s.clients:
            return f"upload budget spent: {self.totals.uploads} uploads ({s.max_uploads_per_client:g} per client)"
        if s.max_wall_s and time.monotonic() - self._started >= s.max_wall_s:  # wall
            return f"wall-time budget of {s.max_wall_s:g}s spent"
        if round_ >= s.rounds:
            return f"ran {s.rounds} rounds"
        return None


class RoundEngine(Engine):
    def __init__(self, settings: Settings, strategy: Strategy, model: ModelSpec, data: Data, runlog: RunLog):
        super().__init__(settings, model, data, runlog)
        self.strategy = strategy
        strategy.population = settings.clients
        self.algorithm = strategy.name
        self.over_select, self.on_quorum_missed = settings.over_select, settings.on_quorum_missed
        if self.on_quorum_missed not in QUORUM_POLICIES:
            raise ValueError(f"on_quorum_missed = {self.on_quorum_missed!r}; use {' or '.join(QUORUM_POLICIES)}")
        if self.over_select and strategy.selects_all:
            raise ValueError(f"{strategy.name} selects every client: over_select does not apply")
        problem = aggregation_problem(settings.aggregation, strategy, settings.compression)
        if problem:
            raise ValueError(problem)
        self.at_nodes = settings.aggregation == "nodes"
        self._deadline_hinted = False

    def main(self, proc: ThreadProcess) -> tuple[str, str]:
        s = self.settings
        for round_ in range(1, s.rounds + 1):
            self._rejoin_waiting(proc, round_)
            if len(self.live) < s.quorum:
                cause = (f"{len(self.live)} live clients, fewer than the quorum of {s.quorum}: "
                         f"no round can aggregate again; {losses(self.totals.faults)}")
                self.runlog.event("deadlock", round=round_, cause=cause, live=len(self.live))
                return "failed", self._every_client_lost() if not self.live else f"deadlock: {cause}"
            started = time.monotonic()  # wall
            round_started = proc.now()  # emulated
            proc.node.announce_round(round_, by=proc.pid)
            selected = self.select(round_)
            # Over-selection: a phase closes once m replies are in.
            book = _RoundBook(selected, target=s.per_round if self.over_select else None)
            self.totals.asked.update(selected)
            new_weights = self.strategy.run_round(
                lambda task, lr, **extra: self._phase(proc, round_, book, task, lr, **extra), self.weights, round_)
            self.totals.straggled += len(book.stragglers)
            if new_weights is not None:
                self.weights = new_weights
                self.totals.aggregations += 1
            accuracy = loss = None
            if round_ % s.eval_every == 0 or round_ == s.rounds:
                accuracy, loss = self._evaluate()
            round_ended = proc.now()  # emulated (the server's evaluation takes none)
            traffic, broker, facts = self._traffic_since_last(proc, round_)
            self._record(round_, accuracy)
            final = book.final_replies
            n = sum(r.num_samples for r in final)
            clients = self.timeline.judge(round_, round_started, round_ended, facts, book.selected, book.seen(),
                                          {r.client: r for r in final},
                                          lambda k: s.stragglers.slowdown(k, round_))
            self.runlog.event(
                "round", round=round_, accuracy=accuracy, loss=loss,
                participants=len(final), aggregated=new_weights is not None, uploads=book.uploads,
                **traffic, **self._per_client(round_, book, clients), quorum_missed=book.quorum_missed,
                train_loss=(sum(r.train_loss * r.num_samples for r in final) / n) if n else None,
                compute_s_max=max((r.compute_s for r in final), default=None),
                offline=broker.get("offline", []), emulated_s=broker["emulated_s"],
                round_emulated_s=round(round_ended - round_started, 6),
                round_s=round(time.monotonic() - started, 4),  # wall
            )
            self.timeline.round_span(round_, round_started, round_ended, "aggregated" if new_weights is not None
                                     else "kept the model")
            self.timeline.flush()
            self._hint_if_the_deadline_cut_everyone(round_, book)
            reason = self._finished(round_, accuracy)
            if reason:
                return "completed", reason
        return "completed", f"ran {s.rounds} rounds"

    def select(self, round_: int) -> list[int]:
        """Round ``round_``'s clients, sorted: m (+ over_select) of the live ones, drawn
        from the round's own stream ("selection", round), so no earlier round's draws (a
        retried selection, a changed C) move it; every live client for FSVRG."""
        candidates = sorted(self.live)
        if self.strategy.selects_all:
            return candidates
        m = min(self.settings.per_round + self.over_select, len(candidates))
        return sorted(int(k) for k in streams.generator(self.settings.seed, "selection", round_).choice(
            candidates, size=m, replace=False))

    def _per_client(self, round_: int, book: _RoundBook, clients: list[ClientRound]) -> dict:
        """A round event's per-client fields: which selected clients answered, straggled,
        were lost or discarded as the server saw it; what happened to them as the
        emulator knows it (``outcomes``: OUTCOMES; ``offline_at``: when each offline
        one's device went offline; ``failed_transfers``: which message was lost), and
        each one's straggler factor. Listed in the event for rounds of up to
        CLIENTS_IN_EVENTS clients (``client_log = "auto"``); beyond, or with "csv", the
        event counts them. clients.csv gets a row per client either way."""
        self.runlog.table(CLIENTS, CLIENT_COLUMNS, [c.row(round_) for c in clients])
        counts = {name: 0 for name in OUTCOMES}
        for c in clients:
            counts[c.outcome] += 1
        final = {r.client for r in book.final_replies}
        mode = self.settings.client_log
        if mode == "events" or (mode == "auto" and len(book.selected) <= CLIENTS_IN_EVENTS):
            return dict(selected=book.selected, answered=sorted(final), stragglers=sorted(book.stragglers),
                        dropped=sorted(book.dropped), discarded=sorted(book.discarded),
                        slowdowns={c.client: round(c.slowdown, 3) for c in clients if c.slowdown != 1.0},
                        outcome_counts=counts,
                        outcomes={name: [c.client for c in clients if c.outcome == name] for name in OUTCOMES},
                        offline_at={c.client: c.offline_at for c in clients if c.outcome == "offline"},
                        failed_transfers={c.client: c.failed for c in clients if c.outcome == "failed_transfer"})
        seen = {"selected": len(book.selected), "answered": len(final), "stragglers": len(book.stragglers),
                "dropped": len(book.dropped), "discarded": len(book.discarded),
                "slowed": sum(c.slowdown != 1.0 for c in clients)}
        return {"clients": seen, "outcome_counts": counts}

    def _hint_if_the_deadline_cut_everyone(self, round_: int, book: _RoundBook) -> str | None:
        """Once a run: a round in which no selected client answered before the deadline,
        none of them lost, is most often a deadline shorter than the emulated training
        (a heavier model or more epochs than the default job's): say so, naming the keys."""
        if (self._deadline_hinted or book.final_replies or not book.quorum_missed
                or book.stragglers != set(book.selected) - book.dropped or not book.stragglers):
            return None
        self._deadline_hinted = True
        message = (f"round {round_}: none of the {len(book.stragglers)} selected clients answered within "
                   f"algorithm.deadline_s = {self.settings.deadline_s:g} emulated s, so the model was kept; if their "
                   f"training takes longer on the emulated device (run.device_flops), raise algorithm.deadline_s "
                   f"or set it to 0 (wait for every answer)")
        log.warning("%s", message)
        self.runlog.event("hint", round=round_, message=message)
        return message

    def _phase(self, proc: ThreadProcess, round_: int, book: _RoundBook, task: str | type[tasks.LocalTask],
               lr: float, lr_decay: float = 0.0, extra: dict | None = None) -> list[TrainReply] | None:
        s = self.settings
        encodes = (task if isinstance(task, type) else tasks.get(task)).encodes_update
        task = tasks.reference(task)
        request = TrainRequest(round=round_, task=task, weights=self.weights, epochs=s.epochs,
                               batch_size=s.batch_size, lr=lr, seed=s.seed, lr_decay=lr_decay,
                               compression=s.compression if encodes and self.codec else None,
                               keep_at_node=self.at_nodes, extra=extra)
        asked = [k for k in book.selected if k in self.live]
        proc.send_many([self.pids[k] for k in asked], request)  # one copy per worker node
        period = s.deadline_s if s.deadline_s else float("inf")  # emulated seconds
        deadline = proc.now() + period
        extended = False
        waiting = self._waiting = set(asked)  # (and the round: what a deadlock names)
        self._round = round_
        replies = Replies(exact=self.at_nodes)  # each update folded into the phase's mean as it arrives
        watchdog = time.monotonic() + s.progress_timeout_s  # wall: a node stuck for real
        while waiting and not (book.target and len(replies) >= book.target):
            msg = self._receive(proc, (TrainReply, Down, WorkerReady),
                                timeout=None if deadline == float("inf") else deadline - proc.now(),
                                wall_timeout=watchdog - time.monotonic())  # wall
            if msg is TIMEOUT:
                if proc.now() >= deadline:
                    if len(replies) < s.quorum and self.on_quorum_missed == "extend_once" and not extended:
                        extended = True
                        deadline += period
                        continue
                    break
                self.runlog.event("stall", round=round_, task=task, waiting_s=s.progress_timeout_s,
                                  waiting_for=sorted(waiting), emulated_s=proc.now(), cause=(
                                      "no reply from these clients; no deadline set" if deadline == float("inf") else
                                      f"no reply from these clients, and the clock has not reached the deadline "
                                      f"at emulated {deadline:g}s"))
                watchdog = time.monotonic() + s.progress_timeout_s  # wall
                continue
            body = msg.body
            if isinstance(body, TrainReply) and msg.sender == self.pids.get(body.client):
                # On time or not, its local work goes into the timeline (from its own process only).
                self.timeline.reply(body.round, body.client, body.started_s, body.ended_s, body.compute_s,
                                    late=not (body.round == round_ and body.task == task and body.client in waiting))
            if isinstance(body, WorkerReady):
                self._rejoin(proc, msg, round_)  # selectable from the next round on
            elif isinstance(body, Down):
                k = self._client_down(proc, body, round_)
                if k in waiting:
                    waiting.discard(k)
                    book.dropped.add(k)
            elif body.round == round_ and body.task == task and body.client in waiting:
                if msg.sender != self.pids[body.client]:  # only the process the request went to answers it
                    log.warning("round %d: a reply for client %d from %s, not from its process %s: ignored",
                                round_, body.client, msg.sender, self.pids[body.client])
                    continue
                waiting.discard(body.client)
                if body.encoded is not None and not self._decode(body, round_):
                    book.dropped.add(body.client)
                    continue
                if (body.update is not None or not self.at_nodes) and not self._usable(body.update, body.client,
                                                                                        round_, lr):
                    book.dropped.add(body.client)
                    continue
                replies.fold(body, keep_update=self.strategy.keeps_updates)
            # else: a straggler's reply from an earlier round or phase, which has closed.
        if book.target and len(replies) >= book.target:
            book.discarded |= waiting  # over-selected: m answered first, these are not waited for
            for k in sorted(waiting):
                proc.send(self.pids[k], Cancel(round_))
        else:
            book.stragglers |= waiting
        if self.at_nodes and len(replies) >= s.quorum:
            book.dropped |= self._sum_at_nodes(proc, round_, task, replies)
        if len(replies) < s.quorum:
            book.quorum_missed = "extended_then_skipped" if extended else "skipped"
        elif extended:
            book.quorum_missed = "extended"
        book.uploads += len(replies)
        self.totals.uploads += len(replies)
        book.final_replies = replies
        return replies if len(replies) >= s.quorum else None

    def _sum_at_nodes(self, proc: ThreadProcess, round_: int, task: str, replies: Replies) -> set[int]:
        """Aggregation on the nodes, as a phase closes: each worker node sends the exact sum
        of the updates it kept for the clients whose replies counted, and the server adds
        them. A node lost before it answers loses those updates: its clients are returned
        (dropped) and leave ``replies``. No emulated time passes (the server's merging
        costs none either)."""
        by_node: dict[str, list[int]] = {}
        for reply in replies:
            if reply.update is None:  # kept at its node
                by_node.setdefault(self.pids[reply.client].node, []).append(reply.client)
        lost: set[int] = set()
        asked: dict[Pid, list[int]] = {}
        for node, clients in sorted(by_node.items()):
            sums = self.sums.get(node)
            if sums is None:
                lost.update(clients)
                continue
            proc.send(sums, SumRequest(round_, task, clients))
            asked[sums] = clients
        self._waiting_sums = asked
        watchdog = time.monotonic() + self.settings.progress_timeout_s  # wall: a node stuck for real
        while asked:
            msg = self._receive(proc, (SumReply, Down, WorkerReady), wall_timeout=watchdog - time.monotonic())  # wall
            if msg is TIMEOUT:
                self.runlog.event("stall", round=round_, task=task, waiting_s=self.settings.progress_timeout_s,
                                  waiting_for=sorted(p.node for p in asked), cause="no partial sum from these nodes")
                watchdog = time.monotonic() + self.settings.progress_timeout_s  # wall
                continue
            body = msg.body
            if isinstance(body, WorkerReady):
                self._rejoin(proc, msg, round_)
            elif isinstance(body, Down):
                if body.pid in asked:
                    clients = asked.pop(body.pid)
                    self.sums.pop(body.pid.node, None)
                    lost.update(clients)
                    log.warning("round %d: node %s was lost before sending its partial sum; the updates of its "
                                "%d clients are lost", round_, body.pid.node, len(clients))
                else:
                    self._client_down(proc, body, round_)  # its update, kept at its node, still counts
            elif msg.sender in asked and body.round == round_ and body.task == task:
                clients = asked.pop(msg.sender)
                try:
                    replies.merge_node_sum(body.state)
                except (ValueError, TypeError, KeyError, OverflowError) as exc:
                    log.error("round %d: node %s sent a malformed partial sum (%s); its %d clients' updates are "
                              "left out", round_, body.node, exc, len(clients))
                    lost.update(clients)
                    continue
                lost.update(set(body.missing) & set(clients))
            # else: a partial sum of an earlier phase, whose wait was cut short: ignored.
        if lost:
            replies.leave_out(lost)
        return lost

    def waiting_for(self) -> str:
        sums = getattr(self, "_waiting_sums", None)
        if sums:
            return f"partial sums of round {getattr(self, '_round', 0)} from nodes {sorted(p.node for p in sums)}"
        waiting = sorted(getattr(self, "_waiting", ()))
        return (f"replies of round {getattr(self, '_round', 0)} from clients {_ids(waiting)}" if waiting
                else "nothing")

    def _decode(self, reply: TrainReply, round_: int) -> bool:
        """Turn an encoded delta into the client's weights (w_t + delta), in place.
        The mask, basis or rotation comes from the same (seed, round, client) seed."""
        delta = self._decoded_delta(reply.encoded, round_, reply.client, round_)
        if delta is None:
            return False
        reply.update = self.weights + delta
        return True


@dataclass
class _RoundBook:
    """Who did what in one round, across its phases."""

    selected: list[int]
    target: int | None = None  # over-selection: replies that close a phase (m)
    stragglers: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)
    discarded: set[int] = field(default_factory=set)  # still training when the first m had answered
    quorum_missed: str | None = None  # None, "extended", "skipped" or "extended_then_skipped"
    uploads: int = 0
    final_replies: list = field(default_factory=list)

    def seen(self) -> dict[int, str]:
        """How the server saw each selected client that did not answer."""
        return {**{k: "discarded" for k in self.discarded}, **{k: "straggler" for k in self.stragglers},
                **{k: "dropped" for k in self.dropped}}


QUORUM_POLICIES = ("skip", "extend_once")
CLIENT_LOGS = ("auto", "events", "csv")
# client_log = "auto": rounds of up to this many selected clients list them in the event.
CLIENTS_IN_EVENTS = 100


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids)) if len(ids) <= 12 else f"{', '.join(map(str, ids[:10]))}, ... ({len(ids)} in all)"


def _pending_stop(proc) -> Stop | None:
    """A Stop waiting in the server's mailbox, taken (None if none, or a stand-in process)."""
    if not isinstance(proc, ThreadProcess):
        return None
    msg = proc.receive(Stop, timeout=0)
    return msg.body if msg is not TIMEOUT else None


def _broker_lost(proc) -> str | None:
    """Why the server's node lost the broker, or None (also for stand-ins in tests)."""
    return getattr(getattr(proc, "node", None), "broker_lost", None)


class _Stopped(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
