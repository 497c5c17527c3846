"""The bulk byte stream (proto/bulk.py, cache_server/bulk.py, client/bulk.py): tickets,
the byte layout against a real server, and the client's fetches through it, with gRPC
as the fallback whenever the stream is not there."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch
from server_procs import CacheServerProc
from test_cache_client import client, config, kv, prompt
from test_server import SMALL, Harness, key_of, make_block, put, serving

from nopecache.client import ClientConfig
from nopecache.client.bulk import BulkSource
from nopecache.client.transport import ServerConnection
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.bulk import ENTRY, ERROR_CODE, MAGIC, encode_get, hello
from nopecache.proto.contract import method_path


@pytest_asyncio.fixture
async def harness() -> AsyncIterator[Harness]:
    """An in-process server with the SMALL limits."""
    async with serving(SMALL) as h:
        yield h


async def open_bulk(h: Harness) -> pb.OpenBulkReply:
    call = h.channel.unary_unary(
        method_path("OpenBulk"),
        request_serializer=pb.OpenBulkRequest.SerializeToString,
        response_deserializer=pb.OpenBulkReply.FromString,
    )
    reply: pb.OpenBulkReply = await call(pb.OpenBulkRequest())
    return reply


def connect(port: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(first)
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            break
        out += part
    return out


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
