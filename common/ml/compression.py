"""Update compression of Konečný et al. (2016): structured and sketched updates.

A client's update is H = w_local - w_global, one flat float32 vector laid out as
``models.get_flat``. A codec splits it into the model's parameters ("layers") and
treats each one as the paper does:

* **raw** — small layers (fewer than ``min_layer_size`` values) and, unless
  ``compress_biases``, 1-D parameters travel as plain float32.
* **structured** (trained in the restricted space, see ``structured.py``):
  ``random_mask`` sends only the entries of a seeded random pattern;
  ``low_rank`` views a weight of shape (d1, ...) as a matrix (d1, d2), writes
  H = A B with A (d1 x k) regenerated from the seed and sends only B (k x d2).
* **sketched** (trained fully, then compressed): randomized Hadamard rotation,
  subsampling and b-bit probabilistic quantization, in that order (see below).
  A sketch may also be applied on top of a structured update's values, as the
  paper suggests; each sketch is unbiased, so the server's average is too.

Order of the sketch stages, rotate -> subsample -> quantize: the rotation exists
to flatten the vector that quantization sees, and subsampling a flat vector keeps
it flat, so either order serves quantization. The difference is the zero padding
to a power of two. Rotating first (as Section 4.2 of the paper does: "First, we
apply a random rotation to preprocess the local update") lets the client draw
exactly ceil(f * n) of the n' >= n rotated values, so the wire carries the
fraction it was asked for. Subsampling first would rotate m = f * n values padded
to m', and all m' rotated values would have to be sent (up to 2x the bytes).
The price of rotating first is more subsampling variance (n'/m instead of n/m)
and an O(n' log n') transform on both sides, small next to local training.

All randomness (masks, A, signs, subsample indices, stochastic rounding) comes
from ``update_seed(run_seed, round, client)``, which the server recomputes: no
mask, matrix or rotation is ever sent. The encoded update is a dict of one short
string and three numeric arrays (wire-ready, see ``node/wire.py``); quantized
codes are bit-packed, so ``encoded_size`` is the true payload size.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from fedemu.node import streams

STRUCTURED_CHOICES = ("none", "low_rank", "random_mask")
MAX_BITS = 8
FLOAT_BITS = 32  # ``bits = 32`` in a config means "no quantization" (TOML has no null)

# Keys of an encoded update. "codec" is a fingerprint of spec + layer shapes, so a
# server never decodes an update made by a differently configured client.
ENCODED_KEYS = ("codec", "values", "codes", "ranges")
# Upper bound on the msgpack bytes of an encoded dict besides its array frames
# (map, keys, the fingerprint string and three array descriptors); tested
# against node.wire.pack_body. A fixed constant keeps sizes a simple formula.
ENCODED_HEADER_BYTES = 96
_FORMAT = "fedemu-compression-1"

# The purposes of a layer's random streams under one update's seed (fedemu.node.streams).
_MASK, _BASIS, _SIGNS, _SAMPLE, _ROUNDING = "mask", "basis", "signs", "sample", "rounding"


# --- seeds ---------------------------------------------------------------------------


def update_seed(run_seed: int, round_: int, client: int) -> int:
    """The seed of one client's update in one round; client and server both call this."""
    for name, value in (("run_seed", run_seed), ("round", round_), ("client", client)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    # 63 bits, so that it seeds the layers' streams in turn.
    return streams.seed64(int(run_seed), "compression", int(round_), int(client)) >> 1


def _rng(seed: int, layer: int, purpose: str) -> np.random.Generator:
    return streams.generator(seed, f"compression.{purpose}", layer)


# --- the spec ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CompressionSpec:
    """What to compress and how; ``from_dict`` reads it from a config table.

    structured       "none" | "low_rank" | "random_mask"
    rank_fraction    low_rank: k = ceil(rank_fraction * min(d1, d2)), in (0, 1]
    keep_fraction    random_mask: fraction of a layer's entries trained and sent, in (0, 1]
    subsample        sketch: fraction of a layer's values sent, in (0, 1]; 1 = all
    rotate           sketch: randomized Hadamard rotation before quantizing
    bits             sketch: 1..8 bits per value, or None (float32 values)
    min_layer_size   layers with fewer values travel raw
    compress_biases  also compress 1-D parameters (not with low_rank)
    """

    structured: str = "none"
    rank_fraction: float = 0.25
    keep_fraction: float = 0.25
    subsample: float = 1.0
    rotate: bool = False
    bits: int | None = None
    min_layer_size: int = 1024
    compress_biases: bool = False

    def __post_init__(self) -> None:
        for key, value in _validated(dataclasses.asdict(self), "").items():
            object.__setattr__(self, key, value)  # normalized: e.g. int fractions become floats

    @classmethod
    def from_dict(cls, table: Mapping[str, Any], *, prefix: str = "") -> "CompressionSpec":
        """Build from a config table; errors name the key (after ``prefix``, e.g.
        "compression.") and what it accepts. Keys that only matter for another
        ``structured`` choice are rejected rather than silently ignored."""
        if not isinstance(table, Mapping):
            raise ValueError(f"{prefix or 'compression spec'} must be a table, got {type(table).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in table:
            if key not in known:
                raise ValueError(f"unknown key {prefix}{key}; allowed keys: {', '.join(known)}")
        structured = table.get("structured", "none")
        for key, needs in (("rank_fraction", "low_rank"), ("keep_fraction", "random_mask")):
            if key in table and structured != needs:
                raise ValueError(
                    f"{prefix}{key} applies only to {prefix}structured = {needs!r}, not {structured!r}")
        values = {f.name: f.default for f in dataclasses.fields(cls)}
        values.update(table)
        return cls(**_validated(values, prefix))

    def to_dict(self) -> dict:
        """The keys ``from_dict`` accepts back, without those irrelevant to ``structured``."""
        table = dataclasses.asdict(self)
        if self.structured != "low_rank":
            del table["rank_fraction"]
        if self.structured != "random_mask":
            del table["keep_fraction"]
        if table["bits"] is None:
            table["bits"] = FLOAT_BITS
        return table

    @property
    def sketched(self) -> bool:
        return self.subsample < 1.0 or self.rotate or self.bits is not None

    @property
    def compresses(self) -> bool:
        """Whether updates are compressed at all (structured, sketched or both)."""
        return self.structured != "none" or self.sketched


def _validated(values: dict, prefix: str) -> dict:
    """Checked and normalized spec values; a ValueError names the first bad key."""
    out = dict(values)

    def fail(key: str, rule: str) -> None:
        raise ValueError(f"{prefix}{key} = {values[key]!r} is not allowed; it must be {rule}")

    def is_int(value: Any) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if not isinstance(values["structured"], str) or values["structured"] not in STRUCTURED_CHOICES:
        fail("structured", "one of " + ", ".join(map(repr, STRUCTURED_CHOICES)))
    for key in ("rank_fraction", "keep_fraction", "subsample"):
        value = values[key]
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0.0 < value <= 1.0:
            fail(key, "a number in (0, 1]")
        out[key] = float(value)
    for key in ("rotate", "compress_biases"):
        if not isinstance(values[key], bool):
            fail(key, "true or false")
    bits = values["bits"]
    if bits is not None:
        if not is_int(bits) or not (1 <= bits <= MAX_BITS or bits == FLOAT_BITS):
            fail("bits", f"an integer in 1..{MAX_BITS}, or {FLOAT_BITS} (or None) for float32 values")
        out["bits"] = None if bits == FLOAT_BITS else int(bits)
    if not is_int(values["min_layer_size"]) or values["min_layer_size"] < 0:
        fail("min_layer_size", "an integer >= 0")
    out["min_layer_size"] = int(values["min_layer_size"])
    if values["structured"] == "low_rank" and values["compress_biases"]:
        fail("compress_biases", "false with structured = 'low_rank' (a 1-D parameter has no low-rank form)")
    return out


# --- building blocks: Hadamard rotation, quantization, bit packing -------------------------


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fwht(x: np.ndarray) -> np.ndarray:
    """Orthonormal fast Walsh-Hadamard transform (a new float32 array).

    The normalized Sylvester matrix is symmetric and orthogonal, so this
    function is its own inverse. The length must be a power of two.
    """
    y = np.array(x, dtype=np.float32)  # always a copy: callers' arrays may be read-only
    n = y.shape[0]
    if y.ndim != 1 or n == 0 or n & (n - 1):
        raise ValueError(f"fwht needs a 1-D vector of power-of-two length, got shape {y.shape}")
    half = 1
    while half < n:
        pairs = y.reshape(-1, 2, half)
        left = pairs[:, 0, :].copy()
        pairs[:, 0, :] += pairs[:, 1, :]
        np.subtract(left, pairs[:, 1, :], out=pairs[:, 1, :])
        half *= 2
    y *= np.float32(1.0 / math.sqrt(n))
    return y


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """H D x: zero-pad x to len(signs) (a power of two), flip signs, transform."""
    padded = np.zeros(len(signs), dtype=np.float32)
    padded[: len(x)] = x
    padded *= signs
    return fwht(padded)


def unrotate(y: np.ndarray, signs: np.ndarray, length: int) -> np.ndarray:
    """Inverse of ``rotate``: D H y, cut back to the first ``length`` values."""
    x = fwht(y)
    x *= signs
    return x[:length]


def quantize(values: np.ndarray, bits: int, rng: np.random.Generator) -> tuple[np.ndarray, float, float]:
    """Unbiased stochastic rounding onto 2**bits evenly spaced levels in [min, max].

    The paper says "2**b intervals", but b bits index 2**b levels, i.e. 2**b - 1
    intervals; that is what its 1-bit case (levels min and max) is. Returns
    (codes uint8, lo, hi); lo and hi are values of the float32 input, so the
    decoder, given them as float32, rebuilds the exact same grid.
    """
    lo, hi = float(values.min()), float(values.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        # A diverged client: decode to NaN rather than to made-up finite values,
        # so the server sees what an uncompressed update would have carried.
        return np.zeros(len(values), dtype=np.uint8), math.nan, math.nan
    if hi == lo:
        return np.zeros(len(values), dtype=np.uint8), lo, hi
    levels = (1 << bits) - 1
    position = (values.astype(np.float64) - lo) * (levels / (hi - lo))
    lower = np.floor(position)
    # Round up with probability equal to the distance from the lower level:
    # E[code] = position, hence E[dequantized] = value.
    codes = lower + (rng.random(len(values)) < position - lower)
    return np.clip(codes, 0, levels).astype(np.uint8), lo, hi


def dequantize(codes: np.ndarray, bits: int, lo: float, hi: float) -> np.ndarray:
    step = (hi - lo) / ((1 << bits) - 1)
    return (lo + codes.astype(np.float64) * step).astype(np.float32)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """The low ``bits`` bits of each uint8 code, most significant first, packed
    into ceil(len * bits / 8) bytes (the last byte zero-filled)."""
    codes = np.asarray(codes, dtype=np.uint8)
    unpacked = np.unpackbits(codes[:, None], axis=1)[:, 8 - bits :]
    return np.packbits(unpacked.reshape(-1))


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of ``pack_bits``: ``count`` uint8 codes."""
    flat = np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count * bits)
    widened = np.zeros((count, 8), dtype=np.uint8)
    widened[:, 8 - bits :] = flat.reshape(count, bits)
    return np.packbits(widened, axis=1).reshape(count)


def packed_bytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


def low_rank_product(basis: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """A @ B in float32, accumulated in float64 so that client and server get
    bit-identical results whatever BLAS, thread count or summation order."""
    return (basis.astype(np.float64) @ factor.astype(np.float64)).astype(np.float32)


def _count(fraction: float, total: int) -> int:
    # The 1e-9 keeps float noise (0.1 * 30 = 3.0000000000000004) from adding a value.
    return min(total, max(1, math.ceil(fraction * total - 1e-9)))


# --- the codec -----------------------------------------------------------------------------

RAW, RANDOM_MASK, LOW_RANK, SKETCH = "raw", "random_mask", "low_rank", "sketch"


@dataclass(frozen=True)
class LayerPlan:
    """How one parameter tensor is sent; all sizes are fixed by spec and shape."""

    index: int
    shape: tuple[int, ...]
    offset: int  # into the flat vector
    size: int
    kind: str  # RAW, RANDOM_MASK, LOW_RANK or SKETCH
    rows: int  # d1 of the matrix view (low_rank)
    cols: int  # d2 of the matrix view (low_rank)
    rank: int  # k (low_rank)
    coordinates: int  # values describing the layer before any sketch (entries kept, k * d2, or size)
    sketched: bool  # whether rotate / subsample / quantize apply to those coordinates
    rotated_length: int  # next power of two of ``coordinates`` when rotating, else ``coordinates``
    sent: int  # values on the wire
    bits: int  # bits per value on the wire (32 = float32)

    @property
    def wire_bytes(self) -> int:
        if self.bits == FLOAT_BITS:
            return 4 * self.sent
        return packed_bytes(self.sent, self.bits) + 8  # + float32 (lo, hi)


class UpdateCodec:
    """Encodes a client's flat update and decodes it on the server; build with ``make_codec``."""

    def __init__(self, spec: CompressionSpec, layer_shapes: Sequence[Sequence[int]]) -> None:
        self.spec = spec
        self.layer_shapes = [tuple(int(d) for d in shape) for shape in layer_shapes]
        self.layers: list[LayerPlan] = []
        offset = 0
        for index, shape in enumerate(self.layer_shapes):
            plan = self._plan(index, shape, offset)
            self.layers.append(plan)
            offset += plan.size
        self.num_parameters = offset
        digest = hashlib.sha256(
            json.dumps([_FORMAT, spec.to_dict(), self.layer_shapes], sort_keys=True).encode()
        ).hexdigest()
        self.fingerprint = digest[:12]
        self._float_layers = [p for p in self.layers if p.bits == FLOAT_BITS]
        self._quantized_layers = [p for p in self.layers if p.bits != FLOAT_BITS]
        self.encoded_bytes = ENCODED_HEADER_BYTES + sum(p.wire_bytes for p in self.layers)

    @property
    def structured(self) -> bool:
        """Whether some layer is trained in a restricted space (random_mask or low_rank)."""
        return any(plan.kind in (RANDOM_MASK, LOW_RANK) for plan in self.layers)

    def _plan(self, index: int, shape: tuple[int, ...], offset: int) -> LayerPlan:
        spec = self.spec
        size = math.prod(shape)
        rows = shape[0] if shape else 1
        cols = size // rows if rows else 0
        compress = size > 0 and size >= spec.min_layer_size and (len(shape) >= 2 or spec.compress_biases)
        if spec.structured == "low_rank" and len(shape) < 2:
            compress = False
        if not compress or (spec.structured == "none" and not spec.sketched):
            kind, rank, coordinates = RAW, 0, size
        elif spec.structured == "low_rank":
            rank = _count(spec.rank_fraction, min(rows, cols))
            kind, coordinates = LOW_RANK, rank * cols
        elif spec.structured == "random_mask":
            kind, rank, coordinates = RANDOM_MASK, 0, _count(spec.keep_fraction, size)
        else:
            kind, rank, coordinates = SKETCH, 0, size
        sketched = kind != RAW and spec.sketched
        rotated = next_power_of_two(coordinates) if sketched and spec.rotate else coordinates
        if sketched and spec.subsample < 1.0:
            # A fraction of the unpadded count, drawn from all rotated values.
            sent = min(rotated, _count(spec.subsample, coordinates))
        else:
            sent = rotated
        bits = spec.bits if sketched and spec.bits is not None else FLOAT_BITS
        return LayerPlan(index, shape, offset, size, kind, rows, cols, rank, coordinates,
                         sketched, rotated, sent, bits)

    # --- the shared randomness (same seed -> same arrays on client and server) ---

    def mask(self, layer: int, seed: int) -> np.ndarray:
        """random_mask: boolean pattern over the layer's entries (row-major), exactly
        ``coordinates`` of them True."""
        plan = self._layer(layer, RANDOM_MASK)
        chosen = _rng(seed, layer, _MASK).choice(plan.size, size=plan.coordinates, replace=False)
        pattern = np.zeros(plan.size, dtype=bool)
        pattern[chosen] = True
        return pattern.reshape(plan.shape)

    def basis(self, layer: int, seed: int) -> np.ndarray:
        """low_rank: the fixed factor A (d1 x k).

        Entries N(0, 1/d1), so A's columns are nearly orthonormal: a step on B
        moves H by -lr A A^T grad, roughly the projection of the full step onto a
        random k-dimensional subspace, and the plain SGD learning rate still fits.
        """
        plan = self._layer(layer, LOW_RANK)
        rng = _rng(seed, layer, _BASIS)
        return rng.standard_normal((plan.rows, plan.rank), dtype=np.float32) / np.float32(math.sqrt(plan.rows))

    def rotation_signs(self, layer: int, seed: int) -> np.ndarray:
        """The diagonal D of the randomized Hadamard rotation: +-1, float32."""
        plan = self._layer(layer)
        if not (plan.sketched and self.spec.rotate):
            raise ValueError(f"layer {layer} is not rotated")
        flips = _rng(seed, layer, _SIGNS).integers(0, 2, size=plan.rotated_length, dtype=np.int8)
        return (1 - 2 * flips).astype(np.float32)

    def sample_indices(self, layer: int, seed: int) -> np.ndarray:
        """The subsampled positions among the (rotated) values, sent in this order."""
        plan = self._layer(layer)
        if not (plan.sketched and plan.sent < plan.rotated_length):
            raise ValueError(f"layer {layer} is not subsampled")
        return _rng(seed, layer, _SAMPLE).choice(plan.rotated_length, size=plan.sent, replace=False)

    def _layer(self, layer: int, kind: str | None = None) -> LayerPlan:
        plan = self.layers[layer]
        if kind is not None and plan.kind != kind:
            raise ValueError(f"layer {layer} is {plan.kind}, not {kind}")
        return plan

    # --- client side ---

    def encode(self, delta: np.ndarray, seed: int) -> dict:
        """Encode a full update H (flat float32, get_flat layout).

        Structured layers keep H's orthogonal projection onto the restricted
        space: the masked entries, or B = argmin ||A B - H||. That is exact when
        H was trained in that space; ``structured.compressed_client_update``
        passes the trained values directly instead. Non-finite values are passed
        on, never hidden: a quantized layer holding one decodes to all NaN.
        """
        delta = self._check_delta(delta)
        coordinates = []
        for plan in self.layers:
            block = delta[plan.offset : plan.offset + plan.size]
            if plan.kind == RANDOM_MASK:
                block = block[self.mask(plan.index, seed).reshape(-1)]
            elif plan.kind == LOW_RANK:
                basis = self.basis(plan.index, seed).astype(np.float64)
                target = block.reshape(plan.rows, plan.cols).astype(np.float64)
                block = np.linalg.lstsq(basis, target, rcond=None)[0].reshape(-1)
            coordinates.append(block)
        return self.encode_restricted(coordinates, seed)

    def encode_restricted(self, coordinates: Sequence[np.ndarray], seed: int) -> dict:
        """Encode per-layer coordinates: the raw delta of raw and sketch layers,
        the masked entries (row-major) of random_mask layers, B (row-major) of
        low_rank layers."""
        if len(coordinates) != len(self.layers):
            raise ValueError(f"{len(coordinates)} layers of coordinates, codec has {len(self.layers)}")
        floats, codes, ranges = [], [], []
        for plan, values in zip(self.layers, coordinates):
            values = np.asarray(values, dtype=np.float32).reshape(-1)
            if values.shape[0] != plan.coordinates:
                raise ValueError(f"layer {plan.index}: {values.shape[0]} coordinates, expected {plan.coordinates}")
            if plan.sketched:
                if self.spec.rotate:
                    values = rotate(values, self.rotation_signs(plan.index, seed))
                if plan.sent < plan.rotated_length:
                    values = values[self.sample_indices(plan.index, seed)]
            if plan.bits == FLOAT_BITS:
                floats.append(values)
            else:
                layer_codes, lo, hi = quantize(values, plan.bits, _rng(seed, plan.index, _ROUNDING))
                codes.append(pack_bits(layer_codes, plan.bits))
                ranges.append((lo, hi))
        return {
            "codec": self.fingerprint,
            "values": _concat(floats, np.float32),
            "codes": _concat(codes, np.uint8),
            "ranges": np.array(ranges, dtype=np.float32).reshape(-1),
        }

    # --- server side ---

    def decode(self, encoded: Mapping[str, Any], seed: int) -> np.ndarray:
        """The update H as a new flat float32 vector. Unbiased for sketches;
        exact for raw and structured layers. Malformed input raises ValueError."""
        delta = np.empty(self.num_parameters, dtype=np.float32)
        for plan, values in zip(self.layers, self.decode_restricted(encoded, seed)):
            block = delta[plan.offset : plan.offset + plan.size]
            if plan.kind == RANDOM_MASK:
                block[:] = 0.0
                block[self.mask(plan.index, seed).reshape(-1)] = values
            elif plan.kind == LOW_RANK:
                factor = values.reshape(plan.rank, plan.cols)
                block[:] = low_rank_product(self.basis(plan.index, seed), factor).reshape(-1)
            else:
                block[:] = values
        return delta

    def decode_restricted(self, encoded: Mapping[str, Any], seed: int) -> list[np.ndarray]:
        """Per-layer coordinates (as ``encode_restricted`` takes them), un-sketched."""
        floats, codes, ranges = self._check_encoded(encoded)
        float_at = code_at = quantized_seen = 0
        out = []
        for plan in self.layers:
            if plan.bits == FLOAT_BITS:
                values = floats[float_at : float_at + plan.sent].astype(np.float32)
                float_at += plan.sent
            else:
                length = packed_bytes(plan.sent, plan.bits)
                layer_codes = unpack_bits(codes[code_at : code_at + length], plan.bits, plan.sent)
                code_at += length
                lo, hi = float(ranges[2 * quantized_seen]), float(ranges[2 * quantized_seen + 1])
                quantized_seen += 1
                values = dequantize(layer_codes, plan.bits, lo, hi)
            if plan.sketched:
                if plan.sent < plan.rotated_length:
                    # Each position is kept with probability sent / rotated_length:
                    # scaling by its inverse makes the expectation exact.
                    full = np.zeros(plan.rotated_length, dtype=np.float32)
                    full[self.sample_indices(plan.index, seed)] = values * np.float32(plan.rotated_length / plan.sent)
                    values = full
                if self.spec.rotate:
                    values = unrotate(values, self.rotation_signs(plan.index, seed), plan.coordinates)
            out.append(values)
        return out

    def _check_delta(self, delta: np.ndarray) -> np.ndarray:
        delta = np.asarray(delta, dtype=np.float32)
        if delta.shape != (self.num_parameters,):
            raise ValueError(f"update has shape {delta.shape}, codec expects ({self.num_parameters},)")
        return delta

    def _check_encoded(self, encoded: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not isinstance(encoded, Mapping) or set(encoded) != set(ENCODED_KEYS):
            keys = sorted(encoded) if isinstance(encoded, Mapping) else type(encoded).__name__
            raise ValueError(f"an encoded update has keys {', '.join(ENCODED_KEYS)}; got {keys}")
        if encoded["codec"] != self.fingerprint:
            raise ValueError(f"update was encoded by codec {encoded['codec']!r}, this is {self.fingerprint!r} "
                             "(different compression spec or model)")
        expected = {
            "values": (np.float32, sum(p.sent for p in self._float_layers)),
            "codes": (np.uint8, sum(packed_bytes(p.sent, p.bits) for p in self._quantized_layers)),
            "ranges": (np.float32, 2 * len(self._quantized_layers)),
        }
        arrays = []
        for key, (dtype, length) in expected.items():
            array = encoded[key]
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != (length,):
                got = f"{array.dtype} {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
                raise ValueError(f"encoded {key!r} must be {np.dtype(dtype)} of shape ({length},), got {got}")
            arrays.append(array)
        return arrays[0], arrays[1], arrays[2]

    def describe(self) -> list[dict]:
        """One row per layer: what is sent and how many bytes it takes."""
        return [{"layer": p.index, "shape": list(p.shape), "kind": p.kind, "size": p.size,
                 "rank": p.rank, "sent": p.sent, "bits": p.bits, "bytes": p.wire_bytes}
                for p in self.layers]


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def make_codec(spec: CompressionSpec | Mapping[str, Any], layer_shapes: Sequence[Sequence[int]]) -> UpdateCodec:
    """A codec for a model whose parameters have these shapes, in get_flat order."""
    if not isinstance(spec, CompressionSpec):
        spec = CompressionSpec.from_dict(spec)
    return UpdateCodec(spec, layer_shapes)


def parameter_shapes(model: Any) -> list[tuple[int, ...]]:
    """The shapes ``make_codec`` takes, from a torch module."""
    return [tuple(parameter.shape) for parameter in model.parameters()]


def encoded_size(encoded: Mapping[str, Any]) -> int:
    """Bytes of an encoded update: its array payloads plus ENCODED_HEADER_BYTES."""
    return ENCODED_HEADER_BYTES + sum(
        value.nbytes for value in encoded.values() if isinstance(value, np.ndarray))
