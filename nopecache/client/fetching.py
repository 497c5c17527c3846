"""The fetch pipeline: Get streams feeding a worker thread that verifies and places blocks.

::

    loop thread                                   worker thread
    -----------                                   -------------
    Get stream, server A --+                      block 0: verify, rotate + scatter
    Get stream, server B --+--> queue --> submit  block 1: verify, rotate + scatter
                                 (as each block    ...
                                  arrives)

Blocks are handed to the worker the moment their last frame arrives, so block n is
placed while block n+1 is still on the wire (torch releases the GIL, the loop keeps
reading). Into a paged cache off CUDA, the blocks that arrived while the worker was busy
are placed together by its next job (each verified on its own; adjacent hits share one
rotation and one write per cache page: ``placement.place_parts``), so small
position-independent blocks cost about what large exact-prefix ones do per byte. Nothing
is issued into the engine's cache after ``place`` returns or raises: a cancelled fetch
stops the queued jobs and waits for the running one.

On CUDA the worker issues copies and kernels on the device and stream the ``PagedKV``
captured on the engine's thread, so ``place`` returns once they are *issued*:
``FetchResult.ready`` is an event recorded after the last of them (see
``nopecache.client.placement``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nopecache.client.buffers import payload_xxh3
from nopecache.client.chunking import ChunkSpan, TokenArray
from nopecache.client.cuda_arena import DeviceBlob, FetchedBlob
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.metrics import ClientMetrics
from nopecache.client.placement import (
    PagedKV,
    PagedPart,
    StagingRing,
    decode_for_hit,
    paged_part,
    place_contiguous,
    place_paged,
    place_parts,
)
from nopecache.client.plan import Hit, HitKind, ReusePlan
from nopecache.client.sharding import Rendezvous
from nopecache.client.transport import BufferPool, ServerConnection
from nopecache.client.zero_copy import in_release_batch, lapsed
from nopecache.kernels import RopeSpec
from nopecache.proto.block import BlockError

__all__ = ["BlockPlacer", "Download", "FetchResult"]

log = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What a fetch placed; with ``into=None`` also the K/V it placed them in.

    ``mask[i]`` is True when prompt position i got cached KV (with ``into``: a position
    whose slot is -1 never does). Without a paged target,
    ``k``/``v`` are ``[layers, num_tokens, kv_heads, head_dim]``, K rotated to the target
    positions (post-RoPE), zeros where ``mask`` is False. ``ready``: for CUDA caches, an
    event recorded on ``into.stream`` after the last copy and kernel of the fetch (the
    stream itself is ordered already; another stream waits on it with
    ``stream.wait_event(ready)``, the host with ``ready.synchronize()``); None otherwise.
    """

    plan: ReusePlan
    placed: tuple[Hit, ...]  # in prompt order
    failed: tuple[Hit, ...]  # planned hits that became misses (server, verification)
    nbytes: int  # block bytes received
    seconds: float  # from the first Get (a prefetch's start) to the last block placed
    mask: torch.Tensor
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    @property
    def placed_tokens(self) -> int:
        """Prompt tokens whose KV was placed."""
        return sum(h.num_tokens for h in self.placed)

    @property
    def prefix_tokens(self) -> int:
        """Length of the exact prefix placed without a gap from position 0 (lossless KV)."""
        end = 0
        for hit in sorted(
            (h for h in self.placed if h.kind is HitKind.PREFIX), key=lambda h: h.target.start
        ):
            if hit.target.start != end:
                break
            end = hit.target.end
        return end

    @property
    def misses(self) -> tuple[ChunkSpan, ...]:
        """Maximal token ranges without cached KV: what the engine must prefill."""
        out: list[ChunkSpan] = []
        covered = 0
        for hit in sorted(self.placed, key=lambda h: h.target.start):
            if hit.target.start > covered:
                out.append(ChunkSpan(covered, hit.target.start))
            covered = max(covered, hit.target.end)
        if covered < self.plan.num_tokens:
            out.append(ChunkSpan(covered, self.plan.num_tokens))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class BlockPlacer:
    """Verifies a fetched blob against its hits and places it (runs on the worker thread).

    Prefix hits are checked against the prefix fingerprint, position-independent ones
    against the NOPE one (their keys were made with them).
    """

    prefix_fingerprint: ModelFingerprint
    pi_fingerprint: ModelFingerprint
    rope: RopeSpec
    v_head_dim: int
    metrics: ClientMetrics
    # Pinned buffers for blocks on their way to a GPU cache (used on the worker thread only).
    staging: StagingRing = field(default_factory=StagingRing, compare=False, repr=False)

    def warm_up(self, device: torch.device) -> None:
        """Compile the kernels a fetch and a store launch on CUDA ``device``, ahead of time.

        Triton compiles a kernel variant on its first launch (seconds); the variants
        depend on the model only, so this takes that cost once at start-up, not on the
        first request.
        """
        if device.type != "cuda":
            return
        from nopecache.kernels.triton_rope import warm_up

        fp = self.prefix_fingerprint
        with torch.cuda.device(device):
            warm_up(self.rope, fp.torch_dtype, fp.num_kv_heads, self.v_head_dim, device)

    def outputs(self, num_tokens: int) -> Outputs:
        """Uninitialised contiguous K and V for a prompt (V None for MLA)."""
        fp = self.prefix_fingerprint
        shape = (fp.num_layers, num_tokens, fp.num_kv_heads)
        k = torch.empty((*shape, fp.head_dim), dtype=fp.torch_dtype)
        v = (
            torch.empty((*shape, self.v_head_dim), dtype=fp.torch_dtype)
            if self.v_head_dim
            else None
        )
        return k, v

    def place(
        self,
        blob: FetchedBlob,
        hits: Sequence[Hit],
        prompt: TokenArray,
        into: PagedKV | None,
        out: Outputs | None,
        cancelled: threading.Event,
    ) -> bool:
        """Verify ``blob`` for each of ``hits`` (one key) and place it; False: a miss."""
        if cancelled.is_set():
            return False
        fp = self.prefix_fingerprint if hits[0].kind is HitKind.PREFIX else self.pi_fingerprint
        # The payload's digest when the bulk stream hashed it as it arrived (else None:
        # verification reads it); one for every hit of the blob.
        digest = payload_xxh3(blob) if isinstance(blob, memoryview) else None
        try:
            # A block in a server's device pool is read on into's stream (its header copy,
            # a join of several runs) and kept, with its lease, until that stream has
            # finished reading it.
            device = isinstance(blob, DeviceBlob) and into is not None
            # A compact block (kv_codec) bound for a GPU cache is decoded there, on into's
            # stream: half the bytes cross the bus, and the GPU does the arithmetic.
            decode_on = into.device if into is not None and into.device.type == "cuda" else None
            issuing = into is not None and (device or decode_on is not None)
            with into.issuing() if issuing and into is not None else contextlib.nullcontext():
                for hit in hits:
                    block = decode_for_hit(
                        blob, hit, prompt, fp, self.v_head_dim, digest, decode_on
                    )
                    if into is not None:
                        place_paged(block, hit, into, self.rope, self.staging)
                    else:
                        assert out is not None
                        place_contiguous(block, hit, out[0], out[1], self.rope)
                if device and into is not None and into.stream is not None:
                    self.staging.hold(blob)
        except BlockError as e:
            log.warning("nopecache: block %s failed verification, a miss: %s", hits[0].key.hex(), e)
            self.metrics.record_verify_failure()
            return False
        return True

    def place_many(
        self,
        items: Sequence[tuple[FetchedBlob, Sequence[Hit]]],
        prompt: TokenArray,
        into: PagedKV,
        cancelled: threading.Event,
    ) -> list[bool]:
        """``place`` for host blobs bound for a paged cache off CUDA: each verified on its
        own (a bad one is a miss, the others still land), then all placed together
        (``place_parts``: one rotation and one run of page writes for adjacent hits)."""
        oks: list[bool] = []
        parts: list[PagedPart] = []
        for blob, hits in items:
            if cancelled.is_set():
                oks.append(False)
                continue
            fp = self.prefix_fingerprint if hits[0].kind is HitKind.PREFIX else self.pi_fingerprint
            digest = payload_xxh3(blob) if isinstance(blob, memoryview) else None
            try:
                mine = [
                    paged_part(
                        decode_for_hit(blob, hit, prompt, fp, self.v_head_dim, digest), hit, into
                    )
                    for hit in hits
                ]
            except BlockError as e:
                log.warning(
                    "nopecache: block %s failed verification, a miss: %s", hits[0].key.hex(), e
                )
                self.metrics.record_verify_failure()
                oks.append(False)
                continue
            oks.append(True)
            parts.extend(p for p in mine if p is not None)
        if cancelled.is_set():
            return [False] * len(oks)
        if parts:
            place_parts(parts, into, self.rope)
        return oks


