"""The client engines embed: store KV after prefill, plan reuse before it, fetch and place hits.

::

    engine                         AsyncCacheClient (one event loop)          servers
    ------                         ---------------------------------          -------
    lookup(tokens) ------------->  keys: prefix chain + content chunks
                                   one Lookup per owner server, in parallel -> Lookup
                                   plan_reuse(keep=cost filter)
    fetch(plan, tokens, into) -->  one Get stream per owner, in parallel   -> Get
                                     block n arrives ... ---> worker thread: verify,
                                     block n+1 arrives         rotate + scatter block n
    store(tokens, (k, v), pos) ->  keys, Lookup to skip present ones,
                                   un-rotate K once (worker), encode       -> Put per owner

Keys. Two key families per prompt (see ``keys.py``): the *prefix* chain over fixed blocks
of ``prefix_block_tokens`` (from the config, 256 by default), keyed with the
client's fingerprint, whose ``form`` is the form prefix blocks are stored in; and
*position-independent* content chunks (the config's ``chunk_*_tokens``, or the call's chunker),
always stored as NOPE K and keyed with the NOPE variant of the fingerprint. An engine
that holds post-RoPE K gives a ROPE fingerprint, and exact-prefix hits are then bit-exact
copies (no rotation at all when the positions agree).

Failures. A server down or slow, a block that fails verification: misses, counted in
``metrics``, never exceptions. Bad arguments (shapes, dtypes, a model other than the
fingerprint's) raise ``InvalidArgumentError`` / ``FingerprintMismatchError`` at once.

Threads. :class:`AsyncCacheClient` belongs to the event loop it is used on. CPU work
(un-rotation, encoding, verification, placement) runs on one worker thread, so the loop
keeps receiving while a block is placed (torch releases the GIL). :class:`CacheClient`
is the synchronous facade: it owns a background thread running the loop; every method
may be called from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nopecache.client.chunking import (
    Chunker,
    FixedChunker,
    TokenArray,
    TokenIds,
    token_array,
)
from nopecache.client.config import (
    DEFAULT_CHUNKER,
    DEFAULT_PREFIX_BLOCK_TOKENS,
    ClientConfig,
    normalize_server,
)
from nopecache.client.cost import CostModel, bytes_per_token
from nopecache.client.discovery import Discovery, Resolver
from nopecache.client.errors import FingerprintMismatchError, InvalidArgumentError
from nopecache.client.fetching import BlockPlacer, Download, FetchResult
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keyplan import KeyPlanner
from nopecache.client.keys import KeyedChunk, Namespace
from nopecache.client.metrics import ClientMetrics, ClientStats
from nopecache.client.placement import PagedKV
from nopecache.client.plan import ReusePlan, plan_reuse
from nopecache.client.sharding import Rendezvous
from nopecache.client.shm import ShmFastPath
from nopecache.client.transport import BufferPool, FastPathFactory, PutStatus, ServerConnection
from nopecache.kernels import RopeSpec
from nopecache.kernels.api import Positions, rotate
from nopecache.proto.block import StoredForm, encode_block

__all__ = [
    "DEFAULT_CHUNKER",
    "DEFAULT_PREFIX_BLOCK_TOKENS",
    "AsyncCacheClient",
    "AsyncPrefetch",
    "FetchResult",
    "KForm",
    "PreparedStore",
    "StoreReport",
]

log = logging.getLogger(__name__)

# Blocks encoded and sent per Put batch: bounds the extra memory a store holds at once.
_STORE_BATCH_BYTES = 64 * 1024**2
_STORE_CONCURRENCY = 2

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


class _StoreBudget:
    """Blocks queued by ``store(wait=False)``; a store that does not fit is dropped.

    Thread-safe: the engine's threads admit, the loop thread releases. The lock guards
    one int for a few instructions and is never held across an await.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._queued = 0
        self._lock = threading.Lock()

    def admit(self, blocks: int) -> bool:
        with self._lock:
            if self._queued + blocks > self.capacity:
                return False
            self._queued += blocks
            return True

    def release(self, blocks: int) -> None:
        with self._lock:
            self._queued -= blocks

    @property
    def queued(self) -> int:
        """Blocks admitted and not finished."""
        return self._queued


