"""The bulk listener under the server's own limits (issue 25): sockets without a HELLO
cannot fill it (the oldest is evicted, each is closed at the HELLO deadline), welcomed
connections and unused tickets are capped by ``--max-connections`` and a share per
principal, a GET whose keys never come is cut, an idle connection holds no send buffer,
and a reader that keeps reading slowly is not cut mid-block.

Real servers in process on loopback, raw sockets speaking proto/bulk.py.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.bulk import BLOCK, COUNT, ENTRY, MAGIC, encode_get, encode_put
from tests.support.bulk_wire import BOUNDED, MiB, open_bulk, recv_exact, welcomed
from tests.support.server_harness import frames_of, key_of, make_block, put, serving, stream
from tests.support.tenants import open_channel
from tests.support.waiting import wait_until

OWN_CONNECTION = [*BOUNDED.grpc_options, ("grpc.use_local_subchannel_pool", 1)]

# Generous next to the deadlines under test (0.5 s): a loaded machine runs timers late,
# never this late; without the deadline the wait never ends.
CLOSE_WITHIN_S = 8.0


def closed_within(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` within ``within_s`` (its bytes are dropped)."""
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while sock.recv(65536):
            if time.monotonic() > deadline:
                return False
    except TimeoutError:
        return False
    except OSError:
        pass  # reset: closed too
    return True


@pytest.mark.asyncio
async def test_sockets_without_hello_do_not_lock_a_tenant_out() -> None:
    async with serving(replace(BOUNDED, max_connections=64)) as h:
        port = (await open_bulk(h)).port
        # More silent sockets than the old fixed cap of 256 connections.
        squat = [
            await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 5)
            for _ in range(300)
        ]
        # A tenant's connection gets its welcome all the same.
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        sock.close()
        bulk = h.running.service.bulk
        assert bulk is not None
        assert bulk.admission.pending() <= 64 // 16
        for s in squat:
            s.close()


@pytest.mark.asyncio
async def test_a_socket_that_never_says_hello_is_closed_at_the_deadline() -> None:
    async with serving(replace(BOUNDED, handshake_timeout_s=0.5)) as h:
        port = (await open_bulk(h)).port
        silent = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 5)
        assert await asyncio.to_thread(closed_within, silent, CLOSE_WITHIN_S)
        silent.close()


@pytest.mark.asyncio
async def test_bulk_connections_and_tickets_are_capped_per_principal() -> None:
    async with serving(replace(BOUNDED, max_connections=8)) as h:
        bulk = h.running.service.bulk
        first = [await open_bulk(h) for _ in range(2)]
        # A principal may hold max_connections // 4 = 2 unused tickets ...
        assert "tickets" in (await open_bulk(h)).refused
        socks = [await asyncio.to_thread(welcomed, r) for r in first]
        assert bulk is not None and bulk.admission.welcomed() == 2
        # ... and as many connections: a third ticket is issued, its connection refused.
        third = await open_bulk(h)
        assert third.refused == ""

        def refused_welcome() -> bytes:
            with socket.create_connection(("127.0.0.1", third.port), timeout=5) as s:
                s.sendall(MAGIC + third.ticket)
                _code, size = ENTRY.unpack(recv_exact(s, ENTRY.size))
                return recv_exact(s, size)

        assert b"max_connections" in await asyncio.to_thread(refused_welcome)
        for s in socks:
            s.close()


@pytest.mark.asyncio
async def test_a_get_whose_keys_never_come_is_cut() -> None:
    async with serving(BOUNDED) as h:
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        sock.sendall(COUNT.pack(40))  # announces 40 keys, sends none
        assert await asyncio.to_thread(closed_within, sock, CLOSE_WITHIN_S)
        sock.close()


