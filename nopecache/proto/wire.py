"""Protobuf varints, shared by the hand-written frame codecs of server and client.

Both sides encode and decode PutFrame/GetFrame themselves (upb spent milliseconds per MiB
serialising fresh bytes fields); the varint rules live here once.
"""

from __future__ import annotations

__all__ = ["WireError", "encode_varint", "read_varint"]


class WireError(ValueError):
    """A message is not valid protobuf wire format for its type; names the field."""


def encode_varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(buf: bytes, pos: int, field: str) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; ``field`` names it in errors."""
    result = shift = 0
    end = len(buf)
    while shift < 70:
        if pos >= end:
            raise WireError(f"{field}: message ends inside a varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise WireError(f"{field}: varint longer than 10 bytes")
