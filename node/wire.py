"""The wire format: what crosses a ZeroMQ socket between nodes and the broker.

A message is a multipart ZeroMQ message::

    [header, body, array_0, array_1, ...]

* ``header`` — msgpack array ``[version, kind, src_node, src_id, dst_node, dst]``,
  optionally followed by a ``timing`` field and a ``charge`` (see :class:`Header`): the only frame
  the broker unpacks, so routing cost does not grow with the payload. ``dst`` is a
  local process id (int) or a registered name (str); ``dst_node`` is ``""`` when the
  destination is a name the broker must resolve.
* A message to many processes of one node (``MANY``, see :func:`encode_many`) has a
  ``recipients`` frame between the header and the body: it crosses each socket once
  and the receiving node decodes the body once per recipient.
* ``body`` — msgpack of the payload. ndarrays inside it are replaced by a small
  extension record (index, dtype, shape) and travel as the raw frames that follow,
  so a 800 KB model is never copied into a msgpack buffer and never pickled.
* Pids and registered message classes (dataclasses, see :func:`message`) travel as
  msgpack extension types as well.

Decoding is defensive: every limit is checked and any violation raises
:class:`WireError` with the reason, which callers log before dropping the message.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, NamedTuple

import msgpack
import numpy as np
import zmq

VERSION = 1

# Plain ints for the socket loops (broker and node I/O): OR-ing or passing zmq's Flag enums
# costs microseconds per frame.
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)

# Message kinds (header[1]).
USER = 0  # a message between processes
CTL = 1  # runtime control traffic (hello, heartbeat, monitor, down, register, ...)
MANY = 2  # one message to many processes of one node: [header, recipients, body, arrays...]

# Extension type codes inside a body.
_EXT_PID = 1
_EXT_ARRAY = 2
_EXT_MESSAGE = 3

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_HEADER_BYTES = 4096
MAX_ARRAYS = 1024
MAX_RECIPIENTS = 1_000_000  # processes one MANY message may address
MAX_CHARGE = 1 << 40  # bytes a header may charge beyond its frames (see Header.charge)

# Plain numeric dtypes only: object or structured dtypes could smuggle arbitrary data.
_ALLOWED_DTYPE_KINDS = set("biuf")


class WireError(ValueError):
    """A frame that cannot be decoded; the message names what is wrong."""


class OversizeError(WireError):
    """A message over the size limit: its own error, as the broker counts these apart."""


class Pid(NamedTuple):
    """A process id: the node it lives on and its id there."""

    node: str
    id: int

    def __str__(self) -> str:
        return f"<{self.node}.{self.id}>"


# The broker's address: control messages for it go to this pid ("$" starts no node's name).
BROKER_NODE = "$broker"
BROKER_PID = Pid(BROKER_NODE, 0)


class Hold(NamedTuple):
    """What the broker tells a receiving node about an emulated message."""

    hold: float  # seconds the receiver must still hold it, counted from `sent_at`
    sent_at: float  # broker clock when the broker forwarded it (due = sent_at + hold)
    link: int  # the client link it crossed, and in which direction: a drop on
    direction: int  # going offline is per link, and the broker counts it per direction


class Header(NamedTuple):
    kind: int
    src: Pid
    dst_node: str  # "" when dst is a name the broker resolves
    dst: int | str
    # Link-emulation timing, all times in the *broker's* monotonic clock (each node
    # estimates its offset to it from heartbeats):
    # * node -> broker: the sender's send time (float), where the model's clock starts;
    # * broker -> node: a Hold: the receiver keeps the message until it is due.
    timing: float | Hold | None = None
    # Bytes the message stands for on its link beyond its own frames (node -> broker,
    # USER only): an update a worker node keeps for its partial sum is charged as if sent.
    charge: int = 0


# --- registered message classes -------------------------------------------------

_MESSAGE_TYPES: dict[str, type] = {}


def message(cls: type) -> type:
    """Class decorator: make a dataclass sendable (registered by its class name).

    Both ends must import the module that defines it; an unknown name is a
    :class:`WireError` on decode, never an arbitrary import.
    """
    if not dataclasses.is_dataclass(cls):
        cls = dataclasses.dataclass(cls)
    name = cls.__name__
    if name in _MESSAGE_TYPES and _MESSAGE_TYPES[name] is not cls:
        raise ValueError(f"message type {name!r} registered twice")
    _MESSAGE_TYPES[name] = cls
    return cls


# --- header -----------------------------------------------------------------------


def pack_header(kind: int, src: Pid, dst: Pid | str, timing: float | Hold | None = None, charge: int = 0) -> bytes:
    fields = [VERSION, kind, src.node, src.id, *((dst.node, dst.id) if isinstance(dst, Pid) else ("", dst))]
    if timing is not None or charge:
        fields.append(list(timing) if isinstance(timing, Hold) else timing)
    if charge:
        fields.append(charge)
    return msgpack.packb(fields)


def unpack_header(frame: bytes | memoryview) -> Header:
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        fields = _unpack_fields(frame)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"header is not msgpack: {exc}") from None
    if not isinstance(fields, list) or not 6 <= len(fields) <= 8:
        raise WireError("header is not a 6- to 8-element array")
    version, kind, src_node, src_id, dst_node, dst = fields[:6]
    if version != VERSION:
        raise WireError(f"wire version {version!r}, expected {VERSION}")
    if kind not in (USER, CTL, MANY):
        raise WireError(f"unknown message kind {kind!r}")
    if kind == MANY and (type(dst) is not int or not 1 <= dst <= MAX_RECIPIENTS or not dst_node):
        raise WireError(f"a message to many names a node and 1..{MAX_RECIPIENTS} recipients, not {dst_node!r}, {dst!r}")
    if not isinstance(src_node, str) or not isinstance(src_id, int):
        raise WireError("header source is not (str, int)")
    if not isinstance(dst_node, str) or not isinstance(dst, (int, str)) or isinstance(dst, bool):
        raise WireError("header destination is not (str, int|str)")
    timing = _timing(fields[6]) if len(fields) >= 7 else None
    charge = fields[7] if len(fields) == 8 else 0
    if type(charge) is not int or not 0 <= charge <= MAX_CHARGE or (charge and kind != USER):
        raise WireError(f"header charge {charge!r} is not a user message's byte count in 0..{MAX_CHARGE}")
    return Header(kind, Pid(src_node, src_id), dst_node, dst, timing, charge)


def user_fields(frame: bytes, sender: str) -> list | None:
    """The header fields of a well-formed USER message from node ``sender`` whose timing
    is none or a send time: the broker's fast path (nearly all traffic), the same checks
    as ``unpack_header`` without building a Header. None for anything else, which
    ``unpack_header`` then names."""
    if len(frame) > MAX_HEADER_BYTES:
        return None
    try:
        fields = _unpack_fields(frame)
    except Exception:
        return None
    if type(fields) is not list or not 6 <= len(fields) <= 8:
        return None
    version, kind, src_node, src_id, dst_node, dst = fields[:6]
    sent = fields[6] if len(fields) >= 7 else None
    charge = fields[7] if len(fields) == 8 else 0
    if (kind == USER and version == VERSION and src_node == sender and type(src_id) is int
            and type(dst_node) is str and (type(dst) is int or type(dst) is str)
            and (sent is None or (type(sent) is float and math.isfinite(sent)))
            and type(charge) is int and 0 <= charge <= MAX_CHARGE):
        return fields
    return None



def held_header(fields: list, hold: Hold) -> bytes:
    """The header the broker forwards an emulated user message with: its fields as
    :func:`user_fields` returned them, the send time replaced by ``hold``."""
    return msgpack.packb([*fields[:6], list(hold)])


def _unpack_fields(frame: bytes) -> Any:
    return msgpack.unpackb(frame, use_list=True, raw=False, strict_map_key=True)


def _timing(value: Any) -> float | Hold | None:
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, list) and len(value) == 4:
        hold, sent_at, link, direction = value
        if (isinstance(hold, float) and isinstance(sent_at, float) and math.isfinite(hold)
                and math.isfinite(sent_at) and type(link) is int and type(direction) is int and direction in (0, 1)):
            return Hold(hold, sent_at, link, direction)
    raise WireError(f"header timing {value!r} is neither a send time nor [hold, sent_at, link, direction]")


# --- body -------------------------------------------------------------------------


# msgpack.packb builds a Packer, with a 1 MiB buffer, per call, and packing an array's
# record inside the body's packing keeps two alive at once: at times slower than all the
# rest of encoding. So each thread reuses its packers: one per level of nesting in use.
_local = threading.local()


def _packb(obj: Any) -> bytes:
    try:
        free = _local.free
    except AttributeError:
        free = _local.free = []
    # strict_types: a Pid (a tuple subclass) must reach `_default`, not become a list.
    packer = free.pop() if free else msgpack.Packer(default=_default, use_bin_type=True, strict_types=True)
    try:
        return packer.pack(obj)  # a failed pack leaves the packer empty (msgpack resets it)
    finally:
        free.append(packer)


def _default(obj: Any) -> msgpack.ExtType:
    """What msgpack cannot pack itself; arrays go to the current body's buffers."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _ALLOWED_DTYPE_KINDS:
            raise TypeError(f"cannot send an ndarray of dtype {obj.dtype}")
        arr = np.ascontiguousarray(obj)
        buffers = _local.buffers
        buffers.append(memoryview(arr).cast("B") if arr.size else b"")
        return msgpack.ExtType(_EXT_ARRAY, _packb([len(buffers) - 1, arr.dtype.str, list(arr.shape)]))
    if isinstance(obj, Pid):
        return msgpack.ExtType(_EXT_PID, _packb([obj.node, obj.id]))
    if isinstance(obj, tuple):
        return list(obj)  # type: ignore[return-value]
    if dataclasses.is_dataclass(obj) and type(obj).__name__ in _MESSAGE_TYPES:
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return msgpack.ExtType(_EXT_MESSAGE, _packb([type(obj).__name__, fields]))
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()  # type: ignore[return-value]
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)  # type: ignore[return-value]
    raise TypeError(f"cannot send an object of type {type(obj).__name__}")


