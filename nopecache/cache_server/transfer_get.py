"""The rules of a Get (and of the key lists of Lookup and Delete), whichever transport.

Which keys: a packed key field (concatenated 16-byte keys) is checked (a whole number of
keys, at most ``max_keys_per_request``) and mapped into the caller's namespace
(:meth:`GetRules.keys`). What each key yields, in request order: its bytes and the code
of the tier that held it, or a miss (code 0). How the tiers are read, bounded by the
caller's lease of the in-flight budget (``inflight.py``), two ways:

* :meth:`GetRules.windows` (gRPC frames): ``TieredStore.get_many`` over windows of up to
  ``GET_WINDOW_KEYS`` keys (one Redis round trip for many small blocks), fewer once blocks
  turn out large, so that a stream holds about ``GET_WINDOW_BYTES`` at a time; the window
  is reserved in the lease while its blocks are sent.
* :meth:`GetRules.into` (the bulk byte stream): a block of the host-memory tier is lent
  (``TieredStore.lease``: views of its pages, which are not reused until it is sent);
  any other is copied by ``TieredStore.get_into`` into the connection's one send buffer
  (no blob allocated per block), which grows to the largest block seen. Each block is
  reserved in the lease while it is sent.

The codecs (``service.py``, ``bulk.py``) turn each entry into their frames; bytes sent
are counted here once the last entry is taken. With fault injection on (``faults.py``,
testing and staging only) each hit passes ``FaultInjector.tamper`` on its way out: it
may be delayed, answered as a miss, or replaced by a damaged copy (never the stored bytes).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import numpy as np

from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.faults import FaultInjector
from nopecache.cache_server.inflight import Lease
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.refusal import bad_request, over_limit
from nopecache.cache_server.store import TieredStore
from nopecache.cache_server.tenants import Tenant, namespaced_keys
from nopecache.proto.block import KEY_BYTES

__all__ = ["GET_WINDOW_BYTES", "GET_WINDOW_KEYS", "GetRules", "SendBuffer"]

# Keys fetched from the store per step of a Get stream: up to GET_WINDOW_KEYS (to batch a
# Redis round trip for small blocks), fewer once blocks turn out large, so that one stream
# holds about GET_WINDOW_BYTES of blocks at a time (and a block is framed while its bytes
# are still in cache, not after seven others were read).
GET_WINDOW_KEYS = 8
GET_WINDOW_BYTES = 8 * 1024 * 1024
_KEY_DTYPE = np.dtype(f"V{KEY_BYTES}")


class SendBuffer:
    """Where a bulk connection's current block is: ``parts``, views of its bytes in order
    (the tier's own pages under a read lease, or ``data``, the one buffer a block is
    copied into when the tier cannot lend its pages)."""

    __slots__ = ("data", "parts")

    def __init__(self) -> None:
        self.data = bytearray()
        self.parts: list[memoryview] = []


class GetRules:
    """Which keys a request names, and what reading them yields (module docstring)."""

    def __init__(
        self,
        store: TieredStore,
        config: ServerConfig,
        metrics: ServerMetrics,
        codes: dict[str | None, int],
        share_bytes: int,
        faults: FaultInjector | None = None,
    ) -> None:
        """Rules reading ``store``; ``codes`` numbers the tiers (a miss is 0),
        ``share_bytes`` is one client's share of the in-flight budget; ``faults``: what
        damages sent blocks (testing only; None: nothing)."""
        self._store = store
        self._faults = faults
        self._metrics = metrics
        self._max_keys = config.max_keys_per_request
        self._codes = codes
        # A window of the largest blocks must fit the client's in-flight share.
        self._most = max(1, min(GET_WINDOW_KEYS, share_bytes // config.max_block_bytes))
        # Tenant name -> [keys found, keys missed] by Gets since start (Admin.AdminStats).
        self.tally: dict[str, list[int]] = {}

    def check_count(self, count: int, field: str, noun: str = "keys") -> None:
        """Raise Refusal (OVER_LIMIT) when ``count`` keys are more than one request may name."""
        if count > self._max_keys:
            raise over_limit(
                "too_many_keys",
                f"{field}: {count} {noun} exceeds max_keys_per_request {self._max_keys}",
            )

    def keys(self, packed: bytes, field: str, namespace: bytes = b"") -> list[bytes]:
        """The keys of a packed key field as stored (prefixed with ``namespace``); raises
        Refusal when malformed or too many."""
        if len(packed) % KEY_BYTES:
            raise bad_request(
                "bad_keys",
                f"{field}: {len(packed)} bytes is not a multiple of the {KEY_BYTES}-byte key",
            )
        self.check_count(len(packed) // KEY_BYTES, field)
        if namespace:
            return namespaced_keys(namespace, packed)
        keys: list[bytes] = np.frombuffer(packed, dtype=_KEY_DTYPE).tolist()
        return keys

    async def windows(
        self, tenant: Tenant, keys: Sequence[bytes], lease: Lease
    ) -> AsyncGenerator[tuple[int, int, bytes | None], None]:
        """(index, tier code, bytes or None for a miss) per key, read a window at a time,
        each window reserved in ``lease`` until the next is read. Raises Refusal."""
        codes = self._codes
        sent = hits = 0
        start, window = 0, self._most
        while start < len(keys):
            lease.release()  # the previous window is sent
            found = await self._store.get_many(keys[start : start + window])
            await lease.reserve(sum(len(f[0]) for f in found if f), "GetFrame")
            for index, item in enumerate(found, start):
                if item is None:
                    yield index, 0, None
                    continue
                blob, tier = item
                if self._faults is not None:
                    tampered = await self._faults.tamper("get", blob)
                    if tampered is None:
                        yield index, 0, None
                        continue
                    blob = tampered
                sent += len(blob)
                hits += 1
                yield index, codes[tier], blob
            start += len(found)
            if sent:
                window = max(1, min(self._most, GET_WINDOW_BYTES * hits // sent))
        self._count(tenant, sent, hits, len(keys) - hits)

    async def lent(
        self, tenant: Tenant, keys: Sequence[bytes], lease: Lease
    ) -> AsyncGenerator[tuple[int, int, list[memoryview] | bytes | None], None]:
        """``windows`` one key at a time, a block of the host-memory tier lent rather
        than read: (index, tier code, the views of its pages) valid until the next entry
        is asked for (``TieredStore.lease``; the shared-memory Get copies them straight
        into the client's segment). Raises Refusal."""
        sent = hits = 0
        for index, key in enumerate(keys):
            lent = self._store.lease(key)
            if lent is None:
                found = (await self._store.get_many([key]))[0]
                if found is None:
                    yield index, 0, None
                    continue
                blob, tier = found
                if self._faults is not None:
                    tampered = await self._faults.tamper("get", blob)
                    if tampered is None:
                        yield index, 0, None
                        continue
                    blob = tampered
                await lease.reserve(len(blob), "GetFrame")
                sent += len(blob)
                hits += 1
                yield index, self._codes[tier], blob
                lease.release()
                continue
            tier_lease, tier = lent
            try:
                views: list[memoryview] | bytes = tier_lease.views
                if self._faults is not None:
                    out = await self._faults.tamper("get", views)
                    if out is None:
                        yield index, 0, None
                        continue
                    views = out  # the pages, or a damaged copy of them
                await lease.reserve(tier_lease.size, "GetFrame")
                sent += tier_lease.size
                hits += 1
                yield index, self._codes[tier], views
            finally:
                tier_lease.release()
                lease.release()
        self._count(tenant, sent, hits, len(keys) - hits)

    async def into(
        self, tenant: Tenant, keys: Sequence[bytes], lease: Lease, buffer: SendBuffer
    ) -> AsyncGenerator[tuple[int, int], None]:
        """(tier code, size) per key, its bytes in ``buffer.parts`` (0, 0 for a miss)
        until the next entry is asked for; each block reserved in ``lease`` while it is
        taken. Raises Refusal.

        A block of the host-memory tier is lent, not copied: ``parts`` are views of its
        pages under a tier read lease (no page of it is reused until the next entry is
        asked for), so its bytes go from the pool to the socket with no copy here."""
        sent = hits = 0
        for key in keys:
            lent = self._store.lease(key)
            if lent is not None:
                tier_lease, tier = lent
                try:
                    await lease.reserve(tier_lease.size, "bulk GET")
                    buffer.parts = tier_lease.views
                    size = await self._tamper_bulk(buffer, tier_lease.size)
                    yield (self._codes[tier] if size else 0), size
                finally:
                    buffer.parts = []
                    tier_lease.release()
                    lease.release()
                sent += size
                hits += size > 0  # 0: dropped by an injected fault
                continue
            found = await self._store.get_into(key, memoryview(buffer.data))
            if found is not None and found[0] > len(buffer.data):
                # Grown to the largest block seen (within the budget), then reused for
                # every later one.
                await lease.reserve(found[0], "bulk GET")
                buffer.data = bytearray(found[0])
                found = await self._store.get_into(key, memoryview(buffer.data))
            if found is None:
                lease.release()
                yield 0, 0
                continue
            size, tier = found
            await lease.reserve(size - lease.held_bytes, "bulk GET")
            buffer.parts = [memoryview(buffer.data)[:size]]
            size = await self._tamper_bulk(buffer, size)
            yield (self._codes[tier] if size else 0), size
            buffer.parts = []
            lease.release()
            sent += size
            hits += size > 0
        self._count(tenant, sent, hits, len(keys) - hits)

    async def _tamper_bulk(self, buffer: SendBuffer, size: int) -> int:
        """The size of the block to send from ``buffer`` once faults had their turn: 0
        (``parts`` emptied) for a drop, a damaged copy's size (``parts`` now views it)."""
        if self._faults is None:
            return size
        tampered = await self._faults.tamper("bulk", buffer.parts)
        if tampered is None:
            buffer.parts = []
            return 0
        if isinstance(tampered, bytes):  # a damaged copy, never the pages or the buffer
            buffer.parts = [memoryview(tampered)]
            return len(tampered)
        return size

    def _count(self, tenant: Tenant, sent: int, hits: int, misses: int) -> None:
        self._metrics.get_bytes(sent)
        self._metrics.tenant_get_bytes(tenant.name, sent)
        tally = self.tally.setdefault(tenant.name, [0, 0])
        tally[0] += hits
        tally[1] += misses