@pytest.mark.asyncio
async def test_an_idle_connection_holds_no_send_buffer() -> None:
    async with serving(BOUNDED) as h:
        key = key_of(1)
        blob = make_block(key, tokens=3 * MiB // 256, head_dim=64)
        assert [r.outcome for r in await put(h.stub, [(key, blob)], h.frame_bytes)] == [
            pb.PUT_OUTCOME_STORED
        ]

        def fetch() -> socket.socket:
            sock = welcomed(asyncio.run_coroutine_threadsafe(open_bulk(h), loop).result())
            sock.sendall(encode_get(key))
            _code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
            assert recv_exact(sock, size) == blob
            return sock

        loop = asyncio.get_running_loop()
        socks = [await asyncio.to_thread(fetch) for _ in range(6)]
        bulk = h.running.service.bulk
        assert bulk is not None
        # Six idle connections that each sent a 3 MiB block: none keeps a buffer, the
        # pool keeps at most two of the largest blocks for the next GETs.
        assert bulk.buffers.lent == 0
        assert bulk.buffers.idle_bytes <= 2 * BOUNDED.max_block_bytes
        for s in socks:
            s.close()


@pytest.mark.asyncio
async def test_a_slow_reader_that_keeps_reading_is_not_cut_mid_block() -> None:
    # A block bigger than the socket buffers the kernel grows on loopback (~4 MiB).
    big = replace(
        BOUNDED,
        max_block_bytes=16 * MiB,
        max_request_bytes=16 * MiB,
        max_inflight_bytes=32 * MiB,
        max_inflight_bytes_per_client=16 * MiB,
    )
    async with serving(big) as h:
        key = key_of(2)
        blob = make_block(key, tokens=12 * MiB // 256, head_dim=64)
        assert [r.outcome for r in await put(h.stub, [(key, blob)], h.frame_bytes)] == [
            pb.PUT_OUTCOME_STORED
        ]
        reply = await open_bulk(h)

        def slow_read() -> bytes:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
            sock.settimeout(10)
            sock.connect(("127.0.0.1", reply.port))
            sock.sendall(MAGIC + reply.ticket)
            assert recv_exact(sock, 16) == MAGIC
            sock.sendall(encode_get(key))
            _code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
            got = bytearray()
            start = time.monotonic()
            while len(got) < size:
                part = sock.recv(min(64 * 1024, size - len(got)))
                if not part:
                    break
                got += part
                # ~6 MiB/s: the block takes ~2 s, four idle timeouts (0.5 s), but the
                # reader never stops for one.
                time.sleep(max(0.0, len(got) / (6 * MiB) - (time.monotonic() - start)))
            sock.close()
            return bytes(got)

        assert await asyncio.to_thread(slow_read) == blob


@pytest.mark.asyncio
async def test_bulk_put_heads_that_announce_blocks_and_stall_do_not_squat_the_budget() -> None:
    # Long idle timeout: what frees the room is the reclaim (1 s while others wait).
    async with serving(replace(BOUNDED, stream_idle_timeout_s=60.0)) as h:
        address = h.running.address
        ticket_channels = [open_channel(address, options=OWN_CONNECTION) for _ in range(2)]
        squatters = []
        for n in range(4):  # two principals, two 4 MiB heads each: the whole 16 MiB budget
            ch = ticket_channels[n % 2]
            reply = await ch.unary_unary(
                "/nopecache.v1.KVCache/OpenBulk",
                request_serializer=pb.OpenBulkRequest.SerializeToString,
                response_deserializer=pb.OpenBulkReply.FromString,
            )(pb.OpenBulkRequest())
            sock = await asyncio.to_thread(welcomed, reply)
            sock.sendall(encode_put(1) + BLOCK.pack(4 * MiB, key_of(50 + n)) + b"x")
            squatters.append(sock)
        inflight = h.running.service.inflight
        await wait_until(lambda: inflight.used_bytes >= 16 * MiB, timeout_s=30)
        victim = open_channel(address, options=OWN_CONNECTION)
        key = key_of(60)
        blob = make_block(key, tokens=MiB // 256, head_dim=64)
        stub = cache_pb2_grpc.KVCacheStub(victim)
        # Without the reclaim the Put waits for the squatters' 60 s idle timeout.
        reply = await stub.Put(stream(frames_of([(key, blob)], h.frame_bytes)), timeout=10)
        assert [r.outcome for r in reply.results] == [pb.PUT_OUTCOME_STORED]
        for s in squatters:
            s.close()
        for c in [*ticket_channels, victim]:
            await c.close(None)
