"""Same-host zero copy on a GPU: the server's ``cuda://`` pool opened over CUDA IPC.

Where the server's fastest tier is a pool in GPU memory, OpenArena offers it with kind
``ARENA_KIND_CUDA_IPC``: the socket of the usual handshake (nonce, SO_PEERCRED) answers
with the pool's CUDA IPC handle (``proto/arena_layout.CudaIpcHandle``) instead of a
descriptor. :class:`CudaArena` opens it on the GPU named by the reply's UUID; LeaseGet
runs are byte offsets in it, exactly as in a host pool::

    leased block (its runs)     DeviceBlob: views of the device pool (no copy); several
                                runs are joined on the placement stream (one D2D copy)
    placement                   header copied to the host (a few hundred bytes) and
                                checked (header checksum, key, fingerprint, tokens); K
                                and V stay on the GPU: rerope_scatter_layers reads them
                                from the pool straight into the paged cache (D2D)
    lease release               once the GPU finished reading (an event on the
                                placement stream, ``StagingRing.hold``), never before

The payload checksum is not recomputed here: the bytes never reach the host (there is no
xxh3 on the GPU) and the server checked it when the block was stored
(``proto.block.validate`` on every Put). Unlike the sealed memfd, a CUDA IPC mapping
cannot be made read-only: this client never writes through it, but a process of the same
tenant that was handed the pool could; the trust boundary of this path is the tenant
(docs/security.md). A compressed (lz4) block is copied to the host and decoded there
(checked in full).

A client that cannot open the pool (no CUDA in this process, the GPU not visible here,
``cudaIpcOpenMemHandle`` failing, e.g. in the server's own process) raises
:class:`ArenaRefusedError`; the caller logs it once, counts it and takes the copying paths.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

from nopecache.client.errors import ArenaRefusedError
from nopecache.proto.arena_layout import CudaIpcHandle, cuda_device_uuid
from nopecache.proto.block import (
    DecodedBlock,
    check_expected,
    decode_block,
    head_nbytes,
    parse_head,
)
from nopecache.proto.kv_codec import decode_payload

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = [
    "CudaArena",
    "DeviceBlob",
    "FetchedBlob",
    "cuda_ipc_possible",
    "decode_device_block",
    "host_view",
    "local_device",
]

# The first read of a block's head: most headers (token ids of a 16-256-token block) fit.
_HEAD_GUESS = 4096


def cuda_ipc_possible() -> bool:
    """Whether this process could open a pool over CUDA IPC: torch is loaded and sees a
    GPU (never imports torch for it)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_available())


