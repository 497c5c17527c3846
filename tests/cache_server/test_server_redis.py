"""The server over CPU -> Redis with a real redis-server: demotion and promotion seen through
gRPC, and a Redis that dies and comes back while the server keeps serving."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.cache_server.main import tier_health_name
from nopecache.proto import cache_pb2 as pb
from tests.support.redis_procs import RedisProc
from tests.support.server_harness import (
    SMALL,
    STORED,
    get,
    key_of,
    make_block,
    put,
    serving,
)
from tests.support.waiting import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Four 4 KiB pages: each test block takes one, so the fifth put evicts.
CPU = "cpu://?capacity=16KiB&page=4KiB&pinned=no"
# A hang guard, not a timing: each wait is for an event that takes well under a second on
# an idle machine; a loaded 2-core machine (load ~6) may take many times that.
HANG_S = 60.0


@pytest.mark.asyncio
async def test_eviction_demotes_to_redis_and_a_hit_promotes_back(redis_clean: RedisProc) -> None:
    config = replace(SMALL, tiers=(CPU, redis_clean.url))
    async with serving(config) as h:
        keys = [key_of(i) for i in range(5)]
        blobs = [make_block(k, tokens=8, head_dim=32) for k in keys]
        for k, b in zip(keys, blobs, strict=True):
            assert [r.outcome for r in await put(h.stub, [(k, b)], h.frame_bytes)] == [STORED]
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert list(lookup.tier_names) == ["cpu", "redis"]
        assert lookup.tiers == b"\x02\x01\x01\x01\x01"
        assert h.sample("nopecache_demotions_total", {"from_tier": "cpu", "to_tier": "redis"}) == 1

        got, frames = await get(h.stub, [keys[0]])
        assert got == [blobs[0]]
        assert (frames[0].tier, list(frames[0].tier_names)) == (2, ["cpu", "redis"])
        # The promotion of keys[0] into the CPU tier evicted keys[1], the LRU, to Redis.
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert lookup.tiers == b"\x01\x02\x01\x01\x01"
        assert h.sample("nopecache_promotions_total", {"from_tier": "redis", "to_tier": "cpu"}) == 1
        assert h.sample("nopecache_demotions_total", {"from_tier": "cpu", "to_tier": "redis"}) == 2
        assert h.sample("nopecache_hits_total", {"tier": "redis"}) == 1

        got, _ = await get(h.stub, keys)
        assert got == blobs


@pytest.mark.asyncio
async def test_redis_down_keeps_serving_and_reports_the_tier(redis_disposable: RedisProc) -> None:
    config = replace(SMALL, tiers=(CPU, redis_disposable.url))
    async with serving(config) as h:
        health = health_pb2_grpc.HealthStub(h.channel)

        async def status(name: str) -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            return int(reply.status)

        async def redis_is(expected: int) -> bool:
            return await status(tier_health_name("redis")) == expected

        await wait_until(lambda: redis_is(SERVING), timeout_s=HANG_S, interval_s=0.1)
        first = key_of(1)
        await put(h.stub, [(first, make_block(first))], h.frame_bytes)

        redis_disposable.kill()
        # Traffic while Redis is gone: puts land in the CPU tier, gets and lookups answer.
        second = key_of(2)
        results = await put(h.stub, [(second, make_block(second))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        got, _ = await get(h.stub, [first, second, key_of(3)])
        assert got == [make_block(first), make_block(second), None]
        await wait_until(lambda: redis_is(NOT_SERVING), timeout_s=HANG_S, interval_s=0.1)
        assert await status("nopecache.v1.KVCache") == SERVING
        assert await status(tier_health_name("cpu")) == SERVING
        assert await status("") == SERVING
        assert h.sample("nopecache_tier_healthy", {"tier": "redis"}) == 0.0
        stats = await h.stub.Stats(pb.StatsRequest())
        assert [(t.name, t.healthy) for t in stats.tiers] == [("cpu", True), ("redis", False)]

        redis_disposable.start()
        await wait_until(lambda: redis_is(SERVING), timeout_s=HANG_S, interval_s=0.1)
        assert h.sample("nopecache_tier_healthy", {"tier": "redis"}) == 1.0
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=first + second))
        assert lookup.tiers == b"\x01\x01"


@pytest.mark.asyncio
async def test_redis_only_server_is_not_serving_while_redis_is_down(
    redis_disposable: RedisProc,
) -> None:
    config = replace(SMALL, tiers=(redis_disposable.url,))
    async with serving(config) as h:
        health = health_pb2_grpc.HealthStub(h.channel)

        async def service_is(expected: int) -> bool:
            reply = await health.Check(
                health_pb2.HealthCheckRequest(service="nopecache.v1.KVCache")
            )
            return reply.status == expected

        await wait_until(lambda: service_is(SERVING), timeout_s=HANG_S, interval_s=0.1)
        redis_disposable.kill()
        await wait_until(lambda: service_is(NOT_SERVING), timeout_s=HANG_S, interval_s=0.1)
        key = key_of(5)
        results = await put(h.stub, [(key, make_block(key))], h.frame_bytes)
        assert [(r.outcome, r.code) for r in results] == [
            (pb.PUT_OUTCOME_REJECTED, grpc.StatusCode.UNAVAILABLE.value[0])
        ]
        got, _ = await get(h.stub, [key])
        assert got == [None]
