"""Asynchronous mode, wire format: framing round trips, malformed frames rejected clearly."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnihvd.asynchronous.protocol import (DONE, FINAL, HEADER_BYTES, HELLO, PARAMS, PUSH,
                                           ProtocolError, decode, encode, layout_fingerprint,
                                           shard_bounds)

pytestmark = pytest.mark.unit


@settings(max_examples=50, deadline=None)
@given(kind=st.sampled_from([HELLO, PUSH, DONE, PARAMS, FINAL]),
       sender=st.integers(0, 10 ** 6), seq=st.integers(0, 2 ** 40),
       version=st.integers(0, 2 ** 40), batch=st.integers(0, 10 ** 6),
       interval=st.integers(0, 10 ** 9), layout=st.integers(0, 2 ** 63 - 1),
       n=st.integers(0, 50), dtype=st.sampled_from(["float32", "float64", "float16", "int64"]))
def test_round_trip(kind, sender, seq, version, batch, interval, layout, n, dtype):
    payload = np.arange(n).astype(dtype)
    buf = encode(kind, sender, payload, seq=seq, version=version, batch_size=batch,
                 interval_us=interval, layout=layout)
    assert buf.dtype == np.uint8 and buf.size == HEADER_BYTES + payload.nbytes
    m = decode(bytes(buf))
    assert (m.kind, m.sender, m.seq, m.version, m.batch_size, m.interval_us, m.layout) == (
        kind, sender, seq, version, batch, interval, layout)
    assert m.payload.dtype == np.dtype(dtype) and np.array_equal(m.payload, payload)


def test_truncated_payload_is_rejected_with_the_counts():
    buf = encode(PUSH, 3, np.ones(10, np.float32))
    with pytest.raises(ProtocolError, match=r"rank 3 PUSH: header says 10 float32 elements "
                                            r"\(40 bytes\) but 36 payload bytes arrived"):
        decode(buf[:-4], source=3)
    with pytest.raises(ProtocolError, match="44 payload bytes"):
        decode(np.concatenate([buf, np.zeros(4, np.uint8)]), source=3)


def test_short_and_foreign_buffers_are_rejected():
    with pytest.raises(ProtocolError, match="shorter than the 80-byte header"):
        decode(b"\x00" * 79)
    foreign = encode(PUSH, 1, np.ones(2, np.float32))
    foreign[:8] = 7  # another magic: not ours, or another protocol version
    with pytest.raises(ProtocolError, match="magic .*not an omnihvd parameter-server message"):
        decode(foreign, source=1)


@pytest.mark.parametrize("field,index,value,match", [
    ("kind", 1, 99, "unknown kind 99"),
    ("dtype", 7, 42, "unknown dtype code 42"),
    ("seq", 3, -1, "header field seq is negative"),
    ("count", 8, -2, "header field count is negative"),
])
def test_corrupt_header_fields(field, index, value, match):
    buf = encode(PUSH, 1, np.ones(2, np.float32))
    buf[:HEADER_BYTES].view("<i8")[index] = value
    with pytest.raises(ProtocolError, match=match):
        decode(buf)


def test_encode_refuses_bad_input():
    with pytest.raises(ProtocolError, match="unknown message kind"):
        encode(17, 0)
    with pytest.raises(ProtocolError, match="must be 1-d"):
        encode(PUSH, 0, np.ones((2, 2), np.float32))
    with pytest.raises(ProtocolError, match="complex64 is not supported"):
        encode(PUSH, 0, np.ones(2, np.complex64))
    with pytest.raises(ProtocolError, match="batch_size must be >= 0"):
        encode(PUSH, 0, batch_size=-1)


def test_layout_fingerprint_distinguishes_shapes_order_and_dtype():
    a = layout_fingerprint([(3, 5), (3,)])
    assert 0 <= a < 2 ** 63
    assert a == layout_fingerprint([[3, 5], [3]])
    assert a != layout_fingerprint([(3,), (3, 5)])
    assert a != layout_fingerprint([(5, 3), (3,)])
    assert a != layout_fingerprint([(3, 5), (3,)], dtype="float64")


@settings(max_examples=100, deadline=None)
@given(numel=st.integers(1, 10 ** 7), servers=st.integers(1, 64))
def test_shard_bounds_cover_everything_once(numel, servers):
    if numel < servers:
        with pytest.raises(ProtocolError, match="cannot shard"):
            shard_bounds(numel, servers)
        return
    b = shard_bounds(numel, servers)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == numel and len(b) == servers + 1
    assert sizes.min() >= 1 and sizes.max() - sizes.min() <= 1
