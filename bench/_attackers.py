"""The attackers of issue 25 for bench/load.py's hostile phase, beside those of _hostile.py:
clients that try to take a shared resource from everyone else (loopback only).

    watch_flood      no token: 1100 health Watch streams (they never end), re-opened as
                     they are refused
    idle_flood       no token: up to 1100 raw connections that send the HTTP/2 preface and
                     SETTINGS ACK, then nothing; each one the server closes is re-opened
    slow_loris       tenant loris: 256 Put streams that announce a 64 MiB block, send 14
                     MiB of it and stall, again each time one is cut
    budget_squat     tenant squat: 16 Put streams whose 1-byte frame announces a 64 MiB
                     block, then nothing, again each time one is cut
    bulk_squat       no ticket: 300 sockets to the bulk port that never say HELLO,
                     re-opened as they are closed
    idle_bulk        tenant squat: 16 bulk connections that each GET a 16 MiB block once,
                     then idle (what they keep is the measure)
    new_clients      tenant good: a client on a new connection every 0.25 s, one Lookup
                     each; ``new_client_ok_share`` is the share that succeed

Every loop ends at the phase's end time. Every client dials the front proxy, each attacker
from addresses of its own (``_proxied.Route``, ``_proxied.SOURCES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.bulk import ENTRY, MAGIC, encode_get, hello

if TYPE_CHECKING:
    from _proxied import Route

MiB = 1024 * 1024
LORIS = "loris-token-4c8a2e6f0b"
SQUAT = "squat-token-7b3d9f1e5a"
WATCHES = 1100
IDLE_CONNECTIONS = 1100
LORIS_STREAMS = 256
SQUAT_STREAMS = 16
BULK_SQUATTERS = 300
IDLE_BULK = 16
FLOOD_AFTER_S = 3.0
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS = struct.pack(">I", 0)[1:] + bytes([4, 0]) + struct.pack(">I", 0)
_SETTINGS_ACK = struct.pack(">I", 0)[1:] + bytes([4, 1]) + struct.pack(">I", 0)


def tenants_toml() -> str:
    """The attackers' tenants, for the server's tokens file (no quota: they hold nothing)."""
    return f'[tenants.loris]\ntokens = ["{LORIS}"]\n[tenants.squat]\ntokens = ["{SQUAT}"]\n'


@dataclass(frozen=True)
class Sizes:
    """How many of each attacker run (``QUICK``: a smoke run's handful)."""

    watches: int = WATCHES
    idle_connections: int = IDLE_CONNECTIONS
    loris_streams: int = LORIS_STREAMS
    squat_streams: int = SQUAT_STREAMS
    bulk_squatters: int = BULK_SQUATTERS
    idle_bulk: int = IDLE_BULK


FULL = Sizes()
QUICK = Sizes(32, 32, 16, 4, 16, 2)


@dataclass
class FloodReport:
    """What the attackers of this module saw."""

    watches_held: int = 0
    idle_held: int = 0
    idle_closed_by_server: int = 0
    loris_cut: int = 0
    squat_cut: int = 0
    bulk_squat_closed: int = 0
    idle_bulk_opened: int = 0
    new_ok: int = 0
    new_failed: int = 0

    def new_client_ok_share(self) -> float:
        """The share of new clients whose Lookup succeeded (1.0 when none ran)."""
        total = self.new_ok + self.new_failed
        return self.new_ok / total if total else 1.0


async def watch_flood(address: str, n: int, end: float, report: FloodReport) -> None:
    """Tokenless health Watch streams, as many as the server lets one address hold."""
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.use_local_subchannel_pool", 1)]
    ) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        calls: list[grpc.aio.UnaryStreamCall] = []
        while time.monotonic() < end:
            calls = [c for c in calls if not c.done()]
            fresh = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(n - len(calls))]
            for call in fresh:
                with contextlib.suppress(
                    grpc.aio.AioRpcError, asyncio.CancelledError, TimeoutError
                ):
                    await asyncio.wait_for(call.read(), 2)
            calls += fresh
            report.watches_held = max(report.watches_held, sum(not c.done() for c in calls))
            await asyncio.sleep(1.0)
        for call in calls:
            call.cancel()


