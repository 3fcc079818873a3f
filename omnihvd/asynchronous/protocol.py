"""Wire format of the parameter server: framing, decoding and validation. Pure numpy.

Every message is one contiguous byte buffer: a fixed header of ten little-endian
int64 fields followed by a typed payload::

    magic | kind | sender | seq | version | batch_size | interval_us | dtype | count | layout
    payload: ``count`` elements of ``dtype`` (float32 parameters or gradients)

One buffer per message (rather than a header message followed by a data message)
means a receiver can never pair a header with the wrong payload, and its length is
known from ``MPI.Status`` before receiving, so a truncated or oversized message is
caught before anything is applied.

Kinds, and who sends them:

* ``HELLO`` (worker -> server): first contact; ``layout`` carries the fingerprint of
  the worker's model so a different model is rejected before it can push.
* ``PUSH`` (worker -> server): a gradient shard. ``seq`` counts this worker's pushes
  from 0, ``version`` is the shard version the gradient was computed on,
  ``batch_size`` the samples it averages over, ``interval_us`` the worker's time
  since its previous push (what the balancer equalises).
* ``DONE`` (worker -> server): the worker stops; ``seq`` is how many pushes it sent,
  which the server checks against how many it applied.
* ``PARAMS`` (server -> worker): reply to HELLO and PUSH: the current shard and its
  ``version``; ``batch_size`` is the batch the worker must use next.
* ``FINAL`` (server -> worker): reply to DONE, sent once every worker is done: the
  final shard.
* ``STOPPED`` (server -> worker): the server stopped on an error (its traceback says
  which); a worker waiting for that server raises instead of waiting for ever. Only
  seen with ``abort_on_exception=False``: otherwise the server aborts the whole job.

:func:`decode` checks the frame (magic, kind, dtype, length); the server checks the
content against its state (:mod:`omnihvd.asynchronous.server`).
"""
import zlib
from typing import NamedTuple, Sequence

import numpy as np

from ..errors import OmniHvdError

__all__ = [
    "ProtocolError", "Message", "HELLO", "PUSH", "DONE", "PARAMS", "FINAL", "STOPPED",
    "KIND_NAMES",
    "DTYPES", "HEADER_FIELDS", "HEADER_BYTES", "TAG_TO_SERVER", "TAG_TO_WORKER",
    "encode", "decode", "layout_fingerprint", "shard_bounds",
]

MAGIC = 0x4F4D4E4950530001  # "OMNIPS" + protocol version 1
HELLO, PUSH, DONE, PARAMS, FINAL, STOPPED = 1, 2, 3, 4, 5, 6
KIND_NAMES = {HELLO: "HELLO", PUSH: "PUSH", DONE: "DONE", PARAMS: "PARAMS", FINAL: "FINAL",
              STOPPED: "STOPPED"}
# Wire code -> numpy dtype. Parameters travel as float32; the others are listed so a
# worker sending float64 or float16 gets "wrong dtype", not "garbage".
DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<f8"), 3: np.dtype("<f2"), 4: np.dtype("<i8")}
_CODES = {dt: code for code, dt in DTYPES.items()}
HEADER_FIELDS = ("magic", "kind", "sender", "seq", "version", "batch_size", "interval_us",
                 "dtype", "count", "layout")
HEADER_BYTES = 8 * len(HEADER_FIELDS)
# Tags on the parameter server's own (duplicated) communicator.
TAG_TO_SERVER = 7101
TAG_TO_WORKER = 7102


class ProtocolError(OmniHvdError):
    """A message is malformed or does not fit the server's state; says who sent what."""


class Message(NamedTuple):
    """A decoded message. ``payload`` is a read-only view into the received buffer."""

    kind: int
    sender: int        # MPI rank of the sender on the server's communicator
    seq: int = 0
    version: int = 0
    batch_size: int = 0
    interval_us: int = 0
    layout: int = 0
    payload: np.ndarray = np.empty(0, dtype=np.float32)

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, "kind %d" % self.kind)


def encode(kind: int, sender: int, payload=None, *, seq: int = 0, version: int = 0,
           batch_size: int = 0, interval_us: int = 0, layout: int = 0) -> np.ndarray:
    """Frame one message as a ``uint8`` buffer ready for ``comm.Send``.

    Args:
        kind: one of HELLO, PUSH, DONE, PARAMS, FINAL, STOPPED.
        sender: the sender's rank.
        payload: 1-d array of a dtype in :data:`DTYPES` (None: empty float32).
        seq, version, batch_size, interval_us, layout: header fields (integers >= 0).

    Returns:
        ``np.ndarray`` of ``uint8``: header then payload bytes.

    Raises:
        ProtocolError: unknown kind, negative field, unsupported dtype, not 1-d.

    >>> buf = encode(PUSH, 2, np.ones(3, np.float32), seq=5, version=9, batch_size=32)
    >>> m = decode(buf)
    >>> (m.kind_name, m.sender, m.seq, m.version, m.batch_size, m.payload.tolist())
    ('PUSH', 2, 5, 9, 32, [1.0, 1.0, 1.0])
    """
    if kind not in KIND_NAMES:
        raise ProtocolError("cannot encode unknown message kind %r" % (kind,))
    data = np.empty(0, dtype=np.float32) if payload is None else np.asarray(payload)
    if data.ndim != 1:
        raise ProtocolError("%s payload must be 1-d (a flat shard), got shape %s"
                            % (KIND_NAMES[kind], data.shape))
    code = _CODES.get(data.dtype.newbyteorder("<"))
    if code is None:
        raise ProtocolError("%s payload dtype %s is not supported; use float32"
                            % (KIND_NAMES[kind], data.dtype))
    fields = [MAGIC, kind, sender, seq, version, batch_size, interval_us, code, data.size, layout]
    for name, value in zip(HEADER_FIELDS[2:], fields[2:]):
        if int(value) < 0:
            raise ProtocolError("header field %s must be >= 0, got %r" % (name, value))
    buf = np.empty(HEADER_BYTES + data.nbytes, dtype=np.uint8)
    buf[:HEADER_BYTES].view("<i8")[:] = [int(v) for v in fields]
    buf[HEADER_BYTES:] = np.ascontiguousarray(data, dtype=DTYPES[code]).view(np.uint8)
    return buf


