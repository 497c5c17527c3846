"""Host-memory tier: one preallocated buffer, a page allocator over it, an LRU index.

Pool layout (``cpu://?capacity=1MiB&page=256KiB``: 4 pages)::

    pool (one buffer, allocated once at start)
    +-----------+-----------+-----------+-----------+
    |  page 0   |  page 1   |  page 2   |  page 3   |
    +-----------+-----------+-----------+-----------+
     \\_______ block A ______/ \\_ B (part) _/  free
       runs ((0, 2),)          runs ((2, 1),)
       size 300 KiB            size 100 KiB

Allocator: fixed-size pages, each block owning a short list of *runs* (first page, page
count). Why pages rather than variable-size extents with coalescing free lists: with
extents, a large block may not fit although enough bytes are free (external
fragmentation), so the tier would have to evict more than LRU asks for, or compact.
With pages any free page serves any block, so eviction frees exactly the LRU entries it
needs and the pool never fragments; the cost is internal waste below one page per block
(at most 1/32 for a 2 MiB block with 64 KiB pages) and a gather on read, which is free
because ``get`` must return a private copy anyway. Free pages form a stack whose pops
come out in ascending order and frees are pushed back in reverse, so on a fresh pool and
under steady same-size churn a block is one run: one memcpy in, one out.

Eviction: exact LRU (``collections.OrderedDict``: a hash map over a doubly linked list,
so lookup, refresh and evict-oldest are O(1) with no allocation per move). Why LRU: a
KV block's next use follows its last one (a system prompt shared by a burst of
requests, a conversation re-sent each turn); the usual argument for scan-resistant
policies (one huge one-off prompt flushing the hot set) is weaker here because an
evicted block is demoted to the next tier, not lost. ``get`` and ``put`` of a present key
refresh recency; ``contains_many`` is a query and does not.

Read leases (``lease``): a reader that sends a block's bytes across awaits (the bulk
stream) borrows views of its pages instead of a copy. While leased, the block may still be
evicted or deleted (it leaves the index at once), but its pages stay out of the free
stack until the last lease ends, so they are never rewritten under a reader. Leases hold
at most ``lease_share`` of the pool (more are refused: the reader copies), and a put that
could only find room in leased pages is refused (UNAVAILABLE) before anything is evicted.

Concurrency: no method awaits between reading and updating the index or the pool, so
each operation is atomic with respect to other coroutines on the loop; no lock is
needed (and none may be added that blocks in ``async def``). An 8 MiB copy holds the
loop for about a millisecond, less than receiving that block over gRPC takes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import urlsplit

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

if TYPE_CHECKING:  # a host pool never needs it, and it pulls in protobuf (the pool's RSS test)
    from nopecache.proto.arena_layout import CudaIpcHandle

__all__ = [
    "DEFAULT_PAGE_BYTES",
    "CpuTier",
    "PageTable",
    "PagedTier",
    "Placement",
    "TierLease",
]

DEFAULT_PAGE_BYTES = 64 * 1024
# Device files of a GPU driver torch.cuda can use (NVIDIA, ROCm, WSL): without any of them
# pinned=auto skips importing torch altogether.
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one block lives: runs of consecutive pages, and its exact byte size."""

    runs: tuple[tuple[int, int], ...]
    size: int


