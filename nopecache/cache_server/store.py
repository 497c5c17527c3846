"""The tier chain: lookup top-down, promotion on hit, demotion on eviction, write-through.

::

    put ──> tier 0 (cpu) ──evict──> tier 1 (disk) ──evict──> tier 2 (redis) ──> dropped
              ^                        |                        |
              └──────── promote on get (a hit below the top is copied to tier 0) ┘
    write_through: every newly stored block also goes to the last tier (shared by replicas)

The hierarchy is *inclusive* on the way up: a promoted block keeps its copy below, so a
promotion from a Redis shared by several replicas never takes the block away from the
others, and demoting it later costs nothing (the lower tier answers ALREADY_PRESENT).
A blob larger than a tier's ``max_blob_bytes`` skips that tier (put, promotion and
demotion go to the nearest tier that can hold it).

With ``write_through`` the last tier already received every block when it was first
stored (or was the source of its promotion), so neither a repeated put nor an eviction
from the tier just above it resends the block: it is dropped there, which saves an lz4
compression and a network round trip per eviction.

Demotion happens inline, before ``put``/``get`` return: a full tier's evictions are
written below while the caller waits. That is the backpressure that keeps memory
bounded - a background queue of evicted blobs would grow without limit when Redis is
slower than the clients.

Lower tiers are checked: a blob read from a tier that is not ``trusted`` (Redis, which
other processes write) goes through ``verify`` (the service's BlockVerifier: header and
payload checksums, sizes, the key) before it is served or promoted. A blob that fails is
deleted from that tier, counted (``on_corrupt``) and answered as a miss, so a later Put
of the key can store a good copy.

Drops: a block evicted from the last memory tier that holds it and kept nowhere below is
gone; ``drop_listeners`` hear its key (the quota ledger releases its charge).

Concurrency: one event loop; no lock. Every tier operation is atomic on its own (the
memory tiers never await mid-operation, Redis applies each command atomically). The
store's own state is ``_moving`` and ``_doomed`` (plain dicts/sets, changed only between
awaits): the keys currently travelling between tiers (read below for promotion, or
evicted and being written below), and those of them a ``delete`` hit while they
travelled. A travelling key that was deleted is deleted again from where it landed, so
a delete racing with a promotion or demotion cannot bring the block back. A lookup
during a move may see a miss: a normal cache outcome.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from nopecache.cache_server.tiers import Tier, TierConfigError, TierName, TierStats, tier_from_url
from nopecache.cache_server.tiers.base import BlobLike, Evicted, KeepSet, PutStatus, check_key
from nopecache.cache_server.tiers.cpu import PagedTier, TierLease

__all__ = [
    "NULL_OBSERVER",
    "BlobTooLargeError",
    "PutOutcome",
    "StoreObserver",
    "TieredStore",
]


log = logging.getLogger(__name__)

# (stored key, blob) -> why the blob is not that key's valid block, or None.
BlobVerifier = Callable[[bytes, bytes], Awaitable[str | None]]
DropListener = Callable[[Sequence[bytes]], None]


class PutOutcome(enum.Enum):
    """What ``TieredStore.put`` did."""

    STORED = "stored"
    ALREADY_PRESENT = "already_present"
    # Every tier that could hold the blob is unreachable (only Redis can be): not stored.
    UNAVAILABLE = "unavailable"
    # The tiers that could hold the blob are full of pinned blocks: not stored.
    FULL = "full"


class _Moved(enum.Enum):
    """What moving one block between tiers did."""

    YES = "moved"
    NO = "not stored there"
    # A delete hit the key while it travelled: it must land nowhere.
    DELETED = "deleted"


class BlobTooLargeError(ValueError):
    """A blob exceeds what every tier can hold (the service answers RESOURCE_EXHAUSTED)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"blob: {size} bytes exceeds the largest tier limit of {limit} bytes")
        self.size = size
        self.limit = limit


