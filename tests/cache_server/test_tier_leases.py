"""Read leases of the host-memory tier: a leased block's pages are never rewritten, leases
hold at most their share of the pool, and a put never evicts for room leases keep."""

from __future__ import annotations

import random

import pytest

from nopecache.cache_server.tiers import Evicted, PutResult, PutStatus
from nopecache.cache_server.tiers.cpu import CpuTier

PAGE = 100


def blob_of(tag: int, size: int) -> bytes:
    """Deterministic bytes, different per tag."""
    return random.Random(tag).randbytes(size)


def tier_of(pages: int) -> CpuTier:
    """A tier of ``pages`` pages of PAGE bytes."""
    return CpuTier(pages * PAGE, page_bytes=PAGE, pinned=False)


def lent_bytes(views: list[memoryview]) -> bytes:
    """The bytes a lease's views show now."""
    return b"".join(bytes(v) for v in views)


@pytest.mark.asyncio
async def test_a_leased_block_keeps_its_bytes_through_eviction_until_released() -> None:
    tier = tier_of(4)
    a, b = blob_of(1, 2 * PAGE), blob_of(2, 2 * PAGE)
    await tier.put(b"a", a)
    await tier.put(b"b", b)
    lease = tier.lease(b"a")
    assert lease is not None and lease.size == 2 * PAGE
    assert all(v.readonly for v in lease.views)
    # The lease refreshed a, so b is the least recent and goes first.
    c = blob_of(3, 2 * PAGE)
    assert await tier.put(b"c", c) == PutResult(PutStatus.STORED, (Evicted(b"b", b),))
    big = blob_of(4, 3 * PAGE)
    # Three pages cannot come free while a's two are leased: nothing is evicted for it.
    assert await tier.put(b"big", big) == PutResult(PutStatus.UNAVAILABLE)
    assert await tier.get(b"c") == c
    # Two can: a leaves the index (a miss from now on) but keeps its pages; c's are reused.
    d = blob_of(5, 2 * PAGE)
    assert await tier.put(b"d", d) == PutResult(
        PutStatus.STORED, (Evicted(b"a", a), Evicted(b"c", c))
    )
    assert await tier.get(b"a") is None
    tier.check_invariants()
    assert lent_bytes(lease.views) == a
    lease.release()
    lease.release()  # idempotent
    assert (await tier.put(b"big", big)).status is PutStatus.STORED
    assert await tier.get(b"big") == big
    tier.check_invariants()


@pytest.mark.asyncio
async def test_evicting_a_leased_block_retires_its_pages_until_the_last_lease_ends() -> None:
    tier = tier_of(6)
    a = blob_of(1, 2 * PAGE)
    await tier.put(b"a", a)
    first, second = tier.lease(b"a"), tier.lease(b"a")
    assert first is not None and second is not None
    assert await tier.delete(b"a") is True
    assert await tier.get(b"a") is None
    assert tier.lease(b"a") is None  # gone from the index: a miss
    fill = [blob_of(10 + i, PAGE) for i in range(4)]
    for i, blob in enumerate(fill):  # the 4 free pages; a's 2 stay retired
        assert (await tier.put(bytes([i]), blob)).status is PutStatus.STORED
    first.release()
    assert lent_bytes(second.views) == a  # still held by the second lease
    # A new block needs a page: the LRU fill block is evicted, a's pages are not reused.
    assert (await tier.put(b"n", blob_of(20, PAGE))).status is PutStatus.STORED
    assert lent_bytes(second.views) == a
    tier.check_invariants()
    second.release()
    stats = await tier.stats()
    assert stats.used_bytes == 4 * PAGE  # a's two pages came back
    tier.check_invariants()


@pytest.mark.asyncio
async def test_leases_hold_at_most_their_share_of_the_pool() -> None:
    tier = tier_of(8)
    assert tier.lease_share == 0.5
    for i in range(4):
        await tier.put(bytes([i]), blob_of(i, 2 * PAGE))
    held = [tier.lease(bytes([0])), tier.lease(bytes([1]))]
    assert all(h is not None for h in held)  # 4 of 8 pages: the share
    assert tier.lease(bytes([2])) is None  # a third would pass it: the caller copies
    again = tier.lease(bytes([0]))  # a second lease of a leased block holds no new page
    assert again is not None
    for h in (*held, again):
        assert h is not None
        h.release()
    assert tier.lease(bytes([2])) is not None


@pytest.mark.asyncio
async def test_a_closed_tier_leaves_a_lease_readable() -> None:
    tier = tier_of(2)
    a = blob_of(1, PAGE)
    await tier.put(b"a", a)
    lease = tier.lease(b"a")
    assert lease is not None
    await tier.close()
    assert lent_bytes(lease.views) == a
    lease.release()
