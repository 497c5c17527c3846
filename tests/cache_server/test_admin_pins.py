"""Pins on a real server: hard pins never evicted, soft pins expire (TTL capped), pinned
bytes count against the quota, a tenant pins only its own blocks, and the Redis copy of a
pinned block keeps no TTL (real Redis)."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from nopecache.cache_server.tenants import namespace_tag
from nopecache.cache_server.tiers.redis import RedisTier
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.redis_procs import RedisProc
from tests.support.server_harness import SMALL, STORED, get, key_of, make_block, put, serving
from tests.support.tenants import ALICE, AUTH, BOB, tenant_serving
from tests.support.waiting import wait_until

ADMIN = "admin-token-5e1d9b7c3a2f4680"

# Four 4 KiB pages: each test block takes one, so the fifth put evicts.
CPU = "cpu://?capacity=16KiB&page=4KiB&pinned=no"
# A hang guard, not a timing (see test_server_redis.py).
HANG_S = 60.0


def packed(*indices: int) -> bytes:
    return b"".join(key_of(i) for i in indices)


async def store(stub: cache_pb2_grpc.KVCacheAsyncStub, *indices: int) -> None:
    results = await put(stub, [(key_of(i), make_block(key_of(i))) for i in indices], 4096)
    assert [r.outcome for r in results] == [STORED] * len(indices)


@pytest.mark.asyncio
async def test_a_hard_pin_is_never_evicted_and_unpin_makes_it_evictable() -> None:
    async with serving(replace(SMALL, tiers=(CPU,))) as h:
        admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel)
        await store(h.stub, 0, 1, 2, 3)
        pinned = await admin.Pin(pb.PinRequest(keys=packed(0, 9), hard=True))
        assert (pinned.pinned, pinned.missing, pinned.pinned_bytes, pinned.ttl_ms) == (
            1,
            1,
            4096,
            0,
        )
        # Key 0 is the LRU: without its pin the next two puts would evict it first.
        await store(h.stub, 4, 5)
        found = await h.stub.Lookup(pb.LookupRequest(keys=packed(0, 1, 2, 3, 4, 5)))
        assert found.tiers == b"\1\0\0\1\1\1"
        looked = await admin.AdminLookup(pb.AdminLookupRequest(keys=packed(0, 3)))
        assert (looked.tiers, looked.pins, list(looked.pin_ttl_ms)) == (b"\1\1", b"\2\0", [0, 0])
        assert (await admin.Unpin(pb.UnpinRequest(keys=packed(0)))).unpinned == 1
        await store(h.stub, 6)
        found = await h.stub.Lookup(pb.LookupRequest(keys=packed(0, 6)))
        assert found.tiers == b"\0\1"


@pytest.mark.asyncio
async def test_a_tier_full_of_pins_refuses_a_put_and_evicts_nothing() -> None:
    async with serving(replace(SMALL, tiers=(CPU,))) as h:
        admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel)
        await store(h.stub, 0, 1, 2, 3)
        await admin.Pin(pb.PinRequest(keys=packed(0, 1, 2, 3), hard=True))
        results = await put(h.stub, [(key_of(4), make_block(key_of(4)))], 4096)
        assert [(r.outcome, r.code, r.reason) for r in results] == [
            (
                pb.PUT_OUTCOME_REJECTED,
                grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                "tiers: every tier that can hold this block is full of pinned blocks",
            )
        ]
        found = await h.stub.Lookup(pb.LookupRequest(keys=packed(0, 1, 2, 3)))
        assert found.tiers == b"\1\1\1\1"


@pytest.mark.asyncio
async def test_a_soft_pin_expires_and_its_ttl_is_capped() -> None:
    async with serving(replace(SMALL, tiers=(CPU,), pin_max_ttl_s=60.0)) as h:
        admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel)
        await store(h.stub, 0, 1)
        capped = await admin.Pin(pb.PinRequest(keys=packed(1), ttl_ms=3_600_000))
        assert capped.ttl_ms == 60_000
        short = await admin.Pin(pb.PinRequest(keys=packed(0), ttl_ms=300))
        assert (short.pinned, short.ttl_ms) == (1, 300)
        looked = await admin.AdminLookup(pb.AdminLookupRequest(keys=packed(0, 1)))
        assert looked.pins == b"\1\1"
        assert 0 < looked.pin_ttl_ms[1] <= 60_000

        async def expired() -> bool:
            reply = await admin.AdminLookup(pb.AdminLookupRequest(keys=packed(0)))
            return reply.pins == b"\0"

        await wait_until(expired, timeout_s=HANG_S, interval_s=0.05)
        # Key 0 is evictable again (the LRU), key 1 still pinned.
        await store(h.stub, 2, 3, 4)
        found = await h.stub.Lookup(pb.LookupRequest(keys=packed(0, 1, 2, 3, 4)))
        assert found.tiers == b"\0\1\1\1\1"


@pytest.mark.asyncio
async def test_pinned_bytes_count_against_the_quota_and_a_tenant_pins_its_own_blocks() -> None:
    async with tenant_serving(replace(AUTH, tiers=(CPU,), tenant_quota=3 * 4096)) as h:
        alice: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel(ALICE))
        await store(h.stub(ALICE), 0, 1, 2)
        await store(h.stub(BOB), 5)
        # Bob's key 5 is not in Alice's namespace: for her it is missing.
        reply = await alice.Pin(pb.PinRequest(keys=packed(0, 1, 5), hard=True))
        assert (reply.pinned, reply.missing, reply.pinned_bytes) == (2, 1, 2 * 4096)
        quota = await alice.GetQuota(pb.GetQuotaRequest())
        assert [(q.quota_bytes, q.used_bytes, q.pinned_bytes) for q in quota.tenants] == [
            (3 * 4096, 3 * 4096, 2 * 4096)
        ]
        bob: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel(BOB))
        stats = await bob.AdminLookup(pb.AdminLookupRequest(keys=packed(5, 0)))
        assert (stats.tiers, stats.pins) == (b"\1\0", b"\0\0")


@pytest.mark.asyncio
async def test_a_pin_past_the_quota_is_refused_and_a_deleted_block_loses_its_pin() -> None:
    async with tenant_serving(replace(AUTH, tiers=(CPU,), admin_tokens=ADMIN)) as h:
        alice: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel(ALICE))
        admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel(ADMIN))
        await store(h.stub(ALICE), 0, 1, 2)
        await alice.Pin(pb.PinRequest(keys=packed(0), hard=True))
        await h.stub(ALICE).Delete(pb.DeleteRequest(keys=packed(0)))
        looked = await alice.AdminLookup(pb.AdminLookupRequest(keys=packed(0)))
        assert (looked.tiers, looked.pins) == (b"\0", b"\0")
        await admin.SetQuota(pb.SetQuotaRequest(tenant="alice", quota_bytes=4096))
        assert (await alice.Pin(pb.PinRequest(keys=packed(1), hard=True))).pinned_bytes == 4096
        with pytest.raises(grpc.aio.AioRpcError) as over:
            await alice.Pin(pb.PinRequest(keys=packed(2), hard=True))
        assert over.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert over.value.details() == (
            "pin: 8192 pinned bytes would exceed tenant alice's quota of 4096 bytes "
            "(pinned bytes count against the quota)"
        )
        looked = await alice.AdminLookup(pb.AdminLookupRequest(keys=packed(1, 2)))
        assert looked.pins == b"\2\0"


@pytest.mark.asyncio
async def test_a_pinned_block_in_redis_keeps_no_ttl_until_unpinned(redis_clean: RedisProc) -> None:
    redis_url = redis_clean.url + "?ttl=600"
    config = replace(AUTH, tiers=(CPU, redis_url), write_through=True)
    async with tenant_serving(config) as h:
        alice: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel(ALICE))
        await store(h.stub(ALICE), 0, 1)
        tier = h.running.store.tiers[1]
        assert isinstance(tier, RedisTier)
        r = redis_clean.client()
        stored = [tier.redis_key(namespace_tag("alice") + key_of(i)) for i in (0, 1)]
        assert all(0 < r.ttl(k) <= 600 for k in stored)

        await alice.Pin(pb.PinRequest(keys=packed(0), hard=True))
        assert r.ttl(stored[0]) == -1  # no TTL while pinned
        assert 0 < r.ttl(stored[1]) <= 600
        # Demotion keeps the pin: the CPU copy of 0 stays (never evicted) while the others
        # move down; flushing the CPU tier's other blocks through puts leaves it resident.
        await store(h.stub(ALICE), 2, 3, 4, 5)
        found = await h.stub(ALICE).Lookup(pb.LookupRequest(keys=packed(0, 1)))
        assert found.tiers == b"\1\2"
        assert r.ttl(stored[0]) == -1

        await alice.Unpin(pb.UnpinRequest(keys=packed(0)))
        assert 0 < r.ttl(stored[0]) <= 600


@pytest.mark.asyncio
async def test_a_pin_taken_on_a_block_only_redis_holds_survives_its_promotion(
    redis_clean: RedisProc,
) -> None:
    redis_url = redis_clean.url + "?ttl=600"
    async with serving(replace(SMALL, tiers=(CPU, redis_url))) as h:
        admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel)
        await store(h.stub, 0, 1, 2, 3, 4)  # key 0 demoted to Redis (with the tier's TTL)
        found = await h.stub.Lookup(pb.LookupRequest(keys=packed(0)))
        assert found.tiers == b"\2"
        tier = h.running.store.tiers[1]
        assert isinstance(tier, RedisTier)
        r = redis_clean.client()
        assert 0 < r.ttl(tier.redis_key(key_of(0))) <= 600
        reply = await admin.Pin(pb.PinRequest(keys=packed(0), hard=True))
        # Pinning read the block's size from Redis (without promoting it).
        assert (reply.pinned, reply.pinned_bytes) == (1, 4096)
        assert r.ttl(tier.redis_key(key_of(0))) == -1
        assert (await h.stub.Lookup(pb.LookupRequest(keys=packed(0)))).tiers == b"\2"
        # A hit promotes it; in the CPU tier it is pinned too, so puts never evict it.
        blobs, _ = await get(h.stub, [key_of(0)])
        assert blobs == [make_block(key_of(0))]
        await store(h.stub, 5, 6, 7, 8)
        # Three unpinned pages: 5 went down to Redis when 8 came.
        found = await h.stub.Lookup(pb.LookupRequest(keys=packed(0, 5, 8)))
        assert found.tiers == b"\1\2\1"
        assert r.ttl(tier.redis_key(key_of(0))) == -1
