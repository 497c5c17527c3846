"""How a vLLM attention backend lays out one layer's paged KV cache, as one small object.

The connector reads and writes token slots (``slot = block_id * block_size + offset``)
only through a :class:`KVLayout`, which turns a layer's cache tensor into two strided
views ``[num_blocks, block_size, kv_heads, head_dim]`` (K and V) over the same memory, so
a write lands exactly where the backend's attention kernel reads, with no copy of the
cache; :meth:`KVLayout.paged` hands those views to the client as its one paged-cache
type (``PagedKV``), so fetched blocks are placed straight into vLLM's pages. Two layouts
are known:

CPU attention backend (``CPU_ATTN``), per layer ``[num_blocks, kv_heads, block_size,
2 * head_dim]``. Each (block, head) page holds K transposed, then V::

    page (2 * block_size * head_dim elements)
    +---------------------------------------+---------------------------------------+
    | K^T [head_dim, block_size]            | V [block_size, head_dim]              |
    | K[t, d] at d * block_size + t         | V[t, d] at block_size * head_dim      |
    |                                       |            + t * head_dim + d         |
    +---------------------------------------+---------------------------------------+

(what vLLM 0.32's ``cpu_attn_reshape_and_cache`` writes for its ``vec`` ISA; the
connector re-checks it against that op at start-up, see ``compat.verify_cpu_layout``).

FlashAttention (GPU), per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``:
``cache[0]`` is K, ``cache[1]`` is V, both in the standard paged layout.

:func:`detect_layout` picks the layout from a tensor's shape and strides and refuses
anything else with :class:`UnsupportedLayoutError`, naming the shape and stride: an
unknown layout is a start-up error, never silently garbled KV.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nopecache.client.placement import PagedKV
from nopecache.integrations.vllm.errors import UnsupportedLayoutError

__all__ = [
    "CpuAttnLayout",
    "FlashAttnLayout",
    "KVLayout",
    "UnsupportedLayoutError",
    "detect_layout",
]


@dataclass(frozen=True, slots=True)
class KVLayout(ABC):
    """One layer layout of a paged KV cache: strided K/V views and slot reads/writes."""

    block_size: int
    num_kv_heads: int
    head_dim: int

    name = "abstract"

    @abstractmethod
    def k_view(self, cache: torch.Tensor) -> torch.Tensor:
        """K of ``cache`` as a ``[num_blocks, block_size, kv_heads, head_dim]`` view."""

    @abstractmethod
    def v_view(self, cache: torch.Tensor) -> torch.Tensor:
        """V of ``cache`` as a ``[num_blocks, block_size, kv_heads, head_dim]`` view."""

    @abstractmethod
    def check(self, layer: str, cache: torch.Tensor) -> None:
        """Raise UnsupportedLayoutError unless ``cache`` has this layout."""

    def paged(
        self,
        caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        heads: slice | None = None,
    ) -> PagedKV:
        """The client's paged-cache contract over every layer's cache (views, no copy).

        ``slot_mapping``: int64, the slot of every prompt position, -1 where nothing is
        to be written. A fetch ``into=`` it lands each block in vLLM's own pages through
        the fused re-RoPE scatter kernel API. ``heads``: only these KV heads of the cache
        (a head group's block holds a slice of a rank's heads; a strided view, which the
        CPU placement takes and CUDA's contiguous-only kernel refuses).
        """
        sel = slice(None) if heads is None else heads
        return PagedKV(
            [self.k_view(c)[:, :, sel] for c in caches],
            [self.v_view(c)[:, :, sel] for c in caches],
            slot_mapping,
        )

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(torch.int64)
        return slots // self.block_size, slots % self.block_size

    def write(
        self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k``/``v`` ``[n, kv_heads, head_dim]`` into the ``n`` token ``slots``."""
        blocks, offsets = self._split(slots.to(cache.device))
        self.k_view(cache)[blocks, offsets] = k.to(cache.dtype)
        self.v_view(cache)[blocks, offsets] = v.to(cache.dtype)

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, kv_heads, head_dim]`` of the ``n`` token ``slots`` (new tensors)."""
        blocks, offsets = self._split(slots.to(cache.device))
        return self.k_view(cache)[blocks, offsets], self.v_view(cache)[blocks, offsets]

    def read_blocks_into(
        self, cache: torch.Tensor, block_ids: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        """Copy whole blocks into ``k_out``/``v_out`` ``[len(block_ids) * block_size, H, D]``,
        which must be on the cache's device (a gather cannot cross devices).

        One gather per tensor straight into the outputs (no temporary).
        """
        ids = block_ids.to(device=cache.device, dtype=torch.int64)
        shape = (len(ids), self.block_size, self.num_kv_heads, self.head_dim)
        torch.index_select(self.k_view(cache), 0, ids, out=k_out.view(shape))
        torch.index_select(self.v_view(cache), 0, ids, out=v_out.view(shape))

    def blocks_to_host(
        self, caches: Sequence[torch.Tensor], block_ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks of every layer, ``[layers, len(block_ids) * block_size,
        H, D]`` each, in host memory (pinned when the caches are on CUDA).

        Each layer is gathered on the caches' device, then copied once to the host::

            cache (device) --index_select--> staging (device, one layer) --copy--> host

        (``layer_to_host``, one layer at a time). The staging holds one layer, not the
        whole request: vLLM gives the KV cache most of the GPU's memory, so a whole
        request's KV gathered there at once could fail to allocate. The copies are queued on the device's current stream (after the forward
        that wrote the blocks) and waited for before returning: the client's store queue
        reads the host tensors on another thread.
        """
        device = caches[0].device
        rows = len(block_ids) * self.block_size
        shape = (len(caches), rows, self.num_kv_heads, self.head_dim)
        on_cuda = device.type == "cuda"
        k = torch.empty(shape, dtype=caches[0].dtype, pin_memory=on_cuda)
        v = torch.empty(shape, dtype=caches[0].dtype, pin_memory=on_cuda)
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=device)
        for layer, cache in enumerate(caches):
            self.layer_to_host(cache, ids, k[layer], v[layer])
        if on_cuda:
            torch.cuda.current_stream(device).synchronize()
        return k, v

    def layer_to_host(
        self, cache: torch.Tensor, block_ids: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        """Copy whole blocks of one layer into host ``k_out``/``v_out`` ``[len(block_ids) *
        block_size, H, D]``: straight into them for a CPU cache; for a CUDA one through
        a one-layer device staging, the copy queued on the current stream (the caller
        synchronizes it before reading the outputs; the allocator keeps the staging
        until the queued copy has read it)."""
        if cache.device.type == "cpu":
            self.read_blocks_into(cache, block_ids, k_out, v_out)
            return
        staging_k = torch.empty(k_out.shape, dtype=k_out.dtype, device=cache.device)
        staging_v = torch.empty(v_out.shape, dtype=v_out.dtype, device=cache.device)
        self.read_blocks_into(cache, block_ids, staging_k, staging_v)
        k_out.copy_(staging_k, non_blocking=True)
        v_out.copy_(staging_v, non_blocking=True)


def _describe(cache: torch.Tensor) -> str:
    return f"shape {list(cache.shape)}, stride {list(cache.stride())}, dtype {cache.dtype}"


@dataclass(frozen=True, slots=True)
class CpuAttnLayout(KVLayout):
    """vLLM's CPU attention layout ``[num_blocks, kv_heads, block_size, 2 * head_dim]``."""

    name = "CPU_ATTN"

    def check(self, layer: str, cache: torch.Tensor) -> None:
        """Shape ``[*, H, bs, 2D]`` with each (block, head) page contiguous."""
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        ok = (
            cache.dim() == 4
            and tuple(cache.shape[1:]) == (h, bs, 2 * d)
            and cache.stride()[1:] == (bs * 2 * d, 2 * d, 1)
        )
        if not ok:
            raise UnsupportedLayoutError(
                f"layer {layer!r}: KV cache {_describe(cache)} is not the CPU_ATTN layout "
                f"[num_blocks, {h}, {bs}, {2 * d}] with contiguous pages"
            )

    def k_view(self, cache: torch.Tensor) -> torch.Tensor:
        """K^T pages read as ``[blocks, block_size, heads, head_dim]``."""
        bs, d = self.block_size, self.head_dim
        s_block, s_head = cache.stride(0), cache.stride(1)
        return cache.as_strided(
            (cache.shape[0], bs, self.num_kv_heads, d),
            (s_block, 1, s_head, bs),
            cache.storage_offset(),
        )

    def v_view(self, cache: torch.Tensor) -> torch.Tensor:
        """The V half of each page read as ``[blocks, block_size, heads, head_dim]``."""
        bs, d = self.block_size, self.head_dim
        s_block, s_head = cache.stride(0), cache.stride(1)
        return cache.as_strided(
            (cache.shape[0], bs, self.num_kv_heads, d),
            (s_block, d, s_head, 1),
            cache.storage_offset() + bs * d,
        )


@dataclass(frozen=True, slots=True)
class FlashAttnLayout(KVLayout):
    """vLLM's FlashAttention layout ``[2, num_blocks, block_size, kv_heads, head_dim]``."""

    name = "FLASH_ATTN"

    def check(self, layer: str, cache: torch.Tensor) -> None:
        """Shape ``[2, *, bs, H, D]``, each of K and V in the standard contiguous order."""
        bs, h, d = self.block_size, self.num_kv_heads, self.head_dim
        ok = (
            cache.dim() == 5
            and cache.shape[0] == 2
            and tuple(cache.shape[2:]) == (bs, h, d)
            and cache.stride()[2:] == (h * d, d, 1)
            and cache.stride(1) == bs * h * d
        )
        if not ok:
            raise UnsupportedLayoutError(
                f"layer {layer!r}: KV cache {_describe(cache)} is not the FlashAttention "
                f"layout [2, num_blocks, {bs}, {h}, {d}] (NHD, contiguous blocks)"
            )

    def k_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache[0]``."""
        return cache[0]

    def v_view(self, cache: torch.Tensor) -> torch.Tensor:
        """``cache[1]``."""
        return cache[1]


def detect_layout(
    layer: str, cache: torch.Tensor, *, block_size: int, num_kv_heads: int, head_dim: int
) -> KVLayout:
    """The layout of one layer's KV cache tensor; UnsupportedLayoutError if unknown."""
    if not isinstance(cache, torch.Tensor):
        raise UnsupportedLayoutError(
            f"layer {layer!r}: KV cache is a {type(cache).__name__}, not a tensor"
        )
    layout: KVLayout
    if cache.dim() == 4:
        layout = CpuAttnLayout(block_size, num_kv_heads, head_dim)
    elif cache.dim() == 5:
        layout = FlashAttnLayout(block_size, num_kv_heads, head_dim)
    else:
        raise UnsupportedLayoutError(
            f"layer {layer!r}: KV cache {_describe(cache)} matches no known layout "
            f"(CPU_ATTN [num_blocks, {num_kv_heads}, {block_size}, {2 * head_dim}] or "
            f"FlashAttention [2, num_blocks, {block_size}, {num_kv_heads}, {head_dim}])"
        )
    layout.check(layer, cache)
    return layout
