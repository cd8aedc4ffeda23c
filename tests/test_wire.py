import msgpack
import numpy as np
import pytest

from fedemu.node import Down, Pid, WireError, wire
from fedemu.common.messages import TrainRequest

SRC, DST = Pid("a", 1), Pid("b", 2)


def roundtrip(payload, **kw):
    frames = [bytes(f) for f in wire.encode(wire.USER, SRC, DST, payload)]
    return frames, wire.decode(frames, **kw)


def test_message_classes_pids_and_arrays_round_trip():
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    body = {"req": TrainRequest(round=3, task="train", weights=weights, epochs=1, batch_size=10, lr=0.1, seed=7),
            "down": Down(5, Pid("n", 9), "normal"), "pids": (SRC, DST), "n": np.int64(4)}
    frames, (header, got) = roundtrip(body)
    assert header == wire.Header(wire.USER, SRC, "b", 2)
    assert got["req"].round == 3 and np.array_equal(got["req"].weights, weights)
    assert got["down"] == Down(5, Pid("n", 9), "normal")
    assert got["pids"] == [SRC, DST] and isinstance(got["pids"][0], Pid)
    assert got["n"] == 4
    # The array travelled as its own raw frame, not inside the msgpack body.
    # (the 48-byte array is far smaller than the body here; what matters is that its
    # bytes are a frame of their own and not inside the body)
    assert len(frames) == 3 and len(frames[2]) == weights.nbytes
    assert weights.tobytes() not in frames[1]


def test_arrays_are_not_copied_on_either_side():
    weights = np.ones(1000, np.float32)
    frames = wire.encode(wire.USER, SRC, DST, weights)
    assert np.shares_memory(np.frombuffer(frames[2], np.float32), weights)
    _, got = wire.decode(frames)
    assert np.shares_memory(got, np.frombuffer(frames[2], np.float32))
    assert not got.flags.writeable  # a view of the frame: copy before changing it


def test_timing_travels_in_the_header():
    # A sender's stamp, and what the broker adds for the receiving node.
    sent = [bytes(f) for f in wire.encode(wire.USER, SRC, DST, "x", timing=12.5)]
    assert wire.decode(sent)[0].timing == 12.5
    hold = wire.Hold(0.25, 100.0, 7, 1)
    held = [bytes(f) for f in wire.encode(wire.USER, SRC, "client/7", "x", timing=hold)]
    header, body = wire.decode(held)
    assert header.timing == hold and type(header.timing) is wire.Hold
    assert (header.dst_node, header.dst, body) == ("", "client/7", "x")
    assert wire.decode(wire.encode(wire.USER, SRC, DST, "x"))[0].timing is None


def test_names_as_destinations():
    frames = wire.encode(wire.USER, SRC, "client/17", "hi")
    assert wire.decode(frames)[0].dst == "client/17"


def test_objects_that_cannot_travel_are_refused_at_the_sender():
    with pytest.raises(TypeError, match="object"):
        wire.encode(wire.USER, SRC, DST, np.array([object()]))
    with pytest.raises(TypeError, match="cannot send an object of type function"):
        wire.encode(wire.USER, SRC, DST, lambda: 0)


@pytest.mark.parametrize("frames, reason", [
    ([b"x"], "a message needs a header and a body"),
    ([b"\x01", b""], "header is not a 6- to 8-element array"),
    ([msgpack.packb([1, 0, "a", 1, "b", 2, "soon"]), msgpack.packb(0)], "header timing 'soon' is neither"),
    ([msgpack.packb([1, 0, "a", 1, "b", 2, [0.1, 5.0, 3, 2]]), msgpack.packb(0)], "header timing [0.1, 5.0, 3, 2]"),
    ([msgpack.packb([1, 7, "a", 1, "b", 2]), msgpack.packb(0)], "unknown message kind 7"),
    ([wire.pack_header(0, SRC, DST), b"\xc1"], "body is not valid msgpack"),
    ([wire.pack_header(0, SRC, DST), msgpack.packb(msgpack.ExtType(3, msgpack.packb(["Evil", {}])))],
     "unknown message type 'Evil'"),
    ([wire.pack_header(0, SRC, DST), msgpack.packb(msgpack.ExtType(3, msgpack.packb(["Down", {"x": 1}])))],
     "bad fields for Down"),
    ([wire.pack_header(0, SRC, DST), msgpack.packb(msgpack.ExtType(2, msgpack.packb([0, "<f4", [4]]))), b"123"],
     "array frame has 3 bytes, shape [4] of float32 needs 16"),
    ([wire.pack_header(0, SRC, DST), msgpack.packb(msgpack.ExtType(2, msgpack.packb([0, "|O", [1]]))), b"12345678"],
     "not allowed on the wire"),
    ([wire.pack_header(0, SRC, DST), msgpack.packb(None), b"stray"], "array frames not referenced"),
])
def test_malformed_messages_name_the_problem(frames, reason):
    with pytest.raises(WireError) as err:
        wire.decode(frames)
    assert reason in str(err.value)


