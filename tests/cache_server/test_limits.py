"""Limits that keep one client from starving the others: concurrent calls per client
(RESOURCE_EXHAUSTED past the limit), message size, and deadlines that end a call on the
server too (a hung Redis does not hold a request past its deadline). Real server, real
redis-server (stopped with SIGSTOP to hang it)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.redis_procs import RedisProc
from tests.support.server_harness import (
    SMALL,
    STORED,
    digest,
    frames_of,
    get,
    key_of,
    make_block,
    put,
)
from tests.support.tenants import ALICE, AUTH, BOB, TenantHarness, rpc_code, tenant_serving
from tests.support.waiting import wait_until

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


def held_put(
    stub: cache_pb2_grpc.KVCacheAsyncStub, release: asyncio.Event, key: bytes
) -> grpc.aio.StreamUnaryCall:
    """A Put that sends one block, then keeps its stream open until ``release`` is set."""
    frames = frames_of([(key, make_block(key))], 1 << 16)

    async def requests() -> AsyncIterator[pb.PutFrame]:
        for f in frames:
            yield f
        await release.wait()

    return stub.Put(requests())


# -- concurrent calls ----------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_tenant_over_its_stream_limit_is_refused_and_others_are_not() -> None:
    async with tenant_serving(replace(AUTH, max_streams_per_client=2)) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        limiter = h.running.gate.limiter
        release = asyncio.Event()
        held = [held_put(alice, release, key_of(i)) for i in range(2)]
        await wait_until(lambda: limiter.in_flight("alice") == 2, timeout_s=10.0)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await alice.Lookup(pb.LookupRequest(keys=key_of(0)))
        assert err.value.code() == EXHAUSTED
        assert err.value.details() == (
            "max_streams_per_client: 2 calls already in flight for this tenant"
        )
        # Another tenant is not starved.
        assert (await bob.Lookup(pb.LookupRequest(keys=key_of(0)))).tiers == b"\x00"

        release.set()
        replies = [await call for call in held]
        assert [r.results[0].outcome for r in replies] == [STORED, STORED]
        assert limiter.in_flight() == 0
        lookup = await alice.Lookup(pb.LookupRequest(keys=key_of(0) + key_of(1)))
        assert lookup.tiers == b"\x01\x01"
        assert (
            h.sample(
                "nopecache_tenant_rejected_total", {"tenant": "alice", "reason": "too_many_streams"}
            )
            == 1
        )
        assert (
            h.sample(
                "nopecache_requests_rejected_total",
                {"method": "Lookup", "reason": "too_many_streams"},
            )
            == 1
        )


@pytest.mark.asyncio
async def test_without_auth_the_limit_is_per_connection() -> None:
    async with tenant_serving(replace(SMALL, max_streams_per_client=1)) as h:
        busy = h.stub(None)
        # A channel of its own connection (gRPC shares one between equal channels).
        own = [*SMALL.grpc_options, ("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(h.running.address, options=own) as channel:
            idle = cache_pb2_grpc.KVCacheStub(channel)
            release = asyncio.Event()
            call = held_put(busy, release, key_of(1))
            await wait_until(lambda: h.running.gate.limiter.in_flight() == 1, timeout_s=10.0)
            assert await rpc_code(lambda: busy.Stats(pb.StatsRequest())) == EXHAUSTED
            assert await rpc_code(lambda: idle.Stats(pb.StatsRequest())) == grpc.StatusCode.OK
            release.set()
            assert (await call).results[0].outcome == STORED
        assert h.running.gate.limiter.in_flight() == 0


# -- message size --------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_message_over_max_message_bytes_is_refused_and_stores_nothing() -> None:
    async with tenant_serving(SMALL) as h:
        await put(h.stub(None), [(key_of(1), make_block(key_of(1)))], h.frame_bytes)
        # A client without a send limit of its own, so the server is the one refusing.
        async with grpc.aio.insecure_channel(h.running.address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            before = await digest(stub, [key_of(1), key_of(2)])
            too_big = key_of(1) * (SMALL.max_message_bytes // 16 + 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Delete(pb.DeleteRequest(keys=too_big))
            assert err.value.code() == EXHAUSTED
            assert "SERVER: Received message larger than max" in (err.value.details() or "")
            # A complete valid block, then a frame over the limit: the stream is refused
            # by the transport, and the block before it must not be stored either.
            frames = [
                *frames_of([(key_of(2), make_block(key_of(2)))], 1 << 16),
                pb.PutFrame(data=bytes(SMALL.max_message_bytes + 10)),
            ]
            assert await rpc_code(lambda: stub.Put(_aiter(frames))) == EXHAUSTED
            await wait_until(lambda: h.running.gate.limiter.in_flight() == 0, timeout_s=10.0)
            assert await digest(stub, [key_of(1), key_of(2)]) == before


async def _aiter(frames: list[pb.PutFrame]) -> AsyncIterator[pb.PutFrame]:
    for f in frames:
        yield f


@pytest.mark.asyncio
async def test_a_put_cancelled_by_the_client_stores_nothing() -> None:
    async with tenant_serving(SMALL) as h:
        stub = h.stub(None)
        release = asyncio.Event()
        call = held_put(stub, release, key_of(3))
        await wait_until(lambda: h.running.gate.limiter.in_flight() == 1, timeout_s=10.0)
        await asyncio.sleep(0.05)  # the block has reached the server
        call.cancel()
        await wait_until(lambda: h.running.gate.limiter.in_flight() == 0, timeout_s=10.0)
        assert (await stub.Lookup(pb.LookupRequest(keys=key_of(3)))).tiers == b"\x00"


# -- deadlines -----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_put_past_its_deadline_stores_nothing() -> None:
    async with tenant_serving(SMALL) as h:
        stub = h.stub(None)
        keys = [key_of(1), key_of(2)]
        frames = frames_of([(k, make_block(k)) for k in keys], 1 << 16)

        async def stalls() -> AsyncIterator[pb.PutFrame]:
            for f in frames:
                yield f
            await asyncio.sleep(30)

        assert await rpc_code(lambda: stub.Put(stalls(), timeout=0.3)) == DEADLINE
        await wait_until(lambda: h.running.gate.limiter.in_flight() == 0, timeout_s=10.0)
        lookup = await stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert lookup.tiers == b"\x00\x00"


@pytest.mark.asyncio
async def test_a_hung_redis_does_not_hold_a_get_past_its_deadline(
    redis_disposable: RedisProc,
) -> None:
    # Redis read timeout of 30 s: only the call's deadline can end the wait.
    tiers = ("cpu://?capacity=64KiB&page=4KiB&pinned=no", f"{redis_disposable.url}?timeout=30")
    async with tenant_serving(replace(SMALL, tiers=tiers, write_through=True)) as h:
        stub = h.stub(None)
        keys = [key_of(i) for i in range(9)]
        results = await put(stub, [(k, make_block(k)) for k in keys], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED] * 9
        # The ninth block is in Redis only: the first Get window (8 keys) is served from
        # the CPU tier, the second one waits on Redis.
        await h.running.store.tiers[0].delete(keys[8])
        assert redis_disposable.proc is not None
        redis_disposable.proc.send_signal(signal.SIGSTOP)
        try:
            await _get_stops_at_its_deadline(h, stub, keys)
        finally:
            redis_disposable.proc.send_signal(signal.SIGCONT)
        got, _ = await get(stub, keys[8:])
        assert got == [make_block(keys[8])]


async def _get_stops_at_its_deadline(
    h: TenantHarness, stub: cache_pb2_grpc.KVCacheAsyncStub, keys: list[bytes]
) -> None:
    frames: list[pb.GetFrame] = []
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for frame in stub.Get(pb.GetRequest(keys=b"".join(keys)), timeout=0.5):
            frames.append(frame)
    assert err.value.code() == DEADLINE
    assert [f.index for f in frames] == list(range(8))
    # The server dropped the call too: nothing is left in flight although Redis still hangs.
    await wait_until(lambda: h.running.gate.limiter.in_flight() == 0, timeout_s=5.0)
    assert time.monotonic() - started < 10.0
