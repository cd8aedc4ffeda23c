"""The server process: what every algorithm's engine shares.

:class:`Engine` finds the clients (worker nodes announce them), watches them (a DOWN
is a lost client), evaluates, applies the budgets (rounds, uploads per client, wall
time, target accuracy) and writes the run log. Its subclasses own the loop:
``round_engine.RoundEngine`` runs synchronous rounds for FedAvg, FedSGD and FSVRG;
``async_engine.AsyncEngine`` runs CO-OP, FedAsync and FedBuff.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from fedemu.common.algorithms.rounds import selected_per_round
from fedemu.common.messages import WorkerReady, as_pid_map, update_problem
from fedemu.common.ml import models, training
from fedemu.common.ml.compression import make_codec, parameter_shapes, update_seed
from fedemu.common.ml.data import Data
from fedemu.common.ml.models import ModelSpec
from fedemu.common.stragglers import StragglerGroups, StragglerSpec
from fedemu.node import TIMEOUT, Down, NodeError, Pid, Stalled, ThreadProcess, message

from .outcome import NodeExits, losses, nothing_aggregated
from .runlog import RunLog, RunLogError
from .timeline import Facts, Timeline

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
    offline: int = 0  # of those, the ones whose device was offline (timeline.OUTCOMES)
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
        except Stopped as stop:
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
            if self._clock_started is not None and broker_lost(proc) is None:
                self.timeline.take(proc.node.broker_stats(timeline=True), self.totals.rounds + 1)
            self.timeline.flush()
        except (NodeError, RunLogError, OSError, AttributeError) as exc:  # AttributeError: a stand-in process
            log.info("the timeline's last rows are not written: %s", exc)

    def _failure(self, proc: ThreadProcess, exc: Exception) -> tuple[str, str]:
        """Why the run ends with ``exc``: a stop asked for meanwhile (the launcher died,
        and the broker with it), a lost broker (what a call to it that timed out means),
        or the error itself."""
        if isinstance(exc, NodeError) and broker_lost(proc) is None:
            # If the broker is gone, the node's heartbeats say so within their timeout.
            proc.node.closed.wait(proc.node.heartbeat_timeout + 1.0)
        stop = pending_stop(proc)
        if stop is not None:
            return stop.status, stop.reason
        if broker_lost(proc) is not None:  # the cause, not what it broke (a stats call)
            return "failed", f"lost the broker: {broker_lost(proc)}"
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
        late = f"{t.straggled:,} not in by the deadline" + (f" ({t.offline:,} of them offline)" if t.offline else "")
        return f"{t.uploads:,} replies in time, {late}, {len(t.faults):,} clients lost, over {t.rounds:,} rounds"

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
                    raise Stopped("failed", f"worker node {gone[0]} ended before it reported ({gone[1]})")
                continue
            if msg is TIMEOUT:
                raise Stopped("failed", (
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
            raise Stopped("failed", f"{len(missing)} clients were never hosted, e.g. {sorted(missing)[:5]}")
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
            raise Stopped(msg.body.status, msg.body.reason)
        if msg is not TIMEOUT and isinstance(msg.body, Stalled):
            cause = (f"the run is quiescent with nothing pending (no message in flight, no timer, no scheduled "
                     f"change) while the server waits for {self.waiting_for()}")
            self.runlog.event("deadlock", round=self.totals.rounds, cause=cause, emulated_s=msg.body.now)
            raise Stopped("failed", f"deadlock: {cause}")
        return msg

    def _client_down(self, proc: ThreadProcess, down: Down, round_: int) -> int | None:
        if broker_lost(proc) is not None:
            # Every remote process looks DOWN when the broker is gone: the run is lost, not
            # its clients. A stop asked for first (the launcher died, and the broker with it)
            # is the cause.
            stop = pending_stop(proc)
            if stop is not None:
                raise Stopped(stop.status, stop.reason)
            raise Stopped("failed", f"lost the broker: {broker_lost(proc)}")
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


CLIENT_LOGS = ("auto", "events", "csv")


def pending_stop(proc) -> Stop | None:
    """A Stop waiting in the server's mailbox, taken (None if none, or a stand-in process)."""
    if not isinstance(proc, ThreadProcess):
        return None
    msg = proc.receive(Stop, timeout=0)
    return msg.body if msg is not TIMEOUT else None


def broker_lost(proc) -> str | None:
    """Why the server's node lost the broker, or None (also for stand-ins in tests)."""
    return getattr(getattr(proc, "node", None), "broker_lost", None)


class Stopped(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def __getattr__(name: str):
    if name == "RoundEngine":  # its home before issue 51 split this file
        # lazy: only an old import path gets here
        import importlib
        import warnings

        warnings.warn("fedemu.server.engine.RoundEngine has moved to fedemu.server.round_engine; import it from "
                      "there (the old path will go in a later release)", DeprecationWarning, stacklevel=2)
        return importlib.import_module(f"{__package__}.round_engine").RoundEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
