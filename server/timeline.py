"""The run's timeline and each selected client's ground truth.

The broker's link emulator records what happened on every client link (each transfer as
it ended, each device going offline or coming back: ``node.net.emulator``) and hands it
over once, to whoever asks; the server asks at the end of every round (every evaluation,
for asynchronous rules). The clients say when their local work started and ended (in
their replies). From both, :class:`Timeline`:

* writes ``timeline.csv``, a row per transfer, computation, device switch and round
  (``TIMELINE_COLUMNS``), appended and fsynced once per round like the event log;
* tells, for each selected client of a round, what really happened to it
  (:data:`OUTCOMES`) beside what the server saw: a drop-out looks like a straggler to
  the server (as in a deployed system), but the emulator knows it went offline, and when.

Emulated times are the broker's clock, as the events' ``emulated_s``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

TIMELINE = "timeline.csv"
TIMELINE_COLUMNS = ("round", "client", "kind", "start_s", "end_s", "bytes", "wire_bytes", "retransmitted_bytes",
                    "outcome")
# kind: "download" (server to client) and "upload" (client to server), a transfer on the
# client's link (outcome: delivered, loss, queue, offline, timeout); "compute", a
# client's local work (outcome: "on time", or "late": its reply came after its round
# closed); "offline"/"online", its device switching (an instant: end_s empty); "round",
# the server's round or evaluation (client empty; outcome: aggregated, skipped, ...).
KINDS = ("download", "upload", "compute", "offline", "online", "round")

# What happened to a selected client in a round, as the emulator knows it, in the order
# they take precedence: its reply counted; the server lost it (a crash, its node, an
# unusable update); its device went offline; a message to or from it was lost on its
# link; over-selected, the round closed on the first m without it; else it was still
# computing or uploading when the round closed.
OUTCOMES = ("answered", "dropped", "offline", "failed_transfer", "discarded", "straggler")
FAILED = ("loss", "queue", "timeout")  # transfer outcomes that lose the message on a live link
UP, DOWN = 0, 1  # net.links' directions, as TRANSFER_FIELDS carry them
# A late reply's upload is the one that entered the link when the reply says it left the
# device: the same instant in virtual time; on the wall clock, within this.
SAME_INSTANT = 1e-3


@dataclass
class Facts:
    """The broker's transfers and device switches of one period (a round), by client."""

    transfers: dict[int, list[list]] = field(default_factory=dict)  # TRANSFER_FIELDS rows
    availability: dict[int, list[tuple[float, bool]]] = field(default_factory=dict)


@dataclass
class ClientRound:
    """One selected client in one round: what the server saw and what happened."""

    client: int
    seen: str  # the server's view: answered, straggler, dropped, discarded
    outcome: str  # OUTCOMES
    offline_at: float | None = None  # emulated time its device went offline (outcome offline)
    failed: str | None = None  # which transfer failed, e.g. "up loss" (outcome failed_transfer)
    slowdown: float = 1.0
    num_samples: int | None = None
    train_loss: float | None = None
    compute_s: float | None = None  # the device's compute seconds, before its straggler factor
    compute_start_s: float | None = None
    compute_end_s: float | None = None
    bytes_down: int = 0
    bytes_up: int = 0
    download_s: float | None = None  # emulated seconds from entry to end, summed over its transfers
    upload_s: float | None = None

    def row(self, round_: int) -> tuple:
        return (round_, self.client, self.outcome, self.seen, _t(self.offline_at), self.failed, self.slowdown,
                self.num_samples, self.train_loss, self.compute_s, _t(self.compute_start_s),
                _t(self.compute_end_s), self.bytes_down, self.bytes_up, _t(self.download_s), _t(self.upload_s))


CLIENT_COLUMNS = ("round", "client", "outcome", "seen", "offline_at_s", "failed_transfer", "slowdown",
                  "num_samples", "train_loss", "compute_s", "compute_start_s", "compute_end_s", "bytes_down",
                  "bytes_up", "download_s", "upload_s")


def _t(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class Timeline:
    """The server's side of the timeline: takes the broker's facts, keeps each device's
    state, writes ``timeline.csv`` (unless ``write`` is False) and judges each selected
    client's outcome."""

    def __init__(self, runlog, write: bool = True) -> None:
        self.runlog = runlog
        self.write = write
        self._offline_since: dict[int, float] = {}  # devices offline now, since when
        self._before: dict[int, float] = {}  # the same, before the last take's switches
        self._rows: list[tuple] = []  # waiting for the next flush
        self._replies: dict[int, dict[int, tuple]] = {}  # round -> client -> (start, end, compute_s)
        # Clients' replies that came after their round closed: when each entered its uplink,
        # so that upload is not counted in the round it landed in.
        self._late_ends: dict[int, list[float]] = {}

    # --- what comes in -------------------------------------------------------------------

    def take(self, stats: dict, round_: int) -> Facts:
        """The facts in a broker ``stats`` reply (asked with timeline=True): rows for the
        file, the devices' states updated; returns them by client for judging a round."""
        facts = Facts()
        for row in stats.get("transfers", ()):
            link, direction, entry, end, size, wire, resent, outcome, due = row
            facts.transfers.setdefault(link, []).append(row)
            kind = "upload" if direction == UP else "download"
            self._add(round_, link, kind, entry if entry is not None else end, end, size, wire, resent, outcome)
        self._before = dict(self._offline_since)
        # By time, then client: the broker notes an instant's switches in the order its
        # nodes registered their clients, which differs from run to run.
        for link, at, offline in sorted(stats.get("availability", ()), key=lambda r: (r[1], r[0])):
            facts.availability.setdefault(link, []).append((at, offline))
            self._add(round_, link, "offline" if offline else "online", at, None, None, None, None, None)
            if offline:
                self._offline_since.setdefault(link, at)
            else:
                self._offline_since.pop(link, None)
        return facts

    def reply(self, round_: int, client: int, started: float | None, ended: float | None, compute_s: float,
              late: bool = False) -> None:
        """A client's reply came: its local work ran from ``started`` to ``ended``
        (emulated; the reply entered its uplink then)."""
        if started is None or ended is None:
            return  # a client of an older fedemu
        self._replies.setdefault(round_, {})[client] = (started, ended, compute_s)
        if late:
            self._late_ends.setdefault(client, []).append(ended)
        self._add(round_, client, "compute", started, ended, None, None, None, "late" if late else "on time")

    def round_span(self, round_: int, start: float, end: float, outcome: str) -> None:
        self._add(round_, None, "round", start, end, None, None, None, outcome)

    def _add(self, round_, client, kind, start, end, size, wire, resent, outcome) -> None:
        if self.write:
            self._rows.append((round_, client, kind, _t(start), _t(end), size, wire, resent, outcome))

    def flush(self) -> None:
        """Append what came since the last flush to timeline.csv (one write, fsynced)."""
        if self._rows:
            rows, self._rows = self._rows, []
            self.runlog.table(TIMELINE, TIMELINE_COLUMNS, rows)

    # --- judging a round -----------------------------------------------------------------

    def judge(self, round_: int, start: float, end: float, facts: Facts, selected: Iterable[int],
              seen: dict[int, str], replies: dict, slowdown) -> list[ClientRound]:
        """Each selected client's :class:`ClientRound` for a round that ran from
        ``start`` to ``end`` (emulated): ``seen`` is the server's view of the clients
        that did not answer (straggler, dropped, discarded), ``replies`` the counted
        replies by client, ``slowdown(client)`` its straggler factor."""
        computed = self._replies.pop(round_, {})
        late_ends, self._late_ends = self._late_ends, {}
        for old in [r for r in self._replies if r < round_ - 1]:
            del self._replies[old]  # late replies of long-closed rounds are written, not judged
        out = []
        for k in selected:
            reply = replies.get(k)
            view = "answered" if reply is not None else seen.get(k, "straggler")
            transfers = facts.transfers.get(k, [])
            downloads = [t for t in transfers if t[1] == DOWN and _began(t) >= start]
            span = computed.get(k)
            after = span[0] if span else min((t[3] for t in downloads), default=start)
            uploads = [t for t in transfers if t[1] == UP and _began(t) >= after
                       and not any(abs(_began(t) - e) < SAME_INSTANT for e in late_ends.get(k, ()))]
            c = ClientRound(k, view, view, slowdown=round(slowdown(k), 6))
            if reply is not None:
                c.num_samples, c.train_loss, c.compute_s = reply.num_samples, reply.train_loss, reply.compute_s
            if span:
                c.compute_start_s, c.compute_end_s = span[0], span[1]
                c.compute_s = span[2] if c.compute_s is None else c.compute_s
            c.bytes_down, c.bytes_up = sum(t[4] for t in downloads), sum(t[4] for t in uploads)
            c.download_s = _duration(downloads)
            c.upload_s = _duration(uploads)
            if view in ("straggler", "discarded"):
                offline_at = self._went_offline(k, start, end, facts)
                failed = next((t for t in downloads + uploads if t[7] in FAILED), None)
                if offline_at is not None:
                    c.outcome, c.offline_at = "offline", offline_at
                elif failed is not None:
                    c.outcome, c.failed = "failed_transfer", f"{'up' if failed[1] == UP else 'down'} {failed[7]}"
            out.append(c)
        return out

    def _went_offline(self, k: int, start: float, end: float, facts: Facts) -> float | None:
        """When client k's device went offline, if it was offline at any time in the
        round [start, end): since before the round, or during it."""
        since = self._before.get(k)
        for at, offline in facts.availability.get(k, ()):
            if at <= start:  # switches up to the round's first instant set its state then
                since = (since if since is not None else at) if offline else None
            elif at < end and offline:
                return at if since is None else since
        return since


def _began(transfer: list) -> float:
    entry, end = transfer[2], transfer[3]
    return entry if entry is not None else end


def _duration(transfers: list[list]) -> float | None:
    spans = [t[3] - t[2] for t in transfers if t[2] is not None]
    return round(math.fsum(spans), 6) if spans else None
