"""Device-memory tier: the page-pool design of the CPU tier on a CUDA device.

One ``torch.uint8`` tensor of ``n_pages x page_bytes`` is allocated on the device when
the tier starts; blocks own runs of pages exactly as in :mod:`.cpu` (same allocator,
same exact LRU), only the copies differ: ``put`` copies host -> device run by run, ``get``
gathers the runs on the device and copies once device -> host.

The copies are synchronous (``get`` must hand back finished bytes, and ``put``'s source
buffer belongs to the caller once it returns), so, as in the CPU tier, every operation
completes without awaiting and is atomic with respect to other coroutines; the stream
used is the device's current stream.

``cuda://0?capacity=8GiB[&page=64KiB]`` - the host part is the device index. Without
CUDA the factory raises :class:`CudaUnavailableError` instead of silently using host
memory: a config that asks for GPU memory and gets none is a deployment bug.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, ClassVar
from urllib.parse import urlsplit

from nopecache.cache_server.sizes import SizeError, parse_size
from nopecache.cache_server.tiers.base import TierConfigError, TierName, query_options
from nopecache.cache_server.tiers.cpu import DEFAULT_PAGE_BYTES, PagedTier, Placement

if TYPE_CHECKING:
    import torch

__all__ = ["CudaTier", "CudaUnavailableError"]


class CudaUnavailableError(TierConfigError):
    """A ``cuda://`` tier was asked for where no usable CUDA device exists."""


class CudaTier(PagedTier):
    """Blocks in one preallocated device tensor."""

    name: ClassVar[TierName] = "cuda"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        device: int = 0,
        page_bytes: int = DEFAULT_PAGE_BYTES,
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
        self.device = torch.device("cuda", device)
        self._pool: torch.Tensor | None = torch.empty(
            self.capacity_bytes, dtype=torch.uint8, device=self.device
        )

    @classmethod
    def from_url(cls, url: str) -> CudaTier:
        """Build from ``cuda://<device>?capacity=8GiB[&page=64KiB]``."""
        parts = urlsplit(url)
        if parts.scheme != "cuda":
            raise TierConfigError(f"{url}: scheme must be cuda://")
        host = parts.netloc or "0"
        if not host.isdigit():
            raise TierConfigError(f"{url}: device must be a device index such as cuda://0")
        if parts.path not in ("", "/"):
            raise TierConfigError(f"{url}: cuda:// takes no path")
        options = query_options(parts.query, allowed=frozenset({"capacity", "page"}), url=url)
        if "capacity" not in options:
            raise TierConfigError(f"{url}: option 'capacity' is required (e.g. capacity=8GiB)")
        try:
            capacity = parse_size(options["capacity"], field=f"{url}: capacity")
            page = parse_size(options.get("page", DEFAULT_PAGE_BYTES), field=f"{url}: page")
        except SizeError as exc:
            raise TierConfigError(str(exc)) from exc
        return cls(capacity, device=int(host), page_bytes=page, url=url)

    def _pool_tensor(self) -> torch.Tensor:
        assert self._pool is not None, "pool used after close"
        return self._pool

    def _read(self, placement: Placement) -> bytes:
        pool, page = self._pool_tensor(), self._table.page_bytes
        left = placement.size
        pieces = []
        for start, count in placement.runs:
            n = min(count * page, left)
            pieces.append(pool[start * page : start * page + n])
            left -= n
        if not pieces:
            return b""
        import torch

        gathered = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return gathered.cpu().numpy().tobytes()

    def _write(self, placement: Placement, src: memoryview) -> None:
        if not len(src):
            return
        import torch

        pool, page = self._pool_tensor(), self._table.page_bytes
        with warnings.catch_warnings():
            # torch warns that a read-only buffer is wrapped; this view is only read from.
            warnings.simplefilter("ignore", UserWarning)
            host = torch.frombuffer(src, dtype=torch.uint8)
        offset = 0
        for start, count in placement.runs:
            n = min(count * page, len(src) - offset)
            pool[start * page : start * page + n].copy_(host[offset : offset + n])
            offset += n

    def _free_pool(self) -> None:
        self._pool = None