class AsyncCacheClient:
    """The nopecache client on an asyncio loop (see the module docstring).

    ``fingerprint`` identifies the model; its ``form`` is the form exact-prefix blocks are
    stored in (ROPE for an engine holding post-RoPE K gives bit-exact prefix hits).
    ``rope`` must be the spec the fingerprint was made from; ``v_head_dim`` is V's last
    dim (0 for MLA). Create it inside the loop that will use it; ``close()`` when done.
    """

    def __init__(
        self,
        config: ClientConfig | str,
        *,
        fingerprint: ModelFingerprint,
        rope: RopeSpec,
        v_head_dim: int,
        prefix_block_tokens: int | None = None,
        chunker: Chunker | None = None,
        metrics: ClientMetrics | None = None,
        fast_path: FastPathFactory | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        """A client of the servers in ``config`` (a ClientConfig or a nopecache:// URL).

        ``prefix_block_tokens`` and ``chunker`` override the config's (None: use it).
        ``resolver`` replaces getaddrinfo for ``discover=dns`` (see ``discovery.py``).
        """
        if isinstance(config, str):
            config = ClientConfig.from_url(config)
        if not isinstance(config, ClientConfig):
            raise InvalidArgumentError("config", f"must be a ClientConfig or URL, got {config!r}")
        _check_model(fingerprint, rope, v_head_dim)
        if prefix_block_tokens is None:
            prefix_block_tokens = config.prefix_block_tokens
        if chunker is None:
            chunker = config.content_chunker()
        if resolver is not None and config.discover != "dns":
            raise InvalidArgumentError("resolver", "is only used with discover='dns'")
        if isinstance(prefix_block_tokens, bool) or not isinstance(prefix_block_tokens, int):
            raise InvalidArgumentError("prefix_block_tokens", "must be an int")
        self.config = config
        self.fingerprint = fingerprint
        self.rope = rope
        self.v_head_dim = v_head_dim
        self.prefix_chunker = FixedChunker(prefix_block_tokens)
        self.chunker = chunker
        # One keying for the client and its stand-ins (keyplan.py).
        self.keying = KeyPlanner(
            fingerprint,
            config.namespace,
            self.prefix_chunker,
            chunker,
            config.content_chunker(),
        )
        self.pi_fingerprint = self.keying.pi_fingerprint
        self.metrics = ClientMetrics() if metrics is None else metrics
        self.cost = CostModel(config.cost)
        self.ring = Rendezvous(config.servers)
        self._bytes_per_token = bytes_per_token(fingerprint, v_head_dim)
        # One pool for every connection: a fetch places blocks of any server.
        self._pool = BufferPool()
        # Same-host shared memory (shm.py) unless switched off or replaced by the caller's
        # own fast path; the client detaches its sessions on close.
        self.shm: ShmFastPath | None = fast_path if isinstance(fast_path, ShmFastPath) else None
        if fast_path is None and config.shm != "off":
            fast_path = self.shm = ShmFastPath(config.shm)
        self._fast_path = fast_path
        self._connections = {s: self._connect(s) for s in config.servers}
        self._placer = BlockPlacer(fingerprint, self.pi_fingerprint, rope, v_head_dim, self.metrics)
        # One worker: placements run one at a time (torch parallelises each op itself).
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nopecache")
        self._budget = _StoreBudget(config.store_queue_blocks)
        self._background: set[asyncio.Task[Any]] = set()
        self._store_slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._discovery = (
            Discovery.for_config(config, self.set_servers, resolver)
            if config.discover == "dns"
            else None
        )

    def _connect(self, server: str) -> ServerConnection:
        return ServerConnection(
            server,
            self.config,
            metrics=self.metrics,
            cost=self.cost,
            fast_path=self._fast_path,
            pool=self._pool,
        )

    def connection(self, server: str) -> ServerConnection:
        """The connection to one server of the ring."""
        return self._connections[server]

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers keys are sharded over now (sorted; with ``discover=dns``, the
        configured names until the first call resolves them)."""
        return self.ring.servers

    async def refresh_servers(self) -> tuple[str, ...]:
        """With ``discover=dns``, resolve the names now and shard over the result; the
        servers in use (without discovery, just those)."""
        self._in_loop()
        if self._discovery is None:
            return self.servers
        if not self._discovery.started:
            return await self._discovery.start()
        return await self._discovery.refresh()

    async def set_servers(self, servers: Sequence[str]) -> None:
        """Shard over ``servers`` from now on (service discovery); only the keys of added or
        removed servers move. Connections to removed servers are closed (their in-flight
        calls turn into misses). With ``discover=dns`` the next resolution replaces them."""
        self._in_loop()
        ring = Rendezvous(normalize_server(s) for s in servers)
        gone = [c for s, c in self._connections.items() if s not in ring.servers]
        self._connections = {s: self._connections.get(s) or self._connect(s) for s in ring.servers}
        self.ring = ring
        await asyncio.gather(*(c.close() for c in gone))

    def stats(self) -> ClientStats:
        """The client's counters (hits by kind, dropped hits, bytes, failures)."""
        return self.metrics.snapshot()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Report that the engine prefilled ``tokens`` in ``seconds`` (for the cost model)."""
        self.cost.observe_prefill(tokens, seconds)

    def _in_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise InvalidArgumentError("loop", "an AsyncCacheClient is bound to one event loop")
        return loop

    async def _on_worker(self, fn: Any, *args: Any) -> Any:
        return await self._in_loop().run_in_executor(self._worker, fn, *args)

    # -- keys -------------------------------------------------------------------------
    def _pi_chunker(self, chunking: Chunker | None, segments: Sequence[int] | None) -> Chunker:
        return self.keying.pi_chunker(chunking, segments)

    def _keys(
        self,
        tokens: TokenArray,
        namespace: Namespace | None,
        chunker: Chunker,
        *,
        prefix: bool,
        pi: bool,
    ) -> tuple[list[KeyedChunk], list[KeyedChunk]]:
        return self.keying.keys(tokens, namespace, chunker, prefix=prefix, pi=pi)

    async def _present(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys their owners hold: one Lookup per server, all in parallel."""
        if self._discovery is not None:
            await self._discovery.start()  # the first resolution; at once after it
        groups = self.ring.group(keys)
        answers = await asyncio.gather(
            *(
                self._connections[server].lookup(b"".join(keys[i] for i in idx))
                for server, idx in groups.items()
            )
        )
        if self._discovery is not None and any(c.is_down() for c in self._connections.values()):
            self._discovery.server_failed()  # DNS may no longer list it: resolve again soon
        present = [False] * len(keys)
        for idx, codes in zip(groups.values(), answers, strict=True):
            for i, code in zip(idx, codes, strict=True):
                present[i] = code != 0
        return present

    # -- lookup -----------------------------------------------------------------------
    async def lookup(
        self,
        tokens: TokenIds,
        *,
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        allow_position_independent: bool = True,
    ) -> ReusePlan:
        """The reuse plan of a prompt: exact prefix, position-independent hits, misses.

        Hits the cost model finds slower to fetch than to recompute are in ``dropped``.
        """
        self._in_loop()
        start = time.perf_counter()
        arr = token_array(tokens)
        chunker = self._pi_chunker(chunking, segments)
        pre, pi = self._keys(arr, namespace, chunker, prefix=True, pi=allow_position_independent)
        unique = list(dict.fromkeys(c.key.value for c in (*pre, *pi)))
        present = dict(zip(unique, await self._present(unique), strict=True))
        found = {c.key: self.fingerprint.form for c in pre if present[c.key.value]}
        found.update({c.key: self.pi_fingerprint.form for c in pi if present[c.key.value]})
        keep = (
            self.cost.hit_filter(self._bytes_per_token, self.ring.owner)
            if self.config.cost.enabled
            else None
        )
        plan = plan_reuse(len(arr), pre, pi, found, keep=keep)
        self.metrics.record_plan(plan, time.perf_counter() - start)
        return plan

    # -- fetch ------------------------------------------------------------------------
    def _check_into(self, into: PagedKV | None, num_tokens: int) -> None:
        if into is None:
            return
        if not isinstance(into, PagedKV):
            raise InvalidArgumentError(
                "into", f"must be a PagedKV or None, got {type(into).__name__}"
            )
        fp = self.fingerprint
        got = (into.num_layers, into.num_kv_heads, into.head_dim, into.v_head_dim)
        want = (fp.num_layers, fp.num_kv_heads, fp.head_dim, self.v_head_dim)
        if got != want or into.dtype != fp.torch_dtype:
            raise FingerprintMismatchError(
                f"into: caches of (layers, kv_heads, head_dim, v_head_dim) {got} {into.dtype}, "
                f"the model has {want} {fp.torch_dtype}"
            )
        if into.slot_mapping.numel() != num_tokens:
            raise InvalidArgumentError(
                "into.slot_mapping", f"{into.slot_mapping.numel()} slots for {num_tokens} tokens"
            )

    async def fetch(
        self, plan: ReusePlan, tokens: TokenIds, *, into: PagedKV | None = None
    ) -> FetchResult:
        """Fetch the plan's blocks, verify each against ``tokens``, and place it.

        With ``into`` the KV lands in the engine's paged cache; without, in new contiguous
        tensors (see FetchResult). A block that is missing or fails verification is a
        miss (in ``failed``), never an exception.
        """
        self._in_loop()
        arr = self._check_fetch(plan, tokens, into)
        return await self._download(plan).place(arr, into)

    def _download(self, plan: ReusePlan) -> Download:
        """Start the Get streams of ``plan`` (on the running loop)."""
        return Download(plan, self.ring, self._connections, self._placer, self._worker, self._pool)

    def _check_fetch(self, plan: ReusePlan, tokens: TokenIds, into: PagedKV | None) -> TokenArray:
        if not isinstance(plan, ReusePlan):
            raise InvalidArgumentError("plan", f"must be a ReusePlan, got {type(plan).__name__}")
        arr = token_array(tokens)
        if len(arr) != plan.num_tokens:
            raise InvalidArgumentError(
                "tokens", f"{len(arr)} tokens, the plan is for {plan.num_tokens}"
            )
        self._check_into(into, plan.num_tokens)
        return arr

    def prefetch(
        self,
        tokens: TokenIds,
        *,
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        allow_position_independent: bool = True,
    ) -> AsyncPrefetch:
        """Start lookup and download in the background as soon as the prompt is known."""
        self._in_loop()
        arr = token_array(tokens)
        self._pi_chunker(chunking, segments)  # bad arguments raise here, not in the task
        return AsyncPrefetch(
            self,
            arr,
            self.lookup(
                arr,
                chunking=chunking,
                segments=segments,
                namespace=namespace,
                allow_position_independent=allow_position_independent,
            ),
        )

    # -- store ------------------------------------------------------------------------
    def prepare_store(
        self,
        tokens: TokenIds,
        kv: tuple[torch.Tensor, torch.Tensor | None],
        positions: Positions = 0,
        *,
        form: KForm = "nope",
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        prefix: bool = True,
        position_independent: bool = True,
    ) -> PreparedStore:
        """Validate a store and compute its keys (any thread; raises on bad arguments)."""
        arr = token_array(tokens)
        k, v = _check_kv(kv, self.fingerprint, self.v_head_dim, len(arr))
        if form not in ("nope", "rope"):
            raise InvalidArgumentError("form", f"must be 'nope' or 'rope', got {form!r}")
        positions = _check_positions(positions, len(arr))
        chunker = self._pi_chunker(chunking, segments)
        pre, pi = self._keys(arr, namespace, chunker, prefix=prefix, pi=position_independent)
        return PreparedStore(arr, k, v, positions, form, tuple(pre), tuple(pi))

    async def store(
        self,
        tokens: TokenIds,
        kv: tuple[torch.Tensor, torch.Tensor | None],
        positions: Positions = 0,
        *,
        form: KForm = "nope",
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        prefix: bool = True,
        position_independent: bool = True,
        wait: bool = True,
    ) -> StoreReport:
        """Store the KV of ``tokens`` computed at ``positions`` (an int start or a tensor).

        ``kv`` is (K, V), each ``[layers, tokens, kv_heads, head_dim]``, K in ``form``. Only
        blocks their servers lack are sent. ``wait=False`` returns at once (``queued``, or
        ``dropped`` when ``config.store_queue_blocks`` blocks are already waiting); K and V
        are then read later: do not modify them in place until ``drain()``.
        """
        self._in_loop()
        job = self.prepare_store(
            tokens,
            kv,
            positions,
            form=form,
            chunking=chunking,
            segments=segments,
            namespace=namespace,
            prefix=prefix,
            position_independent=position_independent,
        )
        if wait:
            return await self.store_prepared(job)
        return self.enqueue_store(job)

    def enqueue_store(self, job: PreparedStore) -> StoreReport:
        """Queue a prepared store for the background (thread-safe; never blocks)."""
        if self._loop is None:
            raise InvalidArgumentError("loop", "use the client on its loop once before queuing")
        if not self._budget.admit(job.num_blocks):
            self.metrics.record_store_dropped(job.num_blocks)
            return StoreReport(dropped=True)
        self._loop.call_soon_threadsafe(self._spawn_store, job)
        return StoreReport(queued=True)

    def _spawn_store(self, job: PreparedStore) -> None:
        task = asyncio.get_running_loop().create_task(self._queued_store(job))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _queued_store(self, job: PreparedStore) -> None:
        try:
            if self._store_slots is None:
                self._store_slots = asyncio.Semaphore(_STORE_CONCURRENCY)
            async with self._store_slots:
                await self.store_prepared(job)
        except Exception:  # a background store has no caller to raise to
            log.exception("nopecache: background store failed")
        finally:
            self._budget.release(job.num_blocks)

    async def drain(self) -> None:
        """Wait until every queued store has finished."""
        while self._background or self._budget.queued:
            if self._background:
                await asyncio.gather(*list(self._background), return_exceptions=True)
            else:
                # Admitted but not spawned yet: its call_soon_threadsafe runs next iteration.
                await asyncio.sleep(0)

    async def store_prepared(self, job: PreparedStore) -> StoreReport:
        """Run a prepared store now: Lookup, convert K, encode and Put what is missing."""
        self._in_loop()
        start = time.perf_counter()
        chunks = list({c.key.value: c for c in (*job.prefix, *job.pi)}.values())
        present = await self._present([c.key.value for c in chunks]) if chunks else []
        missing = [c for c, p in zip(chunks, present, strict=True) if not p]
        already = len(chunks) - len(missing)
        if not missing:
            return StoreReport(already_present=already, seconds=time.perf_counter() - start)
        prefix_keys = {c.key.value for c in job.prefix}
        nope_k, prefix_k = await self._on_worker(self._store_forms, job)
        groups = self.ring.group([c.key.value for c in missing])
        counts = await asyncio.gather(
            *(
                self._store_on(
                    server,
                    [missing[i] for i in idx],
                    job,
                    (nope_k, prefix_k),
                    prefix_keys,
                )
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
        chunks: Sequence[KeyedChunk],
        job: PreparedStore,
        forms: tuple[torch.Tensor | None, torch.Tensor | None],
        prefix_keys: set[bytes],
    ) -> tuple[int, int, int, int]:
        """Encode and Put ``chunks`` to ``server`` in batches; (stored, present, failed, bytes)."""
        # Discovery may have dropped the server since the keys were grouped.
        connection = self._connections.get(server)
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
        for batch in batches:
            blobs = await self._on_worker(self._encode, batch, job, forms, prefix_keys)
            results = await connection.put(blobs)
            for r, (_, blob) in zip(results, blobs, strict=True):
                if r.status is PutStatus.STORED:
                    stored += 1
                    nbytes += len(blob)
                elif r.status is PutStatus.ALREADY_PRESENT:
                    present += 1
                else:
                    failed += 1
                    if r.status is PutStatus.REJECTED:
                        log.error(
                            "nopecache: %s rejected block %s: %s", server, r.key.hex(), r.reason
                        )
        return stored, present, failed, nbytes

    def _encode(
        self,
        chunks: Sequence[KeyedChunk],
        job: PreparedStore,
        forms: tuple[torch.Tensor | None, torch.Tensor | None],
        prefix_keys: set[bytes],
    ) -> list[tuple[bytes, bytes]]:
        """Worker thread: the blobs of ``chunks``."""
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
            blob = encode_block(
                key=c.key.value,
                fingerprint=fp.to_bytes(),
                form=fp.form,
                k=k[:, s:e],
                v=None if job.v is None else job.v[:, s:e],
                token_ids=job.tokens[s:e].tolist(),
                source_positions=source,
            )
            out.append((c.key.value, blob))
        return out

    async def close(self) -> None:
        """Finish queued stores, close every connection and the worker thread."""
        await self.drain()
        if self._discovery is not None:
            await self._discovery.close()
        if self.shm is not None:
            await self.shm.close()  # DetachShm needs the channels: before they close
        await asyncio.gather(*(c.close() for c in self._connections.values()))
        # Joining the worker blocks: off the loop (it is idle after drain unless a fetch
        # is still running elsewhere).
        await asyncio.to_thread(self._worker.shutdown, True)

    async def __aenter__(self) -> AsyncCacheClient:
        self._in_loop()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncPrefetch:
    """A lookup and download started early; ``plan()`` and ``fetch(into)`` collect them."""

    def __init__(
        self, client: AsyncCacheClient, tokens: TokenArray, lookup: Coroutine[Any, Any, ReusePlan]
    ) -> None:
        self._client = client
        self._tokens = tokens
        self._download: Download | None = None
        self._task = asyncio.get_running_loop().create_task(self._run(lookup))

    async def _run(self, lookup: Coroutine[Any, Any, ReusePlan]) -> ReusePlan:
        plan = await lookup
        self._download = self._client._download(plan)
        return plan

    async def plan(self) -> ReusePlan:
        """The reuse plan (waits for the lookup only)."""
        return await asyncio.shield(self._task)

    async def fetch(self, into: PagedKV | None = None) -> FetchResult:
        """Place the downloaded blocks (waiting for those still arriving); once only."""
        plan = await self.plan()
        self._client._check_into(into, plan.num_tokens)
        assert self._download is not None
        return await self._download.place(self._tokens, into)

    def done(self) -> bool:
        """Whether lookup and download have both finished."""
        return self._task.done() and (self._download is None or self._download.task.done())

    def cancel(self) -> None:
        """Stop the lookup or download (a later fetch raises CancelledError)."""
        self._task.cancel()
        if self._download is not None:
            self._download.task.cancel()


# -- argument checks ---------------------------------------------------------------------
def _check_model(fingerprint: ModelFingerprint, rope: RopeSpec, v_head_dim: int) -> None:
    if not isinstance(fingerprint, ModelFingerprint):
        raise InvalidArgumentError(
            "fingerprint", f"must be a ModelFingerprint, got {type(fingerprint).__name__}"
        )
    if not isinstance(rope, RopeSpec):
        raise InvalidArgumentError("rope", f"must be a RopeSpec, got {type(rope).__name__}")
    if rope.digest() != fingerprint.rope_digest or rope.head_dim != fingerprint.head_dim:
        raise FingerprintMismatchError(
            "rope: this RopeSpec is not the one the fingerprint was made from"
        )
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, int) or v_head_dim < 0:
        raise InvalidArgumentError("v_head_dim", f"must be an int >= 0, got {v_head_dim!r}")
    if (v_head_dim == 0) != (fingerprint.form == StoredForm.MLA):
        raise InvalidArgumentError(
            "v_head_dim",
            f"must be 0 exactly for MLA models, got {v_head_dim} for {fingerprint.form.name}",
        )


def _check_kv(
    kv: tuple[torch.Tensor, torch.Tensor | None],
    fp: ModelFingerprint,
    v_head_dim: int,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(kv, tuple | list) or len(kv) != 2:
        raise InvalidArgumentError("kv", "must be a (k, v) pair")
    k, v = kv
    want = (fp.num_layers, num_tokens, fp.num_kv_heads)
    for name, t, dim in (("k", k, fp.head_dim), ("v", v, v_head_dim)):
        if name == "v" and v_head_dim == 0:
            if t is not None:
                raise InvalidArgumentError("kv", "v must be None for MLA (the latent holds it)")
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InvalidArgumentError(
                f"kv.{name}", f"must be a 4-D tensor [layers, tokens, kv_heads, dim], got {t!r:.60}"
            )
        if t.shape[1] != num_tokens:
            raise InvalidArgumentError(
                f"kv.{name}", f"{t.shape[1]} tokens, but {num_tokens} token ids were given"
            )
        if t.dtype != fp.torch_dtype or tuple(t.shape) != (*want, dim):
            raise FingerprintMismatchError(
                f"kv.{name}: {t.dtype} {list(t.shape)}, the model's is {fp.torch_dtype} "
                f"{[*want, dim]}"
            )
    return k, v


def _check_positions(positions: Positions, num_tokens: int) -> Positions:
    if isinstance(positions, bool) or not isinstance(positions, int | torch.Tensor):
        raise InvalidArgumentError(
            "positions", f"must be an int start or a 1-D int tensor, got {positions!r:.60}"
        )
    if isinstance(positions, int):
        if positions < 0:
            raise InvalidArgumentError("positions", f"must be >= 0, got {positions}")
        return positions
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape != (num_tokens,):
        raise InvalidArgumentError(
            "positions",
            f"must be int32/int64 of shape ({num_tokens},), got {positions.dtype} "
            f"{list(positions.shape)}",
        )
    if num_tokens and int(positions.min()) < 0:
        raise InvalidArgumentError("positions", "must all be >= 0")
    return positions


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