def decode(buf, source: int = -1) -> Message:
    """Parse and check the frame of one received buffer.

    Args:
        buf: the received bytes (``uint8`` array, ``bytes`` or ``bytearray``).
        source: the MPI rank it came from, for the error message (-1: unknown).

    Returns:
        :class:`Message`.

    Raises:
        ProtocolError: too short, bad magic (not one of ours, or another protocol
            version), unknown kind or dtype, negative fields, or a payload whose length
            differs from ``count`` elements.

    >>> decode(b"junk", source=3)
    Traceback (most recent call last):
    ...
    omnihvd.asynchronous.protocol.ProtocolError: message from rank 3 is 4 bytes, shorter than the 80-byte header: not an omnihvd parameter-server message
    """
    raw = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8)
    who = "message from rank %d" % source if source >= 0 else "message"
    if raw.size < HEADER_BYTES:
        raise ProtocolError("%s is %d bytes, shorter than the %d-byte header: not an omnihvd "
                            "parameter-server message" % (who, raw.size, HEADER_BYTES))
    head = raw[:HEADER_BYTES].view("<i8")
    fields = dict(zip(HEADER_FIELDS, (int(v) for v in head)))
    if fields["magic"] != MAGIC:
        raise ProtocolError("%s has magic 0x%x, expected 0x%x: not an omnihvd parameter-server "
                            "message, or one from another omnihvd version; run the same omnihvd "
                            "on every rank" % (who, fields["magic"] & (2 ** 64 - 1), MAGIC))
    if fields["kind"] not in KIND_NAMES:
        raise ProtocolError("%s has unknown kind %d" % (who, fields["kind"]))
    for name in HEADER_FIELDS[2:]:
        if fields[name] < 0:
            raise ProtocolError("%s: header field %s is negative (%d)" % (who, name, fields[name]))
    dtype = DTYPES.get(fields["dtype"])
    if dtype is None:
        raise ProtocolError("%s has unknown dtype code %d" % (who, fields["dtype"]))
    body = raw.size - HEADER_BYTES
    if body != fields["count"] * dtype.itemsize:
        raise ProtocolError("%s %s: header says %d %s elements (%d bytes) but %d payload bytes "
                            "arrived" % (who, KIND_NAMES[fields["kind"]], fields["count"], dtype,
                                         fields["count"] * dtype.itemsize, body))
    payload = raw[HEADER_BYTES:].view(dtype)
    return Message(fields["kind"], fields["sender"], fields["seq"], fields["version"],
                   fields["batch_size"], fields["interval_us"], fields["layout"], payload)


def layout_fingerprint(shapes: Sequence[Sequence[int]], dtype="float32") -> int:
    """A non-negative 63-bit fingerprint of a model's parameter shapes and dtype.

    Two ranks with different models (or the same tensors in another order) get
    different fingerprints with overwhelming probability, so the server can reject a
    mismatched worker at HELLO instead of applying a gradient to the wrong weights.

    >>> layout_fingerprint([(3, 2), (3,)]) == layout_fingerprint([[3, 2], [3]])
    True
    >>> layout_fingerprint([(3, 2), (3,)]) == layout_fingerprint([(2, 3), (3,)])
    False
    """
    text = "%s|%s" % (np.dtype(dtype).str, ";".join(",".join(str(int(d)) for d in s) for s in shapes))
    data = text.encode()
    return (zlib.crc32(data) << 31) ^ zlib.adler32(data)


def shard_bounds(numel: int, num_servers: int) -> list:
    """Split ``numel`` flat parameters into contiguous, near-equal shards, one per server.

    Returns:
        list of ``num_servers + 1`` offsets; server s holds ``[b[s], b[s+1])``.

    Raises:
        ProtocolError: fewer elements than servers (a server would hold nothing).

    >>> shard_bounds(10, 3)
    [0, 4, 7, 10]
    """
    if num_servers < 1 or numel < num_servers:
        raise ProtocolError("cannot shard %d parameters over %d servers; use at most %d "
                            "servers" % (numel, num_servers, max(numel, 1)))
    base, extra = divmod(int(numel), int(num_servers))
    bounds = [0]
    for s in range(num_servers):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds
