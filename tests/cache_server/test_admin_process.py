"""Drain and restart with real processes: SIGTERM takes a server out of rotation (new Puts
refused UNAVAILABLE) while an in-flight Put finishes within the grace; the process exits
0; a server restarted behind the same Redis serves what Redis holds (real Redis)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.redis_procs import RedisProc
from tests.support.server_harness import STORED, get, key_of, make_block, put
from tests.support.server_procs import ServerFactory

# 20 s of grace: far more than the in-flight Put below needs once released (milliseconds
# on an idle machine), so the test's outcome never depends on the machine's load.
GRACE = ("--shutdown-grace-s", "20")
FRAME = 4096
DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


async def _refused_put(address: str) -> grpc.StatusCode:
    """The status a new Put on a fresh connection ends with (OK when it was stored)."""
    async with grpc.aio.insecure_channel(address) as fresh:
        stub = cache_pb2_grpc.KVCacheStub(fresh)
        try:
            await put(stub, [(key_of(50), make_block(key_of(50)))], FRAME)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def _sigterm_during_a_put(address: str, proc_signal: object) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        stored = await put(stub, [(key_of(1), make_block(key_of(1)))], FRAME)
        assert [r.outcome for r in stored] == [STORED]

        blob = make_block(key_of(2), tokens=64, head_dim=64)
        release = asyncio.Event()
        sent_first = asyncio.Event()

        async def frames() -> AsyncIterator[pb.PutFrame]:
            yield pb.PutFrame(key=key_of(2), total_size=len(blob), data=blob[:FRAME])
            sent_first.set()
            await release.wait()
            for i in range(FRAME, len(blob), FRAME):
                yield pb.PutFrame(data=blob[i : i + FRAME])

        in_flight = stub.Put(frames())
        await sent_first.wait()
        # The first frame left the client; the call is in flight once the server runs it
        # (on a loaded machine that can be much later): wait for the server to say so.
        admin = cache_pb2_grpc.AdminStub(channel)
        deadline = time.monotonic() + 30  # a hang guard
        while (await admin.AdminStats(pb.AdminStatsRequest())).in_flight < 1:
            assert time.monotonic() < deadline, "the Put never reached the server"
            await asyncio.sleep(0.01)
        proc_signal(signal.SIGTERM)  # type: ignore[operator]
        # Out of rotation: a new Put is refused, UNAVAILABLE by the drain or by the closed
        # listener, or CANCELLED when it reaches gRPC as it shuts down; the client treats
        # both as a server down (client/health.py): its keys miss and it stores elsewhere.
        # When depends on how soon the server runs its signal handler, so ask until
        # refused (30 s: a hang guard on a loaded machine).
        deadline = time.monotonic() + 30
        while (code := await _refused_put(address)) not in DOWN:
            assert code == grpc.StatusCode.OK, code
            assert time.monotonic() < deadline, "new Puts are still admitted after SIGTERM"
            await asyncio.sleep(0.02)
        release.set()
        reply = await in_flight
        assert [(r.key, r.outcome) for r in reply.results] == [(key_of(2), STORED)]


@pytest.mark.asyncio
async def test_sigterm_drains_then_a_restart_serves_what_redis_holds(
    cache_servers: ServerFactory, redis_clean: RedisProc
) -> None:
    (server,) = cache_servers(1, redis_url=redis_clean.url, extra_args=GRACE)
    assert server.proc is not None
    await _sigterm_during_a_put(server.address, server.proc.send_signal)
    assert server.proc.wait(timeout=60) == 0  # a hang guard: exits once the Put is done
    log = server.log_tail()
    assert "shutting down: finishing in-flight requests (grace 20.0s)" in log
    assert log.rstrip().endswith("stopped")

    server.start()  # same port, same Redis, an empty CPU tier
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        looked = await stub.Lookup(pb.LookupRequest(keys=key_of(1) + key_of(2)))
        assert (list(looked.tier_names), looked.tiers) == (["cpu", "redis"], b"\2\2")
        blobs, frames = await get(stub, [key_of(1), key_of(2)])
        assert blobs == [make_block(key_of(1)), make_block(key_of(2), tokens=64, head_dim=64)]
        assert [f.tier for f in frames if f.tier] == [2, 2]
        # Served from Redis, promoted as any hit below the top.
        looked = await stub.Lookup(pb.LookupRequest(keys=key_of(1) + key_of(2)))
        assert looked.tiers == b"\1\1"
    server.stop()
