"""Cold start: what a client does at construction so its first fetch is not its slowest.

Measured before this existed: the first fetch of a process took 130-270 ms for 11 MiB
against a few tens of ms warm. The first call paid for the gRPC channel (connect, HTTP/2
settings), the server's info (a Stats call), the shared-memory segment (created,
``posix_fallocate``-d, attached) or the bulk socket (ticket, connect), first-touch page
faults of the receive buffers, and the first call of every torch op on the placement
path (dispatch, allocator, on a GPU the kernels' compilation). :func:`warm_client` does
all of that once, off the engine's critical path:

* every connection's :meth:`~nopecache.client.transport.ServerConnection.warm` (channel,
  Stats, the fast path's session or socket);
* the buffer pool gets two touched buffers of one prefix block's size;
* one synthetic one-token block of each kind is verified and placed by the client's
  own :class:`~nopecache.client.fetching.BlockPlacer` on the worker thread.

A failure here is never an error: a server that is down is only down (its first call
probes it again), and a placement warm-up that fails is logged at DEBUG.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import torch

from nopecache.client.buffers import BufferPool
from nopecache.client.chunking import ChunkSpan, token_array
from nopecache.client.fetching import BlockPlacer
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import BlockKey
from nopecache.client.plan import Hit, HitKind
from nopecache.client.transport import ServerConnection
from nopecache.proto.block import StoredForm, encode_block

__all__ = ["warm_client", "warm_placement"]

log = logging.getLogger(__name__)

_POOL_BUFFERS = 2


async def warm_client(
    connections: Iterable[ServerConnection],
    pool: BufferPool,
    block_bytes: int,
    placer: BlockPlacer,
    on_worker: Callable[..., Awaitable[Any]],
) -> None:
    """Warm channels, buffers and the placement path (see the module docstring)."""
    await asyncio.gather(*(c.warm() for c in connections))
    await asyncio.to_thread(pool.warm, block_bytes, _POOL_BUFFERS)
    try:
        await on_worker(warm_placement, placer)
    except Exception as e:  # a warm-up must never break the client
        log.debug("nopecache: placement warm-up failed: %s", e)


def warm_placement(placer: BlockPlacer) -> None:
    """Verify and place one synthetic one-token block per hit kind (worker thread)."""
    prompt = token_array([0])
    out = placer.outputs(1)
    cancelled = threading.Event()
    for kind, fp in (
        (HitKind.PREFIX, placer.prefix_fingerprint),
        (HitKind.POSITION_INDEPENDENT, placer.pi_fingerprint),
    ):
        key = bytes(16)
        blob = _synthetic_block(key, fp, placer.v_head_dim)
        hit = Hit(BlockKey(key), ChunkSpan(0, 1), ChunkSpan(0, 1), fp.form, kind)
        if not placer.place(memoryview(blob), [hit], prompt, None, out, cancelled):
            raise RuntimeError(f"the synthetic {kind.name} block did not verify")


def _synthetic_block(key: bytes, fp: ModelFingerprint, v_head_dim: int) -> bytes:
    shape = (fp.num_layers, 1, fp.num_kv_heads)
    k = torch.zeros((*shape, fp.head_dim), dtype=fp.torch_dtype)
    v = torch.zeros((*shape, v_head_dim), dtype=fp.torch_dtype) if v_head_dim else None
    return encode_block(
        key=key,
        fingerprint=fp.to_bytes(),
        form=fp.form,
        k=k,
        v=v,
        token_ids=[0],
        source_positions=[0] if fp.form == StoredForm.ROPE else None,
    )
