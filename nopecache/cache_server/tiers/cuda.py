"""Device-memory tier: the page-pool design of the CPU tier on a CUDA device.

One ``torch.uint8`` tensor of ``n_pages x page_bytes`` is allocated on the device when
the tier starts; blocks own runs of pages exactly as in :mod:`.cpu` (same allocator,
same exact LRU), only the copies differ.

Copies go through one preallocated pinned host buffer (``staging``, 64 MiB by default)
on the tier's own CUDA stream, and run on the tier's copy thread, never on the event
loop::

    put:  blob (caller's buffer) --memcpy--> staging --DMA, run by run--> device pages
    get:  device pages --DMA, run by run--> staging --one memcpy--> bytes (returned)

A block larger than the staging buffer goes through it in pieces.

Same-host engines read the pool itself over CUDA IPC (``cuda_ipc_handle``, offered by
``cache_server/zero_copy.py``): a read lease (``lease(key, host_views=False)``) keeps a
block's pages from reuse while a client copies from them device to device. There is no gathered
temporary on the device (the runs land at their offsets in the staging buffer), and no
pageable copy (the DMA engine reads and writes pinned memory directly).

Concurrency: the index is read and updated on the loop without awaiting, as in the CPU
tier; an ``asyncio.Lock`` then serialises the copying operations (``get``, ``get_many``,
``put``), which hold it from the index lookup until their copies completed. A page can
only be rewritten by a ``put`` holding the lock, so a read in flight never sees its pages
change, even if ``delete`` (which only frees pages in the index) runs meanwhile. The copy
thread is the only thread that touches the pool or the staging buffer.

``cuda://0?capacity=8GiB[&page=64KiB][&staging=64MiB]`` - the host part is the device
index. Without CUDA the factory raises :class:`CudaUnavailableError` instead of silently
using host memory: a config that asks for GPU memory and gets none is a deployment bug.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar
from urllib.parse import urlsplit

import numpy as np

from nopecache.cache_server.sizes import SizeError, parse_size
from nopecache.cache_server.tiers.base import (
    BlobLike,
    Evicted,
    PutResult,
    PutStatus,
    TierConfigError,
    TierName,
    query_options,
)
from nopecache.cache_server.tiers.cpu import DEFAULT_PAGE_BYTES, PagedTier, Placement, TierLease
from nopecache.cache_server.tiers.cuda_ipc import share_pool
from nopecache.proto.arena_layout import CudaIpcHandle, cuda_device_uuid

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_STAGING_BYTES", "CudaTier", "CudaUnavailableError", "staging_pieces"]

DEFAULT_STAGING_BYTES = 64 * 1024 * 1024
_T = TypeVar("_T")


Piece = list[tuple[int, int, int]]


def staging_pieces(placement: Placement, page_bytes: int, room: int) -> list[Piece]:
    """A block's bytes cut into pieces that fit a staging buffer of ``room`` bytes: for
    each piece, ``(pool offset, staging offset, length)`` of every run (part) in it, the
    runs of a piece packed from staging offset 0 in block order."""
    pieces: list[Piece] = [[]]
    filled, left = 0, placement.size
    for start, count in placement.runs:
        offset, n = start * page_bytes, min(count * page_bytes, left)
        left -= n
        while n:
            if filled == room:
                pieces.append([])
                filled = 0
            take = min(n, room - filled)
            pieces[-1].append((offset, filled, take))
            filled += take
            offset += take
            n -= take
    return pieces


class CudaUnavailableError(TierConfigError):
    """A ``cuda://`` tier was asked for where no usable CUDA device exists."""


