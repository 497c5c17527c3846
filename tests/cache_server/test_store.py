"""TieredStore over a real CPU tier and a real Redis: demotion, promotion, write-through."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio
from redis.backoff import ExponentialBackoff

from nopecache.cache_server.store import (
    BlobTooLargeError,
    PutOutcome,
    StoreObserver,
    TieredStore,
)
from nopecache.cache_server.tiers import Tier, TierConfigError, TierName
from nopecache.cache_server.tiers.cpu import CpuTier
from nopecache.cache_server.tiers.redis import LZ4_FRAME_MAGIC, RedisTier
from tests.support.redis_procs import RedisProc

PAGE = 100
Event = tuple[str, ...]
MakeStore = Callable[..., TieredStore]


def blob_of(tag: int, size: int = PAGE) -> bytes:
    """Deterministic random bytes, distinct per tag."""
    return random.Random(tag).randbytes(size)


class Recorder(StoreObserver):
    """An observer that records every event in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def on_hit(self, tier: TierName) -> None:
        self.events.append(("hit", tier))

    def on_miss(self) -> None:
        self.events.append(("miss",))

    def on_eviction(self, tier: TierName) -> None:
        self.events.append(("evict", tier))

    def on_demotion(self, src: TierName, dst: TierName) -> None:
        self.events.append(("demote", src, dst))

    def on_promotion(self, src: TierName, dst: TierName) -> None:
        self.events.append(("promote", src, dst))

    def on_tier_health(self, tier: TierName, healthy: bool) -> None:
        self.events.append(("health", tier, str(healthy)))

    def take(self) -> list[Event]:
        """The events since the last call."""
        events, self.events = self.events, []
        return events


@pytest_asyncio.fixture
async def make_store() -> AsyncIterator[MakeStore]:
    """Build stores inside the test's loop: ``make_store(cpu_pages, redis_url, ...)``."""
    made: list[TieredStore] = []

    def make(
        cpu_pages: int,
        redis_url: str | None = None,
        *,
        page: int = PAGE,
        write_through: bool = False,
        observer: StoreObserver | None = None,
    ) -> TieredStore:
        tiers: list[Tier] = [CpuTier(cpu_pages * page, page_bytes=page, pinned=False)]
        if redis_url is not None:
            fast = ExponentialBackoff(cap=0.2, base=0.02)
            tiers.append(RedisTier.from_url(redis_url + "?timeout=0.2", backoff=fast))
        store = TieredStore(tiers, write_through=write_through, observer=observer)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


def cpu_of(store: TieredStore) -> CpuTier:
    """The store's CPU tier (always its first here)."""
    tier = store.tiers[0]
    assert isinstance(tier, CpuTier)
    return tier


@pytest.mark.asyncio
async def test_cpu_only_store_round_trip(make_store: MakeStore) -> None:
    store = make_store(cpu_pages=64, page=64)
    keys = [b"k%04d" % i for i in range(4096)]
    for i, key in enumerate(keys[:40]):
        assert await store.put(key, blob_of(i, 50)) is PutOutcome.STORED
    assert await store.put(keys[0], b"other") is PutOutcome.ALREADY_PRESENT
    found = await store.lookup(keys)
    assert found == ["cpu"] * 40 + [None] * 4056
    assert await store.get(keys[3]) == (blob_of(3, 50), "cpu")
    assert await store.get(b"absent") is None
    assert await store.get_many([keys[1], b"absent"]) == [(blob_of(1, 50), "cpu"), None]
    assert await store.delete([keys[1], keys[2], b"absent"]) == 2
    assert await store.lookup(keys[:3]) == ["cpu", None, None]
    [stats] = await store.stats()
    assert (stats.name, stats.entries, stats.used_bytes) == ("cpu", 38, 38 * 64)


@pytest.mark.asyncio
async def test_eviction_demotes_to_redis_and_get_promotes_back(
    redis_clean: RedisProc, make_store: MakeStore
) -> None:
    recorder = Recorder()
    store = make_store(cpu_pages=2, redis_url=redis_clean.url, observer=recorder)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    assert await store.put(a, blob_of(1)) is PutOutcome.STORED
    assert await store.put(b, blob_of(2)) is PutOutcome.STORED
    assert recorder.take() == []
    assert await store.put(c, blob_of(3)) is PutOutcome.STORED
    assert recorder.take() == [("evict", "cpu"), ("demote", "cpu", "redis")]
    assert await store.lookup([a, b, c, b"d" * 16]) == ["redis", "cpu", "cpu", None]

    # A hit in Redis is reported as such, then copied up; b (least recent) makes room.
    assert await store.get(a) == (blob_of(1), "redis")
    assert recorder.take() == [
        ("hit", "redis"),
        ("evict", "cpu"),
        ("demote", "cpu", "redis"),
        ("promote", "redis", "cpu"),
    ]
    assert await store.lookup([a, b, c]) == ["cpu", "redis", "cpu"]
    assert await store.get(a) == (blob_of(1), "cpu")
    assert recorder.take() == [("hit", "cpu")]
    assert cpu_of(store).lru_keys() == [c, a]
    # Promotion copies: Redis keeps a, so other replicas still find it.
    with redis_clean.client() as raw:
        assert raw.exists(b"nc:" + a) == 1
    assert await store.get(b"e" * 16) is None
    assert recorder.take() == [("miss",)]


