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
import time
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any

import torch

from nopecache.client.bulk import BulkSource
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
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fetching import BlockPlacer, Download, FetchResult
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.identity import InputIdentity
from nopecache.client.keyplan import KeyPlanner
from nopecache.client.keys import Namespace
from nopecache.client.metrics import ClientMetrics, ClientStats
from nopecache.client.placement import PagedKV
from nopecache.client.plan import ReusePlan, plan_reuse
from nopecache.client.sharding import Rendezvous
from nopecache.client.shm import ShmFastPath
from nopecache.client.storing import KForm, PreparedStore, StorePipeline, StoreReport, StoreRoute
from nopecache.client.transport import BufferPool, FastPathFactory, ServerConnection
from nopecache.client.validation import (
    check_fetch,
    check_into,
    check_kv,
    check_model,
    check_positions,
)
from nopecache.client.warmup import warm_client
from nopecache.kernels import RopeSpec
from nopecache.kernels.api import Positions
from nopecache.proto.allocator import tune_malloc_once

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
        check_model(fingerprint, rope, v_head_dim)
        if config.kv_codec != "none":
            # Compact blocks are another stored form: keyed apart from the engine's dtype.
            fingerprint = replace(fingerprint, codec=config.kv_codec)
        if prefix_block_tokens is None:
            prefix_block_tokens = config.prefix_block_tokens
        if chunker is None:
            chunker = config.content_chunker()
        if resolver is not None and config.discover != "dns":
            raise InvalidArgumentError("resolver", "is only used with discover='dns'")
        if isinstance(prefix_block_tokens, bool) or not isinstance(prefix_block_tokens, int):
            raise InvalidArgumentError("prefix_block_tokens", "must be an int")
        # The server's glibc allocator setting, for this process too (proto/allocator.py):
        # freed block-sized buffers stay for reuse instead of page-faulting in anew.
        tune_malloc_once()
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
            fast_path = self.shm = ShmFastPath(config.shm, zero_copy=config.zero_copy)
        self._fast_path = fast_path
        # The bulk byte stream carries Get payloads when the server offers it (plaintext).
        self._data_path = BulkSource if config.bulk == "auto" and not config.use_tls else None
        self._connections = {s: self._connect(s) for s in config.servers}
        self._placer = BlockPlacer(fingerprint, self.pi_fingerprint, rope, v_head_dim, self.metrics)
        # One worker: placements run one at a time (torch parallelises each op itself).
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nopecache")
        self._stores = StorePipeline(
            fingerprint=fingerprint,
            pi_fingerprint=self.pi_fingerprint,
            rope=rope,
            bytes_per_token=self._bytes_per_token,
            metrics=self.metrics,
            queue_blocks=config.store_queue_blocks,
            route=lambda: StoreRoute(self.ring, self._connections),
            present=self._present,
            on_worker=self._on_worker,
        )
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
            data_path=self._data_path,
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
        """The client's counters (hits by kind, dropped hits, bytes, failures) and the cost
        model's estimates and last decision per server (``cost``)."""
        return replace(self.metrics.snapshot(), cost=self.cost.snapshot())

    async def warm(self) -> None:
        """Connect to every server, prepare its fast path, pre-fault receive buffers and
        run the placement path once (client/warmup.py); a down server stays down."""
        self._in_loop()
        if self._discovery is not None:
            await self._discovery.start()
        block_bytes = self.prefix_chunker.size * self._bytes_per_token
        await warm_client(
            list(self._connections.values()), self._pool, block_bytes, self._placer, self._on_worker
        )

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Report that the engine prefilled ``tokens`` in ``seconds`` (for the cost model)."""
        self.cost.observe_prefill(tokens, seconds)

    def _in_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._stores.bind(loop)
        elif self._loop is not loop:
            raise InvalidArgumentError("loop", "an AsyncCacheClient is bound to one event loop")
        return loop

    async def _on_worker(self, fn: Any, *args: Any) -> Any:
        return await self._in_loop().run_in_executor(self._worker, fn, *args)

    # -- keys (self.keying: keyplan.py) ----------------------------------------------------
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
        identity: InputIdentity | None = None,
    ) -> ReusePlan:
        """The reuse plan of a prompt: exact prefix, position-independent hits, misses.

        Hits the cost model finds slower to fetch than to recompute are in ``dropped``.
        ``identity``: what beside the tokens shapes their KV (adapter, salt, images:
        ``identity.py``); blocks are found only under the same identity.
        """
        self._in_loop()
        start = time.perf_counter()
        arr = token_array(tokens)
        chunker = self.keying.pi_chunker(chunking, segments)
        pre, pi = self.keying.keys(
            arr, namespace, chunker, prefix=True, pi=allow_position_independent, identity=identity
        )
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
        check_into(into, self.fingerprint, self.v_head_dim, num_tokens)

    async def fetch(
        self, plan: ReusePlan, tokens: TokenIds, *, into: PagedKV | None = None
    ) -> FetchResult:
        """Fetch the plan's blocks, verify each against ``tokens``, and place it.

        With ``into`` the KV lands in the engine's paged cache (a hit whose positions all
        have slot -1 there is not fetched); without, in new contiguous tensors (see
        FetchResult). A block that is missing or fails verification is a
        miss (in ``failed``), never an exception.
        """
        self._in_loop()
        arr = self._check_fetch(plan, tokens, into)
        return await self._download(plan, into).place(arr, into)

    def _download(self, plan: ReusePlan, into: PagedKV | None = None) -> Download:
        """Start the Get streams of ``plan`` (on the running loop); with ``into``, of the
        hits that land in it only."""
        return Download(
            plan, self.ring, self._connections, self._placer, self._worker, self._pool, into
        )

    def _check_fetch(self, plan: ReusePlan, tokens: TokenIds, into: PagedKV | None) -> TokenArray:
        return check_fetch(plan, tokens, into, self.fingerprint, self.v_head_dim)

    def prefetch(
        self,
        tokens: TokenIds,
        *,
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        allow_position_independent: bool = True,
        identity: InputIdentity | None = None,
    ) -> AsyncPrefetch:
        """Start lookup and download in the background as soon as the prompt is known."""
        self._in_loop()
        arr = token_array(tokens)
        self.keying.pi_chunker(chunking, segments)  # bad arguments raise here, not in the task
        return AsyncPrefetch(
            self,
            arr,
            self.lookup(
                arr,
                chunking=chunking,
                segments=segments,
                namespace=namespace,
                allow_position_independent=allow_position_independent,
                identity=identity,
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
        identity: InputIdentity | None = None,
        prefix_end: int | None = None,
    ) -> PreparedStore:
        """Validate a store and compute its keys (any thread; raises on bad arguments)."""
        arr = token_array(tokens)
        k, v = check_kv(kv, self.fingerprint, self.v_head_dim, len(arr))
        if form not in ("nope", "rope"):
            raise InvalidArgumentError("form", f"must be 'nope' or 'rope', got {form!r}")
        positions = check_positions(positions, len(arr))
        chunker = self.keying.pi_chunker(chunking, segments)
        pre, pi = self.keying.keys(
            arr,
            namespace,
            chunker,
            prefix=prefix,
            pi=position_independent,
            identity=identity,
            prefix_end=prefix_end,
        )
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
        identity: InputIdentity | None = None,
        prefix_end: int | None = None,
    ) -> StoreReport:
        """Store the KV of ``tokens`` computed at ``positions`` (an int start or a tensor).

        ``prefix_end``: exact-prefix keys only for the blocks ending at or before it; the
        tokens after it get content keys only (their KV is approximate: it attended to
        reused position-independent KV). None: the whole prompt.

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
            identity=identity,
            prefix_end=prefix_end,
        )
        if wait:
            return await self.store_prepared(job)
        return self.enqueue_store(job)

    def enqueue_store(self, job: PreparedStore) -> StoreReport:
        """Queue a prepared store for the background (thread-safe; never blocks)."""
        return self._stores.enqueue(job)

    async def drain(self) -> None:
        """Wait until every queued store has finished."""
        await self._stores.drain()

    async def store_prepared(self, job: PreparedStore) -> StoreReport:
        """Run a prepared store now: Lookup, convert K, encode and Put what is missing."""
        self._in_loop()
        return await self._stores.run(job)

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
        await self.warm()
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