class CudaTier(PagedTier):
    """Blocks in one preallocated device tensor, copied through a pinned staging buffer."""

    name: ClassVar[TierName] = "cuda"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        device: int = 0,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        url: str | None = None,
    ) -> None:
        url = url or f"cuda://{device}?capacity={capacity_bytes}&page={page_bytes}"
        import torch

        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                f"{url}: CUDA is not available in this process "
                "(torch.cuda.is_available() is False); use a cpu:// tier instead"
            )
        if not 0 <= device < torch.cuda.device_count():
            raise CudaUnavailableError(
                f"{url}: device {device} does not exist "
                f"({torch.cuda.device_count()} CUDA device(s) visible)"
            )
        super().__init__(capacity_bytes, page_bytes, url)
        if staging_bytes < page_bytes:
            raise TierConfigError(
                f"{url}: staging ({staging_bytes} B) is smaller than one page ({page_bytes} B)"
            )
        self.device = torch.device("cuda", device)
        self._pool: torch.Tensor | None = torch.empty(
            self.capacity_bytes, dtype=torch.uint8, device=self.device
        )
        # Whole pages, so that a piece of a block is always whole runs but for the last.
        staging_bytes -= staging_bytes % page_bytes
        self._staging = torch.empty(
            min(staging_bytes, self.capacity_bytes), dtype=torch.uint8, pin_memory=True
        )
        self._staging_np: np.ndarray = self._staging.numpy()
        self._stream = torch.cuda.Stream(self.device)
        self._copier = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"nopecache-cuda{device}"
        )
        self._lock = asyncio.Lock()
        # The block whose pages the copy thread is writing now (put): not leased until
        # written, as its key is in the index from the allocation on.
        self._writing: Placement | None = None
        self.cuda_device_uuid = cuda_device_uuid(self.device)

    @classmethod
    def from_url(cls, url: str) -> CudaTier:
        """Build from ``cuda://<device>?capacity=8GiB[&page=64KiB][&staging=64MiB]``."""
        parts = urlsplit(url)
        if parts.scheme != "cuda":
            raise TierConfigError(f"{url}: scheme must be cuda://")
        host = parts.netloc or "0"
        if not host.isdigit():
            raise TierConfigError(f"{url}: device must be a device index such as cuda://0")
        if parts.path not in ("", "/"):
            raise TierConfigError(f"{url}: cuda:// takes no path")
        options = query_options(
            parts.query, allowed=frozenset({"capacity", "page", "staging"}), url=url
        )
        if "capacity" not in options:
            raise TierConfigError(f"{url}: option 'capacity' is required (e.g. capacity=8GiB)")
        try:
            capacity = parse_size(options["capacity"], field=f"{url}: capacity")
            page = parse_size(options.get("page", DEFAULT_PAGE_BYTES), field=f"{url}: page")
            staging = parse_size(
                options.get("staging", DEFAULT_STAGING_BYTES), field=f"{url}: staging"
            )
        except SizeError as exc:
            raise TierConfigError(str(exc)) from exc
        return cls(capacity, device=int(host), page_bytes=page, staging_bytes=staging, url=url)

    # ------------------------------------------------------------------ loop side

    async def _on_copier(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._copier, fn)

    async def get(self, key: bytes) -> bytes | None:
        """A copy of the blob, refreshing its recency; None on a miss."""
        return (await self.get_many((key,)))[0]

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the blobs in key order, None per miss (one trip to the copy thread)."""
        self._check_open()
        async with self._lock:
            self._check_open()
            index = self._table.index
            placements: list[Placement | None] = []
            for key in keys:
                placement = index.get(key)
                if placement is not None:
                    index.move_to_end(key)
                placements.append(placement)
            found = [p for p in placements if p is not None]
            blobs = iter(await self._on_copier(functools.partial(self._read_all, found)))
            return [None if p is None else next(blobs) for p in placements]

    async def put(self, key: bytes, blob: BlobLike, *, keep_evicted: bool = True) -> PutResult:
        """Copy ``blob`` into the pool, evicting least recently used blocks to make room."""
        self._check_open()
        async with self._lock:
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
                # Pages leased to CUDA IPC readers come back when their reads end; nothing
                # is evicted for it (as in PagedTier.put).
                return PutResult(PutStatus.UNAVAILABLE)
            old: list[tuple[bytes, Placement]] = []
            while table.free_pages < need:
                old_key, placement = table.pop_lru()
                old.append((old_key, placement))
                table.release(placement)
            placement = table.allocate(key, len(src))
            # Evicted blocks are read out before the new one overwrites their pages (the
            # copy thread runs the two in this order; no other copy runs meanwhile).
            reads = [p for _, p in old] if keep_evicted else []
            self._writing = placement
            try:
                evicted = await self._on_copier(
                    functools.partial(self._evict_and_write, reads, placement, src)
                )
            finally:
                self._writing = None
            blobs = iter(evicted)
            return PutResult(
                PutStatus.STORED,
                tuple(Evicted(k, next(blobs) if keep_evicted else None) for k, _ in old),
            )

    def lease(self, key: bytes, *, host_views: bool = True) -> TierLease | None:
        """A lease of ``key``'s device pages (``host_views=False``: there are no host
        views of device memory); None while its pages are still being written."""
        placement = self._table.index.get(key)
        if placement is not None and placement is self._writing:
            return None
        return super().lease(key, host_views=host_views)

    def cuda_ipc_handle(self) -> CudaIpcHandle:
        """The pool's CUDA IPC handle for one more process: made per handoff, as torch
        counts every process it is handed to (each one's close counts it back down)."""
        self._check_open()
        return share_pool(self._pool_tensor())

    # ------------------------------------------------------------------ copy thread

    def _pool_tensor(self) -> torch.Tensor:
        assert self._pool is not None, "pool used after close"
        return self._pool

    def _read_all(self, placements: list[Placement]) -> list[bytes]:
        return [self._read(p) for p in placements]

    def _evict_and_write(
        self, old: list[Placement], new: Placement, src: memoryview
    ) -> list[bytes]:
        evicted = [self._read(p) for p in old]
        self._write(new, src)
        return evicted

    def _read(self, placement: Placement) -> bytes:
        """Copy thread: the block's bytes, device pages -> staging -> one new ``bytes``."""
        import torch

        pool, staging = self._pool_tensor(), self._staging
        parts = []
        for piece in staging_pieces(placement, self._table.page_bytes, self._staging.numel()):
            with torch.cuda.stream(self._stream):
                for offset, at, n in piece:
                    staging[at : at + n].copy_(pool[offset : offset + n], non_blocking=True)
            self._stream.synchronize()
            filled = sum(n for _, _, n in piece)
            parts.append(self._staging_np[:filled].tobytes())  # the one host copy
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _write(self, placement: Placement, src: memoryview) -> None:
        """Copy thread: ``src`` -> staging -> the block's device pages."""
        import torch

        pool, staging = self._pool_tensor(), self._staging
        host = np.frombuffer(src, dtype=np.uint8)
        done = 0
        for piece in staging_pieces(placement, self._table.page_bytes, self._staging.numel()):
            filled = sum(n for _, _, n in piece)
            self._staging_np[:filled] = host[done : done + filled]
            done += filled
            with torch.cuda.stream(self._stream):
                for offset, at, n in piece:
                    pool[offset : offset + n].copy_(staging[at : at + n], non_blocking=True)
            # The next piece reuses the staging buffer: wait for this one's DMA.
            self._stream.synchronize()

    async def close(self) -> None:
        """Wait for the copy in flight, then forget every entry and drop the pool."""
        async with self._lock:
            await super().close()

    def _free_pool(self) -> None:
        # Called under the lock: no copy is queued or running.
        self._pool = None
        self._copier.shutdown(wait=False)
