"""The store pipeline: Lookup to skip present blocks, K converted once, encode, Put.

::

    loop thread                                    worker thread
    -----------                                    -------------
    store_prepared(job)
      Lookup every key, one call per owner    -->
      missing blocks                               K to NOPE form / prefix form: one
                                                   rotation of the whole prompt each
      per owner, per batch of <= 64 MiB:           encode_block_parts per chunk (a head,
        Put of the batch's blocks         <----    K and V slices checksummed in place)
        (StoreResult per block)

It mirrors ``fetching.py``: the loop only moves bytes; rotation and encoding run on the
client's one worker thread (torch releases the GIL). A block is encoded in parts: its
head and views of the K/V slices where they lie (``encode_block_parts``: no copy). The
bulk stream sends them with gathering writes, so the kernel's copy into the socket is
the only one; the gRPC fallback joins a block (one copy) and frames it
(``encode_put_frame``: one more copy into each frame message, gRPC's own).

``store(wait=False)`` queues a job: :class:`StoreBudget` bounds the blocks waiting, and
at most ``_STORE_CONCURRENCY`` queued stores run at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nopecache.client.chunking import TokenArray
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import KeyedChunk
from nopecache.client.metrics import ClientMetrics
from nopecache.client.sharding import Rendezvous
from nopecache.client.transport import ServerConnection, StoreResult, StoreStatus
from nopecache.kernels import RopeSpec
from nopecache.kernels.api import Positions, rotate
from nopecache.proto.block import StoredForm
from nopecache.proto.block_parts import EncodedBlock, encode_block_parts

__all__ = ["KForm", "PreparedStore", "StoreBudget", "StorePipeline", "StoreReport"]

log = logging.getLogger("nopecache.client.cache_client")

# Block bytes per Put batch (encoded blocks are views of K and V: a batch in flight holds
# its heads, and the server holds it in its in-flight budget until stored).
_STORE_BATCH_BYTES = 64 * 1024**2
_STORE_CONCURRENCY = 2
# Put batches of one store travelling at once to one server.
_PUTS_IN_FLIGHT = 2

KForm = Literal["nope", "rope"]
"""What the K given to ``store`` is: before RoPE ("nope") or after it ("rope")."""


@dataclass(frozen=True, slots=True)
class StoreReport:
    """What a store did. ``queued``/``dropped`` answer ``wait=False`` (counts then 0)."""

    stored: int = 0  # blocks newly stored
    already_present: int = 0  # blocks found on their server (skipped or answered so)
    failed: int = 0  # blocks refused, or whose server failed: not stored
    nbytes: int = 0  # bytes of the stored blocks
    seconds: float = 0.0
    queued: bool = False  # accepted into the background queue
    dropped: bool = False  # refused: the queue was full (counted in metrics)


@dataclass(frozen=True, slots=True)
class PreparedStore:
    """A validated store with its keys computed (``prepare_store``), ready to run or queue."""

    tokens: TokenArray
    k: torch.Tensor
    v: torch.Tensor | None
    positions: Positions
    form: KForm
    prefix: tuple[KeyedChunk, ...]
    pi: tuple[KeyedChunk, ...]

    @property
    def num_blocks(self) -> int:
        """Blocks the store would write if none were present."""
        return len(self.prefix) + len(self.pi)


class StoreBudget:
    """Blocks queued by ``store(wait=False)``; a store that does not fit is dropped.

    Thread-safe: the engine's threads admit, the loop thread releases. The lock guards
    one int for a few instructions and is never held across an await.
    """

    def __init__(self, capacity: int) -> None:
        """A budget of ``capacity`` queued blocks."""
        self.capacity = capacity
        self._queued = 0
        self._lock = threading.Lock()

    def admit(self, blocks: int) -> bool:
        """Reserve room for ``blocks``; False (nothing reserved) when they do not fit."""
        with self._lock:
            if self._queued + blocks > self.capacity:
                return False
            self._queued += blocks
            return True

    def release(self, blocks: int) -> None:
        """Give back the room of a finished store."""
        with self._lock:
            self._queued -= blocks

    @property
    def queued(self) -> int:
        """Blocks admitted and not finished."""
        return self._queued


@dataclass(frozen=True, slots=True)
class StoreRoute:
    """Where blocks go now: the ring and the live connections (they change with discovery)."""

    ring: Rendezvous
    connections: Mapping[str, ServerConnection]


class StorePipeline:
    """Runs prepared stores (now or queued) for one client (see the module docstring)."""

    def __init__(
        self,
        *,
        fingerprint: ModelFingerprint,
        pi_fingerprint: ModelFingerprint,
        rope: RopeSpec,
        bytes_per_token: int,
        metrics: ClientMetrics,
        queue_blocks: int,
        route: Callable[[], StoreRoute],
        present: Callable[[Sequence[bytes]], Awaitable[list[bool]]],
        on_worker: Callable[..., Awaitable[Any]],
    ) -> None:
        """A pipeline routing by ``route()``, asking ``present`` which keys exist and
        running CPU work through ``on_worker``."""
        self.fingerprint = fingerprint
        self.pi_fingerprint = pi_fingerprint
        self.rope = rope
        self._bytes_per_token = bytes_per_token
        self.metrics = metrics
        self.budget = StoreBudget(queue_blocks)
        self._route = route
        self._present = present
        self._on_worker = on_worker
        self._background: set[asyncio.Task[Any]] = set()
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- queue ------------------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop queued stores run on (the client's)."""
        self._loop = loop

    def enqueue(self, job: PreparedStore) -> StoreReport:
        """Queue a prepared store for the background (thread-safe; never blocks)."""
        if self._loop is None:
            raise InvalidArgumentError("loop", "use the client on its loop once before queuing")
        if not self.budget.admit(job.num_blocks):
            self.metrics.record_store_dropped(job.num_blocks)
            return StoreReport(dropped=True)
        self._loop.call_soon_threadsafe(self._spawn, job)
        return StoreReport(queued=True)

    def _spawn(self, job: PreparedStore) -> None:
        task = asyncio.get_running_loop().create_task(self._queued(job))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _queued(self, job: PreparedStore) -> None:
        try:
            if self._slots is None:
                self._slots = asyncio.Semaphore(_STORE_CONCURRENCY)
            async with self._slots:
                await self.run(job)
        except Exception:  # a background store has no caller to raise to
            log.exception("nopecache: background store failed")
        finally:
            self.budget.release(job.num_blocks)

    async def drain(self) -> None:
        """Wait until every queued store has finished."""
        while self._background or self.budget.queued:
            if self._background:
                await asyncio.gather(*list(self._background), return_exceptions=True)
            else:
                # Admitted but not spawned yet: its call_soon_threadsafe runs next iteration.
                await asyncio.sleep(0)

    # -- one store --------------------------------------------------------------------
    async def run(self, job: PreparedStore) -> StoreReport:
        """Run a prepared store now: Lookup, convert K, encode and Put what is missing."""
        start = time.perf_counter()
        chunks = list({c.key.value: c for c in (*job.prefix, *job.pi)}.values())
        present = await self._present([c.key.value for c in chunks]) if chunks else []
        missing = [c for c, p in zip(chunks, present, strict=True) if not p]
        already = len(chunks) - len(missing)
        if not missing:
            return StoreReport(already_present=already, seconds=time.perf_counter() - start)
        prefix_keys = {c.key.value for c in job.prefix}
        forms = await self._on_worker(self._store_forms, job)
        route = self._route()
        groups = route.ring.group([c.key.value for c in missing])
        counts = await asyncio.gather(
            *(
                self._store_on(server, route, [missing[i] for i in idx], job, forms, prefix_keys)
                for server, idx in groups.items()
            )
        )
        stored = sum(c[0] for c in counts)
        nbytes = sum(c[3] for c in counts)
        self.metrics.record_store(stored, nbytes)
        return StoreReport(
            stored=stored,
            already_present=already + sum(c[1] for c in counts),
            failed=sum(c[2] for c in counts),
            nbytes=nbytes,
            seconds=time.perf_counter() - start,
        )

    def _store_forms(self, job: PreparedStore) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Worker thread: K in NOPE form (for content blocks) and in the prefix form.

        Each conversion is one rotation of the whole prompt; K already in the needed form
        is passed through.
        """
        prefix_form = self.fingerprint.form
        nope: torch.Tensor | None = None
        if job.pi or (job.prefix and prefix_form != StoredForm.ROPE):
            nope = (
                job.k
                if job.form == "nope"
                else _rotate_layers(job.k, job.positions, None, self.rope)
            )
        prefixed: torch.Tensor | None = None
        if job.prefix:
            if prefix_form != StoredForm.ROPE:
                prefixed = nope
            else:
                prefixed = (
                    job.k
                    if job.form == "rope"
                    else _rotate_layers(job.k, None, job.positions, self.rope)
                )
        return nope, prefixed

    async def _store_on(
        self,
        server: str,
        route: StoreRoute,
        chunks: Sequence[KeyedChunk],
        job: PreparedStore,
        forms: tuple[torch.Tensor | None, torch.Tensor | None],
        prefix_keys: set[bytes],
    ) -> tuple[int, int, int, int]:
        """Encode and Put ``chunks`` to ``server`` in batches; (stored, present, failed, bytes)."""
        # Discovery may have dropped the server since the keys were grouped.
        connection = route.connections.get(server)
        if connection is None or connection.is_down():
            return 0, 0, len(chunks), 0  # not worth encoding: the put would fail at once
        per_block = self._bytes_per_token
        batches: list[list[KeyedChunk]] = [[]]
        size = 0
        for c in chunks:
            if batches[-1] and size + len(c.span) * per_block > _STORE_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(c)
            size += len(c.span) * per_block
        stored = present = failed = nbytes = 0
        # The worker encodes batch n + 1 while batch n travels; up to _PUTS_IN_FLIGHT
        # batches travel at once (each on its own bulk socket), so the server stores one
        # while the next arrives. Encoded blocks are views of K/V: nothing held but heads.
        encoding = asyncio.ensure_future(
            self._on_worker(self._encode, batches[0], job, forms, prefix_keys)
        )
        travelling: collections.deque[
            asyncio.Future[tuple[list[StoreResult], list[tuple[bytes, EncodedBlock]]]]
        ] = collections.deque()

        async def put(
            blobs: list[tuple[bytes, EncodedBlock]],
        ) -> tuple[list[StoreResult], list[tuple[bytes, EncodedBlock]]]:
            return await connection.put(blobs), blobs

        def settle(results: list[StoreResult], blobs: list[tuple[bytes, EncodedBlock]]) -> None:
            nonlocal stored, present, failed, nbytes
            for r, (_, blob) in zip(results, blobs, strict=True):
                if r.status is StoreStatus.STORED:
                    stored += 1
                    nbytes += blob.nbytes
                elif r.status is StoreStatus.ALREADY_PRESENT:
                    present += 1
                else:
                    failed += 1
                    if r.status is StoreStatus.REJECTED:
                        log.error(
                            "nopecache: %s rejected block %s: %s", server, r.key.hex(), r.reason
                        )

        try:
            for n in range(len(batches)):
                blobs = await encoding
                if n + 1 < len(batches):
                    encoding = asyncio.ensure_future(
                        self._on_worker(self._encode, batches[n + 1], job, forms, prefix_keys)
                    )
                if len(travelling) >= _PUTS_IN_FLIGHT:
                    settle(*await travelling.popleft())
                travelling.append(asyncio.ensure_future(put(blobs)))
            while travelling:
                settle(*await travelling.popleft())
        finally:
            for put_task in travelling:  # cancelled mid-store: the rest is not needed
                put_task.cancel()
            if not encoding.done():
                encoding.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await encoding
        return stored, present, failed, nbytes

    def _encode(
        self,
        chunks: Sequence[KeyedChunk],
        job: PreparedStore,
        forms: tuple[torch.Tensor | None, torch.Tensor | None],
        prefix_keys: set[bytes],
    ) -> list[tuple[bytes, EncodedBlock]]:
        """Worker thread: the blocks of ``chunks``, in parts (views of K and V: nothing
        copied; the bulk stream sends them as they lie)."""
        nope_k, prefix_k = forms
        positions = (
            _positions_list(job.positions, len(job.tokens))
            if StoredForm.ROPE in (self.fingerprint.form, self.pi_fingerprint.form)
            else []
        )
        out = []
        for c in chunks:
            s, e = c.span.start, c.span.end
            is_prefix = c.key.value in prefix_keys
            fp = self.fingerprint if is_prefix else self.pi_fingerprint
            k = prefix_k if is_prefix else nope_k
            assert k is not None
            source = positions[s:e] if fp.form == StoredForm.ROPE else None
            blob = encode_block_parts(
                key=c.key.value,
                fingerprint=fp.to_bytes(),
                form=fp.form,
                k=k[:, s:e],
                v=None if job.v is None else job.v[:, s:e],
                token_ids=job.tokens[s:e].tolist(),
                source_positions=source,
                codec=fp.codec,
            )
            out.append((c.key.value, blob))
        return out


def _positions_list(positions: Positions, num_tokens: int) -> list[int]:
    if isinstance(positions, int):
        return list(range(positions, positions + num_tokens))
    out: list[int] = positions.tolist()
    return out


def _rotate_layers(
    k: torch.Tensor, from_pos: Positions | None, to_pos: Positions | None, spec: RopeSpec
) -> torch.Tensor:
    """K ``[layers, tokens, heads, dim]`` rotated between positions (None = nope), one pass."""
    out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    src = from_pos.to(k.device) if isinstance(from_pos, torch.Tensor) else from_pos
    dst = to_pos.to(k.device) if isinstance(to_pos, torch.Tensor) else to_pos
    for layer in range(k.shape[0]):
        rotate(k[layer], src, dst, spec, out=out[layer])
    return out
