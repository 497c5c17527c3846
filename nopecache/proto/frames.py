"""The block-carrying frames of the wire contract: PutFrame and GetFrame codecs, and the one
GetFrame stream assembler both the client's gRPC path and its shared-memory path use.

Why hand-written: upb builds a fresh encode buffer per message and grows it by doubling,
and reading ``GetFrame.data`` from a parsed message copies it out: milliseconds per MiB,
several times the transport itself. The codecs here write standard protobuf wire format
(byte-identical to ``SerializeToString``, checked against the generated classes by
tests) with one copy out (encode) and zero copies in (decode: ``data`` is a view of the
received message). Protobuf parsing rules hold: the last occurrence of a field wins and
unknown fields (the reserved 8-15 among them) are skipped.

A Get stream, per requested key, in request order (proto/cache.proto)::

    miss         one frame: index, tier = 0, no data
    shm hit      one frame: index, tier, total_size, shm_offset, shm_length (= total_size)
    data hit     first frame: index, tier, total_size, data[0 : f]
                 continuations: index, data[f : 2f] ... until total_size bytes arrived

:class:`GetFrameAssembler` checks that order and reassembles multi-frame blocks into one
buffer taken from the caller's pool (the only copy on the gRPC path); a block in a single
frame is handed on as a view of the message (no copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nopecache.proto.wire import WireError, encode_varint, read_varint

__all__ = [
    "GetEntry",
    "GetFrameAssembler",
    "GetFrameFields",
    "WireError",
    "decode_get_frame",
    "decode_put_frame",
    "encode_get_frame",
    "encode_put_frame",
]

BytesLike = bytes | bytearray | memoryview


def _nbytes(data: BytesLike) -> int:
    return data.nbytes if isinstance(data, memoryview) else len(data)


# -- PutFrame (client -> server) ---------------------------------------------------------
def encode_put_frame(key: bytes, total_size: int, data: BytesLike) -> bytes:
    """A PutFrame in wire format with ``data`` copied once; ``key`` and ``total_size`` are
    set on a block's first frame only."""
    head = bytearray()
    if key:
        head += b"\x0a" + encode_varint(len(key)) + key
    if total_size:
        head += b"\x10" + encode_varint(total_size)
    n = _nbytes(data)
    if n:
        head += b"\x1a" + encode_varint(n)
    return b"".join((head, data))


_PUT_NAMES = {1: "PutFrame.key", 2: "PutFrame.total_size", 3: "PutFrame.data"}


def decode_put_frame(raw: bytes) -> tuple[bytes, int, memoryview]:
    """(key, total_size, data) of a PutFrame; ``data`` views ``raw``. WireError names the
    field of malformed input."""
    view = memoryview(raw)
    key, total_size, data = b"", 0, view[0:0]
    pos, end = 0, len(raw)
    while pos < end:
        tag, pos = read_varint(raw, pos, "PutFrame")
        field, wire = tag >> 3, tag & 7
        name = _PUT_NAMES.get(field, f"PutFrame field {field}")
        if field == 0:
            raise WireError("PutFrame: field number 0 is invalid")
        if wire == 0:
            value, pos = read_varint(raw, pos, name)
            if field == 2:
                total_size = value
            elif field in (1, 3):
                raise WireError(f"{name}: expected length-delimited bytes, got a varint")
        elif wire == 2:
            length, pos = read_varint(raw, pos, name)
            stop = pos + length
            if stop > end:
                raise WireError(f"{name}: length {length} runs past the end of the message")
            if field == 1:
                key = raw[pos:stop]
            elif field == 3:
                data = view[pos:stop]
            elif field == 2:
                raise WireError(f"{name}: expected a varint, got length-delimited bytes")
            pos = stop
        elif wire in (1, 5) and field > 3:
            pos += 8 if wire == 1 else 4
        else:
            raise WireError(f"{name}: unsupported wire type {wire}")
    if pos != end:
        raise WireError("PutFrame: the last field runs past the end of the message")
    return key, total_size, data


# -- GetFrame (server -> client) ---------------------------------------------------------
def encode_get_frame(
    index: int,
    tier: int,
    total_size: int,
    data: BytesLike,
    tier_names: Sequence[bytes],
    shm: tuple[int, int] | None = None,
) -> bytes:
    """A GetFrame in wire format (fields in number order, zero values omitted) with ``data``
    copied once. ``shm`` is (shm_offset, shm_length) of a block written into the call's
    shared-memory window; such a frame has no data."""
    head = bytearray()
    if index:
        head += b"\x08" + encode_varint(index)
    if tier:
        head += b"\x10" + encode_varint(tier)
    if total_size:
        head += b"\x18" + encode_varint(total_size)
    n = _nbytes(data)
    if n:
        head += b"\x22" + encode_varint(n)
    tail = b"".join(b"\x2a" + encode_varint(len(name)) + name for name in tier_names)
    if shm is not None:
        offset, length = shm
        if offset:
            tail += b"\x40" + encode_varint(offset)
        if length:
            tail += b"\x48" + encode_varint(length)
    if not tail:
        return b"".join((head, data))
    return b"".join((head, data, tail))


@dataclass(slots=True)
class GetFrameFields:
    """The fields of one GetFrame the client reads; ``data`` views the message."""

    index: int
    tier: int
    total_size: int
    data: memoryview
    shm_offset: int
    shm_length: int


