"""Trace files as users have them, read into one table: entries (a client of the trace),
each with fields that change over time.

Formats (``detect`` tells them apart by their content):

* **fedemu**: CSV with the header ``client,t,field,value``, one row per change: entry
  ``client`` (any name) has ``field`` = ``value`` from ``t`` (emulated seconds) until
  its next row for that field. A field's first row holds from t = 0. Fields
  (:data:`FIELDS`): ``online`` (1 or 0), ``flops`` (training FLOP/s), ``example_s``
  (seconds to train on one example; ``example_s:MODEL`` for one model, e.g.
  ``example_s:cnn``), ``up_bytes_per_s``, ``down_bytes_per_s``, ``latency_ms``,
  ``loss``, and ``period_s`` (the entry's series repeat with this period).
* **fedscale**: FedScale's pickles (Lai et al., ICML 2022). ``client_device_capacity``:
  client id -> {'computation': ms of inference per sample, 'communication': kbit/s};
  FedScale charges training as 3 x the inference time per sample, and counts a kbit
  as 1,024 bits (its model size is bytes / 1024 x 8), so these become example_s = 3 x
  computation / 1000 and a bandwidth of communication x 128 bytes/s both ways.
  ``client_behave_trace``: client id -> {'active': [s], 'inactive': [s], 'finish_time':
  s, ...}: online from each active[i] to inactive[i], repeating every finish_time.
  Pickles are read with an unpickler that builds no object at all (every global is
  refused), and what it returns must be plain dicts, lists, numbers and strings.
* **mahimahi**: one link's packet-delivery trace (traces.RateTrace.from_mahimahi); the
  config says which direction it plays. Read without one (``fedemu traces``), a file
  named ``*.up`` or ``*.down`` (mm-link's uplink and downlink files) fills only its
  direction (:func:`mahimahi_direction`), any other name both; the entry is named for
  the link (``phone`` of ``phone.up``), so that a pair converts to one entry.
"""
from __future__ import annotations

import csv
import io
import math
import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .traces import RateTrace, StepSeries, TraceError

FORMATS = ("fedemu", "fedscale", "mahimahi")
CSV_HEADER = ["client", "t", "field", "value"]
RATE_FIELDS = ("up_bytes_per_s", "down_bytes_per_s")
LINK_FIELDS = (*RATE_FIELDS, "latency_ms", "loss")
COMPUTE_FIELDS = ("flops", "example_s")  # and example_s:MODEL
FIELDS = ("online", *COMPUTE_FIELDS, *LINK_FIELDS, "period_s")
# Which fields each use of a trace takes (network.traces.NAME.use).
USES = {"compute": COMPUTE_FIELDS, "availability": ("online",), "links": LINK_FIELDS}

FEDSCALE_TRAINING_FACTOR = 3.0  # FedScale's augmentation_factor: training = 3 x inference
FEDSCALE_KBIT_BYTES = 1024 / 8  # FedScale's kbit is 1,024 bits


@dataclass
class TraceTable:
    """What a trace file holds: for each entry (in the file's order) its fields, each a
    (times, values) pair starting at t = 0, and the entry's period if it repeats."""

    source: str
    format: str
    entries: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    periods: dict[str, float] = field(default_factory=dict)

    def fields(self) -> set[str]:
        return {name for fields in self.entries.values() for name in fields}

    def series(self, entry: str, name: str) -> StepSeries | None:
        got = self.entries[entry].get(name)
        if got is None:
            return None
        cls = RateTrace if name in RATE_FIELDS else StepSeries
        return cls(got[0], got[1], self.periods.get(entry), where=f"{self.source}, entry {entry!r}, {name}")

    def rows(self) -> Iterable[tuple[str, float, str, float]]:
        """The fedemu format's rows: (client, t, field, value), entries in order."""
        for entry, fields in self.entries.items():
            if entry in self.periods:
                yield entry, 0.0, "period_s", self.periods[entry]
            for name, (times, values) in sorted(fields.items()):
                for t, v in zip(times.tolist(), values.tolist()):
                    yield entry, t, name, v


def is_field(name: str) -> bool:
    return name in FIELDS or (name.startswith("example_s:") and len(name) > len("example_s:"))


