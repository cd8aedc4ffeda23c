"""The round engine: synchronous rounds for FedAvg, FedSGD, FSVRG and the other
round-based rules, over what :class:`~.engine.Engine` shares.

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

import logging
import time
from dataclasses import dataclass, field

from fedemu.common.algorithms import tasks
from fedemu.common.algorithms.base import aggregation_problem
from fedemu.common.algorithms.rounds import Replies, Strategy
from fedemu.common.messages import Cancel, SumReply, SumRequest, TrainReply, TrainRequest, WorkerReady
from fedemu.common.ml.data import Data
from fedemu.common.ml.models import ModelSpec
from fedemu.node import TIMEOUT, Down, Pid, ThreadProcess, streams

from .engine import Engine, Settings
from .outcome import losses, no_answer_hint
from .runlog import CLIENTS, RunLog
from .timeline import CLIENT_COLUMNS, OUTCOMES, ClientRound

log = logging.getLogger("fedemu.server")

QUORUM_POLICIES = ("skip", "extend_once")
# client_log = "auto": rounds of up to this many selected clients list them in the event.
CLIENTS_IN_EVENTS = 100


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
        self._no_answer_hinted: set[str] = set()  # the causes hinted at (no_answer_hint)

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
            book = RoundBook(selected, target=s.per_round if self.over_select else None)
            self.totals.asked.update(selected)
            new_weights = self.strategy.run_round(
                lambda task, lr, **extra: self._phase(proc, round_, book, task, lr, **extra), self.weights, round_)
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
            self.totals.straggled += len(book.stragglers)
            self.totals.offline += sum(c.outcome == "offline" and c.client in book.stragglers for c in clients)
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
            self._hint_if_no_one_answered(round_, book, clients)
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

    def _per_client(self, round_: int, book: RoundBook, clients: list[ClientRound]) -> dict:
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

    def _hint_if_no_one_answered(self, round_: int, book: RoundBook, clients: list[ClientRound]) -> str | None:
        """Once a run for each cause: a round in which no selected client answered before
        the deadline, none of them lost, gets a hint naming why as the emulator knows it
        (outcome.no_answer_hint): every one offline, a deadline shorter than the emulated
        training (a heavier model or more epochs than the default job's), or a mix."""
        if (book.final_replies or not book.quorum_missed
                or book.stragglers != set(book.selected) - book.dropped or not book.stragglers):
            return None
        hint = no_answer_hint(round_, [c.outcome for c in clients if c.client in book.stragglers],
                              self.settings.deadline_s)
        if hint is None or hint[0] in self._no_answer_hinted:
            return None
        cause, message = hint
        self._no_answer_hinted.add(cause)
        log.warning("%s", message)
        self.runlog.event("hint", round=round_, message=message)
        return message

    def _phase(self, proc: ThreadProcess, round_: int, book: RoundBook, task: str | type[tasks.LocalTask],
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
class RoundBook:
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


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids)) if len(ids) <= 12 else f"{', '.join(map(str, ids[:10]))}, ... ({len(ids)} in all)"