class PageTable:
    """Free-page stack plus the LRU index of placed blocks; knows nothing of the bytes."""

    def __init__(self, n_pages: int, page_bytes: int) -> None:
        if n_pages < 1:
            raise ValueError(f"n_pages: must be >= 1, got {n_pages}")
        if page_bytes < 1:
            raise ValueError(f"page_bytes: must be >= 1, got {page_bytes}")
        self.n_pages = n_pages
        self.page_bytes = page_bytes
        # Top of the stack is the end of the list: page 0 is popped first.
        self._free: list[int] = list(range(n_pages - 1, -1, -1))
        # Iteration order is recency order: first = least recently used.
        self.index: OrderedDict[bytes, Placement] = OrderedDict()
        # Read leases: placements whose pages someone reads outside the loop's atomic
        # steps (a send in flight), with their lease counts. A leased block that is
        # evicted or deleted leaves the index at once but keeps its pages (``retired``)
        # until its last lease ends: its pages are never rewritten while leased.
        self._leases: dict[Placement, int] = {}
        self._retired: set[Placement] = set()
        self.leased_pages = 0

    @property
    def free_pages(self) -> int:
        """Pages not owned by any block."""
        return len(self._free)

    def pages_for(self, size: int) -> int:
        """Pages a blob of ``size`` bytes occupies."""
        return -(-size // self.page_bytes)

    def allocate(self, key: bytes, size: int) -> Placement:
        """Take pages for ``size`` bytes and index ``key`` as most recent; caller made room."""
        need = self.pages_for(size)
        if need > len(self._free):
            raise RuntimeError(f"allocate: {need} pages needed, {len(self._free)} free")
        runs: list[tuple[int, int]] = []
        if need:
            taken = self._free[-need:]
            del self._free[-need:]
            start, count = taken[-1], 0
            for page in reversed(taken):
                if page == start + count:
                    count += 1
                else:
                    runs.append((start, count))
                    start, count = page, 1
            runs.append((start, count))
        placement = Placement(tuple(runs), size)
        self.index[key] = placement
        return placement

    def restore(self, entries: Sequence[tuple[bytes, Placement]]) -> None:
        """Index ``entries`` (least recently used first) on an empty table and take their
        pages (a tier whose blocks outlived the process: the disk tier's rebuild)."""
        assert not self.index, "restore: the table is not empty"
        owned = bytearray(self.n_pages)
        for key, placement in entries:
            self.index[key] = placement
            for start, count in placement.runs:
                owned[start : start + count] = b"\x01" * count
        self._free = [p for p in range(self.n_pages - 1, -1, -1) if not owned[p]]

    def pop_lru(self, keep: KeepSet | None = None) -> tuple[bytes, Placement]:
        """Unindex the least recently used block that ``keep`` does not hold; its pages
        stay owned until ``release``. The caller checked that such a block exists."""
        if keep is None or not len(keep):
            return self.index.popitem(last=False)
        # Pinned blocks stay at the LRU end; there are few, so skipping them is cheap.
        for key in self.index:
            if not keep.holds(key):
                return key, self.index.pop(key)
        raise RuntimeError("pop_lru: every block is kept")

    def kept_pages(self, keep: KeepSet) -> int:
        """Pages owned by blocks ``keep`` holds (O(number of kept keys))."""
        index = self.index
        return sum(
            self.pages_for(index[key].size)
            for key in keep.pinned_keys()
            if key in index and keep.holds(key)
        )

    def leased(self, placement: Placement) -> bool:
        """Whether ``placement`` is held by a read lease now."""
        return placement in self._leases

    def lease(self, placement: Placement) -> None:
        """Hold ``placement``'s pages: not reused until ``unlease`` (see ``_leases``)."""
        count = self._leases.get(placement, 0)
        if not count:
            self.leased_pages += self.pages_for(placement.size)
        self._leases[placement] = count + 1

    def unlease(self, placement: Placement) -> None:
        """End one lease of ``placement``; the last one frees a retired block's pages."""
        count = self._leases[placement] - 1
        if count:
            self._leases[placement] = count
            return
        del self._leases[placement]
        self.leased_pages -= self.pages_for(placement.size)
        if placement in self._retired:
            self._retired.discard(placement)
            self._free_pages(placement)

    def release(self, placement: Placement) -> None:
        """Return a block's pages to the free stack (ascending pops preserved); a leased
        block's pages only when its last lease ends."""
        if placement in self._leases:
            self._retired.add(placement)
            return
        self._free_pages(placement)

    def _free_pages(self, placement: Placement) -> None:
        for start, count in reversed(placement.runs):
            self._free.extend(range(start + count - 1, start - 1, -1))

    def check(self) -> None:
        """Raise AssertionError unless every page is either free or owned exactly once."""
        seen = list(self._free)
        for placement in (*self.index.values(), *self._retired):
            assert self.pages_for(placement.size) == sum(c for _, c in placement.runs)
            for start, count in placement.runs:
                seen.extend(range(start, start + count))
        assert sorted(seen) == list(range(self.n_pages)), "pages leaked or double-owned"


class TierLease:
    """A read lease of one block's pages (``PagedTier.lease``): ``views`` stay valid and
    unchanged until ``release`` (idempotent; also on leaving a ``with``)."""

    __slots__ = ("_placement", "_table", "size", "views")

    def __init__(self, table: PageTable, placement: Placement, views: list[memoryview]) -> None:
        self._table: PageTable | None = table
        self._placement = placement
        self.views = views
        self.size = placement.size

    @property
    def placement(self) -> Placement:
        """The leased block's page runs (where its bytes are in the pool)."""
        return self._placement

    def release(self) -> None:
        """End the lease: the pages may be reused from now on."""
        table, self._table = self._table, None
        if table is not None:
            table.unlease(self._placement)

    def __enter__(self) -> TierLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PagedTier(Tier):
    """A tier over a preallocated pool of pages; subclasses move the bytes.

    ``lease_share``: the most of the pool that read leases may hold at once, so that
    leases can never keep a put from finding room for a block of up to the rest.
    """

    lease_share: float = 0.5
    # The UUID of the GPU whose memory holds the pool ("GPU-..."); None: host memory.
    # A pool on a GPU is offered to same-host clients over CUDA IPC (cuda_ipc_handle).
    cuda_device_uuid: str | None = None

    def __init__(self, capacity_bytes: int, page_bytes: int, url: str) -> None:
        if page_bytes < 1:
            raise TierConfigError(f"{url}: page must be >= 1 byte, got {page_bytes}")
        if capacity_bytes < page_bytes:
            raise TierConfigError(
                f"{url}: capacity ({capacity_bytes} B) is smaller than one page ({page_bytes} B)"
            )
        self._url = url
        # Capacity is rounded down to whole pages, so the pool never exceeds what was asked.
        self._table = PageTable(capacity_bytes // page_bytes, page_bytes)
        self._closed = False
        # Blocks never evicted while it holds them (the server's PinTable); None: none.
        self.keep: KeepSet | None = None

    @property
    def url(self) -> str:
        """The URL this tier was built from."""
        return self._url

    @property
    def capacity_bytes(self) -> int:
        """Pool size in bytes (requested capacity rounded down to whole pages)."""
        return self._table.n_pages * self._table.page_bytes

    @property
    def page_bytes(self) -> int:
        """Allocation granule in bytes."""
        return self._table.page_bytes

    @property
    def max_blob_bytes(self) -> int:
        """A blob may take the whole pool."""
        return self.capacity_bytes

    def _read(self, placement: Placement) -> bytes:
        """Gather a block's bytes into a new ``bytes``."""
        raise NotImplementedError

    def _write(self, placement: Placement, src: memoryview) -> None:
        """Scatter ``src`` into a block's pages."""
        raise NotImplementedError

    def _free_pool(self) -> None:
        """Drop the pool memory."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"{self._url}: tier is closed")

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys are present (no recency change)."""
        self._check_open()
        # map() over the bound __contains__ keeps the loop in C: ~2x a comprehension.
        return list(map(self._table.index.__contains__, keys))

    async def get(self, key: bytes) -> bytes | None:
        """A copy of the blob, refreshing its recency; None on a miss."""
        self._check_open()
        placement = self._table.index.get(key)
        if placement is None:
            return None
        self._table.index.move_to_end(key)
        return self._read(placement)

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the blobs in key order, None per miss."""
        self._check_open()
        index = self._table.index
        out: list[bytes | None] = []
        for key in keys:
            placement = index.get(key)
            if placement is None:
                out.append(None)
            else:
                index.move_to_end(key)
                out.append(self._read(placement))
        return out

    async def get_into(self, key: bytes, out: memoryview) -> int | None:
        """Copy the blob's pages straight into ``out`` (see ``Tier.get_into``)."""
        self._check_open()
        placement = self._table.index.get(key)
        if placement is None:
            return None
        if placement.size <= out.nbytes:
            self._table.index.move_to_end(key)
            self._read_into(placement, out)
        return placement.size

    def _read_into(self, placement: Placement, out: memoryview) -> None:
        """Gather a block's bytes into ``out`` (one copy per run); the default reads a copy."""
        out[: placement.size] = self._read(placement)

    async def put(self, key: bytes, blob: BlobLike, *, keep_evicted: bool = True) -> PutResult:
        """Copy ``blob`` into the pool, evicting least recently used blocks to make room."""
        self._check_open()
        table = self._table
        if key in table.index:
            table.index.move_to_end(key)
            return PutResult(PutStatus.ALREADY_PRESENT)
        src = memoryview(blob)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        need = table.pages_for(len(src))
        if need > table.n_pages:
            return PutResult(PutStatus.TOO_LARGE)
        if need > table.n_pages - table.leased_pages:
            # Leased pages come back when their reads end; nothing is evicted for it.
            return PutResult(PutStatus.UNAVAILABLE)
        keep = self.keep
        # Checked before evicting anything: a put that cannot fit leaves the tier as it was.
        # (A block both kept and leased counts twice here: a refusal, never a failed loop.)
        if (
            keep is not None
            and len(keep)
            and table.free_pages < need
            and table.n_pages - table.kept_pages(keep) - table.leased_pages < need
        ):
            return PutResult(PutStatus.FULL)
        evicted: list[Evicted] = []
        while table.free_pages < need:
            old_key, old = table.pop_lru(keep)
            # Read before release: the pages are about to be overwritten by the new block.
            evicted.append(Evicted(old_key, self._read(old) if keep_evicted else None))
            table.release(old)
        self._write(table.allocate(key, len(src)), src)
        return PutResult(PutStatus.STORED, tuple(evicted))

    def lease(self, key: bytes, *, host_views: bool = True) -> TierLease | None:
        """Views of ``key``'s bytes in the pool, held from reuse until the lease ends
        (refreshing recency); None on a miss, for a tier whose pages are not host memory
        the caller may read, or when leased pages would pass ``lease_share`` of the pool
        (the caller copies then, with ``get_into``). ``host_views=False``: the pages only
        (no views, ``TierLease.views`` empty), for a reader that addresses the pool by
        offset itself (a device pool opened over CUDA IPC)."""
        self._check_open()
        table = self._table
        placement = table.index.get(key)
        if placement is None:
            return None
        pages = 0 if table.leased(placement) else table.pages_for(placement.size)
        if table.leased_pages + pages > self.lease_share * table.n_pages:
            return None
        views = self._views(placement) if host_views else []
        if views is None:
            return None
        table.index.move_to_end(key)
        table.lease(placement)
        return TierLease(table, placement, views)

    def _views(self, placement: Placement) -> list[memoryview] | None:
        """Read-only views of a block's runs, in order (None: not host memory)."""
        return None

    def cuda_ipc_handle(self) -> CudaIpcHandle:
        """The CUDA IPC handle of a pool on a GPU (``cuda_device_uuid`` is set)."""
        raise NotImplementedError(f"{self._url}: the pool is not in CUDA memory")

    async def delete(self, key: bytes) -> bool:
        """Remove ``key`` and free its pages."""
        self._check_open()
        placement = self._table.index.pop(key, None)
        if placement is None:
            return False
        self._table.release(placement)
        return True

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove ``keys``; for each, whether it was present."""
        self._check_open()
        removed = []
        for key in keys:
            placement = self._table.index.pop(key, None)
            if placement is not None:
                self._table.release(placement)
            removed.append(placement is not None)
        return removed

    async def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """Every stored key starting with ``prefix``."""
        self._check_open()
        return [key for key in self._table.index if key.startswith(prefix)]

    def placement(self, key: bytes) -> Placement | None:
        """Where ``key`` lives in the pool (introspection; no recency change)."""
        return self._table.index.get(key)

    def lru_keys(self) -> list[bytes]:
        """Keys from least to most recently used (eviction order)."""
        return list(self._table.index)

    def check_invariants(self) -> None:
        """Raise AssertionError if a page is leaked or owned twice."""
        self._table.check()

    async def stats(self) -> TierStats:
        """Pages in use x page size against the pool size."""
        table = self._table
        return TierStats(
            name=self.name,
            url=self._url,
            used_bytes=(table.n_pages - table.free_pages) * table.page_bytes,
            capacity_bytes=self.capacity_bytes,
            entries=len(table.index),
            healthy=not self._closed,
        )

    async def close(self) -> None:
        """Forget every entry and drop the pool."""
        if self._closed:
            return
        self._closed = True
        self._table.index.clear()
        self._free_pool()


class CpuTier(PagedTier):
    """Blocks in one preallocated host buffer (page-locked only when asked: ``pinned``).

    ``pinned`` defaults to False: no server path copies between this pool and a GPU (the
    CUDA tier stages through its own pinned buffers), and pinning locks the whole pool
    in RAM up front and creates a CUDA context. ``None`` (``pinned=auto``) pins when CUDA
    is present, ``True`` (``pinned=yes``) requires it.
    """

    name: ClassVar[TierName] = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        pinned: bool | None = False,
        url: str | None = None,
    ) -> None:
        url = url or f"cpu://?capacity={capacity_bytes}&page={page_bytes}"
        super().__init__(capacity_bytes, page_bytes, url)
        self.pinned, self._mem = _host_pool(self.capacity_bytes, pinned, url)
        # The pool's memfd (None when pinned): a same-host client of the only tenant maps
        # it read-only (zero_copy.py).
        self.arena_fd: int | None = _arena_fd(self._mem)

    @classmethod
    def from_url(cls, url: str) -> CpuTier:
        """Build from ``cpu://?capacity=1GiB[&page=64KiB][&pinned=no|auto|yes]`` (default no)."""
        parts = urlsplit(url)
        if parts.scheme != "cpu":
            raise TierConfigError(f"{url}: scheme must be cpu://")
        if parts.netloc or parts.path not in ("", "/"):
            raise TierConfigError(f"{url}: cpu:// takes no host or path, only ?capacity=...")
        options = query_options(
            parts.query, allowed=frozenset({"capacity", "page", "pinned"}), url=url
        )
        if "capacity" not in options:
            raise TierConfigError(f"{url}: option 'capacity' is required (e.g. capacity=8GiB)")
        try:
            capacity = parse_size(options["capacity"], field=f"{url}: capacity")
            page = parse_size(options.get("page", DEFAULT_PAGE_BYTES), field=f"{url}: page")
        except SizeError as exc:
            raise TierConfigError(str(exc)) from exc
        return cls(capacity, page_bytes=page, pinned=_parse_pinned(options, url), url=url)

    def _read(self, placement: Placement) -> bytes:
        mem, page = self._mem, self._table.page_bytes
        left = placement.size
        parts = []
        for start, count in placement.runs:
            n = min(count * page, left)
            parts.append(mem[start * page : start * page + n])
            left -= n
        # bytes.join copies each buffer once straight into the result.
        return b"".join(parts)

    def _views(self, placement: Placement) -> list[memoryview] | None:
        mem, page = self._mem, self._table.page_bytes
        views, left = [], placement.size
        for start, count in placement.runs:
            n = min(count * page, left)
            views.append(mem[start * page : start * page + n].toreadonly())
            left -= n
        return views

    def _read_into(self, placement: Placement, out: memoryview) -> None:
        mem, page = self._mem, self._table.page_bytes
        offset = 0
        for start, count in placement.runs:
            n = min(count * page, placement.size - offset)
            out[offset : offset + n] = mem[start * page : start * page + n]
            offset += n

    def _write(self, placement: Placement, src: memoryview) -> None:
        mem, page = self._mem, self._table.page_bytes
        offset = 0
        for start, count in placement.runs:
            n = min(count * page, len(src) - offset)
            mem[start * page : start * page + n] = src[offset : offset + n]
            offset += n

    def _free_pool(self) -> None:
        self._mem.release()
        fd, self.arena_fd = self.arena_fd, None
        if fd is not None:
            os.close(fd)


def _parse_pinned(options: dict[str, str], url: str) -> bool | None:
    value = options.get("pinned", "no").lower()
    if value == "auto":
        return None
    if value in ("yes", "true", "1"):
        return True
    if value in ("no", "false", "0"):
        return False
    raise TierConfigError(f"{url}: pinned must be auto, yes or no, got {value!r}")


def _host_pool(n_bytes: int, pinned: bool | None, url: str) -> tuple[bool, memoryview]:
    """Allocate the pool: pinned torch memory when CUDA is present, else an anonymous mmap.

    An anonymous mapping is zero-filled lazily by the kernel, so RSS grows as pages are
    first written and never beyond the pool size (a ``bytearray(n)`` would memset, and so
    touch, every page at start). Pinned memory is locked up front: that is the price of
    DMA-speed copies to the GPU.
    """
    if pinned is False or (pinned is None and not _cuda_may_exist()):
        return False, _shared_pool(n_bytes)
    try:
        import torch  # deferred: about 3 s and 200 MB, worth it only when a GPU may exist
    except ImportError:
        torch_cuda = False
    else:
        torch_cuda = torch.cuda.is_available()
    if not torch_cuda:
        if pinned:
            raise TierConfigError(f"{url}: pinned=yes needs CUDA, which is not available")
        return False, _shared_pool(n_bytes)
    tensor = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    # The ndarray view keeps the tensor (and so the pinned allocation) alive.
    return True, tensor.numpy().data


# Linux 5.1+: no new write()s or writable shared mappings, while the server's own mapping
# (made before) keeps writing. fcntl does not export it.
F_SEAL_FUTURE_WRITE = 0x0010
_ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


class _SharedPool(mmap.mmap):
    """The pool's mapping of a memfd, with the descriptor (``fd``) kept for handing out."""

    fd: int = -1


def _shared_pool(n_bytes: int) -> memoryview:
    """The pool as a sealed memfd mapping: lazily zero-filled like an anonymous mapping, and
    mappable read-only by a same-host client (its size and contents sealed against every
    mapping but this one: a client can neither shrink it, which would fault this process,
    nor write to it, even through a descriptor it reopens read-write)."""
    fd = os.memfd_create("nopecache-cpu-tier", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, n_bytes)
        mm = _SharedPool(fd, n_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _ARENA_SEALS)
    except BaseException:
        os.close(fd)
        raise
    mm.fd = fd
    return memoryview(mm)


def _arena_fd(mem: memoryview) -> int | None:
    obj = mem.obj
    return obj.fd if isinstance(obj, _SharedPool) else None


def _cuda_may_exist() -> bool:
    """Whether a GPU may be present, decided without importing torch when it is not loaded."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return bool(torch.cuda.is_available())
    return any(os.path.exists(path) for path in _GPU_DEVICE_FILES)