class StoreObserver(Protocol):
    """Receives store events (for metrics); every method defaults to doing nothing.

    Called synchronously on the event loop: implementations must not block. Hits and
    misses count ``get``/``get_many`` keys only; ``lookup`` is a query and reports nothing.
    """

    def on_hit(self, tier: TierName) -> None:
        """A ``get`` found a key in ``tier``."""
        return None

    def on_miss(self) -> None:
        """A ``get`` found a key in no tier."""
        return None

    def on_eviction(self, tier: TierName) -> None:
        """``tier`` evicted an entry to make room."""
        return None

    def on_demotion(self, src: TierName, dst: TierName) -> None:
        """An entry evicted from ``src`` now lives in ``dst``."""
        return None

    def on_promotion(self, src: TierName, dst: TierName) -> None:
        """An entry found in ``src`` was copied up to ``dst``."""
        return None

    def on_tier_health(self, tier: TierName, healthy: bool) -> None:
        """``tier`` became reachable (``healthy``) or unreachable."""
        return None

    def on_corrupt(self, tier: TierName, count: int) -> None:
        """``count`` blobs read from ``tier`` failed verification (deleted there)."""
        return None


class _NullObserver(StoreObserver):
    """The default observer: ignores everything."""


NULL_OBSERVER: StoreObserver = _NullObserver()


