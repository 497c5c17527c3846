"""Nobody locks the others out through the server's call limits: calls without a token
(health, reflection) are capped per peer, and a principal (a tenant with auth, a
connection without) past the global cap is admitted only within its fair share, so a
well-behaved client's calls keep succeeding while others hold every slot they can.

Real servers on loopback; the attacks of issue 25 scaled down (a cap of 32 calls instead
of 1024) so that they still fill the cap on today's code.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL, frames_of, key_of, make_block, serving
from tests.support.tenants import ALICE, AUTH, BOB, open_channel, tenant_serving
from tests.support.waiting import wait_until

CAROL = "carol-token-5e1b9d7a3c2f4086"
CAP = 32
# A fresh subchannel per channel: each channel is its own connection (its own client
# without auth).
OWN_CONNECTION = [*SMALL.grpc_options, ("grpc.use_local_subchannel_pool", 1)]


async def stalled_put(
    stub: cache_pb2_grpc.KVCacheAsyncStub, key: bytes, release: asyncio.Event
) -> pb.PutReply:
    """A Put that sends one small block and then holds its stream until ``release``."""
    frames = frames_of([(key, make_block(key))], 1 << 16)

    async def requests() -> AsyncIterator[pb.PutFrame]:
        for f in frames:
            yield f
        await release.wait()

    reply: pb.PutReply = await stub.Put(requests())
    return reply


async def lookups_ok(stub: cache_pb2_grpc.KVCacheAsyncStub, n: int) -> int:
    """How many of ``n`` Lookups succeed."""
    ok = 0
    for i in range(n):
        try:
            await stub.Lookup(pb.LookupRequest(keys=key_of(i)), timeout=10)
            ok += 1
        except grpc.aio.AioRpcError:
            pass
    return ok


@pytest.mark.asyncio
async def test_a_tokenless_watch_flood_does_not_take_the_tenants_calls() -> None:
    config = replace(AUTH, max_concurrent_rpcs=CAP)
    async with tenant_serving(config) as h:
        flooder = open_channel(h.running.address, options=OWN_CONNECTION)
        health = health_pb2_grpc.HealthStub(flooder)
        watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(CAP + 8)]

        async def first(call: grpc.aio.UnaryStreamCall) -> bool:
            try:
                await call.read()
                return True
            except grpc.aio.AioRpcError:
                return False

        served = await asyncio.gather(*(first(w) for w in watches))
        assert await lookups_ok(h.stub(ALICE), 20) == 20
        # Probes keep working, but one peer gets a few of them, never the whole cap.
        assert 1 <= sum(served) < CAP // 2
        # A client that connects during the flood is served too.
        late = open_channel(h.running.address, token=BOB, options=OWN_CONNECTION)
        assert await lookups_ok(cache_pb2_grpc.KVCacheStub(late), 5) == 5
        for w in watches:
            w.cancel()
        await late.close(None)
        await flooder.close(None)


@pytest.mark.asyncio
async def test_stalled_puts_of_other_tenants_leave_a_tenant_its_calls() -> None:
    tokens = f"{ALICE} alice; {BOB} bob; {CAROL} carol"
    config = replace(AUTH, auth_tokens=tokens, max_concurrent_rpcs=CAP, max_streams_per_client=CAP)
    async with tenant_serving(config) as h:
        release = asyncio.Event()
        held = [
            asyncio.ensure_future(stalled_put(h.stub(token), key_of(1000 * t + i), release))
            for t, token in enumerate((ALICE, BOB))
            for i in range(CAP // 2 + 4)
        ]
        await wait_until(lambda: h.running.gate.limiter.in_flight() >= CAP, timeout_s=30.0)
        assert await lookups_ok(h.stub(CAROL), 20) == 20
        release.set()
        await asyncio.gather(*held, return_exceptions=True)


@pytest.mark.asyncio
async def test_stalled_puts_over_many_connections_leave_another_connection_its_calls() -> None:
    config = replace(SMALL, max_concurrent_rpcs=CAP, max_streams_per_client=CAP // 2)
    async with serving(config) as h:
        release = asyncio.Event()
        attackers = [open_channel(h.running.address, options=OWN_CONNECTION) for _ in range(3)]
        held = [
            asyncio.ensure_future(
                stalled_put(cache_pb2_grpc.KVCacheStub(c), key_of(100 * n + i), release)
            )
            for n, c in enumerate(attackers)
            for i in range(CAP // 2)
        ]
        await wait_until(lambda: h.running.gate.limiter.in_flight() >= CAP, timeout_s=30.0)
        victim = open_channel(h.running.address, options=OWN_CONNECTION)
        assert await lookups_ok(cache_pb2_grpc.KVCacheStub(victim), 20) == 20
        release.set()
        await asyncio.gather(*held, return_exceptions=True)
        for c in [*attackers, victim]:
            await c.close(None)