async def idle_flood(route: Route, n: int, end: float, report: FloodReport) -> None:
    """Raw HTTP/2 connections past the handshake that never send a call."""

    # The other attackers connect first (the flood would otherwise keep them out too, and
    # their own limits would go untested); clients connecting from now on meet it.
    await asyncio.sleep(FLOOD_AFTER_S)

    async def one(i: int) -> None:
        while time.monotonic() < end:
            opened = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(
                    route.proxy_host, route.grpc_port, local_addr=(route.source("idle_flood", i), 0)
                )
                writer.write(_PREFACE + _SETTINGS)
                await writer.drain()
                await asyncio.wait_for(reader.read(65536), 5)
                writer.write(_SETTINGS_ACK)
                await writer.drain()
            except (OSError, TimeoutError):
                await asyncio.sleep(1.0)
                continue
            report.idle_held += 1
            try:
                while await asyncio.wait_for(reader.read(65536), max(0.01, end - time.monotonic())):
                    pass
                report.idle_closed_by_server += 1
            except (OSError, TimeoutError):
                pass
            finally:
                report.idle_held -= 1
                writer.close()
            if time.monotonic() - opened < 1.0:  # refused (by the proxy): not at once again
                await asyncio.sleep(1.0)

    await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


async def _stalled_puts(
    address: str, token: str, streams: int, first: pb.PutFrame, more: list[pb.PutFrame], end: float
) -> int:
    """``streams`` Puts that send ``first`` and ``more`` and stall; how many were cut."""
    from _hostile import channel

    cut = 0
    async with channel(address, token) as ch:
        stub = cache_pb2_grpc.KVCacheStub(ch)

        async def frames() -> AsyncIterator[pb.PutFrame]:
            yield first
            for f in more:
                yield f
            await asyncio.sleep(max(0.0, end - time.monotonic()))

        async def one() -> None:
            nonlocal cut
            while time.monotonic() < end - 0.5:
                try:
                    await stub.Put(frames(), timeout=max(0.1, end - time.monotonic()))
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise
                    cut += 1
                except grpc.aio.AioRpcError:
                    cut += 1
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(one() for _ in range(streams)), return_exceptions=True)
    return cut


async def slow_loris(address: str, n: int, end: float, report: FloodReport) -> None:
    """256 Puts that announce 64 MiB, send 14 MiB in 1 MiB frames and stall."""
    from _hostile import key

    data = bytes(MiB - 4096)
    first = pb.PutFrame(key=key("loris", 0), total_size=64 * MiB, data=data)
    report.loris_cut = await _stalled_puts(
        address, LORIS, n, first, [pb.PutFrame(data=data)] * 13, end
    )


async def budget_squat(address: str, n: int, end: float, report: FloodReport) -> None:
    """16 Puts whose 1-byte frame announces a 64 MiB block."""
    from _hostile import key

    first = pb.PutFrame(key=key("squat", 0), total_size=64 * MiB, data=b"x")
    report.squat_cut = await _stalled_puts(address, SQUAT, n, first, [], end)


async def _bulk_tickets(address: str, token: str, n: int) -> list[tuple[int, bytes]]:
    """``n`` (port, ticket) pairs asked for over one connection (0: refused)."""
    from _hostile import channel

    async with channel(address, token) as ch:
        call = ch.unary_unary(
            "/nopecache.v1.KVCache/OpenBulk",
            request_serializer=pb.OpenBulkRequest.SerializeToString,
            response_deserializer=pb.OpenBulkReply.FromString,
        )
        replies = [await call(pb.OpenBulkRequest(), timeout=10) for _ in range(n)]
    return [(r.port, r.ticket) for r in replies]


async def bulk_squat(route: Route, n: int, end: float, report: FloodReport) -> None:
    """Sockets to the bulk port that never say HELLO, re-opened as they are closed."""
    ((port, _),) = await _bulk_tickets(route.grpc("bulk_squat"), SQUAT, 1)

    async def one() -> None:
        while time.monotonic() < end:
            opened = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(
                    route.proxy_host, port, local_addr=(route.source("bulk_squat"), 0)
                )
            except OSError:
                await asyncio.sleep(1.0)
                continue
            try:
                await asyncio.wait_for(reader.read(1), max(0.01, end - time.monotonic()))
                report.bulk_squat_closed += 1
            except (OSError, TimeoutError):
                pass
            finally:
                writer.close()
            if time.monotonic() - opened < 1.0:  # refused (by the proxy): not at once again
                await asyncio.sleep(1.0)

    await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)


async def idle_bulk(route: Route, n: int, end: float, report: FloodReport) -> None:
    """Bulk connections that GET one 16 MiB block each, then idle until the end."""
    from _hostile import _one, block, channel, frames_of, key

    k = key("idlebulk", 0)
    address = route.grpc("idle_bulk")
    async with channel(address, SQUAT) as ch:
        # Again until stored: the budget the squatters fill can refuse (or cut) the Put.
        while time.monotonic() < end:
            try:
                await cache_pb2_grpc.KVCacheStub(ch).Put(
                    _one(frames_of(k, block(k, 16 * MiB))), timeout=30
                )
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
    # Tickets first (valid 30 s), before the idle flood takes the gRPC port.
    tickets = await _bulk_tickets(address, SQUAT, n)
    source = (route.source("idle_bulk"), 0)

    def fetch(port: int, ticket: bytes) -> socket.socket:
        sock = socket.create_connection((route.proxy_host, port), 30, source)
        sock.sendall(hello(ticket))
        if sock.recv(len(MAGIC), socket.MSG_WAITALL) != MAGIC:
            return sock
        sock.sendall(encode_get(k))
        _, size = ENTRY.unpack(sock.recv(ENTRY.size, socket.MSG_WAITALL))
        left = size
        while left:
            got = sock.recv(min(left, MiB))
            if not got:
                break
            left -= len(got)
        return sock

    socks = []
    for port, ticket in tickets:
        if port:
            socks.append(await asyncio.to_thread(fetch, port, ticket))
            report.idle_bulk_opened += 1
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    for s in socks:
        s.close()


async def new_clients(address: str, token: str, end: float, report: FloodReport) -> None:
    """A client on a new connection every 0.25 s, one Lookup each."""
    from _hostile import channel

    while time.monotonic() < end - 1:
        try:
            async with channel(address, token) as ch:
                await cache_pb2_grpc.KVCacheStub(ch).Lookup(
                    pb.LookupRequest(keys=bytes(16)), timeout=5
                )
            report.new_ok += 1
        except grpc.aio.AioRpcError:
            report.new_failed += 1
        await asyncio.sleep(0.25)


def attackers(
    route: Route, end: float, report: FloodReport, sizes: Sizes = FULL
) -> list[tuple[str, Coroutine[None, None, None]]]:
    """(name, coroutine) of every attacker of this module and the new-client probe (an
    honest client: from 127.0.0.1, straight to the proxy)."""
    from _hostile import GOOD

    return [
        ("watch_flood", watch_flood(route.grpc("watch_flood"), sizes.watches, end, report)),
        ("idle_flood", idle_flood(route, sizes.idle_connections, end, report)),
        ("slow_loris", slow_loris(route.grpc("slow_loris"), sizes.loris_streams, end, report)),
        (
            "budget_squat",
            budget_squat(route.grpc("budget_squat"), sizes.squat_streams, end, report),
        ),
        ("bulk_squat", bulk_squat(route, sizes.bulk_squatters, end, report)),
        ("idle_bulk", idle_bulk(route, sizes.idle_bulk, end, report)),
        ("new_clients", new_clients(route.grpc("new_clients"), GOOD, end, report)),
    ]
