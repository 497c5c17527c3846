"""The disk tier's record format: a small header in front of each block's bytes.

One record per block, laid out as one byte stream over the block's page runs (the pages
of ``runs``, in order; the header always sits at the start of the first run's first page)::

    offset  size  field
    0       8     magic b"NPCDISK1"
    8       4     header_len (bytes: fixed part + key + runs)
    12      4     n_runs
    16      8     generation (a per-directory sequence number; the newest record wins)
    24      8     payload_len (the block's bytes, exactly)
    32      8     payload_xxh3 (xxh3-64 of the payload)
    40      2     key_len
    42      6     zero
    48      8     header MAC: blake2b-64 keyed by the directory's secret over the header
                  with these 8 bytes left out
    56      k     key
    56 + k  8 n   runs: (first page u32, page count u32) each
    header_len    payload (the block, as the service verified it: proto.block's format)

Why a MAC rather than a plain checksum over the header: the index is rebuilt by reading
headers at page starts, and a page that once held another tenant's payload could hold
bytes shaped like a header. A tenant able to forge one would plant a block under another
tenant's key across a restart; without the directory's secret it cannot. The payload
itself stays the block the service checked; a read compares its length and xxh3 with the
header's, so a torn or damaged record is a miss, never served.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

__all__ = [
    "FIXED_BYTES",
    "HEAD_PROBE_BYTES",
    "MAGIC",
    "MAX_KEY_BYTES",
    "RecordError",
    "RecordHeader",
    "check_runs",
    "header_len",
    "max_runs",
    "pack_header",
    "parse_header",
    "payload_digest",
    "record_pages",
]

MAGIC = b"NPCDISK1"
_FIXED = struct.Struct("<8sIIQQQH6x")
_MAC = struct.Struct("<8s")
FIXED_BYTES = _FIXED.size + _MAC.size  # 56
_RUN = struct.Struct("<II")
# Stored keys are a 16-byte block key behind an optional tenant namespace.
MAX_KEY_BYTES = 64
# What a scan reads at a page start: a whole header must fit in it (see ``max_runs``).
HEAD_PROBE_BYTES = 4096


class RecordError(ValueError):
    """A record header is absent, damaged, forged or inconsistent (the message says which)."""


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """One record's header fields (``runs``: (first page, page count) in stream order)."""

    key: bytes
    runs: tuple[tuple[int, int], ...]
    generation: int
    payload_len: int
    payload_xxh3: int

    @property
    def header_len(self) -> int:
        """Header bytes in front of the payload."""
        return header_len(len(self.key), len(self.runs))


def header_len(key_len: int, n_runs: int) -> int:
    """Bytes of a header for a key of ``key_len`` bytes and ``n_runs`` runs."""
    return FIXED_BYTES + key_len + _RUN.size * n_runs


def max_runs(key_len: int = MAX_KEY_BYTES) -> int:
    """The most runs a header may list: it must fit in ``HEAD_PROBE_BYTES`` (one read)."""
    return (HEAD_PROBE_BYTES - FIXED_BYTES - key_len) // _RUN.size


def record_pages(key_len: int, payload_len: int, page_bytes: int) -> int:
    """Pages a record takes: the fewest n whose bytes hold a header listing up to n runs
    plus the payload (a header never outgrows the pages allocated for it)."""
    n = -(-(FIXED_BYTES + key_len + payload_len) // page_bytes)
    while header_len(key_len, n) + payload_len > n * page_bytes:
        n += 1
    return n


def payload_digest(payload: memoryview | bytes) -> int:
    """The payload checksum records carry (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(payload)


def _mac(secret: bytes, head: memoryview | bytes, tail: memoryview | bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_MAC.size, key=secret)
    h.update(head)
    h.update(tail)
    return h.digest()


def pack_header(secret: bytes, header: RecordHeader, out: memoryview) -> int:
    """Write ``header`` at the start of ``out``; returns its length."""
    n = header.header_len
    if not 0 < len(header.key) <= MAX_KEY_BYTES:
        raise RecordError(f"key: {len(header.key)} bytes (1 to {MAX_KEY_BYTES})")
    if n > HEAD_PROBE_BYTES:
        raise RecordError(f"header: {n} bytes exceeds {HEAD_PROBE_BYTES} ({len(header.runs)} runs)")
    _FIXED.pack_into(
        out,
        0,
        MAGIC,
        n,
        len(header.runs),
        header.generation,
        header.payload_len,
        header.payload_xxh3,
        len(header.key),
    )
    pos = FIXED_BYTES
    out[pos : pos + len(header.key)] = header.key
    pos += len(header.key)
    for start, count in header.runs:
        _RUN.pack_into(out, pos, start, count)
        pos += _RUN.size
    out[_FIXED.size : FIXED_BYTES] = _mac(secret, out[: _FIXED.size], out[FIXED_BYTES:n])
    return n


def parse_header(secret: bytes, raw: memoryview | bytes) -> RecordHeader:
    """The header at the start of ``raw``, or RecordError (no magic, bad MAC, bad fields)."""
    view = memoryview(raw)
    if len(view) < FIXED_BYTES or bytes(view[:8]) != MAGIC:
        raise RecordError("no record header (magic)")
    _, n, n_runs, generation, payload_len, digest, key_len = _FIXED.unpack_from(view, 0)
    if n != header_len(key_len, n_runs) or n > len(view) or not 0 < key_len <= MAX_KEY_BYTES:
        raise RecordError(f"header: inconsistent lengths (header_len={n}, key_len={key_len})")
    if bytes(view[_FIXED.size : FIXED_BYTES]) != _mac(
        secret, view[: _FIXED.size], view[FIXED_BYTES:n]
    ):
        raise RecordError("header: MAC mismatch (damaged, or written under another secret)")
    pos = FIXED_BYTES
    key = bytes(view[pos : pos + key_len])
    pos += key_len
    runs = tuple(_RUN.unpack_from(view, pos + _RUN.size * i) for i in range(n_runs))
    if not runs or any(count < 1 for _, count in runs):
        raise RecordError("header: a record needs runs of at least one page")
    return RecordHeader(key, runs, generation, payload_len, digest)


def check_runs(header: RecordHeader, n_pages: int, page_bytes: int, first_page: int) -> None:
    """RecordError unless ``header``'s runs start at ``first_page``, stay in the pool and
    are exactly as many pages as its bytes need."""
    runs: Sequence[tuple[int, int]] = header.runs
    if runs[0][0] != first_page:
        raise RecordError(f"header: first run at page {runs[0][0]}, found at page {first_page}")
    if any(start + count > n_pages for start, count in runs):
        raise RecordError(f"header: a run ends past the pool's {n_pages} pages")
    need = record_pages(len(header.key), header.payload_len, page_bytes)
    if sum(count for _, count in runs) != need:
        raise RecordError(f"header: runs hold other than the {need} pages the record needs")
