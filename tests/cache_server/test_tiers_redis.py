"""Redis tier against real redis-server processes: format, TTL, failures, Redis Cluster."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import lz4.frame
import pytest
import pytest_asyncio
from redis.backoff import AbstractBackoff, ExponentialBackoff

from nopecache.cache_server.tiers import (
    PutResult,
    PutStatus,
    TierConfigError,
    redact_url,
    tier_from_url,
)
from nopecache.cache_server.tiers.redis import LZ4_FRAME_MAGIC, MAX_VALUE_BYTES, RedisTier
from tests.support.redis_procs import RedisClusterProcs, RedisProc

MakeTier = Callable[..., RedisTier]
# Short breaker delays so recovery is noticed within a test; the default caps at 5 s.
FAST_BACKOFF = ExponentialBackoff(cap=0.2, base=0.02)


def compressible(size: int, seed: int = 0) -> bytes:
    """KV-like bytes: a random 256-byte motif repeated, so lz4 has something to find."""
    motif = random.Random(seed).randbytes(256)
    return (motif * (size // 256 + 1))[:size]


@pytest_asyncio.fixture
async def make_tier() -> AsyncIterator[MakeTier]:
    """Build RedisTiers from URLs inside the test's event loop; all closed afterwards."""
    made: list[RedisTier] = []

    def make(url: str, backoff: AbstractBackoff | None = None) -> RedisTier:
        tier = RedisTier.from_url(url, backoff=backoff)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        await tier.close()


@pytest.mark.asyncio
async def test_round_trip_stores_one_lz4_frame_per_block(
    redis_clean: RedisProc, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_clean.url)
    blob = compressible(64 * 1024)
    assert await tier.put(b"key-1", blob) == PutResult(PutStatus.STORED)
    assert await tier.get(b"key-1") == blob
    # Inspection with a synchronous client: nothing else runs on the loop meanwhile.
    with redis_clean.client() as raw:
        assert list(raw.scan_iter()) == [b"nc:key-1"]
        value = raw.get(b"nc:key-1")
    assert value is not None
    assert value[:4] == LZ4_FRAME_MAGIC
    assert len(value) < len(blob) // 10
    assert lz4.frame.decompress(value) == blob


@pytest.mark.asyncio
async def test_large_incompressible_blob_is_bit_exact(
    redis_clean: RedisProc, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_clean.url)
    blob = random.Random(1).randbytes(1024 * 1024 + 3)  # goes through the worker thread
    assert (await tier.put(b"big", memoryview(blob))).status is PutStatus.STORED
    got = await tier.get(b"big")
    assert type(got) is bytes
    assert got == blob


@pytest.mark.asyncio
async def test_ttl_is_applied_when_configured(redis_clean: RedisProc, make_tier: MakeTier) -> None:
    with_ttl = make_tier(redis_clean.url + "?ttl=100&prefix=t:")
    without = make_tier(redis_clean.url + "?prefix=p:")
    await with_ttl.put(b"k", b"v")
    await without.put(b"k", b"v")
    with redis_clean.client() as raw:
        assert 99_000 < raw.pttl(b"t:k") <= 100_000
        assert raw.ttl(b"p:k") == -1


@pytest.mark.asyncio
async def test_existing_value_is_not_overwritten(
    redis_clean: RedisProc, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_clean.url)
    assert await tier.put(b"k", b"first") == PutResult(PutStatus.STORED)
    assert await tier.put(b"k", b"second") == PutResult(PutStatus.ALREADY_PRESENT)
    assert await tier.get(b"k") == b"first"


@pytest.mark.asyncio
async def test_batched_calls_keep_key_order(redis_clean: RedisProc, make_tier: MakeTier) -> None:
    tier = make_tier(redis_clean.url)
    await tier.put(b"a", b"A" * 10)
    await tier.put(b"c", b"")
    assert await tier.contains_many([b"a", b"b", b"c"]) == [True, False, True]
    assert await tier.get_many([b"c", b"b", b"a"]) == [b"", None, b"A" * 10]
    assert await tier.delete_many([b"a", b"b", b"c"]) == [True, False, True]
    assert await tier.contains_many([b"a", b"c"]) == [False, False]
    assert await tier.contains_many([]) == []


@pytest.mark.asyncio
async def test_damaged_values_are_misses_and_deleted(
    redis_clean: RedisProc, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_clean.url)
    blob = compressible(4096, seed=3)
    await tier.put(b"flip", blob)
    with redis_clean.client() as raw:
        value = raw.get(b"nc:flip")
        assert value is not None
        middle = len(value) // 2
        raw.setrange(b"nc:flip", middle, bytes([value[middle] ^ 0xFF]))
        raw.set(b"nc:junk", b"not an lz4 frame")
    assert await tier.get_many([b"flip", b"junk"]) == [None, None]
    assert tier.corrupt_values == 2
    assert tier.healthy
    with redis_clean.client() as raw:
        assert raw.exists(b"nc:flip", b"nc:junk") == 0


@pytest.mark.asyncio
async def test_stats_report_entries_memory_and_capacity(
    redis_clean: RedisProc, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_clean.url)
    for i in range(5):
        await tier.put(b"k%d" % i, b"x" * 100)
    stats = await tier.stats()
    assert (stats.name, stats.url, stats.entries, stats.healthy) == (
        "redis",
        redis_clean.url,
        5,
        True,
    )
    assert stats.used_bytes > 0
    assert stats.capacity_bytes is None  # no maxmemory: Redis is unbounded
    with redis_clean.client() as raw:
        raw.config_set("maxmemory", "100mb")
    try:
        assert (await tier.stats()).capacity_bytes == 100 * 1024 * 1024
    finally:
        with redis_clean.client() as raw:
            raw.config_set("maxmemory", "0")
    sized = make_tier(redis_clean.url + "?capacity=1GiB")
    assert (await sized.stats()).capacity_bytes == 1024**3
    assert sized.max_blob_bytes == MAX_VALUE_BYTES
    assert (await sized.put(b"huge", bytes(MAX_VALUE_BYTES + 1))).status is PutStatus.TOO_LARGE


