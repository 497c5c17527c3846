"""The synchronous client: :class:`AsyncCacheClient` on a background event-loop thread.

::

    engine threads                      "nopecache-client" thread
    --------------                      -------------------------
    client.lookup(tokens) -- submit --> loop: AsyncCacheClient.lookup
                          <-- result --
    client.store(..., wait=False):      validates and hashes on the calling thread,
                                        then queues; never waits for the network
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from nopecache.client.cache_client import (
    AsyncCacheClient,
    AsyncPrefetch,
    KForm,
    StoreReport,
)
from nopecache.client.chunking import Chunker, TokenIds
from nopecache.client.config import ClientConfig
from nopecache.client.discovery import Resolver
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fetching import FetchResult
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.identity import InputIdentity
from nopecache.client.keys import Namespace
from nopecache.client.metrics import ClientMetrics, ClientStats
from nopecache.client.placement import PagedKV
from nopecache.client.plan import ReusePlan
from nopecache.client.transport import FastPathFactory
from nopecache.kernels import RopeSpec
from nopecache.kernels.api import Positions

__all__ = ["CacheClient", "Prefetch"]

T = TypeVar("T")


class CacheClient:
    """Synchronous facade over :class:`AsyncCacheClient`: same methods, blocking.

    Thread-safe: the async client lives on one background thread running an event loop,
    and each call here submits a coroutine to it and waits. ``store(wait=False)``
    validates and computes keys on the calling thread, then queues the rest without
    waiting. Do not call it from inside the client's own loop. ``close()`` (or a ``with``
    block) finishes queued stores and stops the thread.
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
        warm: bool = True,
    ) -> None:
        """A client of the servers in ``config`` (a ClientConfig or a nopecache:// URL);
        the arguments are :class:`AsyncCacheClient`'s. With ``warm`` (the default) the
        constructor returns once channels, buffers and the placement path are warm
        (:meth:`AsyncCacheClient.warm`), so the first fetch is not the slowest."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="nopecache-client", daemon=True
        )
        self._thread.start()
        self._closed = False

        async def make() -> AsyncCacheClient:
            client = AsyncCacheClient(
                config,
                fingerprint=fingerprint,
                rope=rope,
                v_head_dim=v_head_dim,
                prefix_block_tokens=prefix_block_tokens,
                chunker=chunker,
                metrics=metrics,
                fast_path=fast_path,
                resolver=resolver,
            )
            client._in_loop()
            if warm:
                await client.warm()
            return client

        try:
            self._core = self._call(make())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def core(self) -> AsyncCacheClient:
        """The async client behind this facade (use it only on its loop)."""
        return self._core

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise InvalidArgumentError("CacheClient", "called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def lookup(
        self,
        tokens: TokenIds,
        *,
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        allow_position_independent: bool = True,
        identity: InputIdentity | None = None,
    ) -> ReusePlan:
        """See :meth:`AsyncCacheClient.lookup`."""
        return self._call(
            self._core.lookup(
                tokens,
                chunking=chunking,
                segments=segments,
                namespace=namespace,
                allow_position_independent=allow_position_independent,
                identity=identity,
            )
        )

    def submit_lookup(
        self,
        tokens: TokenIds,
        *,
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        allow_position_independent: bool = True,
        identity: InputIdentity | None = None,
    ) -> concurrent.futures.Future[ReusePlan]:
        """Start :meth:`lookup` on the client's loop and return at once: its future.

        For callers that must not wait on the network (an engine's scheduler asks again
        on a later step). The future raises what ``lookup`` raises; cancelling it cancels
        the lookup.
        """
        if threading.current_thread() is self._thread:
            raise InvalidArgumentError("CacheClient", "called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(
            self._core.lookup(
                tokens,
                chunking=chunking,
                segments=segments,
                namespace=namespace,
                allow_position_independent=allow_position_independent,
                identity=identity,
            ),
            self._loop,
        )

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` (one of :attr:`core`'s) on the client's loop; its future, at once."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise InvalidArgumentError("CacheClient", "called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def fetch(
        self, plan: ReusePlan, tokens: TokenIds, *, into: PagedKV | None = None
    ) -> FetchResult:
        """See :meth:`AsyncCacheClient.fetch`."""
        return self._call(self._core.fetch(plan, tokens, into=into))

    def store(
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
        """See :meth:`AsyncCacheClient.store`; ``wait=False`` never blocks on the network."""
        job = self._core.prepare_store(
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
        if not wait:
            return self._core.enqueue_store(job)
        return self._call(self._core.store_prepared(job))

    def submit_store(
        self,
        tokens: TokenIds,
        kv: tuple[torch.Tensor, torch.Tensor | None],
        positions: Positions = 0,
        *,
        form: KForm = "nope",
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        position_independent: bool = True,
        identity: InputIdentity | None = None,
        prefix_end: int | None = None,
    ) -> concurrent.futures.Future[StoreReport]:
        """Start :meth:`store` on the client's loop and return at once: a future that
        completes when the servers acknowledged it (outside the store queue's budget:
        the caller holds what the store needs until then)."""
        job = self._core.prepare_store(
            tokens,
            kv,
            positions,
            form=form,
            segments=segments,
            namespace=namespace,
            position_independent=position_independent,
            identity=identity,
            prefix_end=prefix_end,
        )
        return self.submit(self._core.store_prepared(job))

    def prefetch(
        self,
        tokens: TokenIds,
        *,
        chunking: Chunker | None = None,
        segments: Sequence[int] | None = None,
        namespace: Namespace | None = None,
        allow_position_independent: bool = True,
        identity: InputIdentity | None = None,
    ) -> Prefetch:
        """See :meth:`AsyncCacheClient.prefetch`; returns without waiting."""

        async def start() -> AsyncPrefetch:
            return self._core.prefetch(
                tokens,
                chunking=chunking,
                segments=segments,
                namespace=namespace,
                allow_position_independent=allow_position_independent,
                identity=identity,
            )

        return Prefetch(self, self._call(start()))

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers keys are sharded over now (sorted)."""
        return self._core.servers

    def set_servers(self, servers: Sequence[str]) -> None:
        """See :meth:`AsyncCacheClient.set_servers`."""
        self._call(self._core.set_servers(servers))

    def refresh_servers(self) -> tuple[str, ...]:
        """See :meth:`AsyncCacheClient.refresh_servers`."""
        return self._call(self._core.refresh_servers())

    def drain(self) -> None:
        """Wait until every queued store has finished."""
        self._call(self._core.drain())

    def stats(self) -> ClientStats:
        """The client's counters."""
        return self._core.stats()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Report an engine prefill time (for the cost model)."""
        self._core.observe_prefill(tokens, seconds)

    def close(self) -> None:
        """Finish queued stores, close connections, stop the loop thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._core.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Prefetch:
    """The synchronous handle of :meth:`CacheClient.prefetch`."""

    def __init__(self, client: CacheClient, handle: AsyncPrefetch) -> None:
        self._client = client
        self._handle = handle

    def plan(self) -> ReusePlan:
        """The reuse plan (waits for the lookup only)."""
        return self._client._call(self._handle.plan())

    def fetch(self, into: PagedKV | None = None) -> FetchResult:
        """Place the downloaded blocks; see :meth:`AsyncPrefetch.fetch`."""
        return self._client._call(self._handle.fetch(into))

    def done(self) -> bool:
        """Whether lookup and download have both finished."""
        return self._handle.done()

    def cancel(self) -> None:
        """Stop the lookup or download."""
        self._client._loop.call_soon_threadsafe(self._handle.cancel)