class TieredStore:
    """A chain of tiers, fastest first, behind one async key -> blob interface."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_through: bool = False,
        observer: StoreObserver | None = None,
        verify: BlobVerifier | None = None,
    ) -> None:
        if not tiers:
            raise TierConfigError("tiers: at least one tier is required")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise TierConfigError(f"tiers: each tier kind may appear once, got {names}")
        self._tiers = tuple(tiers)
        self._write_through = write_through and len(tiers) > 1
        self._observer = observer or NULL_OBSERVER
        self._health = [t.healthy for t in tiers]
        self._moving: dict[bytes, int] = {}
        self._doomed: set[bytes] = set()
        self._verify = verify
        self.drop_listeners: list[DropListener] = []

    @classmethod
    def from_urls(
        cls,
        urls: Iterable[str],
        *,
        write_through: bool = False,
        observer: StoreObserver | None = None,
        verify: BlobVerifier | None = None,
        max_blob_bytes: int | None = None,
    ) -> TieredStore:
        """Build each tier from its URL (fastest first), see ``tier_from_url``."""
        tiers = [tier_from_url(url, max_blob_bytes=max_blob_bytes) for url in urls]
        return cls(tiers, write_through=write_through, observer=observer, verify=verify)

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, fastest first."""
        return self._tiers

    @property
    def write_through(self) -> bool:
        """Whether every put also goes to the last tier."""
        return self._write_through

    @property
    def page_bytes(self) -> int:
        """The allocation unit of the memory tiers (the largest page; 1 without one)."""
        from nopecache.cache_server.tiers.cpu import PagedTier  # the page-pool tiers' base

        return max((t.page_bytes for t in self._tiers if isinstance(t, PagedTier)), default=1)

    @property
    def max_blob_bytes(self) -> int:
        """The largest blob any tier accepts; larger ones raise BlobTooLargeError."""
        return max(t.max_blob_bytes for t in self._tiers)

    async def lookup(self, keys: Sequence[bytes]) -> list[TierName | None]:
        """For each key, the fastest tier holding it, or None; a query (no recency change).

        The hot path of every request: keys are not re-validated here (the service has
        checked them) and the first tier answers for all keys in one call.
        """
        present = await self._tiers[0].contains_many(keys)
        self._note_health(0)
        name = self._tiers[0].name
        found: list[TierName | None] = [name if p else None for p in present]
        if len(self._tiers) == 1 or False not in present:
            return found
        pending = [i for i, p in enumerate(present) if not p]
        for level in range(1, len(self._tiers)):
            if not pending:
                break
            tier = self._tiers[level]
            present = await tier.contains_many([keys[i] for i in pending])
            self._note_health(level)
            missing = []
            for i, p in zip(pending, present, strict=True):
                if p:
                    found[i] = tier.name
                else:
                    missing.append(i)
            pending = missing
        return found

    async def get(self, key: bytes) -> tuple[bytes, TierName] | None:
        """The blob and the tier it was found in, or None; a hit below the top is promoted."""
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, TierName] | None]:
        """``get`` for each key, reading each tier once for all the keys still missing."""
        for i, key in enumerate(keys):
            check_key(key, f"keys[{i}]")
        found: list[tuple[bytes, TierName] | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for level, tier in enumerate(self._tiers):
            if not pending:
                break
            wanted = [keys[i] for i in pending]
            if level == 0:
                blobs = await self._checked(tier, wanted, await tier.get_many(wanted))
                self._note_health(level)
                pending = self._collect(level, pending, blobs, found)
                continue
            # Mark the keys as travelling from the read until their promotion is done,
            # so a delete arriving in between is not undone by the promotion.
            self._begin_move(wanted)
            try:
                blobs = await self._checked(tier, wanted, await tier.get_many(wanted))
                self._note_health(level)
                hits = pending
                pending = self._collect(level, pending, blobs, found)
                for i, blob in zip(hits, blobs, strict=True):
                    if blob is not None and keys[i] not in self._doomed:
                        await self._promote(keys[i], blob, level)
            finally:
                self._end_move(wanted)
        for _ in pending:
            self._observer.on_miss()
        return found

    async def get_into(self, key: bytes, out: memoryview) -> tuple[int, TierName] | None:
        """``get`` of one key copied into ``out`` (see ``Tier.get_into``): (size, tier), or
        None on a miss. The fastest tier copies its pages straight into ``out``; a hit
        below it goes through ``get_many`` (and is promoted). A blob larger than ``out``
        is not copied and not counted: ask again with ``size`` bytes of room. A fastest
        tier that is not ``trusted`` goes through ``get_many`` too (its blobs are verified)."""
        check_key(key)
        top = self._tiers[0]
        if top.trusted or self._verify is None:
            size = await top.get_into(key, out)
            self._note_health(0)
            if size is not None:
                if size <= out.nbytes:
                    self._observer.on_hit(top.name)
                return size, top.name
        found = (await self.get_many([key]))[0]
        if found is None:
            return None
        blob, tier = found
        if len(blob) <= out.nbytes:
            out[: len(blob)] = blob
        return len(blob), tier

    def lease(self, key: bytes, *, host_views: bool = True) -> tuple[TierLease, TierName] | None:
        """A read lease of ``key``'s bytes where the fastest tier holds them in host memory
        (``PagedTier.lease``: views valid until released, counted as a hit), else None
        (a miss there, another kind of tier, an untrusted one, leases at their share):
        the caller uses ``get_into`` then. ``host_views=False``: the pages alone, also of a
        pool on a GPU (a CUDA IPC reader)."""
        check_key(key)
        top = self._tiers[0]
        if not isinstance(top, PagedTier) or not (top.trusted or self._verify is None):
            return None
        lease = top.lease(key, host_views=host_views)
        if lease is None:
            return None
        self._observer.on_hit(top.name)
        return lease, top.name

    async def _checked(
        self, tier: Tier, keys: Sequence[bytes], blobs: Sequence[bytes | None]
    ) -> Sequence[bytes | None]:
        """``blobs`` read from ``tier`` with each one that fails ``verify`` deleted there
        and replaced by a miss (only for tiers that are not trusted)."""
        if self._verify is None or tier.trusted:
            return blobs
        out = list(blobs)
        bad: list[bytes] = []
        for i, (key, blob) in enumerate(zip(keys, blobs, strict=True)):
            if blob is None:
                continue
            problem = await self._verify(key, blob)
            if problem is not None:
                out[i] = None
                bad.append(key)
                log.warning("%s tier: invalid block deleted (%s)", tier.name, problem)
        if bad:
            await tier.delete_many(bad)
            self._observer.on_corrupt(tier.name, len(bad))
        return out

    def _collect(
        self,
        level: int,
        pending: list[int],
        blobs: Sequence[bytes | None],
        found: list[tuple[bytes, TierName] | None],
    ) -> list[int]:
        """Record the hits of one tier into ``found``; the indices still missing."""
        name = self._tiers[level].name
        missing = []
        for i, blob in zip(pending, blobs, strict=True):
            if blob is None:
                missing.append(i)
            else:
                found[i] = (blob, name)
                self._observer.on_hit(name)
        return missing

    async def put(self, key: bytes, blob: BlobLike) -> PutOutcome:
        """Store into the fastest tier that can hold ``blob`` (and the last one, if write-through)."""
        check_key(key)
        size = memoryview(blob).nbytes
        if size > self.max_blob_bytes:
            raise BlobTooLargeError(size, self.max_blob_bytes)
        last = len(self._tiers) - 1
        status = PutStatus.UNAVAILABLE
        full = False
        level = self._next_fitting(-1, size)
        while level is not None:
            result = await self._tiers[level].put(key, blob, keep_evicted=self._demotes_from(level))
            self._note_health(level)
            await self._demote(level, result.evicted)
            status = result.status
            full = full or status is PutStatus.FULL
            if status not in (PutStatus.UNAVAILABLE, PutStatus.FULL):
                break
            level = self._next_fitting(level, size)
        # Only a newly stored block is written through: one the fast tier already held
        # went through when it first arrived (or came up from the last tier).
        stored_above_last = status is PutStatus.STORED and level is not None and level < last
        if self._write_through and stored_above_last:
            await self._tiers[last].put(key, blob, keep_evicted=False)
            self._note_health(last)
        if status is PutStatus.STORED:
            return PutOutcome.STORED
        if status is PutStatus.ALREADY_PRESENT:
            return PutOutcome.ALREADY_PRESENT
        return PutOutcome.FULL if full else PutOutcome.UNAVAILABLE

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Remove ``keys`` from every tier; how many distinct keys were present anywhere."""
        for i, key in enumerate(keys):
            check_key(key, f"keys[{i}]")
        # Keys in flight between tiers count as present and are deleted where they land.
        removed = [key in self._moving for key in keys]
        self._doomed.update(key for key, moving in zip(keys, removed, strict=True) if moving)
        for level, tier in enumerate(self._tiers):
            flags = await tier.delete_many(keys)
            self._note_health(level)
            removed = [a or b for a, b in zip(removed, flags, strict=True)]
        return sum(removed)

    def keep(self, keys: KeepSet) -> None:
        """Never evict (memory tiers) nor expire (Redis) the keys ``keys`` holds (pins)."""
        for tier in self._tiers:
            tier.keep = keys

    async def hold(self, keys: Sequence[bytes], held: bool) -> None:
        """Take (``held``) or give back the TTL of ``keys`` in the tiers that expire keys."""
        for level, tier in enumerate(self._tiers):
            await tier.hold(keys, held)
            self._note_health(level)

    async def sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's blob size in the fastest tier holding it (None: nowhere); a query:
        no recency change, no promotion (a blob below the memory tiers is read to learn it)."""
        from nopecache.cache_server.tiers.cpu import PagedTier  # the page-pool tiers' base

        out: list[int | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for level, tier in enumerate(self._tiers):
            if not pending:
                break
            if isinstance(tier, PagedTier):
                found = [tier.placement(keys[i]) for i in pending]
                sizes = [p.size if p is not None else None for p in found]
            else:
                blobs = await tier.get_many([keys[i] for i in pending])
                self._note_health(level)
                sizes = [len(b) if b is not None else None for b in blobs]
            for i, size in zip(pending, sizes, strict=True):
                out[i] = size
            pending = [i for i in pending if out[i] is None]
        return out

    async def flush(self) -> None:
        """Finish every tier's writes in flight and make them durable (the disk's fsync)."""
        for level, tier in enumerate(self._tiers):
            await tier.flush()
            self._note_health(level)

    async def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """Every distinct stored key starting with ``prefix``, in any tier."""
        seen: dict[bytes, None] = {}
        for level, tier in enumerate(self._tiers):
            seen.update(dict.fromkeys(await tier.keys_with_prefix(prefix)))
            self._note_health(level)
        return list(seen)

    async def stats(self) -> list[TierStats]:
        """One snapshot per tier, fastest first (probes Redis health)."""
        out = []
        for level, tier in enumerate(self._tiers):
            out.append(await tier.stats())
            self._note_health(level)
        return out

    async def close(self) -> None:
        """Close every tier (all of them, even if one fails; the first error is raised)."""
        error: BaseException | None = None
        for tier in self._tiers:
            try:
                await tier.close()
            except Exception as exc:  # close the rest before reporting
                error = error or exc
        if error is not None:
            raise error

    def _next_fitting(self, level: int, size: int) -> int | None:
        """The first tier below ``level`` that can hold ``size`` bytes."""
        for lower in range(level + 1, len(self._tiers)):
            if self._tiers[lower].max_blob_bytes >= size:
                return lower
        return None

    def _demotes_from(self, level: int) -> bool:
        """Whether entries evicted from ``level`` go somewhere (so their bytes are needed)."""
        below = len(self._tiers) - 1 - level
        return below > 1 or (below == 1 and not self._write_through)

    async def _demote(self, level: int, evicted: Sequence[Evicted]) -> None:
        """Hand entries evicted from ``level`` to the next tier that can hold them."""
        if not evicted:
            return
        src = self._tiers[level].name
        for _ in evicted:
            self._observer.on_eviction(src)
        last = len(self._tiers) - 1
        # With write-through the last tier got every block when it was stored.
        kept_below = self._write_through and level < last
        if not self._demotes_from(level):
            if not kept_below:
                self._dropped([entry.key for entry in evicted])
            return
        dropped = []
        for entry in evicted:
            blob = entry.blob
            # None: a tier that reads its evictions back (disk) found the block damaged.
            dst = self._next_fitting(level, len(blob)) if blob is not None else None
            moved = tried = False
            while blob is not None and dst is not None:
                if self._write_through and dst == last:
                    break
                tried = True
                outcome = await self._move(entry.key, blob, dst)
                if outcome is _Moved.YES:
                    self._observer.on_demotion(src, self._tiers[dst].name)
                    moved = True
                    break
                if outcome is _Moved.DELETED or self._tiers[dst].healthy:
                    break
                # The tier below is failing (a full disk): the block skips it.
                dst = self._next_fitting(dst, len(blob))
            if not moved and (tried or not kept_below):
                dropped.append(entry.key)
        self._dropped(dropped)

    def _dropped(self, keys: Sequence[bytes]) -> None:
        """Tell the drop listeners that ``keys`` are held by no tier any more."""
        if keys:
            for listener in self.drop_listeners:
                listener(keys)

    async def _promote(self, key: bytes, blob: bytes, level: int) -> None:
        """Copy a block found at ``level`` into the fastest tier that can hold it."""
        dst = self._next_fitting(-1, len(blob))
        if dst is None or dst >= level:
            return
        if await self._move(key, blob, dst) is _Moved.YES:
            self._observer.on_promotion(self._tiers[level].name, self._tiers[dst].name)

    async def _move(self, key: bytes, blob: bytes, dst: int) -> _Moved:
        """Put a travelling block into tier ``dst`` (cascading its evictions); whether it
        now lives there. A delete that hit the key meanwhile is applied to ``dst``."""
        self._begin_move([key])
        try:
            result = await self._tiers[dst].put(key, blob, keep_evicted=self._demotes_from(dst))
        finally:
            (doomed,) = self._end_move([key])
        self._note_health(dst)
        await self._demote(dst, result.evicted)
        if doomed:
            await self._tiers[dst].delete(key)
            return _Moved.DELETED
        if result.status in (PutStatus.STORED, PutStatus.ALREADY_PRESENT):
            return _Moved.YES
        return _Moved.NO

    def _begin_move(self, keys: Sequence[bytes]) -> None:
        moving = self._moving
        for key in keys:
            moving[key] = moving.get(key, 0) + 1

    def _end_move(self, keys: Sequence[bytes]) -> list[bool]:
        """Unmark ``keys``; for each, whether a delete hit it while it moved."""
        moving, doomed = self._moving, self._doomed
        out = []
        for key in keys:
            left = moving[key] - 1
            if left:
                moving[key] = left
            else:
                del moving[key]
            hit = key in doomed
            if hit and not left:
                doomed.discard(key)
            out.append(hit)
        return out

    def _note_health(self, level: int) -> None:
        healthy = self._tiers[level].healthy
        if healthy != self._health[level]:
            self._health[level] = healthy
            self._observer.on_tier_health(self._tiers[level].name, healthy)
