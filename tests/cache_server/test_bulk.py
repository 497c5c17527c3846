"""The bulk byte stream (proto/bulk.py, cache_server/bulk.py, client/bulk.py): tickets,
the byte layout against a real server, and the client's fetches through it, with gRPC
as the fallback whenever the stream is not there."""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import replace

import lz4.frame
import pytest
import torch

from nopecache.client import ClientConfig
from nopecache.client.bulk import BulkSource
from nopecache.client.transport import ServerConnection
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.bulk import ENTRY, ERROR_CODE, MAGIC, encode_get, hello
from tests.support.bulk_wire import BOUNDED, open_bulk, recv_exact, welcomed
from tests.support.client_harness import client, config, kv, prompt
from tests.support.redis_procs import RedisProc
from tests.support.server_harness import SMALL, Harness, key_of, make_block, put, serving
from tests.support.server_procs import CacheServerProc
from tests.support.waiting import wait_until


def connect(port: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(first)
    return sock


@pytest.mark.asyncio
async def test_a_ticket_opens_one_connection_that_streams_entries_in_order(
    harness: Harness,
) -> None:
    keys = [key_of(i) for i in range(3)]
    blobs = [make_block(keys[0]), make_block(keys[2], tokens=9)]
    assert [
        r.outcome
        for r in await put(harness.stub, [(keys[0], blobs[0]), (keys[2], blobs[1])], 60000)
    ] == [pb.PUT_OUTCOME_STORED] * 2
    reply = await open_bulk(harness)
    assert reply.refused == "" and reply.port > 0 and len(reply.ticket) == 16
    assert reply.ticket_ttl_ms == 30000

    def exchange() -> list[tuple[int, bytes]]:
        with connect(reply.port, hello(reply.ticket)) as sock:
            assert recv_exact(sock, 16) == MAGIC
            out = []
            for _ in range(2):  # two GETs on one connection
                sock.sendall(encode_get(b"".join(keys)))
                for _ in keys:
                    code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
                    out.append((code, recv_exact(sock, size)))
            return out

    got = await asyncio.to_thread(exchange)
    assert got == [(1, blobs[0]), (0, b""), (1, blobs[1])] * 2
    # The ticket was used: a second connection with it is closed without a welcome.
    again = await asyncio.to_thread(
        lambda: recv_exact(connect(reply.port, hello(reply.ticket)), 16)
    )
    assert again == b""


@pytest.mark.asyncio
async def test_wrong_tickets_and_oversized_gets_are_refused(harness: Harness) -> None:
    reply = await open_bulk(harness)
    port = reply.port

    def attempts() -> tuple[bytes, bytes, bytes, bytes]:
        forged = recv_exact(connect(port, hello(bytes(16))), 16)
        bad_magic = recv_exact(connect(port, b"x" * 16 + reply.ticket), 16)
        fresh = asyncio.run_coroutine_threadsafe(open_bulk(harness), loop).result()
        with connect(port, hello(fresh.ticket)) as sock:
            welcome = recv_exact(sock, 16)
            sock.sendall(struct.pack("<I", SMALL.max_keys_per_request + 1))
            code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
            assert code == ERROR_CODE
            message = recv_exact(sock, size)
            assert recv_exact(sock, 1) == b""  # closed after the error
        return forged, bad_magic, welcome, message

    loop = asyncio.get_running_loop()
    forged, bad_magic, welcome, message = await asyncio.to_thread(attempts)
    assert (forged, bad_magic, welcome) == (b"", b"", MAGIC)
    assert message == b"GET key count: 65 keys exceeds max_keys_per_request 64"


def test_the_client_fetches_over_the_bulk_stream_by_default(
    cache_server: CacheServerProc,
) -> None:
    tokens = prompt(80, seed=31)
    k, v = kv(80, seed=31)
    expected = None
    for bulk in ("auto", "off"):
        with client(config([cache_server], "bulk", shm="off", bulk=bulk)) as c:
            c.store(tokens, (k, v))
            plan = c.lookup(tokens)
            result = c.fetch(plan, tokens)
            source = c.core.connection(cache_server.address).data_blocks
        assert result.failed == () and result.k is not None
        if bulk == "auto":
            assert isinstance(source, BulkSource)
            assert source.bulk_blocks == len(plan.blocks) and source.grpc_calls == 0
            expected = result.k
        else:
            assert not isinstance(source, BulkSource)  # the gRPC stream
            assert expected is not None and torch.equal(result.k, expected)


def test_a_stale_bulk_socket_is_replaced_once(cache_server: CacheServerProc) -> None:
    tokens = prompt(40, seed=32)
    k, v = kv(40, seed=32)
    with client(config([cache_server], "bulk-stale", shm="off")) as c:
        c.store(tokens, (k, v))
        plan = c.lookup(tokens)
        source = c.core.connection(cache_server.address).data_blocks
        assert isinstance(source, BulkSource)
        for sock in source._idle:  # what a restarted server leaves behind
            sock.shutdown(socket.SHUT_RDWR)
        result = c.fetch(plan, tokens)
        stats = c.stats()
    assert result.failed == () and source.bulk_blocks == len(plan.blocks)
    assert stats.server_errors == {}


@pytest.mark.asyncio
async def test_a_server_without_the_stream_refuses_and_the_client_uses_grpc() -> None:
    async with serving(SMALL) as h:
        h.running.service.bulk = None  # what a TLS server is
        reply = await open_bulk(h)
        assert reply.refused == "this server offers no bulk stream (TLS or off)"
        assert reply.port == 0
        key = key_of(7)
        blob = make_block(key)
        await put(h.stub, [(key, blob)], 60000)
        cfg = ClientConfig(servers=(h.running.address,), shm="off")
        conn = ServerConnection(h.running.address, cfg, data_path=BulkSource)
        got = [b if b is None else bytes(b) async for _, b in conn.get(key + key_of(8))]
        source = conn.data_blocks
        await conn.close()
    assert got == [blob, None]
    assert isinstance(source, BulkSource) and source.grpc_calls == 1 and not source.available


# -- the hardening of the gRPC Get applies to the bulk stream -------------------------------
async def put_big(h: Harness, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` blocks of about 1 MiB, stored."""
    blocks = [(key_of(i), make_block(key_of(i), tokens=4000, head_dim=64)) for i in range(count)]
    for block in blocks:
        results = await put(h.stub, [block], h.frame_bytes)
        assert [r.outcome for r in results] == [pb.PUT_OUTCOME_STORED]
    return blocks


@pytest.mark.asyncio
async def test_a_bulk_reader_that_stops_reading_is_cut_and_releases_its_block() -> None:
    async with serving(BOUNDED) as h:
        # 40 MiB: more than the loopback buffers take in unread.
        blocks = await put_big(h, 40)
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        budget = h.running.service.inflight
        with sock:
            await asyncio.to_thread(sock.sendall, encode_get(b"".join(k for k, _ in blocks)))
            await wait_until(lambda: budget.used_bytes > 0)  # a block is being sent, unread
            assert budget.used_bytes <= BOUNDED.max_inflight_bytes_per_client
            # Cut when nothing is acknowledged for the rate window: the block is released,
            # the connection closed.
            # The window is the default 5 s; 30 s leaves a loaded machine room.
            await wait_until(lambda: budget.used_bytes == 0, timeout_s=30)

            def drain() -> int:
                got = 0
                while part := sock.recv(1 << 20):
                    got += len(part)
                return got

            received = await asyncio.to_thread(drain)
        assert 0 < received < sum(len(b) + ENTRY.size for _, b in blocks)
        cut = h.running.metrics.registry.get_sample_value(
            "nopecache_requests_rejected_total", {"method": "Bulk", "reason": "stream_too_slow"}
        )
        assert cut == 1.0


@pytest.mark.asyncio
async def test_bulk_gets_wait_for_the_in_flight_budget_and_are_refused_when_it_stays_full() -> None:
    async with serving(BOUNDED) as h:
        [(key, blob)] = await put_big(h, 1)
        budget = h.running.service.inflight
        other = budget.lease("another client")
        await other.reserve(BOUNDED.max_inflight_bytes - 1024, "test")
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        with sock:
            # Room comes back while the GET waits: it is served.
            await asyncio.to_thread(sock.sendall, encode_get(key))
            await asyncio.sleep(0.2)
            assert budget.used_bytes == BOUNDED.max_inflight_bytes - 1024  # still waiting
            other.release()
            code, size = ENTRY.unpack(await asyncio.to_thread(recv_exact, sock, ENTRY.size))
            assert (code, await asyncio.to_thread(recv_exact, sock, size)) == (1, blob)
            await wait_until(lambda: budget.used_bytes == 0)
            # No room for the idle timeout: an ERROR naming the budget, then the close.
            await other.reserve(BOUNDED.max_inflight_bytes - 1024, "test")
            await asyncio.to_thread(sock.sendall, encode_get(key))
            code, size = ENTRY.unpack(await asyncio.to_thread(recv_exact, sock, ENTRY.size))
            message = await asyncio.to_thread(recv_exact, sock, size)
            assert await asyncio.to_thread(recv_exact, sock, 1) == b""
        other.close()
    assert code == ERROR_CODE
    assert message.decode().startswith(
        "bulk GET: the server's in-flight budget stayed full for 0.5 s (this client holds 0 "
        "of its 8388608-byte share, all clients 16776192 of max_inflight_bytes 16777216)"
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("tiers", ["cpu+redis", "redis"])
async def test_a_bad_redis_value_is_a_miss_on_the_bulk_stream_too(
    redis_clean: RedisProc, tiers: str
) -> None:
    cpu = "cpu://?capacity=1MiB&page=4KiB&pinned=no"
    config = replace(
        SMALL, tiers=(cpu, redis_clean.url) if tiers == "cpu+redis" else (redis_clean.url,)
    )
    key, good_key = key_of(7), key_of(8)
    raw = redis_clean.client()
    # Another key's valid block under this key, and a good block.
    raw.set(b"nc:" + key, lz4.frame.compress(make_block(key_of(999))))
    good = make_block(good_key)
    raw.set(b"nc:" + good_key, lz4.frame.compress(good))
    async with serving(config) as h:
        reply = await open_bulk(h)

        def exchange() -> list[tuple[int, bytes]]:
            with connect(reply.port, hello(reply.ticket)) as sock:
                assert recv_exact(sock, 16) == MAGIC
                sock.sendall(encode_get(key + good_key))
                out = []
                for _ in range(2):
                    code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
                    out.append((code, recv_exact(sock, size)))
                return out

        got = await asyncio.to_thread(exchange)
    # The good block: from the first tier (with cpu+redis, promoted there on the first read).
    assert got == [(0, b""), (1, good)]
    assert raw.exists(b"nc:" + key) == 0  # deleted, as on the gRPC path