_GET_VARINTS = frozenset({1, 2, 3, 8, 9})
_GET_BYTES = frozenset({4, 5})


def decode_get_frame(raw: bytes) -> GetFrameFields:
    """The fields of a GetFrame (``tier_names`` and unknown fields skipped); WireError for
    malformed input."""
    view = memoryview(raw)
    index = tier = total_size = shm_offset = shm_length = 0
    data = view[0:0]
    pos, end = 0, len(raw)
    while pos < end:
        tag, pos = read_varint(raw, pos, "GetFrame")
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise WireError("GetFrame: field number 0 is invalid")
        if wire == 0:
            value, pos = read_varint(raw, pos, f"GetFrame field {field}")
            if field == 1:
                index = value
            elif field == 2:
                tier = value
            elif field == 3:
                total_size = value
            elif field == 8:
                shm_offset = value
            elif field == 9:
                shm_length = value
            elif field in _GET_BYTES:
                raise WireError(f"GetFrame field {field}: expected bytes, got a varint")
        elif wire == 2:
            length, pos = read_varint(raw, pos, f"GetFrame field {field}")
            stop = pos + length
            if stop > end:
                raise WireError(f"GetFrame field {field}: length runs past the message")
            if field == 4:
                data = view[pos:stop]
            elif field in _GET_VARINTS:
                raise WireError(f"GetFrame field {field}: expected a varint, got bytes")
            pos = stop
        elif wire in (1, 5) and field not in _GET_VARINTS and field not in _GET_BYTES:
            pos += 8 if wire == 1 else 4
        else:
            raise WireError(f"GetFrame field {field}: unsupported wire type {wire}")
    if pos != end:
        raise WireError("GetFrame: the last field runs past the end of the message")
    return GetFrameFields(index, tier, total_size, data, shm_offset, shm_length)


@dataclass(slots=True)
class GetEntry:
    """One key of a Get stream, complete: a miss (``blob`` None, ``shm_length`` 0), a block
    in the call's shared-memory window (``blob`` None, ``shm_offset``/``shm_length``), or a
    block's bytes (``blob``: a view of the message or of a pooled buffer)."""

    index: int
    blob: memoryview | None
    shm_offset: int = 0
    shm_length: int = 0


class GetFrameAssembler:
    """Checks a Get stream's frame order and reassembles blocks (module docstring).

    ``take(size)`` supplies the buffer a multi-frame block is copied into (a pool's
    ``take``: reused memory, no allocation per block). Not thread-safe: one stream each.
    """

    __slots__ = ("_buffer", "_count", "_filled", "_take", "expect")

    def __init__(self, count: int, take: Callable[[int], memoryview]) -> None:
        """An assembler for a stream answering ``count`` keys."""
        self._count = count
        self._take = take
        self._buffer: memoryview | None = None
        self._filled = 0
        self.expect = 0  # index of the next key whose first frame is due

    def feed(self, raw: bytes) -> GetEntry | None:
        """Take one received frame: the key it completes, or None (a block is still
        arriving). Raises WireError for a frame that breaks the contract."""
        frame = decode_get_frame(raw)
        data = frame.data
        buffer = self._buffer
        if buffer is not None:  # a block is being reassembled: this must be its next frame
            end = self._filled + data.nbytes
            if (
                frame.index != self.expect
                or frame.tier
                or frame.total_size
                or frame.shm_length
                or end > buffer.nbytes
                or not data.nbytes
            ):
                raise WireError(
                    f"GetFrame: expected more of block {self.expect}, got index {frame.index}"
                )
            buffer[self._filled : end] = data
            self._filled = end
            if end < buffer.nbytes:
                return None
            self._buffer = None
            self.expect += 1
            return GetEntry(self.expect - 1, buffer)
        index, total = frame.index, frame.total_size
        if index != self.expect or index >= self._count:
            raise WireError(f"GetFrame.index: got {index}, expected {self.expect}")
        if not frame.tier:
            if data.nbytes or total or frame.shm_length:
                raise WireError(f"GetFrame: miss of key {index} carries data")
            self.expect += 1
            return GetEntry(index, None)
        if total <= 0 or data.nbytes > total:
            raise WireError(
                f"GetFrame.total_size: {total} for a first frame of {data.nbytes} bytes"
            )
        if frame.shm_length:
            if data.nbytes or frame.shm_length != total:
                raise WireError(
                    f"GetFrame.shm_length: {frame.shm_length} for a block of {total} bytes"
                    + (" with data" if data.nbytes else "")
                )
            self.expect += 1
            return GetEntry(index, None, frame.shm_offset, frame.shm_length)
        if data.nbytes == total:
            self.expect += 1
            return GetEntry(index, data)
        if not data.nbytes:
            raise WireError(f"GetFrame: hit of key {index} has neither data nor shm_length")
        buffer = self._take(total)
        buffer[: data.nbytes] = data
        self._buffer = buffer
        self._filled = data.nbytes
        return None

    @property
    def pending_bytes(self) -> int:
        """Total size of the block being reassembled (0 when none)."""
        return 0 if self._buffer is None else self._buffer.nbytes

    def finish(self) -> None:
        """The stream ended: WireError unless every key was answered."""
        if self._buffer is not None or self.expect != self._count:
            raise WireError(f"Get stream ended after {self.expect} of {self._count} keys")
