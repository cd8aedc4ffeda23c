"""Who the clients are: trace files mapped to clients (``[network.traces.NAME]``) and
device classes (``[[network.devices]]``), resolved into what each client's link,
availability and device follow.

A trace entry::

    [network.traces.phones]      # NAME: your choice; its random stream is "traces.NAME"
    file = "traces/devices.pkl"  # fedemu CSV, FedScale pickle, Mahimahi (a list: one entry each)
    format = "auto"              # or fedemu | fedscale | mahimahi
    use = ["compute", "links"]   # what clients take from it: compute, availability, links
                                 # (default: every use the file has fields for)
    assign = "index"             # the i-th client of the group gets the trace's entry i mod N;
                                 # "random": an entry drawn per client from the stream
    clients = "0-49"             # the group (or fraction = 0.5, a seeded choice); default: all
    direction = "both"           # Mahimahi: the link(s) that follow it, up, down or both

Later entries win over earlier ones for the clients and uses they share, as
``network.assign`` does. A client's compute speed comes from, in increasing
precedence: ``run.device_flops``, ``[[network.devices]]`` entries in order, then traces.

Device classes (:data:`DEVICE_CLASSES`) carry figures from a published source, named
beside each; ``[[network.devices]]`` also takes ``flops`` or ``example_s`` directly.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..streams import uniform
from .trace_files import COMPUTE_FIELDS, USES, TraceTable, read
from .traces import RateTrace, StepSeries, TraceError

TRACE_KEYS = ("file", "format", "use", "assign", "clients", "fraction", "direction")
DEVICE_KEYS = ("class", "flops", "example_s", "clients", "fraction")
ASSIGN = ("index", "random")


# Device classes: a compute speed and where it comes from. flops is training FLOP/s,
# counted as fedemu counts a model's training FLOPs (common/ml/devices.py): the
# forward pass's multiply-adds x 2, the same again for the weight gradients and for
# the input gradients (3 x 2 x MACs per example).
_RPI5_RESNET18_S_PER_IMAGE = 116.850590 / (20 * 16)  # t_train of 20 batches of 16 images
_RESNET18_TRAINING_FLOP = 3 * 2 * 1.80e9  # 1.80 GMACs per 224x224 image (the table's gmacs)
DEVICE_CLASSES: dict[str, dict[str, Any]] = {
    "raspberry-pi-5": {
        "flops": _RESNET18_TRAINING_FLOP / _RPI5_RESNET18_S_PER_IMAGE,  # 2.96e10
        "source": "Flower's embedded-federated-vision benchmark (Fernandez-Marques, 'Raspberry Pi 5: Ready "
                  "for Federated Vision', flower.ai/blog/2023-12-07-raspberrypi-is-ready-for-fl): ResNet-18 "
                  "trains 20 batches of 16 224x224 images in 116.85 s on a Raspberry Pi 5 (README's table); "
                  "1.80 GMACs per image",
    },
    "raspberry-pi-4": {
        "flops": _RESNET18_TRAINING_FLOP / _RPI5_RESNET18_S_PER_IMAGE / 2,
        "source": "the same benchmark's blog post: 'the new Raspberry Pi 5 is consistently 2x faster than its "
                  "predecessor' (the Raspberry Pi 4) at training every model it ran",
    },
    "fedscale-lognormal": {
        "example_s_lognormal": (0.005, 1.0, 0.6),  # scale x LogNormal(mean, sigma) s per example
        "source": "FedScale's ClientMetadata.get_completion_time_lognormal (fedscale/cloud/internal/"
                  "client_metadata.py, citing Papaya and GFL): seconds per example = 0.005 x "
                  "LogNormal(1, 0.6), here drawn once per client",
    },
}


@dataclass(frozen=True)
class LinkTrace:
    """What a client's link follows over time; None: what its profile says."""

    up: RateTrace | None = None
    down: RateTrace | None = None
    latency_ms: StepSeries | None = None
    loss: StepSeries | None = None

    def merged(self, other: LinkTrace) -> LinkTrace:
        """``other``'s series where it has them, this one's elsewhere."""
        return LinkTrace(*(b if b is not None else a for a, b in
                           zip((self.up, self.down, self.latency_ms, self.loss),
                               (other.up, other.down, other.latency_ms, other.loss))))