def _by_target(hit: Hit) -> int:
    return hit.target.start


def _lands(hit: Hit, into: PagedKV) -> bool:
    """Whether any position of ``hit`` has a slot in ``into`` (else fetching it is waste)."""
    return bool((into.slots_host[hit.target.start : hit.target.end] >= 0).any())


class Download:
    """The Get streams of one plan, one per owner server; blocks queue up as they arrive.

    ``place`` consumes the queue and hands each block to the worker thread at once, so
    block n is verified and placed while block n+1 is still on the wire. A key used by
    several hits (repeated content) is fetched once and placed for each.
    """

    def __init__(
        self,
        plan: ReusePlan,
        ring: Rendezvous,
        connections: Mapping[str, ServerConnection],
        placer: BlockPlacer,
        worker: concurrent.futures.Executor,
        pool: BufferPool,
        into: PagedKV | None = None,
    ) -> None:
        """Start the Get streams of ``plan``'s blocks (on the running loop); placed blocks'
        buffers go back to ``pool``. With ``into`` (known up front), a hit none of whose
        positions has a slot there is not fetched (the engine holds those positions): it
        is neither placed nor failed."""
        self.plan = plan
        self.ring = ring
        self.connections = connections
        self.placer = placer
        self.worker = worker
        self.pool = pool
        self.start = time.perf_counter()
        self.by_key: dict[bytes, list[Hit]] = {}
        for hit in plan.blocks:
            if into is not None and not _lands(hit, into):
                continue
            self.by_key.setdefault(hit.key.value, []).append(hit)
        self.queue: asyncio.Queue[tuple[list[Hit], FetchedBlob | None] | None] = asyncio.Queue()
        self.consumed = False
        # Blobs waiting for the worker when blocks are placed together (_place_arrived):
        # appended on the loop thread, taken on the worker (deque ends are thread-safe).
        self._arrived: collections.deque[tuple[int, list[Hit], FetchedBlob]] = collections.deque()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        keys = list(self.by_key)
        try:
            await asyncio.gather(
                *(
                    self._stream(server, [keys[i] for i in idx])
                    for server, idx in self.ring.group(keys).items()
                )
            )
        finally:
            self.queue.put_nowait(None)

    async def _stream(self, server: str, keys: list[bytes]) -> None:
        blocks = self.connections[server].get(b"".join(keys))
        try:
            async for index, blob in blocks:
                self.queue.put_nowait((self.by_key[keys[index]], blob))
        finally:
            await blocks.aclose()  # type: ignore[attr-defined]

    def _place(
        self,
        blob: FetchedBlob,
        hits: Sequence[Hit],
        prompt: TokenArray,
        into: PagedKV | None,
        out: Outputs | None,
        cancelled: threading.Event,
    ) -> bool:
        """Worker thread: place one blob, then hand its buffer back for reuse (the block's
        tensors died with ``placer.place``'s frame; nothing reads the buffer any more)."""
        try:
            if lapsed(blob):
                return False
            placed = self.placer.place(blob, hits, prompt, into, out, cancelled)
            # A view of the server's pool whose lease ended while it was verified and
            # placed may have been rewritten meanwhile: failed (the engine recomputes).
            return placed and not lapsed(blob)
        finally:
            if isinstance(blob, memoryview):
                self.pool.give(blob)

    def _place_arrived(
        self,
        prompt: TokenArray,
        into: PagedKV,
        cancelled: threading.Event,
        outcomes: dict[int, bool],
    ) -> None:
        """Worker thread: place, together, every blob that arrived and no earlier job took
        (a paged cache off CUDA); each blob's outcome goes in ``outcomes`` by its index.

        One job is submitted per blob, so the last job runs after the last blob arrived:
        every blob is taken by some job. While placement keeps the worker busy, blobs pile
        up and the next job places all of them at once (``BlockPlacer.place_many``); when
        the worker keeps up, each job places the one blob that arrived.
        """
        taken: list[tuple[int, list[Hit], FetchedBlob]] = []
        while self._arrived:
            taken.append(self._arrived.popleft())
        if not taken:
            return
        try:
            live = [(i, hits, blob) for i, hits, blob in taken if not lapsed(blob)]
            oks = self.placer.place_many(
                [(blob, hits) for _, hits, blob in live], prompt, into, cancelled
            )
            for i, _, _ in taken:
                outcomes[i] = False
            for (i, _, blob), ok in zip(live, oks, strict=True):
                # A view of the server's pool whose lease ended while it was verified and
                # placed may have been rewritten meanwhile: failed (the engine recomputes).
                outcomes[i] = ok and not lapsed(blob)
        finally:
            for _, _, blob in taken:
                if isinstance(blob, memoryview):
                    self.pool.give(blob)

    async def place(self, arr: TokenArray, into: PagedKV | None) -> FetchResult:
        """Place every block as it arrives; the result once all are placed or missed."""
        if self.consumed:
            raise InvalidArgumentError("fetch", "this prefetch was fetched already")
        self.consumed = True
        out = self.placer.outputs(self.plan.num_tokens) if into is None else None
        cancelled = threading.Event()
        # A job returns its blob's outcome, or None when blobs are placed together and
        # the outcome is in ``together`` by the blob's index.
        jobs: list[tuple[list[Hit], concurrent.futures.Future[Any]]] = []
        together: dict[int, bool] | None = (
            {} if into is not None and into.device.type != "cuda" else None
        )
        failed: list[Hit] = []
        nbytes = 0
        try:
            while (item := await self.queue.get()) is not None:
                hits, blob = item
                if blob is None:
                    failed.extend(hits)
                    self.placer.metrics.record_missed()
                    continue
                nbytes += blob.nbytes
                job: concurrent.futures.Future[Any]
                if together is not None and into is not None and isinstance(blob, memoryview):
                    self._arrived.append((len(jobs), hits, blob))
                    job = self.worker.submit(
                        in_release_batch, self._place_arrived, arr, into, cancelled, together
                    )
                else:
                    job = self.worker.submit(self._place, blob, hits, arr, into, out, cancelled)
                jobs.append((hits, job))
                # Only the job holds the block now: a leased view dies (its lease queued
                # for release) with the job's batch, not later with this coroutine.
                item = blob = None
            await self.task  # re-raises a bug in the streams; failures are misses already
            returned = await asyncio.gather(*(asyncio.wrap_future(j) for _, j in jobs))
            results = [
                bool(r) if r is not None else (together or {}).get(i, False)
                for i, r in enumerate(returned)
            ]
        except BaseException:
            # Nothing may write into the engine's cache after we return: stop queued jobs
            # and wait for the one running.
            cancelled.set()
            self.task.cancel()
            await asyncio.to_thread(concurrent.futures.wait, [j for _, j in jobs])
            raise
        placed = [h for (hits, _), ok in zip(jobs, results, strict=True) if ok for h in hits]
        failed += [h for (hits, _), ok in zip(jobs, results, strict=True) if not ok for h in hits]
        # Streams finish in any order; results read in prompt order.
        placed.sort(key=_by_target)
        failed.sort(key=_by_target)
        seconds = time.perf_counter() - self.start
        # Blocks read from a server's device pool are held (with their leases) until the
        # GPU finished reading them: released on the worker, after this fetch's jobs,
        # without making the fetch wait for the GPU.
        with contextlib.suppress(RuntimeError):  # the client is closing: the TTL ends them
            self.worker.submit(in_release_batch, self.placer.staging.release_done, True)
        # Every job has returned: all of the fetch's work is issued on into's stream.
        ready = None if into is None else into.record_ready()
        mask = torch.zeros(self.plan.num_tokens, dtype=torch.bool)
        for hit in placed:
            mask[hit.target.start : hit.target.end] = True
        if into is not None:
            mask &= torch.from_numpy(into.slots_host >= 0)  # slot -1: nothing written there
        result = FetchResult(
            self.plan,
            tuple(placed),
            tuple(failed),
            nbytes,
            seconds,
            mask,
            None if out is None else out[0],
            None if out is None else out[1],
            ready,
        )
        if out is not None:
            for span in result.misses:
                for t in out:
                    if t is not None:
                        t[:, span.start : span.end].zero_()
        self.placer.metrics.record_fetch(sum(ok for ok in results), nbytes, seconds)
        return result
