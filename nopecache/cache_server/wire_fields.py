"""Which field of a request broke its protobuf wire format.

protobuf's parser says only "Error parsing message"; a bad request must be answered with
INVALID_ARGUMENT naming the field (STYLE.md). :func:`bad_field` walks the wire format
record by record, the way the parser reads it, and names the first field whose record
cannot be read::

    record    tag (varint: field number << 3 | wire type), then the value:
              0 varint | 1 eight bytes | 2 varint length + bytes | 5 four bytes
    broken    a truncated tag or value, a length past the end, field number 0,
              a group wire type (3, 4; proto3 has no groups), a string that is not UTF-8

Concurrency: pure functions.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["bad_field"]

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_MAX_VARINT_BYTES = 10


class _Broken(Exception):
    """The record at hand cannot be read."""


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``."""
    value = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos + i >= len(raw):
            raise _Broken("truncated varint")
        byte = raw[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, pos + i + 1
    raise _Broken("varint longer than 10 bytes")


def _skip(raw: bytes, pos: int, wire_type: int) -> tuple[int, int]:
    """(start, end) of the value of ``wire_type`` at ``pos``."""
    if wire_type == _VARINT:
        return pos, _varint(raw, pos)[1]
    if wire_type == _LENGTH:
        size, start = _varint(raw, pos)
        if start + size > len(raw):
            raise _Broken(f"length {size} runs past the end of the message")
        return start, start + size
    width = {_FIXED64: 8, _FIXED32: 4}.get(wire_type)
    if width is None:
        raise _Broken(f"wire type {wire_type} is not used by proto3")
    if pos + width > len(raw):
        raise _Broken("truncated fixed-width value")
    return pos, pos + width


def bad_field(cls: type[Message], raw: bytes) -> str | None:
    """``"Message.field: why"`` for the first unreadable record of ``raw`` as ``cls``, else None.

    A field the message does not declare is named by its number (``field 9``); a broken
    tag, whose field cannot be known, by its byte offset.
    """
    descriptor = cls.DESCRIPTOR
    pos = 0
    while pos < len(raw):
        try:
            tag, after = _varint(raw, pos)
        except _Broken as e:
            return f"{descriptor.name}: tag at byte {pos}: {e}"
        number, wire_type = tag >> 3, tag & 7
        field = descriptor.fields_by_number.get(number)
        name = f"{descriptor.name}.{field.name if field is not None else f'field {number}'}"
        if number == 0:
            return f"{descriptor.name}: tag at byte {pos}: field number 0"
        try:
            start, pos = _skip(raw, after, wire_type)
        except _Broken as e:
            return f"{name}: {e}"
        if field is not None and field.type == FieldDescriptor.TYPE_STRING and wire_type == _LENGTH:
            try:
                raw[start:pos].decode("utf-8")
            except UnicodeDecodeError:
                return f"{name}: not valid UTF-8"
    return None
