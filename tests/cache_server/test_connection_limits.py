"""Connections must earn their place under ``max_connections``: one that never finishes
its handshake, or finishes it and then carries no call, is closed, so a flood of idle
connections cannot shut new clients out for longer than those deadlines.

Raw sockets on loopback speak just enough HTTP/2 (the preface, SETTINGS and its ACK) to
be a connection gRPC accepted, then nothing.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from dataclasses import replace

import grpc
import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL, key_of, serving
from tests.support.tenants import open_channel

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = struct.pack(">I", 0)[1:] + bytes([4, 0]) + struct.pack(">I", 0)
SETTINGS_ACK = struct.pack(">I", 0)[1:] + bytes([4, 1]) + struct.pack(">I", 0)
OWN_CONNECTION = [*SMALL.grpc_options, ("grpc.use_local_subchannel_pool", 1)]
# Generous: the server closes on its own deadline (a second); a loaded machine may be
# slow to run its timers, never this slow.
CLOSE_WITHIN_S = 30.0


def idle_http2(port: int) -> socket.socket:
    """A connection past the HTTP/2 handshake (preface, SETTINGS, ACK) that then idles."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(PREFACE + SETTINGS)
    sock.recv(65536)  # the server's SETTINGS
    sock.sendall(SETTINGS_ACK)
    return sock


def closed_by_server(sock: socket.socket, within_s: float) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping what it sends)."""
    start = time.monotonic()
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return float("inf")
    except OSError:
        pass  # reset by the server: closed too
    return time.monotonic() - start


async def lookup_code(address: str) -> grpc.StatusCode:
    """The status of one Lookup from a new client (a new connection)."""
    channel = open_channel(address, options=OWN_CONNECTION)
    try:
        await cache_pb2_grpc.KVCacheStub(channel).Lookup(
            pb.LookupRequest(keys=key_of(0)), timeout=5
        )
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()
    finally:
        await channel.close(None)


@pytest.mark.asyncio
async def test_idle_http2_connections_are_closed_and_new_clients_get_in() -> None:
    config = replace(SMALL, max_connections=6, connection_idle_timeout_s=1.0)
    async with serving(config) as h:
        port = h.running.port
        flood = [await asyncio.to_thread(idle_http2, port) for _ in range(config.max_connections)]
        # Full now: a new client is turned away while the flood holds the cap ...
        assert await lookup_code(h.running.address) == grpc.StatusCode.UNAVAILABLE
        # ... but only until the idle deadline closes the flood's connections.
        waits = await asyncio.gather(
            *(asyncio.to_thread(closed_by_server, s, CLOSE_WITHIN_S) for s in flood)
        )
        assert max(waits) < CLOSE_WITHIN_S
        assert await lookup_code(h.running.address) == grpc.StatusCode.OK
        for s in flood:
            s.close()


@pytest.mark.asyncio
async def test_a_connection_that_never_says_hello_is_closed() -> None:
    async with serving(replace(SMALL, handshake_timeout_s=0.5)) as h:
        silent = await asyncio.to_thread(
            socket.create_connection, ("127.0.0.1", h.running.port), 10
        )
        assert await asyncio.to_thread(closed_by_server, silent, CLOSE_WITHIN_S) < CLOSE_WITHIN_S
        silent.close()
