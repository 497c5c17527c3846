"""The removal feed: which keys left the cache, for the clients that watch (WatchRemovals).

An engine that announces what the shared cache holds (vLLM's KV events, which routers
such as Dynamo and llm-d index) must withdraw a block once the cache no longer has it.
Lookups that happen to miss see it late or never; this feed tells every watcher at once::

    store drops a key (evicted from the last tier holding it)  ─┐
    Delete of keys                                              ├─> gone(stored keys)
    Admin Flush of a namespace (or of everything)               ──> cleared(prefix)
                                                                     │
        one bounded queue per watcher, filled without awaiting  <───┘
        WatchRemovals streams its queue: RemovalEvent(keys | cleared | lost)

Keys stay in their tenant's namespace: a watcher hears only stored keys under its own
namespace prefix, sent back as the 16-byte client keys it knows (the anonymous tenant's
prefix is empty). A watcher that falls :data:`QUEUE_EVENTS` events behind loses what is
queued and gets one ``lost`` event instead (any key may be gone: it must withdraw all),
so a stalled client never makes the server hold memory without bound. Redis evicting by
itself (its own maxmemory policy) reports nothing, so it is not in the feed.

Concurrency: the server's one event loop calls everything here; ``put_nowait`` never
awaits, so the store's eviction path is never slowed by a watcher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from nopecache.proto.block import KEY_BYTES

__all__ = ["QUEUE_EVENTS", "Removal", "RemovalFeed", "Watcher"]

QUEUE_EVENTS = 4096
"""Events a watcher may fall behind before it gets ``lost`` (each holds up to one store
call's keys: thousands of keys)."""


@dataclass(frozen=True, slots=True)
class Removal:
    """One event of the feed: client keys gone, the namespace cleared, or events lost."""

    keys: bytes = b""  # packed 16-byte client keys
    cleared: bool = False
    lost: bool = False


class Watcher:
    """One WatchRemovals call: the namespace it watches and its queue of events."""

    def __init__(self, namespace: bytes, limit: int) -> None:
        self.namespace = namespace
        self._queue: asyncio.Queue[Removal] = asyncio.Queue(maxsize=limit)

    def offer(self, event: Removal) -> None:
        """Queue ``event``; past the limit, drop the queue for one ``lost`` event."""
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(Removal(lost=True))

    async def next(self) -> Removal:
        """The next event (waits for one)."""
        return await self._queue.get()

    def pending(self) -> int:
        """Events queued and not yet taken."""
        return self._queue.qsize()


class RemovalFeed:
    """Fans removals out to the watchers (see the module docstring)."""

    def __init__(self, limit: int = QUEUE_EVENTS) -> None:
        self._limit = limit
        self._watchers: list[Watcher] = []

    def watch(self, namespace: bytes) -> Watcher:
        """A new watcher of ``namespace``'s removals (call :meth:`unwatch` when done)."""
        watcher = Watcher(namespace, self._limit)
        self._watchers.append(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        """Stop feeding ``watcher``."""
        self._watchers.remove(watcher)

    @property
    def watchers(self) -> int:
        """How many watchers are open."""
        return len(self._watchers)

    def gone(self, stored_keys: Sequence[bytes]) -> None:
        """``stored_keys`` (namespaced) are held by no tier any more."""
        if not stored_keys or not self._watchers:
            return
        for watcher in self._watchers:
            ns = watcher.namespace
            width = len(ns) + KEY_BYTES
            mine = [k[len(ns) :] for k in stored_keys if len(k) == width and k.startswith(ns)]
            if mine:
                watcher.offer(Removal(keys=b"".join(mine)))

    def cleared(self, prefix: bytes) -> None:
        """Every key under ``prefix`` was deleted (b"": every namespace)."""
        for watcher in self._watchers:
            if watcher.namespace.startswith(prefix):
                watcher.offer(Removal(cleared=True))