def test_urls_never_show_passwords() -> None:
    tier = tier_from_url("redis://user:s3cret@127.0.0.1:1/2?ttl=5")
    assert tier.url == "redis://user:***@127.0.0.1:1/2?ttl=5"
    assert "s3cret" not in redact_url("rediss://:s3cret@h:6380/0?ssl_password=s3cret&ttl=1")
    assert redact_url("rediss://:s3cret@h:6380/0?ssl_password=s3cret&ttl=1") == (
        "rediss://:***@h:6380/0?ssl_password=***&ttl=1"
    )


def test_tls_and_cluster_urls_are_understood() -> None:
    tls = tier_from_url("rediss://127.0.0.1:1/0?ssl_cert_reqs=none&timeout=0.5")
    assert isinstance(tls, RedisTier)
    cluster = tier_from_url("rediss+cluster://:pw@127.0.0.1:1,127.0.0.1:2?ttl=60")
    assert isinstance(cluster, RedisTier)
    assert cluster.url == "rediss+cluster://:***@127.0.0.1:1,127.0.0.1:2?ttl=60"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("redis://127.0.0.1:1/0?colour=red", "unknown option 'colour'"),
        ("redis://127.0.0.1:1/0?ttl=0", "ttl must be a whole number of seconds >= 1"),
        ("redis://127.0.0.1:1/0?ttl=1.5", "ttl must be a whole number of seconds >= 1"),
        ("redis://127.0.0.1:1/0?timeout=-1", "timeout must be > 0 seconds"),
        ("redis://127.0.0.1:1/0?timeout=soon", "timeout must be a number of seconds"),
        ("redis://127.0.0.1:1/0?capacity=lots", "capacity: cannot parse 'lots'"),
        ("redis://127.0.0.1:1/0?max_connections=many", "max_connections"),
        ("redis+cluster://127.0.0.1:1,127.0.0.1", "cluster node '127.0.0.1' must be host:port"),
        ("redis+cluster://127.0.0.1:1/3", "Redis Cluster has only db 0"),
        ("redis+unix://x", "unknown tier scheme 'redis+unix'"),
    ],
)
def test_bad_redis_urls_name_the_problem(url: str, fragment: str) -> None:
    with pytest.raises(TierConfigError) as info:
        tier_from_url(url)
    assert fragment in str(info.value)


@pytest.mark.asyncio
async def test_killed_redis_gives_misses_then_recovers_after_restart(
    redis_disposable: RedisProc, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_disposable.url + "?timeout=0.2", backoff=FAST_BACKOFF)
    await tier.put(b"before", b"data")
    assert await tier.get(b"before") == b"data"

    redis_disposable.kill()
    async with asyncio.timeout(5):  # each call is bounded by the tier's own timeouts
        assert await tier.get(b"before") is None
        assert not tier.healthy
        assert await tier.contains_many([b"before"]) == [False]
        assert await tier.put(b"during", b"x") == PutResult(PutStatus.UNAVAILABLE)
        assert await tier.delete(b"before") is False
        assert not (await tier.stats()).healthy

    redis_disposable.start()
    async with asyncio.timeout(10):
        while not (await tier.stats()).healthy:
            await asyncio.sleep(0.05)
    assert tier.healthy
    assert await tier.get(b"before") is None  # nothing persisted: a cache restarts empty
    assert await tier.put(b"after", b"fresh") == PutResult(PutStatus.STORED)
    assert await tier.get(b"after") == b"fresh"


@pytest.mark.asyncio
async def test_slow_redis_times_out_into_a_miss(
    redis_disposable: RedisProc, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_disposable.url + "?timeout=0.2", backoff=FAST_BACKOFF)
    await tier.put(b"k", b"v")
    with redis_disposable.client() as raw:
        raw.execute_command("CLIENT", "PAUSE", "1500", "ALL")
    async with asyncio.timeout(1.4):  # returns well before Redis answers again
        assert await tier.get(b"k") is None
    assert not tier.healthy
    async with asyncio.timeout(10):
        while await tier.get(b"k") is None:
            await asyncio.sleep(0.05)
    assert tier.healthy


@pytest.mark.asyncio
async def test_cluster_round_trip_across_slots(
    redis_cluster_clean: RedisClusterProcs, make_tier: MakeTier
) -> None:
    tier = make_tier(redis_cluster_clean.url + "?ttl=600")
    blobs = {b"block-%03d" % i: compressible(1000 + i, seed=i) for i in range(60)}
    for key, blob in blobs.items():
        assert (await tier.put(key, blob)).status is PutStatus.STORED
    keys = list(blobs)
    assert await tier.get_many(keys) == [blobs[k] for k in keys]
    assert await tier.contains_many([*keys[:3], b"absent"]) == [True, True, True, False]
    # The keys really spread over all three masters, each with its TTL.
    per_node = []
    for node in redis_cluster_clean.nodes:
        with node.client() as raw:
            per_node.append(raw.dbsize())
            assert all(0 < raw.ttl(k) <= 600 for k in raw.scan_iter())
    assert sum(per_node) == 60
    assert all(n > 0 for n in per_node)
    assert (await tier.stats()).entries == 60
    assert sum(await tier.delete_many(keys[:10])) == 10
    assert (await tier.stats()).entries == 50
