"""SGLang host-pool pages as bytes: where a page lies, read as block payloads, written back.

A host pool holds K and V (MHA) or one latent (MLA) per token; each is a *component*
here. The layouts SGLang's HiCache offers and how one page of one component lies::

    layout             component tensor              one page of it            payload order
    page_first         [tokens, layers, heads, dim]  contiguous: [ps, L, H, D]  token-major
    page_first_direct  [pages, layers, ps, H, D]     contiguous: [L, ps, H, D]  layer-major
    layer_first        [layers, tokens, heads, dim]  L strided runs of ps rows  layer-major

A page's payload is its components' bytes one after the other (K then V), each in the
order above; the order is part of the model fingerprint (``fingerprint.py``), so two pools
exchange pages only when their bytes agree. Page-first layouts are zero-copy both ways:
a stored page is read straight from the pool (the block encoder copies it once, into the
blob), a fetched payload is copied once, straight into the pool. ``layer_first`` gathers
the pages of a batch in one torch index (and scatters them back in one), never a Python
copy per page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["LAYOUTS", "PageOrder", "PagePool", "PageWriter", "PoolGeometry"]

PageOrder = Literal["token_major", "layer_major"]
LAYOUTS: tuple[str, ...] = ("page_first", "page_first_direct", "layer_first")


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """What a host pool is, read from SGLang's pool object by ``compat.pool_geometry``."""

    layout: str
    page_size: int
    num_layers: int
    num_heads: int  # KV heads of this rank (1 for the MLA latent)
    head_dim: int  # K's last dim (the latent's for MLA)
    v_head_dim: int  # V's last dim, 0 for MLA (no V)
    dtype: torch.dtype
    components: tuple[torch.Tensor, ...]  # (K, V) or (latent,), in the layout's shape

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(
                f"host pool layout {self.layout!r} is not supported by the nopecache backend "
                f"(supported: {', '.join(LAYOUTS)})"
            )
        if self.page_size <= 0:
            raise ValueError(f"host pool page_size must be positive, got {self.page_size}")

    @property
    def order(self) -> PageOrder:
        """The byte order of a page's payload (see the module docstring)."""
        return "token_major" if self.layout == "page_first" else "layer_major"

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, all components."""
        per_token = self.num_layers * self.num_heads * (self.head_dim + self.v_head_dim)
        return per_token * self.page_size * self.dtype.itemsize


class PagePool:
    """A host pool's pages as byte rows: read pages for a store, a writer for a fetch."""

    def __init__(self, geometry: PoolGeometry) -> None:
        """Views of ``geometry``'s component tensors (no copy)."""
        self.geometry = geometry
        ps = geometry.page_size
        views = []
        for comp in geometry.components:
            raw = comp.view(torch.uint8)
            if geometry.layout == "layer_first":
                tokens = raw.shape[1] - raw.shape[1] % ps
                views.append(raw.narrow(1, 0, tokens).reshape(raw.shape[0], tokens // ps, -1))
            elif geometry.layout == "page_first":
                tokens = raw.shape[0] - raw.shape[0] % ps
                views.append(raw.narrow(0, 0, tokens).reshape(tokens // ps, -1))
            else:  # page_first_direct: already one row per page
                views.append(raw.reshape(raw.shape[0], -1))
        # layer_first: [layers, pages, bytes per layer]; page-first: [pages, bytes].
        self._views = tuple(views)
        # The layer_first gather and scatter move 8-byte words where rows allow (torch
        # copies strided uint8 one byte at a time: several times slower).
        self._wide = tuple(v.view(torch.int64) if v.shape[-1] % 8 == 0 else v for v in views)
        self.num_pages = views[0].shape[-2]
        self.contiguous = geometry.layout != "layer_first"

    def page_ids(self, host_indices: torch.Tensor, num_keys: int) -> list[int] | None:
        """The page numbers of ``host_indices`` (token slots, ``page_size`` per key); None
        when they do not describe ``num_keys`` whole, aligned pages of this pool."""
        ps = self.geometry.page_size
        if host_indices.dim() != 1 or host_indices.numel() != num_keys * ps:
            return None
        starts = host_indices[::ps].to(torch.int64)
        if bool((starts % ps != 0).any()) or (
            num_keys and (int(starts.min()) < 0 or int(starts.max()) // ps >= self.num_pages)
        ):
            return None
        pages: list[int] = (starts // ps).tolist()
        return pages

    def read(self, pages: Sequence[int]) -> list[list[torch.Tensor]]:
        """Per page, its components' bytes (uint8 tensors): views of the pool for page-first
        layouts, rows of one gathered copy for ``layer_first``."""
        if self.contiguous:
            return [[v[p] for v in self._views] for p in pages]
        index = torch.tensor(list(pages), dtype=torch.int64)
        # [layers, n, bytes] -> [n, layers * bytes]: each page's layers back to back.
        gathered = [
            v.index_select(1, index).transpose(0, 1).reshape(len(pages), -1).view(torch.uint8)
            for v in self._wide
        ]
        return [[g[i] for g in gathered] for i in range(len(pages))]

    def writer(self, pages: Sequence[int]) -> PageWriter:
        """A writer that lands fetched payloads in ``pages`` (``finish`` when done)."""
        return PageWriter(self, list(pages))

    def _component_bytes(self) -> list[int]:
        return [v[..., 0, :].numel() if self.contiguous else v[:, 0].numel() for v in self._views]


class PageWriter:
    """Lands fetched payloads in pool pages: at once for page-first layouts, through one
    staging buffer and one scatter at ``finish`` for ``layer_first``.

    ``put`` may be called from another thread than ``finish`` but not concurrently with it.
    """

    def __init__(self, pool: PagePool, pages: list[int]) -> None:
        self._pool = pool
        self._pages = pages
        self._sizes = pool._component_bytes()
        self._staging: torch.Tensor | None = None
        if not pool.contiguous:
            self._staging = torch.empty((len(pages), sum(self._sizes)), dtype=torch.uint8)

    def put(self, i: int, payload: memoryview) -> bool:
        """Copy the payload of page ``i`` (of the writer's pages); False if its size is wrong."""
        if payload.nbytes != sum(self._sizes):
            return False
        src = torch.frombuffer(payload, dtype=torch.uint8)
        if self._staging is not None:
            self._staging[i].copy_(src)
            return True
        offset = 0
        for view, size in zip(self._pool._views, self._sizes, strict=True):
            view[self._pages[i]].copy_(src[offset : offset + size])
            offset += size
        return True

    def finish(self, taken: Sequence[bool]) -> None:
        """Scatter the staged pages that were ``taken`` into the pool (``layer_first``)."""
        if self._staging is None:
            return
        rows = [i for i, ok in enumerate(taken) if ok]
        if not rows:
            return
        index = torch.tensor([self._pages[i] for i in rows], dtype=torch.int64)
        staged = (
            self._staging[torch.tensor(rows, dtype=torch.int64)]
            if len(rows) < len(taken)
            else self._staging
        )
        offset = 0
        for view, size in zip(self._pool._wide, self._sizes, strict=True):
            layers = view.shape[0]
            part = staged[:, offset : offset + size].view(view.dtype)
            view.index_copy_(1, index, part.reshape(len(rows), layers, -1).transpose(0, 1))
            offset += size
