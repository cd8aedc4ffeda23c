"""The synchronous round engine: the server process of FedAvg and FedSGD.

Per round: select m = max(C*K, 1) live clients with the run seed, send each the model,
collect until every selected client answered, was lost (DOWN), or the deadline
passed; aggregate what arrived if at least the quorum did, else keep the model; then
evaluate and write one ``round`` event. A client that never answers cannot hang a
round, and a run whose clients are all gone stops with a ``deadlock`` event that
names the cause instead of waiting forever.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from fedemu.node import TIMEOUT, Down, Pid, ThreadProcess, message
from fedemu.worker import models, training
from fedemu.worker.data import Dataset
from fedemu.worker.protocol import TrainReply, TrainRequest, WorkerReady, as_pid_map

from .runlog import RunLog
from .strategies import Strategy, selected_per_round

log = logging.getLogger("fedemu.server")


# Broker counters a round event reports as the difference over that round.
TRAFFIC_KEYS = ("bytes_up", "bytes_down", "msgs_up", "msgs_down", "lost_up", "lost_down",
                "transfer_s_up", "transfer_s_down")


@message
class Stop:
    """Asks the server to end the run now (Ctrl-C, or its node lost the broker)."""

    status: str  # "interrupted" or "failed"
    reason: str


@dataclass
class RoundSettings:
    clients: int  # K
    C: float
    epochs: int
    batch_size: int  # 0: the full local set
    rounds: int
    seed: int
    deadline_s: float
    quorum: int
    eval_every: int = 1
    target_accuracy: float = 0.0  # 0: run all rounds
    workers: int = 1
    startup_timeout_s: float = 120.0
    time_scale: float = 1.0  # emulated seconds per wall second (deadline_s is emulated)

    @property
    def per_round(self) -> int:
        return selected_per_round(self.C, self.clients)


@dataclass
class _Totals:
    bytes_up: int = 0
    bytes_down: int = 0
    rounds: int = 0
    accuracy: float | None = None
    best_accuracy: float | None = None
    reached_target_round: int | None = None
    faults: list = field(default_factory=list)


class RoundEngine:
    def __init__(self, settings: RoundSettings, strategy: Strategy, model_name: str, dataset: Dataset, runlog: RunLog):
        self.settings = settings
        self.strategy = strategy
        self.model = models.build(model_name, seed=settings.seed)
        self.weights = models.get_flat(self.model)
        self.dataset = dataset
        self.runlog = runlog
        self.pids: dict[int, Pid] = {}
        self.client_of: dict[Pid, int] = {}
        self.live: set[int] = set()
        self.totals = _Totals()

    # --- the server process ---------------------------------------------------------

    def run(self, proc: ThreadProcess) -> dict:
        status, reason = "completed", ""
        try:
            self._await_workers(proc)
            status, reason = self._rounds(proc)
        except _Stopped as stop:
            status, reason = stop.status, stop.reason
        except Exception as exc:
            log.exception("server failed")
            status, reason = "failed", f"{type(exc).__name__}: {exc}"
        self.runlog.event("end", status=status, reason=reason, rounds=self.totals.rounds)
        return self.runlog.summary(
            status=status,
            reason=reason,
            algorithm=self.strategy.name,
            rounds=self.totals.rounds,
            final_accuracy=self.totals.accuracy,
            best_accuracy=self.totals.best_accuracy,
            target_accuracy=self.settings.target_accuracy or None,
            reached_target_round=self.totals.reached_target_round,
            bytes_up=self.totals.bytes_up,
            bytes_down=self.totals.bytes_down,
            faults=len(self.totals.faults),
        )

    def _await_workers(self, proc: ThreadProcess) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        ready_nodes: dict[str, int] = {}
        while len(ready_nodes) < self.settings.workers:
            msg = self._receive(proc, (WorkerReady,), deadline - time.monotonic())
            if msg is TIMEOUT:
                raise _Stopped("failed", (
                    f"only {len(ready_nodes)} of {self.settings.workers} worker nodes reported "
                    f"within {self.settings.startup_timeout_s:.0f}s: {sorted(ready_nodes) or 'none'}"))
            ready: WorkerReady = msg.body
            for k, pid in as_pid_map(ready.clients).items():
                self.pids[k] = pid
                self.client_of[pid] = k
                proc.monitor(pid)
            ready_nodes[ready.node] = len(ready.clients)
        missing = set(range(self.settings.clients)) - set(self.pids)
        if missing:
            raise _Stopped("failed", f"{len(missing)} clients were never hosted, e.g. {sorted(missing)[:5]}")
        self.live = set(self.pids)
        self.runlog.event("start", clients=len(self.pids), placement=ready_nodes,
                          per_round=self.settings.per_round, algorithm=self.strategy.name,
                          time_scale=self.settings.time_scale)

    def _rounds(self, proc: ThreadProcess) -> tuple[str, str]:
        s = self.settings
        rng = np.random.default_rng(np.random.SeedSequence([s.seed, 0x5E1EC7]))
        before = proc.node.broker_stats()
        for round_ in range(1, s.rounds + 1):
            if len(self.live) < s.quorum:
                cause = (f"{len(self.live)} live clients, fewer than the quorum of {s.quorum}: "
                         "no round can aggregate again")
                self.runlog.event("deadlock", round=round_, cause=cause, live=len(self.live))
                return "failed", f"deadlock: {cause}"
            started = time.monotonic()
            proc.node.announce_round(round_)
            m = min(s.per_round, len(self.live))
            selected = sorted(int(k) for k in rng.choice(sorted(self.live), size=m, replace=False))
            lr = self.strategy.learning_rate(round_)
            request = TrainRequest(round=round_, task=self.strategy.task, weights=self.weights,
                                   epochs=s.epochs, batch_size=s.batch_size, lr=lr, seed=s.seed)
            for k in selected:
                proc.send(self.pids[k], request)
            replies, stragglers, dropped = self._collect(proc, round_, selected, started + s.deadline_s / s.time_scale)
            aggregated = len(replies) >= s.quorum
            if aggregated:
                self.weights = self.strategy.aggregate(self.weights, replies, round_)
            accuracy = loss = None
            if round_ % s.eval_every == 0 or round_ == s.rounds:
                accuracy, loss = self._evaluate()
            after = proc.node.broker_stats()
            traffic = {key: after[key] - before[key] for key in TRAFFIC_KEYS}
            before = after
            self._account(round_, accuracy, traffic["bytes_up"], traffic["bytes_down"])
            n = sum(r.num_samples for r in replies)
            self.runlog.event(
                "round", round=round_, accuracy=accuracy, loss=loss,
                participants=len(replies), aggregated=aggregated,
                **traffic,
                selected=selected, answered=sorted(r.client for r in replies),
                stragglers=sorted(stragglers), dropped=sorted(dropped),
                train_loss=(sum(r.train_loss * r.num_samples for r in replies) / n) if n else None,
                compute_s_max=max((r.compute_s for r in replies), default=None),
                slowdowns={r.client: round(r.slowdown, 3) for r in replies if r.slowdown != 1.0},
                offline=after.get("offline", []), emulated_s=after["emulated_s"],
                lr=lr, round_s=round(time.monotonic() - started, 4),
            )
            if accuracy is not None and s.target_accuracy and accuracy >= s.target_accuracy:
                return "completed", f"reached target accuracy {s.target_accuracy} in round {round_}"
        return "completed", f"ran {s.rounds} rounds"

    def _collect(self, proc: ThreadProcess, round_: int, selected: list[int], deadline: float):
        waiting = set(selected)
        replies: list[TrainReply] = []
        dropped: set[int] = set()
        while waiting:
            msg = self._receive(proc, (TrainReply, Down), deadline - time.monotonic())
            if msg is TIMEOUT:
                break
            body = msg.body
            if isinstance(body, Down):
                k = self._client_down(body, round_)
                if k in waiting:
                    waiting.discard(k)
                    dropped.add(k)
            elif body.round == round_ and body.client in waiting:
                waiting.discard(body.client)
                replies.append(body)
            # else: a straggler's reply from an earlier round; the round it was for has closed.
        return replies, waiting, dropped

    def _receive(self, proc: ThreadProcess, kinds: tuple, timeout: float):
        """Receive one of ``kinds``; a Stop message ends the run from any wait."""
        msg = proc.receive((*kinds, Stop), timeout=max(timeout, 0.0))
        if msg is not TIMEOUT and isinstance(msg.body, Stop):
            raise _Stopped(msg.body.status, msg.body.reason)
        return msg

    def _client_down(self, down: Down, round_: int) -> int | None:
        k = self.client_of.get(down.pid)
        if k is None:
            return None
        self.live.discard(k)
        fault = self.runlog.event("fault", round=round_, client=k, pid=str(down.pid), reason=down.reason)
        self.totals.faults.append(fault)
        log.warning("client %d lost in round %d: %s", k, round_, down.reason)
        return k

    def _evaluate(self) -> tuple[float, float]:
        models.set_flat(self.model, self.weights)
        return training.evaluate(self.model, self.dataset.test_images, self.dataset.test_labels)

    def _account(self, round_: int, accuracy: float | None, bytes_up: int, bytes_down: int) -> None:
        t = self.totals
        t.rounds = round_
        t.bytes_up += bytes_up
        t.bytes_down += bytes_down
        if accuracy is not None:
            t.accuracy = accuracy
            t.best_accuracy = accuracy if t.best_accuracy is None else max(t.best_accuracy, accuracy)
            target = self.settings.target_accuracy
            if target and accuracy >= target and t.reached_target_round is None:
                t.reached_target_round = round_


class _Stopped(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
