"""The ``cuda://`` pool as CUDA IPC: its handle for a same-host process, its GPU's UUID.

torch does the CUDA work: ``UntypedStorage._share_cuda_()`` returns the
``cudaIpcMemHandle`` of the allocation that holds the pool, the pool's offset in it, and
torch's producer-side reference counter (a small shared-memory file counting the
processes that hold the allocation open, so that the caching allocator never frees it
under them). ``_share_cuda_`` adds one to that count per call and each opener's close
takes one off, so a handle is made per process it is handed to, as torch's own
``multiprocessing`` does per send. The pool lives as long as the tier.

A process opens it with ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` on the
same GPU (``nopecache/client/cuda_arena.py``). The device index means nothing across
processes (``CUDA_VISIBLE_DEVICES``), so the GPU is named by its UUID
(``proto.arena_layout.cuda_device_uuid``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nopecache.proto.arena_layout import CudaIpcHandle

if TYPE_CHECKING:
    import torch

__all__ = ["share_pool"]


def share_pool(pool: torch.Tensor) -> CudaIpcHandle:
    """The CUDA IPC handle of ``pool`` (a whole uint8 device tensor)."""
    storage = pool.untyped_storage()
    (
        _device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()  # torch's private IPC API
    return CudaIpcHandle(
        handle=bytes(handle),
        size_bytes=int(size_bytes),
        offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=b"" if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync_required),
    )