def detect(path: Path) -> str:
    """A trace file's format, from its first bytes."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:1] == b"\x80":  # every pickle protocol from 2 on starts with PROTO
        return "fedscale"
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.replace(" ", "").lower() == ",".join(CSV_HEADER):
        return "fedemu"
    if first.isdigit():
        return "mahimahi"
    raise TraceError(f"{path}: not a trace fedemu knows: a fedemu CSV starts with the header "
                     f"'{','.join(CSV_HEADER)}', a Mahimahi trace with a millisecond timestamp, a FedScale "
                     "trace is a pickle")


def mahimahi_direction(path: str | Path) -> tuple[str, ...]:
    """The rate fields a Mahimahi file describes, by its name: mm-link takes an uplink
    and a downlink file, conventionally ``NAME.up`` and ``NAME.down``; a name that says
    neither describes both."""
    suffix = Path(path).suffix.lower()
    return {".up": ("up_bytes_per_s",), ".down": ("down_bytes_per_s",)}.get(suffix, RATE_FIELDS)


def read(path: str | Path, format: str = "auto", mahimahi_fields: tuple[str, ...] | None = None,
         mahimahi_window_ms: int = 1) -> TraceTable:
    """A trace file as a table. A Mahimahi trace becomes one entry (the file's name)
    whose ``mahimahi_fields`` all follow it (None: as its name says, mahimahi_direction),
    in steps of ``mahimahi_window_ms`` (RateTrace.from_mahimahi)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {path} does not exist")
    kind = detect(path) if format == "auto" else format
    if kind not in FORMATS:
        raise TraceError(f"{path}: format {format!r} is not one of auto, {', '.join(FORMATS)}")
    if kind == "fedscale":
        return _fedscale(path, load_plain_pickle(path))
    if kind == "mahimahi":
        with open(path) as f:
            rate = RateTrace.from_mahimahi(f, where=str(path), window_ms=mahimahi_window_ms)
        table = TraceTable(str(path), "mahimahi")
        fields = mahimahi_direction(path) if mahimahi_fields is None else mahimahi_fields
        # A one-direction file is named for its link (phone.up): so is its entry, which
        # the other direction's file (phone.down) then joins when converted together.
        entry = path.stem if len(fields) == 1 and mahimahi_direction(path) == fields else path.name
        table.entries[entry] = {name: (rate.times, rate.values) for name in fields}
        table.periods[entry] = rate.period
        return table
    return _fedemu_csv(path)


def write_csv(table: TraceTable, out) -> int:
    """Write ``table`` in fedemu's format to a text stream; returns the rows written."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    count = 0
    for entry, t, name, value in table.rows():
        writer.writerow([entry, repr(float(t)), name, repr(float(value))])
        count += 1
    return count


# --- pickles, read safely ----------------------------------------------------------------


class _PlainUnpickler(pickle.Unpickler):
    """Builds containers and scalars only: any global a pickle names (a class, a
    function: how a pickle runs code) is refused."""

    def __init__(self, f, source: str) -> None:
        super().__init__(f)
        self.source = source

    def find_class(self, module: str, name: str):
        raise TraceError(f"{self.source}: the pickle names {module}.{name}; a trace file may hold only plain "
                         "dicts, lists, numbers and strings, so it is not loaded")

    def persistent_load(self, pid):
        raise TraceError(f"{self.source}: the pickle refers to an external object; a trace file may hold "
                         "only plain dicts, lists, numbers and strings")


def load_plain_pickle(path: str | Path) -> Any:
    """A pickle's content if it is plain data (dicts, lists, tuples, numbers, strings),
    else TraceError naming the file. Never runs code from the file."""
    data = Path(path).read_bytes()
    try:
        value = _PlainUnpickler(io.BytesIO(data), str(path)).load()
    except TraceError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise TraceError(f"{path}: not a readable pickle ({type(exc).__name__}: {exc})") from None
    _check_plain(value, str(path), "the pickle")
    return value


def _check_plain(value: Any, source: str, where: str) -> None:
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TraceError(f"{source}: {at} has a key of type {type(key).__name__}; a trace file "
                                     "may hold only plain dicts, lists, numbers and strings")
                stack.append((inner, f"{at}[{key!r}]"))
        elif isinstance(item, (list, tuple)):
            stack.extend((inner, f"{at}[{i}]") for i, inner in enumerate(item))
        elif not isinstance(item, (int, float, str)):
            raise TraceError(f"{source}: {at} is a {type(item).__name__}; a trace file may hold only plain "
                             "dicts, lists, numbers and strings")


def _number(value: Any, source: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(f"{source}: {where} = {value!r} must be a finite number")
    return float(value)


def _fedscale(path: Path, content: Any) -> TraceTable:
    source = str(path)
    if not isinstance(content, dict) or not content:
        raise TraceError(f"{source}: a FedScale trace is a dict of client id -> record; this pickle holds "
                         f"a {type(content).__name__}")
    sample = next(iter(content.values()))
    if isinstance(sample, dict) and {"computation", "communication"} <= set(sample):
        return _fedscale_devices(source, content)
    if isinstance(sample, dict) and {"active", "inactive", "finish_time"} <= set(sample):
        return _fedscale_behaviour(source, content)
    raise TraceError(f"{source}: neither FedScale trace: client_device_capacity records have 'computation' and "
                     "'communication', client_behave_trace records 'active', 'inactive' and 'finish_time'")


def _constant(value: float) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(1), np.array([value])


def _fedscale_devices(source: str, content: dict) -> TraceTable:
    table = TraceTable(source, "fedscale")
    for client, record in content.items():
        where = f"client {client!r}"
        if not isinstance(record, dict):
            raise TraceError(f"{source}: {where} is not a record")
        computation = _number(record.get("computation"), source, f"{where}['computation']")
        communication = _number(record.get("communication"), source, f"{where}['communication']")
        if computation <= 0 or communication <= 0:
            raise TraceError(f"{source}: {where}: computation and communication must be > 0")
        rate = communication * FEDSCALE_KBIT_BYTES
        table.entries[str(client)] = {"example_s": _constant(FEDSCALE_TRAINING_FACTOR * computation / 1000.0),
                                      "up_bytes_per_s": _constant(rate), "down_bytes_per_s": _constant(rate)}
    return table


def _fedscale_behaviour(source: str, content: dict) -> TraceTable:
    table = TraceTable(source, "fedscale")
    for client, record in content.items():
        where = f"client {client!r}"
        active, inactive = record.get("active"), record.get("inactive")
        if not isinstance(active, list) or not isinstance(inactive, list) or len(active) != len(inactive):
            raise TraceError(f"{source}: {where}: 'active' and 'inactive' must be lists of equal length")
        period = _number(record.get("finish_time"), source, f"{where}['finish_time']")
        if period <= 0:
            raise TraceError(f"{source}: {where}: finish_time must be > 0")
        times, values = [0.0], [0.0]
        for i, (on, off) in enumerate(zip(active, inactive)):
            on, off = _number(on, source, f"{where}['active'][{i}]"), _number(off, source, f"{where}['inactive'][{i}]")
            if not (times[-1] <= on <= off <= period) or (i and on < times[-1]):
                raise TraceError(f"{source}: {where}: interval {i} [{on:g}, {off:g}] must start after the "
                                 f"previous one ends and lie within finish_time = {period:g}")
            _step(times, values, on, 1.0)
            _step(times, values, off, 0.0)
        if len(times) > 1 and times[-1] >= period:  # offline from the period on: where the repeat starts anyway
            times.pop(), values.pop()
        table.entries[str(client)] = {"online": (np.asarray(times), np.asarray(values))}
        table.periods[str(client)] = period
    return table


def _step(times: list[float], values: list[float], t: float, value: float) -> None:
    """Append a step, replacing one at the same time (a zero-length interval)."""
    if times[-1] == t:
        values[-1] = value
        if len(values) > 1 and values[-2] == value:
            times.pop(), values.pop()
    else:
        times.append(t)
        values.append(value)


def _fedemu_csv(path: Path) -> TraceTable:
    source = str(path)
    table = TraceTable(source, "fedemu")
    rows: dict[str, dict[str, list[tuple[float, float, int]]]] = {}
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip().lower() for h in header] != CSV_HEADER:
            raise TraceError(f"{source}: the first line must be the header {','.join(CSV_HEADER)}")
        for number, row in enumerate(reader, 2):
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != 4:
                raise TraceError(f"{source}, line {number}: {len(row)} columns; rows are client,t,field,value")
            client, t_text, name, value_text = (cell.strip() for cell in row)
            if not client:
                raise TraceError(f"{source}, line {number}: the client is empty")
            if not is_field(name):
                raise TraceError(f"{source}, line {number}: unknown field {name!r}; fields are "
                                 f"{', '.join(FIELDS)} (and example_s:MODEL)")
            try:
                t, value = float(t_text), float(value_text)
            except ValueError:
                raise TraceError(f"{source}, line {number}: t and value must be numbers") from None
            if not (math.isfinite(t) and t >= 0 and math.isfinite(value)):
                raise TraceError(f"{source}, line {number}: t must be >= 0 and value finite")
            _check_value(name, value, f"{source}, line {number}")
            rows.setdefault(client, {}).setdefault(name, []).append((t, value, number))
    if not rows:
        raise TraceError(f"{source}: no rows after the header")
    for client, fields in rows.items():
        entry: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, series in fields.items():
            series.sort(key=lambda r: r[0])
            for (t0, _, n0), (t1, _, n1) in zip(series, series[1:]):
                if t0 == t1:
                    raise TraceError(f"{source}, lines {n0} and {n1}: client {client!r} has two {name} rows at "
                                     f"t = {t0:g}")
            if name == "period_s":
                table.periods[client] = series[-1][1]
                continue
            times = np.array([r[0] for r in series])
            times[0] = 0.0  # the first row holds from the start
            entry[name] = (times, np.array([r[1] for r in series]))
        table.entries[client] = entry
    for client, period in table.periods.items():
        last = max((times[-1] for times, _ in table.entries[client].values()), default=0.0)
        if period <= last:
            raise TraceError(f"{source}: client {client!r}: period_s = {period:g} must be after its last change "
                             f"(t = {last:g})")
    return table


def _check_value(name: str, value: float, where: str) -> None:
    rules = {"online": (lambda v: v in (0.0, 1.0), "0 or 1"), "loss": (lambda v: 0 <= v <= 1, "in [0, 1]"),
             "latency_ms": (lambda v: v >= 0, ">= 0"), "up_bytes_per_s": (lambda v: v >= 0, ">= 0"),
             "down_bytes_per_s": (lambda v: v >= 0, ">= 0"), "period_s": (lambda v: v > 0, "> 0")}
    ok, rule = rules.get(name, (lambda v: v > 0, "> 0"))
    if not ok(value):
        raise TraceError(f"{where}: {name} = {value:g} must be {rule}")