def local_device(uuid: str) -> int:
    """The index, in this process's numbering, of the GPU with ``uuid``; raises
    ArenaRefusedError when none is visible here."""
    import torch

    seen = [cuda_device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid in seen:
        return seen.index(uuid)
    raise ArenaRefusedError(
        f"the pool is on GPU {uuid or '(unnamed)'}, not visible in this process "
        f"(visible: {', '.join(seen) or 'none'})"
    )


class CudaArena:
    """The server's device pool opened over CUDA IPC: ``pool`` is a uint8 tensor of
    ``size`` bytes on ``device``; ``arena`` is its id (OpenArenaReply.arena)."""

    def __init__(self, handle: CudaIpcHandle, uuid: str, size: int, arena: bytes) -> None:
        """Open ``handle`` on the GPU named ``uuid``. Raises ArenaRefusedError when this
        process cannot (no CUDA, another GPU, cudaIpcOpenMemHandle failed)."""
        if not cuda_ipc_possible():
            raise ArenaRefusedError("CUDA is not available in this process")
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = local_device(uuid)
        if handle.size_bytes < size:
            raise ArenaRefusedError(
                f"arena: the IPC allocation holds {handle.size_bytes} bytes, reply says {size}"
            )
        try:
            pool = rebuild_cuda_tensor(
                torch.Tensor,
                (size,),
                (1,),
                0,
                torch.UntypedStorage,
                torch.uint8,
                index,
                handle.handle,
                handle.size_bytes,
                handle.offset_bytes,
                False,
                handle.ref_counter_handle,
                handle.ref_counter_offset,
                handle.event_handle or None,
                handle.event_sync_required,
            )
        except (RuntimeError, OSError) as e:  # cudaIpcOpenMemHandle, the ref counter file
            raise ArenaRefusedError(f"cannot open the pool over CUDA IPC: {e}") from e
        self.pool: torch.Tensor | None = pool
        self.device = torch.device("cuda", index)
        self.size = size
        self.arena = arena

    def runs(self, runs: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Views of the pool's byte runs (no copy)."""
        pool = self.pool
        assert pool is not None, "arena used after close"
        return [pool[offset : offset + length] for offset, length in runs]

    def close(self) -> None:
        """Drop this process's reference (torch closes the IPC mapping once no view of
        the pool is left)."""
        self.pool = None


class DeviceBlob:
    """A leased block in the device pool: its runs (views), byte size, and the time
    (``time.monotonic``) until which they may be read. Its lease ends when it dies (a
    finalizer), so whoever issues GPU reads of it keeps it until they completed."""

    __slots__ = ("__weakref__", "lease_deadline", "nbytes", "parts")

    def __init__(self, parts: list[torch.Tensor], lease_deadline: float = math.inf) -> None:
        self.parts = parts
        self.nbytes = sum(int(p.numel()) for p in parts)
        self.lease_deadline = lease_deadline

    def __bytes__(self) -> bytes:
        """A host copy of the block's bytes."""
        return bytes(host_view(self))

    def joined(self) -> torch.Tensor:
        """The block's bytes as one device tensor: the view itself for one run, else a
        copy joined on the current stream."""
        import torch

        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


FetchedBlob = memoryview | DeviceBlob
"""A fetched block: host bytes, or a leased block in a server's device pool."""


def host_view(blob: FetchedBlob) -> memoryview:
    """``blob`` in host memory (a device block copied over: for callers that want bytes)."""
    if isinstance(blob, memoryview):
        return blob
    return blob.joined().cpu().numpy().data.cast("B")


def decode_device_block(
    blob: DeviceBlob,
    *,
    expect_key: bytes | None = None,
    expect_fingerprint: bytes | None = None,
    expect_tokens: Sequence[int] | None = None,
) -> DecodedBlock:
    """``proto.block.decode_block`` of a block in GPU memory, on the current device and
    stream: the header is copied to the host and checked there; K and V are views of the
    device bytes (the payload checksum is the server's, see the module docstring)."""
    import torch

    data = blob.joined()
    total = int(data.numel())
    head = data[: min(total, _HEAD_GUESS)].cpu().numpy().tobytes()
    need = head_nbytes(head, total)
    if need > len(head):
        head = data[:need].cpu().numpy().tobytes()
    header, start = parse_head(head, total)
    check_expected(header, expect_key, expect_fingerprint, expect_tokens)
    if header.compression != "none":
        # No lz4 on the GPU: the block comes to the host and is checked in full there.
        return decode_block(
            data.cpu().numpy().tobytes(),
            expect_key=expect_key,
            expect_fingerprint=expect_fingerprint,
            expect_tokens=expect_tokens,
        )
    dtype = getattr(torch, header.dtype)
    if header.codec != "none":  # a compact block decodes on the device it lies on
        payload = data[start : start + header.payload_nbytes]
        kc, vc = decode_payload(header.codec, payload, dtype, header.shape, header.v_head_dim)
        return DecodedBlock(header=header, k=kc, v=vc)
    k = data[start : start + header.k_nbytes].view(dtype).view(header.shape)
    v_shape = header.v_shape
    v = None
    if v_shape is not None:
        v = data[start + header.k_nbytes : start + header.payload_nbytes].view(dtype).view(v_shape)
    return DecodedBlock(header=header, k=k, v=v)