def pack_body(payload: Any) -> list:
    """Return ``[body_bytes, *array_buffers]`` for ``payload``.

    Arrays are not copied when already C-contiguous: the caller must not modify an
    array after sending it (like MPI_Isend), because the socket may still read it.
    """
    buffers: list = []
    _local.buffers = buffers
    try:
        body = _packb(payload)
    finally:
        _local.buffers = None
    return [body, *buffers]


def unpack_body(body: bytes | memoryview, arrays: list) -> Any:
    """Inverse of :func:`pack_body`; ``arrays`` are the raw frames (bytes or zmq.Frame)."""
    if len(arrays) > MAX_ARRAYS:
        raise WireError(f"{len(arrays)} array frames exceed the limit of {MAX_ARRAYS}")
    used = [False] * len(arrays)

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_PID:
            node, pid_id = msgpack.unpackb(data)
            if not isinstance(node, str) or not isinstance(pid_id, int):
                raise WireError("malformed pid")
            return Pid(node, pid_id)
        if code == _EXT_ARRAY:
            index, dtype_str, shape = msgpack.unpackb(data)
            return _array_from_frame(arrays, used, index, dtype_str, shape)
        if code == _EXT_MESSAGE:
            name, fields = msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=True)
            cls = _MESSAGE_TYPES.get(name)
            if cls is None:
                raise WireError(f"unknown message type {name!r}")
            try:
                return cls(**fields)
            except TypeError as exc:
                raise WireError(f"bad fields for {name}: {exc}") from None
        raise WireError(f"unknown extension type {code}")

    try:
        payload = msgpack.unpackb(body, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"body is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not all(used):
        raise WireError("array frames not referenced by the body")
    return payload


def _array_from_frame(arrays: list, used: list, index: Any, dtype_str: Any, shape: Any) -> np.ndarray:
    if not isinstance(index, int) or not 0 <= index < len(arrays) or used[index]:
        raise WireError(f"array reference {index!r} is invalid")
    try:
        dtype = np.dtype(dtype_str)
    except TypeError:
        raise WireError(f"unknown dtype {dtype_str!r}") from None
    if dtype.kind not in _ALLOWED_DTYPE_KINDS:
        raise WireError(f"dtype {dtype} is not allowed on the wire")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WireError(f"bad array shape {shape!r}")
    frame = arrays[index]
    buf = frame.buffer if hasattr(frame, "buffer") else frame  # zero-copy
    expected = math.prod(shape) * dtype.itemsize  # Python ints: exact, and no numpy call per message
    if len(buf) != expected:
        raise WireError(f"array frame has {len(buf)} bytes, shape {shape} of {dtype} needs {expected}")
    used[index] = True
    # Zero-copy: a view that keeps the frame alive. Read-only whatever the buffer, so
    # a receiver never writes into memory a sender may still own.
    array = np.frombuffer(buf, dtype=dtype).reshape(shape)
    array.flags.writeable = False
    return array


def encode(kind: int, src: Pid, dst: Pid | str, payload: Any, timing: float | Hold | None = None) -> list:
    """All frames of one message, header first. A payload with a ``link_charge`` (bytes
    it stands for beyond itself, see Header.charge) has it in its header."""
    charge = getattr(payload, "link_charge", 0) if kind == USER else 0
    return [pack_header(kind, src, dst, timing, charge), *pack_body(payload)]


def decode(frames: list, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[Header, Any]:
    """Frames (without any routing identity) -> (header, payload); for a message to
    many (``MANY``), the payload is a :class:`Fanout` whose body is not decoded yet."""
    check_envelope(frames, max_bytes)
    header = unpack_header(_small(frames[0]))
    if header.kind == MANY:
        return header, Fanout(unpack_recipients(frames[1]), frames[2:])
    payload = unpack_body(_small(frames[1]), frames[2:])
    return header, payload


# --- messages to many -------------------------------------------------------------


class Fanout(NamedTuple):
    """A decoded ``MANY`` message: who it is for, and its body frames, decoded once per
    recipient (:meth:`body`) so no two receivers share a mutable object; their arrays
    are read-only views of the one received buffer."""

    recipients: Any  # as the sender wrote it: checked by whoever reads it
    frames: list  # [body, arrays...]; empty for a message that carries none

    def body(self) -> Any:
        if not self.frames:
            raise WireError("this message to many carries no body")
        return unpack_body(_small(self.frames[0]), self.frames[1:])


def encode_many(src: Pid, dst_node: str, ids: list[int], payload: Any, timing: float | None = None) -> list:
    """One message for processes ``ids`` of node ``dst_node``: one body for all of them,
    so it crosses each socket once, however many receive it."""
    return [pack_header(MANY, src, Pid(dst_node, len(ids)), timing), _packb(ids), *pack_body(payload)]


def many_frames(src: Pid, dst_node: str, count: int, recipients: Any, body_frames: list) -> list:
    """A ``MANY`` message as the broker forwards one: its own recipients record, the
    body frames as received (zero-copy)."""
    return [pack_header(MANY, src, Pid(dst_node, count)), _packb(recipients), *body_frames]


def link_size(frames: list, kind: int = USER) -> int:
    """What a message weighs on an emulated link: its body and array frames (for a
    message to many, what each receiver gets). The header is fedemu's own routing (node
    names, process ids, whose encoded length varies with placement), so leaving it out
    keeps a link's bytes and times the same on any placement; a link profile's
    ``overhead_bytes`` stands for the headers of a real network."""
    return message_size(frames[2:] if kind == MANY else frames[1:])


def unpack_recipients(frame: Any) -> Any:
    data = _small(frame)
    if len(data) > 16 * MAX_RECIPIENTS:
        raise WireError(f"recipients frame of {len(data)} bytes is too large")
    try:
        return msgpack.unpackb(data, use_list=True, raw=False, strict_map_key=True)
    except Exception as exc:
        raise WireError(f"recipients frame is not msgpack: {type(exc).__name__}: {exc}") from None


def check_ids(ids: Any, count: int) -> list[int]:
    """The recipients a node sent: ``count`` distinct local process ids."""
    if (type(ids) is not list or len(ids) != count or not all(type(i) is int and 0 < i < 2**63 for i in ids)
            or len(set(ids)) != count):
        raise WireError(f"recipients are not {count} distinct process ids")
    return ids


def check_envelope(frames: list, max_bytes: int) -> int:
    """What every message must be before its header is read: a header and a body frame,
    ``max_bytes`` or fewer in all. Returns its size; WireError (OversizeError) says why not."""
    if len(frames) < 2:
        raise WireError(f"{len(frames)} frame(s); a message needs a header and a body")
    size = message_size(frames)
    if size > max_bytes:
        raise OversizeError(f"message of {size} bytes exceeds the limit of {max_bytes}")
    return size


def message_size(frames: list) -> int:
    """Bytes in all frames: bytes, byte-format memoryviews (as encode makes) or zmq Frames."""
    return sum(f.nbytes if type(f) is memoryview else len(f) for f in frames)


def _small(frame: Any) -> Any:
    """A header or body frame to unpack: a zmq Frame's cached bytes unpack about twice as
    fast as a fresh memoryview of it, and these frames are small (arrays travel apart)."""
    return frame.bytes if hasattr(frame, "bytes") else frame