@pytest.mark.asyncio
async def test_write_through_is_in_redis_immediately(
    redis_clean: RedisProc, make_store: MakeStore
) -> None:
    recorder = Recorder()
    store = make_store(
        cpu_pages=1, redis_url=redis_clean.url, write_through=True, observer=recorder
    )
    assert store.write_through
    assert await store.put(b"k1", blob_of(1)) is PutOutcome.STORED
    with redis_clean.client() as raw:
        value = raw.get(b"nc:k1")
    assert value is not None and value[:4] == LZ4_FRAME_MAGIC
    assert await store.lookup([b"k1"]) == ["cpu"]
    # Evicting k1 sends nothing to Redis: it is already there.
    assert await store.put(b"k2", blob_of(2)) is PutOutcome.STORED
    assert recorder.take() == [("evict", "cpu")]
    assert await store.lookup([b"k1", b"k2"]) == ["redis", "cpu"]
    assert await store.put(b"k2", blob_of(9)) is PutOutcome.ALREADY_PRESENT
    # Present in both tiers: counted once, removed from both.
    assert await store.delete([b"k2"]) == 1
    assert await store.lookup([b"k2"]) == [None]


@pytest.mark.asyncio
async def test_blob_sizes_pick_the_tier_or_are_refused(
    redis_clean: RedisProc, make_store: MakeStore
) -> None:
    cpu_only = make_store(cpu_pages=2)
    with pytest.raises(BlobTooLargeError) as info:
        await cpu_only.put(b"big", bytes(2 * PAGE + 1))
    assert (info.value.size, info.value.limit) == (2 * PAGE + 1, 2 * PAGE)
    assert "blob: 201 bytes exceeds" in str(info.value)

    recorder = Recorder()
    store = make_store(cpu_pages=2, redis_url=redis_clean.url, observer=recorder)
    await store.put(b"small", blob_of(1))
    big = blob_of(2, 5 * PAGE)
    assert await store.put(b"big", big) is PutOutcome.STORED
    assert await store.lookup([b"small", b"big"]) == ["cpu", "redis"]
    # Too big to promote: served from Redis, the CPU tier is left alone.
    assert await store.get(b"big") == (big, "redis")
    assert recorder.take() == [("hit", "redis")]
    assert cpu_of(store).lru_keys() == [b"small"]


@pytest.mark.asyncio
async def test_bad_keys_and_tier_lists_are_refused(make_store: MakeStore) -> None:
    store = make_store(cpu_pages=2)
    with pytest.raises(TypeError, match=r"^key: expected bytes, got str"):
        await store.put("k", b"v")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^key: must not be empty"):
        await store.put(b"", b"v")
    with pytest.raises(TypeError, match=r"^keys\[1\]: expected bytes"):
        await store.get_many([b"ok", bytearray(b"no")])  # type: ignore[list-item]
    with pytest.raises(TierConfigError, match="at least one tier"):
        TieredStore([])
    twice = [CpuTier(PAGE, page_bytes=PAGE, pinned=False) for _ in range(2)]
    with pytest.raises(TierConfigError, match="each tier kind may appear once"):
        TieredStore(twice)


@pytest.mark.asyncio
async def test_from_urls_builds_the_chain(redis_clean: RedisProc) -> None:
    store = TieredStore.from_urls(
        ["cpu://?capacity=1KiB&page=256&pinned=no", redis_clean.url], write_through=True
    )
    try:
        assert [t.name for t in store.tiers] == ["cpu", "redis"]
        assert await store.put(b"k", b"v") is PutOutcome.STORED
        stats = await store.stats()
        assert [(s.name, s.entries) for s in stats] == [("cpu", 1), ("redis", 1)]
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_redis_down_is_misses_and_health_events_not_errors(
    redis_disposable: RedisProc, make_store: MakeStore
) -> None:
    recorder = Recorder()
    store = make_store(cpu_pages=1, redis_url=redis_disposable.url, observer=recorder)
    await store.put(b"x", blob_of(1))
    await store.put(b"y", blob_of(2))  # x demoted to Redis
    recorder.take()
    redis_disposable.kill()
    assert await store.get(b"x") is None
    assert recorder.take() == [("health", "redis", "False"), ("miss",)]
    assert await store.lookup([b"x", b"y"]) == [None, "cpu"]
    assert await store.get(b"y") == (blob_of(2), "cpu")
    # Eviction while Redis is down drops the block instead of failing the put.
    assert await store.put(b"z", blob_of(3)) is PutOutcome.STORED
    assert await store.lookup([b"y", b"z"]) == [None, "cpu"]
    recorder.take()

    redis_disposable.start()
    async with asyncio.timeout(10):
        while not all(s.healthy for s in await store.stats()):
            await asyncio.sleep(0.05)
    assert recorder.take() == [("health", "redis", "True")]
    await store.put(b"w", blob_of(4))  # z demoted again, for real
    assert await store.lookup([b"z", b"w"]) == ["redis", "cpu"]


