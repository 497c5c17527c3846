"""The Admin service's roles on a real server: admin token vs tenant tokens, stats, flush,
quotas and drain (pins: test_admin_pins.py; SIGTERM and restart: test_admin_process.py)."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.cache_server.config import ConfigError
from nopecache.cache_server.main import start_server
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL, STORED, get, key_of, make_block, put, serving
from tests.support.tenants import ALICE, AUTH, BOB, TenantHarness, rpc_code, tenant_serving

ADMIN = "admin-token-5e1d9b7c3a2f4680"
ADMIN_AUTH = replace(AUTH, admin_tokens=ADMIN)


def admin_stub(h: TenantHarness, token: str | None) -> cache_pb2_grpc.AdminAsyncStub:
    """An Admin stub on the harness channel that carries ``token``."""
    return cache_pb2_grpc.AdminStub(h.channel(token))


def packed(*indices: int) -> bytes:
    return b"".join(key_of(i) for i in indices)


@pytest.mark.asyncio
async def test_a_tenant_token_flushes_its_own_namespace_only() -> None:
    async with tenant_serving(ADMIN_AUTH) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        for stub in (alice, bob):
            results = await put(stub, [(key_of(i), make_block(key_of(i))) for i in range(3)], 4096)
            assert [r.outcome for r in results] == [STORED] * 3
        reply = await admin_stub(h, ALICE).Flush(pb.FlushRequest())
        assert (reply.deleted, reply.unpinned) == (3, 0)
        assert (await alice.Lookup(pb.LookupRequest(keys=packed(0, 1, 2)))).tiers == b"\0\0\0"
        assert (await bob.Lookup(pb.LookupRequest(keys=packed(0, 1, 2)))).tiers == b"\1\1\1"
        # Alice's charges went with her blocks; Bob's stay.
        quotas = await admin_stub(h, ADMIN).GetQuota(pb.GetQuotaRequest())
        used = {q.tenant: q.used_bytes for q in quotas.tenants}
        assert used == {"alice": 0, "bob": 3 * 4096}


@pytest.mark.asyncio
async def test_a_tenant_token_cannot_reach_another_tenant_nor_admin_verbs() -> None:
    async with tenant_serving(ADMIN_AUTH) as h:
        a = admin_stub(h, ALICE)
        for call in (
            lambda: a.Flush(pb.FlushRequest(tenant="bob")),
            lambda: a.Flush(pb.FlushRequest(all=True)),
            lambda: a.Pin(pb.PinRequest(keys=packed(0), tenant="bob", hard=True)),
            lambda: a.AdminLookup(pb.AdminLookupRequest(keys=packed(0), tenant="bob")),
            lambda: a.Drain(pb.DrainRequest()),
            lambda: a.SetQuota(pb.SetQuotaRequest(tenant="alice", quota_bytes=1)),
            lambda: a.GetQuota(pb.GetQuotaRequest(tenant="bob")),
        ):
            assert await rpc_code(call) == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await a.Drain(pb.DrainRequest())
        assert denied.value.details() == "drain: needs an admin token"
        # Its own quota it may read.
        mine = await a.GetQuota(pb.GetQuotaRequest())
        assert [q.tenant for q in mine.tenants] == ["alice"]


@pytest.mark.asyncio
async def test_tokens_are_checked_on_the_admin_service() -> None:
    async with tenant_serving(ADMIN_AUTH) as h:
        for token in (None, "not-a-known-token-at-all"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin_stub(h, token).AdminStats(pb.AdminStatsRequest())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The admin token is not a tenant token: it stores nothing.
        code = await rpc_code(lambda: h.stub(ADMIN).Lookup(pb.LookupRequest(keys=packed(0))))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        unknown = admin_stub(h, ADMIN).Flush(pb.FlushRequest(tenant="carol"))
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await unknown
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert missing.value.details() == "tenant: no tenant 'carol' (known: alice, bob)"


@pytest.mark.asyncio
async def test_admin_flushes_everything_and_sets_quotas_at_run_time() -> None:
    async with tenant_serving(ADMIN_AUTH) as h:
        for stub in (h.stub(ALICE), h.stub(BOB)):
            await put(stub, [(key_of(i), make_block(key_of(i))) for i in range(2)], 4096)
        admin = admin_stub(h, ADMIN)
        reply = await admin.SetQuota(pb.SetQuotaRequest(tenant="alice", quota_bytes=3 * 4096))
        assert [(q.tenant, q.quota_bytes, q.used_bytes) for q in reply.tenants] == [
            ("alice", 3 * 4096, 2 * 4096)
        ]
        # The new quota applies to the next call: a third page fits, a fourth does not.
        fits = await put(h.stub(ALICE), [(key_of(7), make_block(key_of(7)))], 4096)
        assert [r.outcome for r in fits] == [STORED]
        over = await put(h.stub(ALICE), [(key_of(8), make_block(key_of(8)))], 4096)
        assert [(r.outcome, r.code) for r in over] == [(pb.PUT_OUTCOME_REJECTED, 8)]
        flushed = await admin.Flush(pb.FlushRequest(all=True))
        assert flushed.deleted == 5
        stats = await admin.AdminStats(pb.AdminStatsRequest())
        assert [(t.name, t.entries) for t in stats.tiers] == [("cpu", 0)]
        assert {(t.tenant, t.entries, t.used_bytes) for t in stats.tenants} == {
            ("alice", 0, 0),
            ("bob", 0, 0),
        }


@pytest.mark.asyncio
async def test_stats_count_hits_misses_and_pages_per_tenant() -> None:
    async with tenant_serving(ADMIN_AUTH) as h:
        alice = h.stub(ALICE)
        await put(alice, [(key_of(i), make_block(key_of(i))) for i in range(2)], 4096)
        blobs, _ = await get(alice, [key_of(0), key_of(1), key_of(5)])
        assert blobs[2] is None
        stats = await admin_stub(h, ADMIN).AdminStats(pb.AdminStatsRequest(tenant="alice"))
        (mine,) = stats.tenants
        assert (mine.tenant, mine.entries, mine.used_bytes, mine.pages) == ("alice", 2, 8192, 2)
        assert (mine.hits, mine.misses, mine.in_flight) == (2, 1, 0)
        (cpu,) = stats.tiers
        assert (cpu.name, cpu.entries, cpu.pages, cpu.hits, cpu.evictions) == ("cpu", 2, 2, 2, 0)
        assert (stats.misses, stats.page_bytes, stats.draining) == (1, 4096, False)
        # A tenant sees its own numbers only: tier occupancy over its blocks.
        own = await admin_stub(h, BOB).AdminStats(pb.AdminStatsRequest())
        assert [t.tenant for t in own.tenants] == ["bob"]
        assert [(t.entries, t.used_bytes, t.hits) for t in own.tiers] == [(0, 0, 0)]


@pytest.mark.asyncio
async def test_without_tokens_every_caller_is_the_admin_and_drain_refuses_puts() -> None:
    async with serving(SMALL) as h:
        admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(h.channel)
        health = health_pb2_grpc.HealthStub(h.channel)
        await put(h.stub, [(key_of(1), make_block(key_of(1)))], h.frame_bytes)
        reply = await admin.Drain(pb.DrainRequest(wait=True, timeout_ms=30_000))
        assert (reply.draining, reply.in_flight) == (True, 0)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await put(h.stub, [(key_of(2), make_block(key_of(2)))], h.frame_bytes)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == (
            "server: draining (leaving rotation), it admits no new Put; store elsewhere"
        )
        # What is stored is still served while draining.
        blobs, _ = await get(h.stub, [key_of(1)])
        assert blobs == [make_block(key_of(1))]
        assert (await admin.AdminStats(pb.AdminStatsRequest())).draining


@pytest.mark.asyncio
async def test_an_admin_token_equal_to_a_tenant_token_fails_start_up() -> None:
    with pytest.raises(ConfigError, match="admin_tokens: a token is also a tenant token"):
        await start_server(replace(AUTH, admin_tokens=ALICE))