def test_size_limit():
    frames = wire.encode(wire.USER, SRC, DST, np.zeros(1000, np.uint8))
    with pytest.raises(wire.OversizeError, match="exceeds the limit of 500"):
        wire.decode(frames, max_bytes=500)
    # The one envelope check decode and the broker share: size returned, or why not.
    assert wire.check_envelope(frames, max_bytes=10_000) == wire.message_size(frames)
    with pytest.raises(WireError, match="1 frame") as caught:
        wire.check_envelope(frames[:1], max_bytes=10_000)
    assert not isinstance(caught.value, wire.OversizeError)


def test_the_brokers_fast_check_takes_exactly_the_well_formed_user_headers():
    """wire.user_fields is the fast path's check: what it refuses goes to unpack_header,
    which names the fault; it never takes what unpack_header would refuse."""
    import math

    from fedemu.node.wire import CTL, USER, VERSION, WireError, unpack_header, user_fields

    good = [VERSION, USER, "n1", 3, "n2", 4]
    assert user_fields(msgpack.packb(good), "n1") == good
    assert user_fields(msgpack.packb(good + [12.5]), "n1") == good + [12.5]
    for bad, sender in [(good, "n2"),                                  # another node's name
                        ([VERSION, CTL, "n1", 3, "n2", 4], "n1"),       # control: the slow path
                        ([VERSION, USER, "n1", 3, "n2", True], "n1"),   # bool is no destination
                        (good + [math.inf], "n1"), (good + [math.nan], "n1")]:
        assert user_fields(msgpack.packb(bad), sender) is None
    with pytest.raises(WireError, match="header timing inf"):
        unpack_header(msgpack.packb(good + [math.inf]))
    assert user_fields(b"\xc1", "n1") is None and user_fields(b"x" * 10_000, "n1") is None
    # A charge (bytes kept at the sender's node) follows the timing, present or None.
    assert user_fields(msgpack.packb(good + [None, 800_000]), "n1") == good + [None, 800_000]
    for charge in (-1, 1.5, True, wire.MAX_CHARGE + 1):
        assert user_fields(msgpack.packb(good + [12.5, charge]), "n1") is None
        with pytest.raises(WireError, match="charge"):
            unpack_header(msgpack.packb(good + [12.5, charge]))
    with pytest.raises(WireError, match="charge"):  # only a user message stands for bytes it does not carry
        unpack_header(msgpack.packb([VERSION, CTL, "n1", 3, "n2", 4, None, 10]))


def test_a_payload_with_a_link_charge_has_it_in_its_header():
    """What a node sends for an update it keeps (aggregation on the nodes): the header
    carries the bytes the update would have added, which the broker charges on the link."""
    from fedemu.common.messages import TRAIN, TrainReply

    reply = TrainReply(round=1, client=3, task=TRAIN, update=None, num_samples=1, train_loss=0.0, compute_s=0.0,
                       link_charge=796_853)
    header, body = wire.decode(wire.encode(wire.USER, SRC, DST, reply, timing=1.5))
    assert (header.charge, header.timing, body.link_charge) == (796_853, 1.5, 796_853)
    assert wire.decode(wire.encode(wire.USER, SRC, DST, "x"))[0].charge == 0
    assert wire.decode(wire.encode(wire.CTL, SRC, DST, reply))[0].charge == 0  # control is never charged
