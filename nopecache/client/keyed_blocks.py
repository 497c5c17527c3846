"""Blocks under keys the caller computed: the client for engines that key pages themselves.

:class:`~nopecache.client.CacheClient` chunks token ids, derives keys, converts K and places
blocks into a paged cache. An engine that already hashes its own pages (SGLang's HiCache
hands a storage backend chained page hashes, never token ids) needs less: put these blobs
under these keys, say which keys exist, stream these keys' blobs into my buffers.
:class:`KeyedBlockClient` is that, over the same :class:`ServerConnection`\\ s, sharding
ring, shared-memory fast path and bulk byte stream as the full client::

    engine threads                          "nopecache-blocks" thread (one event loop)
    --------------                          -----------------------------------------
    exists(keys)     -- submit, wait -->    one Lookup per owner server, in parallel
    put(blobs)       -- submit, wait -->    one Put stream per owner, in parallel
    get(keys, sink)  -- submit, wait -->    one Get stream per owner; sink(i, view) is
                                            called on this thread as each block lands

Failures are misses, as everywhere in the client: a down, slow or hung server answers
False / FAILED / a key never handed to ``sink`` within the config's timeouts
(``lookup_timeout_s``, ``put_timeout_s``, ``get_timeout_s``; ``connect_timeout_s`` bounds
the first contact). Bad arguments raise :class:`InvalidArgumentError` at once.

Thread-safe: every method may be called from any thread but the client's own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from nopecache.client.bulk import BulkSource
from nopecache.client.config import ClientConfig
from nopecache.client.cuda_arena import host_view
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.metrics import ClientMetrics
from nopecache.client.sharding import Rendezvous
from nopecache.client.shm import ShmFastPath
from nopecache.client.transport import (
    BufferPool,
    ServerConnection,
    StoreResult,
    StoreStatus,
)
from nopecache.proto.block import KEY_BYTES
from nopecache.proto.frames import BytesLike

__all__ = ["BlockSink", "KeyedBlockClient", "StoreResult", "StoreStatus"]

T = TypeVar("T")

BlockSink = Callable[[int, memoryview], bool]
"""Called with ``(index into keys, blob)`` for every block received; returns whether the
block was taken. The view is valid only during the call."""


def _check_keys(keys: Sequence[bytes]) -> None:
    for key in keys:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidArgumentError("keys", f"every key must be {KEY_BYTES} bytes, got {key!r}")


class KeyedBlockClient:
    """Synchronous exists / put / get / delete of blobs under explicit keys (module doc)."""

    def __init__(self, config: ClientConfig | str, *, metrics: ClientMetrics | None = None):
        """A client of the servers in ``config`` (a ClientConfig or a nopecache:// URL).

        Nothing is contacted here: the first call opens channels (a down server is then a
        miss, not an error)."""
        if isinstance(config, str):
            config = ClientConfig.from_url(config)
        if not isinstance(config, ClientConfig):
            raise InvalidArgumentError("config", f"must be a ClientConfig or URL, got {config!r}")
        if config.discover != "off":
            raise InvalidArgumentError("discover", "KeyedBlockClient shards over fixed servers")
        self.config = config
        self.metrics = ClientMetrics() if metrics is None else metrics
        self.ring = Rendezvous(config.servers)
        self._pool = BufferPool()
        self._shm = (
            ShmFastPath(config.shm, zero_copy=config.zero_copy) if config.shm != "off" else None
        )
        data_path = BulkSource if config.bulk == "auto" and not config.use_tls else None
        # Channels are bound to the loop that creates them: built lazily, on the loop.
        self._connections = {
            s: ServerConnection(
                s,
                config,
                metrics=self.metrics,
                fast_path=self._shm,
                pool=self._pool,
                data_path=data_path,
            )
            for s in self.ring.servers
        }
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="nopecache-blocks", daemon=True
        )
        self._thread.start()
        self._closed = False

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise InvalidArgumentError("KeyedBlockClient", "is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise InvalidArgumentError("KeyedBlockClient", "called from its own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- calls --------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys their owners hold (one Lookup per owner; a failed server: False)."""
        _check_keys(keys)
        if not keys:
            return []
        return self._call(self._exists(list(keys)))

    async def _exists(self, keys: list[bytes]) -> list[bool]:
        groups = self.ring.group(keys)
        answers = await asyncio.gather(
            *(
                self._connections[s].lookup(b"".join(keys[i] for i in idx))
                for s, idx in groups.items()
            )
        )
        present = [False] * len(keys)
        for idx, codes in zip(groups.values(), answers, strict=True):
            for i, code in zip(idx, codes, strict=True):
                present[i] = code != 0
        return present

    def put(self, blobs: Sequence[tuple[bytes, BytesLike]]) -> list[StoreResult]:
        """Store ``(key, blob)`` pairs on their owners; one result per pair, in order.

        The blobs are read while the call runs (keep them unchanged until it returns)."""
        _check_keys([k for k, _ in blobs])
        if not blobs:
            return []
        return self._call(self._put(list(blobs)))

    async def _put(self, blobs: list[tuple[bytes, BytesLike]]) -> list[StoreResult]:
        groups = self.ring.group([k for k, _ in blobs])
        answers = await asyncio.gather(
            *(self._connections[s].put([blobs[i] for i in idx]) for s, idx in groups.items())
        )
        results: list[StoreResult | None] = [None] * len(blobs)
        for idx, rs in zip(groups.values(), answers, strict=True):
            for i, r in zip(idx, rs, strict=True):
                results[i] = r
        return [r for r in results if r is not None]

    def get(self, keys: Sequence[bytes], sink: BlockSink) -> list[bool]:
        """Stream the blobs of ``keys`` into ``sink`` (on the client's thread, as each
        arrives); per key, whether ``sink`` took it (a miss or failed server: False)."""
        _check_keys(keys)
        if not keys:
            return []
        return self._call(self._get(list(keys), sink))

    async def _get(self, keys: list[bytes], sink: BlockSink) -> list[bool]:
        taken = [False] * len(keys)

        async def one(server: str, idx: list[int]) -> None:
            blocks = self._connections[server].get(b"".join(keys[i] for i in idx))
            try:
                async for n, blob in blocks:
                    if blob is None:
                        continue
                    host = host_view(blob)  # a block in a server's GPU pool comes over
                    try:
                        taken[idx[n]] = sink(idx[n], host)
                    finally:
                        self._pool.give(host)
            finally:
                await blocks.aclose()  # type: ignore[attr-defined]

        await asyncio.gather(*(one(s, idx) for s, idx in self.ring.group(keys).items()))
        return taken

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` from their owners; how many were stored (failed servers: 0)."""
        _check_keys(keys)
        if not keys:
            return 0
        return self._call(self._delete(list(keys)))

    async def _delete(self, keys: list[bytes]) -> int:
        groups = self.ring.group(keys)
        counts = await asyncio.gather(
            *(
                self._connections[s].delete(b"".join(keys[i] for i in idx))
                for s, idx in groups.items()
            )
        )
        return sum(counts)

    def close(self) -> None:
        """Close every connection and stop the client's thread (idempotent)."""
        if self._closed:
            return
        try:
            self._call(self._close())
        finally:
            self._closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    async def _close(self) -> None:
        if self._shm is not None:
            await self._shm.close()  # DetachShm needs the channels: before they close
        await asyncio.gather(*(c.close() for c in self._connections.values()))

    def __enter__(self) -> KeyedBlockClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
