"""Rebuilding the disk tier's index at start: a scan of the record headers in the slabs.

Why a scan rather than a journal: the headers already say everything the index holds (key,
pages, generation), so a journal would be a second copy to keep consistent and to
replay; a scan reads one 4 KiB head per record plus one per free page, skipping the rest
of each record's first run, and is bounded by the pool's page count. Measured figures are
in docs/operations.md ("Sizing the disk tier").

Which headers count: one that parses, carries a valid MAC (disk_record), starts its first
run on the page it was found at, and whose runs stay in the pool and match its length.
Records can disagree only after a crash (a stale header whose pages were partly reused):
the higher generation wins every page it claims, a record that loses any page or whose
key a newer record holds is dropped, and its header erased so it never comes back.

Payloads are not read here: every read verifies its record's length and xxh3 (disk.py),
so a torn record is found, counted and deleted when it is first asked for, and a start
costs one small read per record instead of a read of the whole tier.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from nopecache.cache_server.tiers.disk_file import SlabFiles, aligned_buffer
from nopecache.cache_server.tiers.disk_record import (
    HEAD_PROBE_BYTES,
    RecordError,
    RecordHeader,
    check_runs,
    parse_header,
)

__all__ = ["Rebuilt", "rebuild_index"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """What a scan found: live records oldest first, and the scan's cost."""

    records: tuple[RecordHeader, ...]
    next_generation: int
    heads_read: int
    erased: int
    seconds: float


def rebuild_index(slabs: SlabFiles) -> Rebuilt:
    """Scan the slabs' pages for record headers; the live records, oldest first."""
    t0 = time.perf_counter()
    buf = aligned_buffer(HEAD_PROBE_BYTES)
    found: list[RecordHeader] = []
    page, reads = 0, 0
    try:
        while page < slabs.n_pages:
            reads += 1
            got = slabs.read_head(page, buf)
            try:
                if got < HEAD_PROBE_BYTES:
                    raise RecordError("short read")
                header = parse_header(slabs.secret, memoryview(buf))
                check_runs(header, slabs.n_pages, slabs.page_bytes, page)
            except RecordError:
                page += 1
                continue
            found.append(header)
            # The rest of the first run is this record's payload: no header to look for.
            page += header.runs[0][1]
    finally:
        buf.close()
    live, stale = _resolve(found, slabs.n_pages)
    erased = 0
    if stale:
        zeros = aligned_buffer(HEAD_PROBE_BYTES)
        try:
            for page in stale:
                slabs.erase_head(page, zeros)
                erased += 1
        finally:
            zeros.close()
    next_gen = max((h.generation for h in found), default=0) + 1
    seconds = time.perf_counter() - t0
    return Rebuilt(tuple(live), next_gen, reads, erased, seconds)


def _resolve(found: list[RecordHeader], n_pages: int) -> tuple[list[RecordHeader], list[int]]:
    """The records that keep their pages (newest generation first wins), oldest first, and
    the header pages of the losers that no winner overwrites."""
    owner = bytearray(n_pages)  # 1: the page belongs to a live record
    keys: set[bytes] = set()
    live: list[RecordHeader] = []
    losers: list[RecordHeader] = []
    for header in sorted(found, key=lambda h: h.generation, reverse=True):
        pages = [p for start, count in header.runs for p in range(start, start + count)]
        if header.key in keys or any(owner[p] for p in pages):
            losers.append(header)
            continue
        for p in pages:
            owner[p] = 1
        keys.add(header.key)
        live.append(header)
    live.reverse()
    stale = [h.runs[0][0] for h in losers if not owner[h.runs[0][0]]]
    if losers:
        log.info("disk tier: %d stale record(s) superseded by newer ones", len(losers))
    return live, stale