@dataclass
class TraceSource:
    """One ``[network.traces.NAME]`` entry, checked; its file(s) read on first use."""

    name: str
    files: tuple[str, ...]
    format: str = "auto"
    uses: tuple[str, ...] | None = None  # None: whatever the file has
    assign: str = "index"
    clients: frozenset[int] | None = None
    direction: str = "both"

    def tables(self) -> list[TraceTable]:
        fields = {"up": ("up_bytes_per_s",), "down": ("down_bytes_per_s",),
                  "both": ("up_bytes_per_s", "down_bytes_per_s")}[self.direction]
        return [_read_cached(path, self.format, fields, *_stamp(path)) for path in self.files]

    def entries(self) -> list[tuple[TraceTable, str]]:
        """(table, entry) of every entry, in the files' order."""
        return [(table, entry) for table in self.tables() for entry in table.entries]

    def used(self, table: TraceTable) -> tuple[str, ...]:
        """The uses this source takes from ``table``: those asked for (each must have a
        field in the file), else every use the file has a field for."""
        have = table.fields()

        def has(use: str) -> bool:
            return any(name in USES[use] or (use == "compute" and name.startswith("example_s:")) for name in have)

        if self.uses is None:
            return tuple(use for use in USES if has(use))
        for use in self.uses:
            if not has(use):
                raise TraceError(f"network.traces.{self.name}.use has {use!r}, but {table.source} has no field "
                                 f"for it ({', '.join(USES[use])}); it has {', '.join(sorted(have))}")
        return self.uses

    def chosen(self, k: int, position: int, count: int, seed: int) -> int:
        """Which entry (of ``count``) client k, the ``position``-th of the group, gets."""
        if self.assign == "index":
            return position % count
        return min(int(uniform(seed, f"traces.{self.name}", k, 0, 0) * count), count - 1)


def _stamp(path: str) -> tuple[int, int]:
    """What tells a changed file from the one read before."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceError(f"trace file {path} does not exist") from None
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=16)
def _read_cached(path: str, format: str, mahimahi_fields: tuple[str, ...], _mtime: int, _size: int) -> TraceTable:
    """A file read once per process while it is unchanged (validation and the run
    read the same files)."""
    return read(path, format, mahimahi_fields)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Population:
    """The traces and device classes of a run, resolved per client."""

    num_clients: int
    seed: int
    sources: list[TraceSource] = field(default_factory=list)
    devices: list[tuple[dict[str, float], frozenset[int] | None]] = field(default_factory=list)
    _resolved: dict | None = None

    @property
    def files(self) -> list[str]:
        return [path for source in self.sources for path in source.files]

    def digests(self) -> dict[str, dict[str, str]]:
        """Each trace's files with their sha256 (for the run's start event)."""
        return {source.name: {path: sha256_of(path) for path in source.files} for source in self.sources}

    def _resolve(self) -> dict:
        if self._resolved is not None:
            return self._resolved
        compute: dict[int, dict[str, float]] = {}
        for spec, clients in self.devices:
            for k in (range(self.num_clients) if clients is None else clients):
                compute[k] = _device_speed(spec, k, self.seed)
        online: dict[int, StepSeries] = {}
        links: dict[int, LinkTrace] = {}
        series_cache: dict[tuple[int, str, str], Any] = {}

        def series(table: TraceTable, entry: str, name: str):
            key = (id(table), entry, name)
            if key not in series_cache:
                series_cache[key] = table.series(entry, name)
            return series_cache[key]

        for source in self.sources:
            entries = source.entries()
            if not entries:
                continue
            uses = {use for table in {id(t): t for t, _ in entries}.values() for use in source.used(table)}
            clients = sorted(range(self.num_clients) if source.clients is None else source.clients)
            for position, k in enumerate(clients):
                table, entry = entries[source.chosen(k, position, len(entries), self.seed)]
                fields = table.entries[entry]
                if "compute" in uses and any(n in COMPUTE_FIELDS or n.startswith("example_s:") for n in fields):
                    # A device's speed is its first row: compute does not change over time.
                    compute[k] = {n: float(values[0]) for n, (_, values) in fields.items()
                                  if n in COMPUTE_FIELDS or n.startswith("example_s:")}
                if "availability" in uses and "online" in fields:
                    online[k] = series(table, entry, "online")
                if "links" in uses:
                    trace = LinkTrace(series(table, entry, "up_bytes_per_s"), series(table, entry, "down_bytes_per_s"),
                                      series(table, entry, "latency_ms"), series(table, entry, "loss"))
                    links[k] = links[k].merged(trace) if k in links else trace
        self._resolved = {"compute": compute, "online": online, "links": links}
        return self._resolved

    def compute(self) -> dict[int, dict[str, float]]:
        """Client -> its device's speed: {"flops": FLOP/s} or {"example_s": s, and
        "example_s:MODEL" where the trace has it}; clients not listed run at
        run.device_flops."""
        return self._resolve()["compute"]

    def online(self) -> dict[int, StepSeries]:
        return self._resolve()["online"]

    def links(self) -> dict[int, LinkTrace]:
        return self._resolve()["links"]


def _device_speed(spec: dict[str, Any], k: int, seed: int) -> dict[str, float]:
    if "example_s_lognormal" in spec:
        scale, mean, sigma = spec["example_s_lognormal"]
        u1, u2 = uniform(seed, "devices.lognormal/0", k, 0, 0), uniform(seed, "devices.lognormal/1", k, 0, 0)
        z = math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)
        return {"example_s": scale * math.exp(mean + sigma * z)}
    return {key: float(value) for key, value in spec.items() if key in COMPUTE_FIELDS}


def population_from_config(section: dict, num_clients: int, seed: int,
                           group: Callable[[dict, str], frozenset[int] | None], error) -> Population:
    """``network.traces`` and ``network.devices``, checked, files read (so a bad trace is
    refused before a run starts). ``group`` picks an entry's clients (network_spec._group);
    ``error`` is the exception to raise (LinkConfigError)."""
    population = Population(num_clients, seed)
    traces = section.get("traces", {})
    if not isinstance(traces, dict):
        raise error("network.traces must be a table of named traces: [network.traces.NAME] with file = ...")
    for name, entry in traces.items():
        where = f"network.traces.{name}"
        if not isinstance(entry, dict):
            raise error(f"{where} must be a table with file = ...")
        unknown = set(entry) - set(TRACE_KEYS)
        if unknown:
            raise error(f"unknown key {where}.{sorted(unknown)[0]}; a trace has {', '.join(TRACE_KEYS)}")
        files = entry.get("file")
        files = [files] if isinstance(files, str) else files
        if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
            raise error(f"{where}.file must be a file's path, or a list of paths")
        fmt = entry.get("format", "auto")
        if fmt not in ("auto", "fedemu", "fedscale", "mahimahi"):
            raise error(f"{where}.format = {fmt!r}: use auto, fedemu, fedscale or mahimahi")
        uses = entry.get("use")
        if uses is not None and (not isinstance(uses, list) or not uses or any(u not in USES for u in uses)):
            raise error(f"{where}.use = {uses!r}: a list of {', '.join(USES)}")
        assign = entry.get("assign", "index")
        if assign not in ASSIGN:
            raise error(f"{where}.assign = {assign!r}: use index or random")
        direction = entry.get("direction", "both")
        if direction not in ("up", "down", "both"):
            raise error(f"{where}.direction = {direction!r}: use up, down or both")
        source = TraceSource(name, tuple(str(Path(f).resolve()) for f in files), fmt,
                             tuple(uses) if uses is not None else None, assign, group(entry, where), direction)
        try:
            for table in source.tables():
                source.used(table)
        except (TraceError, OSError) as exc:
            raise error(f"{where}: {exc}") from None
        population.sources.append(source)
    devices = section.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise error("network.devices must be an array of tables ([[network.devices]] with class = ...)")
    for i, entry in enumerate(devices):
        where = f"network.devices[{i}]"
        unknown = set(entry) - set(DEVICE_KEYS)
        if unknown:
            raise error(f"unknown key {where}.{sorted(unknown)[0]}; a device entry has {', '.join(DEVICE_KEYS)}")
        given = [key for key in ("class", "flops", "example_s") if key in entry]
        if len(given) != 1:
            raise error(f"{where} needs one of class (a preset: {', '.join(DEVICE_CLASSES)}), flops or example_s")
        if "class" in entry:
            if entry["class"] not in DEVICE_CLASSES:
                raise error(f"{where}.class = {entry['class']!r} is not a device class; classes are "
                            f"{', '.join(DEVICE_CLASSES)}")
            spec = {k: v for k, v in DEVICE_CLASSES[entry["class"]].items() if k != "source"}
        else:
            value = entry[given[0]]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise error(f"{where}.{given[0]} = {value!r} must be a number > 0")
            spec = {given[0]: float(value)}
        population.devices.append((spec, group(entry, where)))
    return population