@pytest.mark.asyncio
async def test_delete_racing_a_promotion_wins(
    redis_clean: RedisProc, make_store: MakeStore
) -> None:
    store = make_store(cpu_pages=1, redis_url=redis_clean.url)
    await store.put(b"a", blob_of(1))
    await store.put(b"b", blob_of(2))  # a demoted to Redis
    getter = asyncio.create_task(store.get(b"a"))
    await asyncio.sleep(0)  # the get is now waiting for Redis
    assert await store.delete([b"a"]) == 1
    got = await getter
    assert got in (None, (blob_of(1), "redis"))
    assert await store.lookup([b"a"]) == [None]


@pytest.mark.asyncio
async def test_delete_racing_a_demotion_wins(redis_clean: RedisProc, make_store: MakeStore) -> None:
    # Blocks this large are compressed in a worker thread, so the delete below runs
    # to completion before the demoted block's SET is even sent.
    size = 200 * 1024
    store = make_store(cpu_pages=1, page=size, redis_url=redis_clean.url)
    await store.put(b"a", blob_of(1, size))
    putter = asyncio.create_task(store.put(b"b", blob_of(2, size)))
    await asyncio.sleep(0)  # a is evicted and on its way to Redis
    assert await store.delete([b"a"]) == 1  # in flight counts as present
    assert await putter is PutOutcome.STORED
    assert await store.lookup([b"a", b"b"]) == [None, "cpu"]


@pytest.mark.asyncio
async def test_concurrent_tasks_keep_every_blob_bit_exact(
    redis_clean: RedisProc, make_store: MakeStore
) -> None:
    store = make_store(cpu_pages=16, page=256, redis_url=redis_clean.url)
    n_tasks, per_task = 24, 12
    blobs = {
        b"t%02d-%02d" % (t, i): blob_of(t * 100 + i, 200 + 37 * ((t + i) % 20))
        for t in range(n_tasks)
        for i in range(per_task)
    }
    keys = list(blobs)

    async def worker(t: int) -> None:
        rng = random.Random(t)
        for i in range(per_task):
            key = b"t%02d-%02d" % (t, i)
            assert await store.put(key, blobs[key]) in (
                PutOutcome.STORED,
                PutOutcome.ALREADY_PRESENT,
            )
            for probe in rng.sample(keys, 3):
                got = await store.get(probe)
                assert got is None or got[0] == blobs[probe]
            await asyncio.sleep(0)

    await asyncio.gather(*(worker(t) for t in range(n_tasks)))
    found = await store.get_many(keys)
    for key, hit in zip(keys, found, strict=True):
        assert hit is not None, key
        assert hit[0] == blobs[key]
    cpu = cpu_of(store)
    cpu.check_invariants()
    stats = await cpu.stats()
    assert stats.capacity_bytes is not None
    assert stats.used_bytes <= stats.capacity_bytes


@pytest.mark.asyncio
async def test_get_into_reads_the_top_tier_in_place_and_promotes_from_redis(
    redis_clean: RedisProc, make_store: MakeStore
) -> None:
    recorder = Recorder()
    store = make_store(cpu_pages=2, redis_url=redis_clean.url, observer=recorder)
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    for i, key in enumerate((a, b, c), 1):
        assert await store.put(key, blob_of(i)) is PutOutcome.STORED
    recorder.take()  # a went down to Redis
    out = bytearray(PAGE)
    assert await store.get_into(c, memoryview(out)) == (PAGE, "cpu")
    assert bytes(out) == blob_of(3) and recorder.take() == [("hit", "cpu")]
    assert await store.get_into(a, memoryview(out)) == (PAGE, "redis")
    assert bytes(out) == blob_of(1)
    assert recorder.take() == [
        ("hit", "redis"),
        ("evict", "cpu"),
        ("demote", "cpu", "redis"),
        ("promote", "redis", "cpu"),
    ]
    small = bytearray(PAGE - 1)
    assert await store.get_into(a, memoryview(small)) == (PAGE, "cpu")  # needs more room
    assert bytes(small) == bytes(PAGE - 1) and recorder.take() == []  # nothing copied
    assert await store.get_into(b"d" * 16, memoryview(out)) is None
    assert recorder.take() == [("miss",)]
