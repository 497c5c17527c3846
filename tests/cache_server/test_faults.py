"""Faults with real processes: Redis killed and restarted under load, the server SIGKILLed
mid-stream, a Redis value damaged on purpose, and a slow Redis behind a delaying proxy.
A cache may lose entries; it must never serve wrong bytes, return errors for what are
only misses, or let a sick backend stretch its latency past its own timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import random
import time
from dataclasses import replace

import grpc
import pytest

from nopecache.cache_server.main import RunningServer, start_server
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.redis_procs import RedisProc
from tests.support.server_harness import SMALL, STORED, get, key_of, make_block, put
from tests.support.server_procs import ServerFactory
from tests.support.tenants import TenantHarness, tenant_serving
from tests.support.waiting import wait_until

BIG_CPU = "cpu://?capacity=4MiB&page=4KiB&pinned=no"
# A hang guard, not a timing: each wait is for an event that takes well under a second on
# an idle machine; a loaded 2-core machine (load ~6) may take many times that.
HANG_S = 60.0


def redis_key(key: bytes) -> bytes:
    """Where the Redis tier keeps a block of the anonymous tenant."""
    return b"nc:" + key


async def redis_healthy(h: TenantHarness) -> bool:
    """Whether Stats reports the Redis tier healthy."""
    stats = await h.stub(None).Stats(pb.StatsRequest())
    return [t.healthy for t in stats.tiers if t.name == "redis"] == [True]


def _stack(task: asyncio.Task[None]) -> str:
    """Where a task is waiting (for a failure message)."""
    out = io.StringIO()
    task.print_stack(limit=40, file=out)
    return out.getvalue()


async def redis_down(h: TenantHarness) -> bool:
    """Whether Stats reports the Redis tier unhealthy."""
    return not await redis_healthy(h)


# -- Redis killed and restarted under load -------------------------------------------------
@pytest.mark.asyncio
async def test_redis_killed_and_restarted_under_load(redis_disposable: RedisProc) -> None:
    config = replace(SMALL, tiers=(BIG_CPU, redis_disposable.url), write_through=True)
    async with tenant_serving(config) as h:
        stub = h.stub(None)
        # Blocks that live in Redis only, asked for once Redis is gone (a hit before would
        # promote them): misses then, not errors, and still after Redis comes back empty.
        remote = [key_of(900 + i) for i in range(4)]
        await put(stub, [(k, make_block(k)) for k in remote], h.frame_bytes)
        for k in remote:
            await h.running.store.tiers[0].delete(k)
        errors: list[str] = []
        served: dict[str, int] = {"hit": 0, "miss": 0}
        stop, gone = asyncio.Event(), asyncio.Event()

        async def client(n: int) -> None:
            rng = random.Random(n)
            keys = [key_of(1000 * n + i) for i in range(6)]
            blobs = {k: make_block(k, tokens=8 + i) for i, k in enumerate(keys)}
            while not stop.is_set():
                try:
                    chosen = rng.sample(keys, 3)
                    results = await put(stub, [(k, blobs[k]) for k in chosen], h.frame_bytes)
                    if {r.outcome for r in results} - {STORED, pb.PUT_OUTCOME_ALREADY_PRESENT}:
                        errors.append(f"put: {results}")
                    got, _ = await get(stub, [*chosen, *(remote if gone.is_set() else ())])
                    for k, blob in zip(chosen, got, strict=False):
                        if blob != blobs[k]:  # in the CPU tier: must be a hit, and exact
                            errors.append(f"get {k.hex()}: {'miss' if blob is None else 'wrong'}")
                    for blob in got[3:]:
                        served["miss" if blob is None else "hit"] += 1
                    await stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
                except grpc.aio.AioRpcError as e:
                    errors.append(f"{e.code().name}: {e.details()}")
                await asyncio.sleep(0.005)

        async def misses_above(n: int) -> bool:
            return served["miss"] > n

        tasks = [asyncio.create_task(client(n)) for n in range(6)]
        await asyncio.sleep(0.4)  # traffic before the kill; nothing below counts on it
        redis_disposable.kill()
        gone.set()
        await wait_until(lambda: redis_down(h), timeout_s=HANG_S, interval_s=0.1)
        # Events, not durations: clients were served misses while Redis was down, and
        # again once it is back (empty), however slowly a loaded machine runs them.
        await wait_until(lambda: misses_above(0), timeout_s=HANG_S, interval_s=0.1)
        redis_disposable.start()
        await wait_until(lambda: redis_healthy(h), timeout_s=HANG_S, interval_s=0.1)
        back = served["miss"]
        await wait_until(lambda: misses_above(back), timeout_s=HANG_S, interval_s=0.1)
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=30)
        assert not pending, "clients stuck:\n" + "\n".join(_stack(t) for t in pending)

        assert errors == []
        assert served["hit"] == 0 and served["miss"] > 0
        # Redis came back empty (a cache has nothing to lose); new blocks reach it again.
        fresh = key_of(777_777)
        await put(stub, [(fresh, make_block(fresh))], h.frame_bytes)
        with redis_disposable.client() as r:
            assert r.exists(redis_key(fresh)) == 1
            assert r.exists(*(redis_key(k) for k in remote)) == 0


# -- the server killed mid-stream ----------------------------------------------------------
@pytest.mark.asyncio
async def test_server_killed_mid_stream_fails_the_call_and_a_restart_serves(
    cache_servers: ServerFactory,
) -> None:
    (server,) = cache_servers(1, tiers=("cpu://?capacity=64MiB&pinned=no",))
    keys = [key_of(i) for i in range(48)]
    blob_of = {k: make_block(k, tokens=1000, head_dim=64) for k in keys}  # ~250 KiB each
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        results = await put(stub, list(blob_of.items()), 4 << 20)
        assert [r.outcome for r in results] == [STORED] * len(keys)

        stream = stub.Get(pb.GetRequest(keys=b"".join(keys)))
        first = await stream.read()
        assert isinstance(first, pb.GetFrame) and first.index == 0
        # The client stops reading, so flow control holds most of the 12 MiB on the server.
        server.kill()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await stream.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        server.start()
        got, _ = await get(stub, keys[:2])
        assert got == [None, None]  # a restarted cache is empty: nothing to lose
        again = await put(stub, [(keys[0], blob_of[keys[0]])], 4 << 20)
        assert [r.outcome for r in again] == [STORED]
        got, _ = await get(stub, keys[:1])
        assert got == [blob_of[keys[0]]]


# -- a damaged value in Redis --------------------------------------------------------------
def _damage(value: bytes, how: str) -> bytes:
    b = bytearray(value)
    if how == "truncated":
        return bytes(b[: len(b) // 2])
    offset = {"frame header": 5, "middle": len(b) // 2, "checksum": len(b) - 1}[how]
    b[offset] ^= 0x5A
    return bytes(b)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["frame header", "middle", "checksum", "truncated"])
async def test_damaged_redis_value_is_detected_deleted_and_never_served(
    redis_clean: RedisProc, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = replace(SMALL, tiers=(BIG_CPU, redis_clean.url), write_through=True)
    async with tenant_serving(config) as h:
        stub = h.stub(None)
        key, other = key_of(1), key_of(2)
        await put(stub, [(key, make_block(key)), (other, make_block(other))], h.frame_bytes)
        for k in (key, other):
            await h.running.store.tiers[0].delete(k)  # served from Redis from now on
        with redis_clean.client() as r:
            value = r.get(redis_key(key))
            assert isinstance(value, bytes)
            r.set(redis_key(key), _damage(value, how))

        with caplog.at_level(logging.WARNING, logger="nopecache.cache_server.tiers.redis"):
            got, frames = await get(stub, [key, other])
        assert got == [None, make_block(other)]
        assert frames[0].tier == 0
        assert "damaged value(s) deleted" in caplog.text
        assert key.hex() in caplog.text
        with redis_clean.client() as r:
            assert r.exists(redis_key(key)) == 0
        await h.running.refresh_tiers()
        assert h.sample("nopecache_corrupt_blocks_total", {"tier": "redis"}) == 1
        lookup = await stub.Lookup(pb.LookupRequest(keys=key + other))
        assert lookup.tiers == b"\x00\x01"  # the intact block was promoted on its hit


# -- a slow Redis ------------------------------------------------------------------------
class DelayProxy:
    """A TCP proxy in front of Redis that holds every reply for ``delay_s`` seconds."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.delay_s = 0.0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening and cut every proxied connection."""
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        for task in (
            asyncio.create_task(self._pipe(reader, up_writer, delayed=False)),
            asyncio.create_task(self._pipe(up_reader, writer, delayed=True)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, delayed: bool
    ) -> None:
        try:
            while data := await reader.read(1 << 16):
                if delayed and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()


@pytest.mark.asyncio
async def test_slow_redis_costs_at_most_the_tier_timeout(redis_clean: RedisProc) -> None:
    proxy = DelayProxy(redis_clean.port)
    await proxy.start()
    # timeout=0.25 s per Redis reply; the proxy will hold replies for 3 s.
    url = f"redis://127.0.0.1:{proxy.port}/0?timeout=0.25"
    config = replace(SMALL, tiers=(BIG_CPU, url), write_through=True)
    try:
        async with tenant_serving(config) as h:
            stub = h.stub(None)
            local, remote = key_of(1), key_of(2)
            await put(stub, [(local, make_block(local)), (remote, make_block(remote))], 1 << 16)
            await h.running.store.tiers[0].delete(remote)

            proxy.delay_s = 3.0
            started = time.monotonic()
            got, _ = await get(stub, [local, remote])
            elapsed = time.monotonic() - started
            assert got == [make_block(local), None]  # the remote block became a miss
            assert elapsed < 2.0, elapsed  # bounded by the tier's timeouts, not the 3 s
            assert not await redis_healthy(h)
            # While the breaker is open, Redis is not even asked: a miss at once.
            assert (await stub.Lookup(pb.LookupRequest(keys=local + remote))).tiers == b"\x01\x00"

            proxy.delay_s = 0.0
            await wait_until(lambda: redis_healthy(h), timeout_s=HANG_S, interval_s=0.1)
            got, _ = await get(stub, [remote])
            assert got == [make_block(remote)]
    finally:
        await proxy.close()


# -- shutdown while a backend misbehaves ---------------------------------------------------
@pytest.mark.asyncio
async def test_stop_returns_when_a_tier_call_swallows_the_cancel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    in_monitor = asyncio.Event()

    async def swallowing_refresh(self: RunningServer) -> None:
        calls.append(1)
        if len(calls) > 1:  # the first call is start_server's own, before the monitor
            in_monitor.set()
        if len(calls) == 2:
            # What redis-py may do with a cancel that lands inside a command: finish
            # normally. (Once only, so that a failing test can still be torn down.)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(2.0)

    monkeypatch.setattr(RunningServer, "refresh_tiers", swallowing_refresh)
    running = await start_server(SMALL, monitor_interval_s=0.01)
    await asyncio.wait_for(in_monitor.wait(), 10)
    # The monitor is inside a refresh (2 s) when stop() cancels it.
    stopping = asyncio.create_task(running.stop(grace_s=0.1))
    done, _ = await asyncio.wait({stopping}, timeout=1.5)
    assert done == {stopping}, "stop() is still waiting for the monitor loop"
