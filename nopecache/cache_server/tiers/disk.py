"""Local-disk tier: blocks in preallocated slab files, an LRU page index, kept across restarts.

Where it sits: ``--tier cpu://?capacity=8GiB --tier file:///var/cache/nopecache?capacity=200GiB
--tier redis://...``: the store demotes what the memory tier evicts into it, promotes a
hit back up, and demotes its own evictions to the tier below (store.py).

Allocation: the page table of the memory tiers (cpu.PageTable: fixed-size pages, a block
owns a few runs, exact LRU, read leases), over slab files instead of a memory pool
(disk_file.py). Why pages rather than slots of one size or an extent allocator: blocks
differ in size across models and chunkings, a fixed slot would waste up to a slot per
block or refuse large ones, and extents fragment until the tier evicts more than LRU
asks for; pages never fragment and a same-size workload keeps each block one run (one
read, one write). The cost is up to a page of padding per block (256 KiB by default, about
6 % of a 4 MiB block; choose ``page`` near the model's block size).

Every record carries a header (disk_record.py: key, lengths, xxh3 of the payload, a
generation, a MAC) and every read checks it against the index and the payload against its
checksum: a torn, damaged or truncated record is a miss, deleted, counted in
``corrupt_values`` (``nopecache_corrupt_blocks_total{tier="disk"}``), never served. That
check is this tier's own, so the tier is ``trusted``: the store does not hash the block a
second time.

Restarts: the index is rebuilt from the headers at start (disk_index.py); recency order
after a restart is write order (a read does not rewrite its header).

Threads: reads run on ``threads`` worker threads (os.preadv), writes and header erasures
on one writer thread, in submission order: a page freed by a delete or an eviction is only
rewritten by a job queued after the erasure or the read that still needs it. The index,
page table and every counter live on the event loop and change only between awaits; a
key whose write is in flight is in ``_writing`` (a miss to readers, never evicted), a
block being read holds a read lease on its pages (evicted or deleted meanwhile, its pages
are not reused until the read ends).

Failures: an OSError from the disk (ENOSPC, EIO, EFBIG past RLIMIT_FSIZE) turns the
operation into a miss or an UNAVAILABLE put and ``healthy`` False until an operation
succeeds again; nothing raises into the store, nothing held in memory is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar
from urllib.parse import unquote, urlsplit

from nopecache.cache_server.sizes import SizeError, parse_size
from nopecache.cache_server.tiers.base import (
    BlobLike,
    Evicted,
    KeepSet,
    PutResult,
    PutStatus,
    Tier,
    TierClosedError,
    TierConfigError,
    TierName,
    TierStats,
    query_options,
)
from nopecache.cache_server.tiers.cpu import PageTable, Placement
from nopecache.cache_server.tiers.disk_file import (
    SLAB_BYTES,
    SlabFiles,
    ThreadBuffers,
    aligned_buffer,
)
from nopecache.cache_server.tiers.disk_index import Rebuilt, rebuild_index
from nopecache.cache_server.tiers.disk_record import (
    HEAD_PROBE_BYTES,
    MAX_KEY_BYTES,
    RecordError,
    RecordHeader,
    header_len,
    max_runs,
    pack_header,
    parse_header,
    payload_digest,
    record_pages,
)

__all__ = ["DEFAULT_DISK_PAGE_BYTES", "DiskTier"]

log = logging.getLogger(__name__)

# Larger than the memory tiers' 64 KiB: fewer, larger I/Os per block, and a header's run
# list (up to ``max_runs()`` runs) then covers blocks of over 100 MiB.
DEFAULT_DISK_PAGE_BYTES = 256 * 1024
DEFAULT_THREADS = 4
_T = TypeVar("_T")
# What a worker returns for one record: its bytes, or why not.
_ReadOutcome = bytes | RecordError | OSError


@dataclass(frozen=True, slots=True)
class _Record:
    """What the index knows of a record beyond its pages."""

    generation: int
    # Header plus payload: a read fetches only these bytes (rounded up to 4 KiB).
    nbytes: int


class _Busy:
    """The keys the tier must not evict: those being written, and the server's pins."""

    def __init__(self, writing: set[bytes]) -> None:
        self.writing = writing
        self.pins: KeepSet | None = None

    def __len__(self) -> int:
        return len(self.writing) + (len(self.pins) if self.pins is not None else 0)

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is being written or pinned."""
        return key in self.writing or (self.pins is not None and self.pins.holds(key))

    def pinned_keys(self) -> list[bytes]:
        """Every key that may be held."""
        pinned = self.pins.pinned_keys() if self.pins is not None else []
        return [*self.writing, *pinned]


class DiskTier(Tier):
    """Blocks in slab files under one directory, served after a restart (module docstring)."""

    name: ClassVar[TierName] = "disk"
    trusted: ClassVar[bool] = True

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        *,
        page_bytes: int = DEFAULT_DISK_PAGE_BYTES,
        files: int | None = None,
        threads: int = DEFAULT_THREADS,
        direct: bool | None = None,
        url: str | None = None,
    ) -> None:
        directory = Path(directory)
        self._url = url or f"file://{directory}?capacity={capacity_bytes}&page={page_bytes}"
        if page_bytes < HEAD_PROBE_BYTES or capacity_bytes < page_bytes:
            raise TierConfigError(
                f"{self._url}: page must be >= {HEAD_PROBE_BYTES} B and capacity >= one page"
            )
        if threads < 1:
            raise TierConfigError(f"{self._url}: threads must be >= 1, got {threads}")
        n_pages = capacity_bytes // page_bytes
        if files is None:
            files = max(1, -(-n_pages * page_bytes // SLAB_BYTES))
        self._slabs = SlabFiles(directory, n_pages, page_bytes, files=files, direct=direct)
        try:
            self.rebuilt: Rebuilt = rebuild_index(self._slabs)
        except OSError as e:
            self._slabs.close()
            raise TierConfigError(f"{self._url}: reading the slabs failed: {e}") from e
        self._table = PageTable(n_pages, page_bytes)
        records = self.rebuilt.records
        self._table.restore([(h.key, self._placement(h.runs)) for h in records])
        self._records = {
            h.key: _Record(h.generation, h.header_len + h.payload_len) for h in records
        }
        self._next_generation = self.rebuilt.next_generation
        log.info(
            "disk tier %s: %d block(s) found in %.3f s (%d header reads over %d pages, "
            "%d stale erased; O_DIRECT %s)",
            directory,
            len(records),
            self.rebuilt.seconds,
            self.rebuilt.heads_read,
            n_pages,
            self.rebuilt.erased,
            "on" if self._slabs.direct else "off",
        )
        self._readers = ThreadPoolExecutor(threads, thread_name_prefix="nopecache-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="nopecache-disk-write")
        self._writing: set[bytes] = set()
        self._busy = _Busy(self._writing)
        self._zeros = aligned_buffer(HEAD_PROBE_BYTES)
        self._buffers = ThreadBuffers()
        self._healthy = True
        self._closed = False
        # Records found damaged (torn, flipped, truncated) since start: each deleted.
        self.corrupt_values = 0

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_url(cls, url: str) -> DiskTier:
        """Build from ``file:///dir?capacity=64GiB[&page=64KiB][&files=N][&threads=4]
        [&direct=auto|yes|no]``."""
        parts = urlsplit(url)
        if parts.scheme != "file":
            raise TierConfigError(f"{url}: scheme must be file://")
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise TierConfigError(f"{url}: expected file:///absolute/directory?capacity=...")
        options = query_options(
            parts.query,
            allowed=frozenset({"capacity", "page", "files", "threads", "direct"}),
            url=url,
        )
        if "capacity" not in options:
            raise TierConfigError(f"{url}: option 'capacity' is required (e.g. capacity=64GiB)")
        try:
            capacity = parse_size(options["capacity"], field=f"{url}: capacity")
            page = parse_size(options.get("page", DEFAULT_DISK_PAGE_BYTES), field=f"{url}: page")
        except SizeError as exc:
            raise TierConfigError(str(exc)) from exc
        files = _int_option(options, "files", url)
        threads = _int_option(options, "threads", url)
        direct = {"auto": None, "yes": True, "no": False}.get(options.get("direct", "auto"), 0)
        if direct == 0:
            raise TierConfigError(f"{url}: direct must be auto, yes or no")
        assert direct is None or isinstance(direct, bool)
        return cls(
            unquote(parts.path),
            capacity,
            page_bytes=page,
            files=files,
            threads=threads if threads is not None else DEFAULT_THREADS,
            direct=direct,
            url=url,
        )

    # -- properties -----------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The URL this tier was built from."""
        return self._url

    @property
    def capacity_bytes(self) -> int:
        """Slab bytes (the requested capacity rounded down to whole pages)."""
        return self._table.n_pages * self._table.page_bytes

    @property
    def page_bytes(self) -> int:
        """Allocation granule in bytes."""
        return self._table.page_bytes

    @property
    def direct(self) -> bool:
        """Whether the slabs are read and written with O_DIRECT."""
        return self._slabs.direct

    @property
    def slabs(self) -> SlabFiles:
        """The slab files (introspection and tests)."""
        return self._slabs

    @property
    def max_blob_bytes(self) -> int:
        """The largest block a record can carry: its header must list every run."""
        pages = min(self._table.n_pages, max_runs())
        return pages * self._table.page_bytes - header_len(MAX_KEY_BYTES, pages)

    @property
    def healthy(self) -> bool:
        """False since a disk operation failed, until one succeeds."""
        return self._healthy and not self._closed

    def lru_keys(self) -> list[bytes]:
        """Keys from least to most recently used (eviction order)."""
        return list(self._table.index)

    def placement(self, key: bytes) -> Placement | None:
        """Where ``key``'s record lives (no recency change)."""
        return self._table.index.get(key)

    def record_bytes(self, key: bytes) -> int | None:
        """Header plus payload bytes of ``key``'s record (what a read fetches, rounded up
        to 4 KiB); None when absent."""
        record = self._records.get(key)
        return record.nbytes if record is not None else None

    # -- reads ----------------------------------------------------------------------------
    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are present and fully written (no recency change)."""
        self._check_open()
        index, writing = self._table.index, self._writing
        return [key in index and key not in writing for key in keys]

    async def get(self, key: bytes) -> bytes | None:
        """The block read back and verified, refreshing recency; None on a miss."""
        self._check_open()
        table = self._table
        placement = table.index.get(key)
        if placement is None or key in self._writing:
            return None
        table.index.move_to_end(key)
        record = self._records[key]
        table.lease(placement)
        try:
            outcome = await self._run(self._readers, self._read_record, key, placement, record)
        finally:
            table.unlease(placement)
        if isinstance(outcome, bytes):
            self._healthy = True
            return outcome
        if table.index.get(key) is not placement:
            return None  # deleted or replaced while it was read: a plain miss
        if isinstance(outcome, RecordError):
            await self._drop_corrupt(key, placement, str(outcome))
        else:
            self._failed("read", outcome)
        return None

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The blocks for ``keys``, read on the worker threads at once."""
        return list(await asyncio.gather(*(self.get(key) for key in keys)))

    def _read_record(self, key: bytes, placement: Placement, record: _Record) -> _ReadOutcome:
        """(worker thread) The payload of ``key``'s record, checked against the index."""
        buf = self._buffers.get(record.nbytes)
        try:
            if not self._slabs.read_runs(placement.runs, buf, record.nbytes):
                return RecordError("short read: a slab was truncated")
            header = parse_header(self._slabs.secret, buf[:HEAD_PROBE_BYTES])
            expected = (key, record.generation, placement.runs)
            if (header.key, header.generation, header.runs) != expected:
                return RecordError("header does not match the index (overwritten)")
            start = header.header_len
            end = start + header.payload_len
            if end != record.nbytes:
                return RecordError(f"length: {header.payload_len} bytes, not the record's")
            with memoryview(buf) as view, view[start:end] as payload:
                if payload_digest(payload) != header.payload_xxh3:
                    return RecordError("payload: xxh3 mismatch (torn or damaged)")
            return buf[start:end]
        except RecordError as e:
            return e
        except OSError as e:
            return e

    # -- writes ---------------------------------------------------------------------------
    async def put(self, key: bytes, blob: BlobLike, *, keep_evicted: bool = True) -> PutResult:
        """Write ``blob`` as a record, evicting least recently used blocks to make room."""
        self._check_open()
        table = self._table
        if key in table.index:
            table.index.move_to_end(key)
            return PutResult(PutStatus.ALREADY_PRESENT)
        src = memoryview(blob)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        need = record_pages(len(key), len(src), table.page_bytes)
        if len(key) > MAX_KEY_BYTES or need > min(table.n_pages, max_runs(len(key))):
            return PutResult(PutStatus.TOO_LARGE)
        if need > table.n_pages - table.leased_pages:
            return PutResult(PutStatus.UNAVAILABLE)
        busy = self._busy
        busy.pins = self.keep
        if (
            len(busy)
            and table.free_pages < need
            and table.n_pages - table.kept_pages(busy) - table.leased_pages < need
        ):
            return PutResult(PutStatus.FULL)
        victims: list[tuple[bytes, Placement, _Record]] = []
        while table.free_pages < need:
            old_key, old = table.pop_lru(busy)
            victims.append((old_key, old, self._records.pop(old_key)))
            table.release(old)
        placement = table.allocate(key, need * table.page_bytes)
        generation = self._next_generation
        self._next_generation += 1
        header = RecordHeader(key, placement.runs, generation, len(src), 0)
        self._records[key] = _Record(generation, header.header_len + len(src))
        self._writing.add(key)
        try:
            read_back, error = await self._run(
                self._writer, self._write_job, header, src, victims, keep_evicted
            )
        finally:
            self._writing.discard(key)
        evicted = []
        for (old_key, _, _), outcome in zip(victims, read_back, strict=True):
            if isinstance(outcome, RecordError):
                self.corrupt_values += 1
                log.warning("disk tier: damaged block dropped on eviction (%s)", outcome)
            evicted.append(Evicted(old_key, outcome if isinstance(outcome, bytes) else None))
        if error is None:
            self._healthy = True
            return PutResult(PutStatus.STORED, tuple(evicted))
        self._failed("write", error)
        if table.index.get(key) is placement:
            del table.index[key]
            self._records.pop(key, None)
            table.release(placement)
            self._erase_later(placement)
        return PutResult(PutStatus.UNAVAILABLE, tuple(evicted))

    def _write_job(
        self,
        header: RecordHeader,
        src: memoryview,
        victims: Sequence[tuple[bytes, Placement, _Record]],
        keep_evicted: bool,
    ) -> tuple[list[_ReadOutcome | None], OSError | None]:
        """(writer thread) Read the victims still needed, erase their headers, write the
        record; the victims' bytes and the write's error."""
        read_back: list[_ReadOutcome | None] = [
            self._read_record(k, p, g) if keep_evicted else None for k, p, g in victims
        ]
        mine = {p for start, count in header.runs for p in range(start, start + count)}
        try:
            for _, old, _ in victims:
                if old.runs[0][0] not in mine:
                    self._slabs.erase_head(old.runs[0][0], self._zeros)
            digest = payload_digest(src)
            full = RecordHeader(header.key, header.runs, header.generation, len(src), digest)
            nbytes = full.header_len + len(src)
            buf = self._buffers.get(nbytes)
            with memoryview(buf) as view:
                start = pack_header(self._slabs.secret, full, view)
                view[start : start + len(src)] = src
            self._slabs.write_runs(header.runs, buf, nbytes)
        except OSError as e:
            return read_back, e
        return read_back, None

    # -- deletes --------------------------------------------------------------------------
    async def delete(self, key: bytes) -> bool:
        """Remove ``key`` and erase its header (it does not come back after a restart)."""
        self._check_open()
        placement = self._table.index.pop(key, None)
        if placement is None:
            return False
        self._records.pop(key, None)
        self._table.release(placement)
        error = await self._run(self._writer, self._erase, placement)
        if error is not None:
            self._failed("erase", error)
        return True

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove ``keys``; for each, whether it was present."""
        return [await self.delete(key) for key in keys]

    def _erase(self, placement: Placement) -> OSError | None:
        """(writer thread) Zero the record's header page."""
        try:
            self._slabs.erase_head(placement.runs[0][0], self._zeros)
        except OSError as e:
            return e
        return None

    def _erase_later(self, placement: Placement) -> None:
        """Queue a header erasure without waiting (after a failed write: best effort)."""
        if not self._closed:
            self._writer.submit(self._erase, placement)

    async def _drop_corrupt(self, key: bytes, placement: Placement, why: str) -> None:
        self.corrupt_values += 1
        log.warning("disk tier: damaged block deleted, answered as a miss (%s)", why)
        await self.delete(key)

    # -- admin ----------------------------------------------------------------------------
    async def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """Every stored key starting with ``prefix``."""
        self._check_open()
        return [key for key in self._table.index if key.startswith(prefix)]

    async def flush(self) -> None:
        """Wait for every queued write, then fdatasync the slabs."""
        self._check_open()
        error = await self._run(self._writer, self._sync)
        if error is not None:
            self._failed("fsync", error)

    def _sync(self) -> OSError | None:
        try:
            self._slabs.sync()
        except OSError as e:
            return e
        return None

    async def stats(self) -> TierStats:
        """Pages in use x page size against the slab capacity."""
        table = self._table
        return TierStats(
            name=self.name,
            url=self._url,
            used_bytes=(table.n_pages - table.free_pages) * table.page_bytes,
            capacity_bytes=self.capacity_bytes,
            entries=len(table.index) - len(self._writing),
            healthy=self.healthy,
        )

    async def close(self) -> None:
        """Finish queued writes, fdatasync, close the files and release the directory."""
        if self._closed:
            return
        try:
            error = await self._run(self._writer, self._sync)
            if error is not None:
                log.warning("disk tier: fsync at close failed: %s", error)
        finally:
            self._closed = True
            await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._slabs.close()
        self._zeros.close()
        self._buffers.close()
        self._table.index.clear()

    # -- helpers --------------------------------------------------------------------------
    def _placement(self, runs: tuple[tuple[int, int], ...]) -> Placement:
        return Placement(runs, sum(c for _, c in runs) * self._slabs.page_bytes)

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _failed(self, what: str, error: OSError) -> None:
        if self._healthy:
            log.warning("disk tier %s: %s failed (%s): unhealthy", self._url, what, error)
        self._healthy = False

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"{self._url}: tier is closed")


def _int_option(options: dict[str, str], name: str, url: str) -> int | None:
    if name not in options:
        return None
    try:
        return int(options[name])
    except ValueError as exc:
        raise TierConfigError(f"{url}: {name} must be an integer, got {options[name]!r}") from exc
