"""ServerConnection against real server processes on loopback: the frame codec, framing by
the server's limits, and server failures turned into misses (never exceptions)."""

from __future__ import annotations

import asyncio
import time

import pytest

from nopecache.client.buffers import BufferPool
from nopecache.client.config import ClientConfig, RetryPolicy
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.metrics import ClientMetrics
from nopecache.client.transport import ServerConnection, StoreStatus
from nopecache.proto.block import StoredForm, build_block
from tests.support.server_harness import key_of
from tests.support.server_procs import CacheServerProc, ServerFactory

# Small frames so that blocks of a few KiB travel in several frames.
SMALL_FRAMES = ["--max-message-bytes", "64KiB", "--max-keys-per-request", "3"]


def blob_of(key: bytes, tokens: int) -> bytes:
    """A valid float16 block for ``key`` (1 layer, 1 head, head_dim 64)."""
    payload = (key * (tokens * 64 * 2 * 2 // 16 + 1))[: tokens * 64 * 2 * 2]
    return build_block(
        key=key,
        fingerprint=b"transport-test",
        form=StoredForm.NOPE,
        dtype="float16",
        shape=(1, tokens, 1, 64),
        v_head_dim=64,
        token_ids=list(range(tokens)),
        payload=payload,
    )


def config(*servers: str, **changes: object) -> ClientConfig:
    """A client config without retries (failures show at once) and short deadlines."""
    fields: dict[str, object] = {
        "retry": RetryPolicy(max_attempts=1),
        "down_backoff_s": 0.3,
        "get_timeout_s": 10.0,
        **changes,
    }
    return ClientConfig(servers=servers, **fields)  # type: ignore[arg-type]


# -- buffer pool -------------------------------------------------------------------------------
def test_pool_reuses_given_back_buffers_of_the_same_size_class() -> None:
    pool = BufferPool(max_bytes=3 * 1024 * 1024)
    first = pool.take(1_500_000)
    assert first.nbytes == 1_500_000 and not first.readonly
    first[:3] = b"abc"
    buffer = first.obj
    pool.give(first)
    assert pool.pooled_bytes == 2 * 1024 * 1024  # 1.5 MB rounds up to a 2 MiB class
    again = pool.take(2_000_000)  # same class: the same memory comes back
    assert again.obj is buffer and again.nbytes == 2_000_000 and pool.pooled_bytes == 0
    other = pool.take(100)  # another class: fresh memory
    assert other.obj is not buffer
    pool.give(memoryview(b"not from the pool"))  # ignored
    pool.give(again)
    pool.give(pool.take(2 * 1024 * 1024 + 1))  # 3 MiB class: over max_bytes, not kept
    assert pool.pooled_bytes == 2 * 1024 * 1024


# -- against a server --------------------------------------------------------------------------
async def _round_trip(server: CacheServerProc) -> None:
    conn = ServerConnection(server.address, config(server.address))
    keys = [key_of(i) for i in range(7)]
    blobs = [blob_of(k, tokens=40 * (i + 1)) for i, k in enumerate(keys)]  # 20..140 KiB
    results = await conn.put(list(zip(keys, blobs, strict=True)))
    assert [r.status for r in results] == [StoreStatus.STORED] * 7
    again = await conn.put([(keys[0], blobs[0]), (keys[6], memoryview(blobs[6]))])
    assert [r.status for r in again] == [StoreStatus.ALREADY_PRESENT] * 2
    info = conn.info
    assert info is not None and info.limits.max_keys_per_request == 3
    assert info.limits.max_frame_data_bytes == 64 * 1024 - 4096
    missing = key_of(99)
    asked = [keys[3], missing, *keys, missing]
    assert await conn.lookup(b"".join(asked)) == b"\x01\x00" + b"\x01" * 7 + b"\x00"
    got = [(i, None if b is None else bytes(b)) async for i, b in conn.get(b"".join(asked))]
    assert got == [(i, None if k == missing else blobs[keys.index(k)]) for i, k in enumerate(asked)]
    assert await conn.delete(b"".join([keys[0], keys[1], missing])) == 2
    assert await conn.lookup(b"".join(keys[:3])) == b"\x00\x00\x01"
    stats = await conn.stats()
    assert stats is not None and stats.tiers[0].entries == 5
    await conn.close()


def test_round_trip_in_frames_and_key_batches(cache_servers: ServerFactory) -> None:
    (server,) = cache_servers(1, extra_args=SMALL_FRAMES)
    asyncio.run(_round_trip(server))


async def _oversized(server: CacheServerProc) -> None:
    conn = ServerConnection(server.address, config(server.address))
    big, small = key_of(1), key_of(2)
    results = await conn.put([(big, blob_of(big, 1200)), (small, blob_of(small, 4))])
    assert results[0].status is StoreStatus.REJECTED
    assert "over the server's max_block_bytes 262144" in results[0].reason
    assert results[1].status is StoreStatus.STORED
    wrong = key_of(3)  # a block whose header names another key: the server refuses it
    (refused,) = await conn.put([(wrong, blob_of(small, 4))])
    assert refused.status is StoreStatus.REJECTED and "does not match" in refused.reason
    await conn.close()


def test_blocks_over_the_server_limit_are_rejected_before_sending(
    cache_servers: ServerFactory,
) -> None:
    (server,) = cache_servers(1, extra_args=["--max-block-bytes", "256KiB"])
    asyncio.run(_oversized(server))


async def _down_then_up(port_holder: CacheServerProc) -> None:
    metrics = ClientMetrics()
    address = port_holder.address
    conn = ServerConnection(address, config(address, down_backoff_s=3.0), metrics=metrics)
    keys = b"".join(key_of(i) for i in range(3))
    assert await conn.lookup(keys) == bytes(3)
    assert conn.is_down()
    assert [b async for _, b in conn.get(keys)] == [None, None, None]
    (failed,) = await conn.put([(key_of(0), blob_of(key_of(0), 4))])
    assert failed.status is StoreStatus.FAILED and not failed.ok
    assert await conn.delete(keys) == 0 and await conn.stats() is None
    stats = metrics.snapshot()
    # One failed call (the first Stats); the rest were answered from the down state.
    assert stats.server_errors == {address: 1}
    assert stats.unreachable_keys == {address: 3 + 3 + 1}
    port_holder.start()
    assert conn.is_down()
    assert await conn.lookup(keys) == bytes(3)  # still inside the back-off: no call made
    await asyncio.sleep(conn.down_until - time.monotonic() + 0.01)
    (stored,) = await conn.put([(key_of(0), blob_of(key_of(0), 4))])
    assert stored.status is StoreStatus.STORED
    assert await conn.lookup(keys) == b"\x01\x00\x00"
    assert metrics.snapshot().server_errors == {address: 1}
    await conn.close()


def test_a_down_server_answers_misses_until_the_back_off_ends(
    cache_servers: ServerFactory,
) -> None:
    # A server killed on its free port: connections are refused until it restarts there.
    (server,) = cache_servers(1)
    server.kill()
    asyncio.run(_down_then_up(server))


async def _killed_mid_get(server: CacheServerProc) -> None:
    conn = ServerConnection(server.address, config(server.address))
    keys = [key_of(i) for i in range(48)]
    blobs = [blob_of(k, 2048) for k in keys]  # 512 KiB each: 24 MiB in all
    assert all(r.ok for r in await conn.put(list(zip(keys, blobs, strict=True))))
    stream = conn.get(b"".join(keys))
    got = [await anext(stream)]
    server.kill()
    got += [item async for item in stream]
    assert [i for i, _ in got] == list(range(48))
    received = [i for i, b in got if b is not None]
    assert received == list(range(len(received)))  # a prefix of the stream, then misses
    assert 1 <= len(received) < 48
    assert all(bytes(b) == blobs[i] for i, b in got if b is not None)
    assert conn.is_down()
    await conn.close()


def test_a_server_killed_mid_get_turns_the_rest_into_misses(cache_servers: ServerFactory) -> None:
    (server,) = cache_servers(1)
    asyncio.run(_killed_mid_get(server))


async def _hung(server: CacheServerProc) -> None:
    metrics = ClientMetrics()
    conn = ServerConnection(
        server.address, config(server.address, lookup_timeout_s=0.2), metrics=metrics
    )
    key = key_of(1)
    assert (await conn.put([(key, blob_of(key, 4))]))[0].ok
    server.pause()
    try:
        start = time.monotonic()
        assert await conn.lookup(key) == b"\x00"  # present, but the server does not answer
        assert 0.2 <= time.monotonic() - start < 2.0
        start = time.monotonic()
        assert await conn.lookup(key) == b"\x00"  # down: answered without a call
        assert time.monotonic() - start < 0.1
    finally:
        server.resume()
    assert metrics.snapshot().timeouts == {server.address: 1}
    assert conn.is_down()
    await asyncio.sleep(0.35)
    assert await conn.lookup(key) == b"\x01"
    await conn.close()


def test_a_hung_server_is_a_miss_after_its_deadline(cache_server: CacheServerProc) -> None:
    asyncio.run(_hung(cache_server))


def test_keys_must_be_packed_16_byte_keys() -> None:
    async def run() -> None:
        conn = ServerConnection("127.0.0.1:1", config("127.0.0.1:1"))
        with pytest.raises(InvalidArgumentError, match="keys: must be packed 16-byte keys"):
            await conn.lookup(b"x" * 17)

    asyncio.run(run())
