"""deploy/haproxy/haproxy.cfg: HAProxy's own config check, and the real proxy in front of a
real server on loopback: connection slots per source address (issue 36, finding 3).

No haproxy on PATH is a failure, not a skip: ``make haproxy`` (run by ``make test``)
installs the Debian package. Clients "from" 127.0.0.2 and 127.0.0.3 bind their sockets
there, or go through tests/support/source_address.py's relays (gRPC cannot bind).
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.cache_server.config import ServerConfig
from nopecache.client.bulk import BulkSource
from nopecache.client.transport import ServerConnection
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.contract import SERVICE_NAME, method_path
from tests.client.test_transport import blob_of, config
from tests.support.haproxy_proc import (
    CONFIG,
    HAProxyProc,
    ProxyPorts,
    check_config,
    haproxy_binary,
)
from tests.support.server_harness import key_of
from tests.support.server_procs import CacheServerProc
from tests.support.source_address import connect_from, relay_from

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = struct.pack(">I", 0)[1:] + bytes([4, 0]) + struct.pack(">I", 0)
# The per-source limits the config declares, as docs/security.md states them:
# frontend -> (connections at once, new connections per 10 s).
LIMITS = {"grpc": (32, 64), "bulk": (64, 128), "health": (2, 20)}
SERVER_HANDSHAKE_S = 120


def test_haproxy_is_installed() -> None:
    assert haproxy_binary() is not None, "haproxy not found: make haproxy installs it"


def test_config_check_passes_with_the_sidecar_defaults_and_with_test_addresses() -> None:
    # The defaults (presetenv) are the Kubernetes sidecar's; the tests set every address.
    assert "Configuration file is valid" in check_config()
    assert "Configuration file is valid" in check_config(env=ProxyPorts.free().env())


def test_config_check_rejects_a_broken_copy(tmp_path: Path) -> None:
    """The check is HAProxy's own parser: a misspelt keyword fails it."""
    broken = tmp_path / "haproxy.cfg"
    broken.write_text(CONFIG.read_text().replace("track-sc0 src", "track-sc0 scr", 1))
    with pytest.raises(subprocess.CalledProcessError) as failed:
        check_config(broken)
    assert "scr" in failed.value.stderr


def _frontends(text: str) -> dict[str, str]:
    """Frontend name -> its section's text."""
    sections = re.split(r"^(?=\S)", text, flags=re.MULTILINE)
    return {s.split()[1]: s for s in sections if s.startswith("frontend ")}


def test_every_client_frontend_limits_connections_and_rate_per_source() -> None:
    frontends = _frontends(CONFIG.read_text())
    assert set(frontends) == {*LIMITS, "monitor"}
    for name, (current, rate) in LIMITS.items():
        text = frontends[name]
        assert "tcp-request connection track-sc0 src" in text, name
        assert f"reject if {{ sc_conn_cur(0) gt {current} }}" in text, name
        assert f"reject if {{ sc_conn_rate(0) gt {rate} }}" in text, name
        assert "conn_rate(10s)" in text and "tcp-request inspect-delay 5s" in text, name
        # The proxy holds fewer connections than the server's own cap (the inner wall).
        (maxconn,) = re.findall(r"^\s+maxconn (\d+)$", text, flags=re.MULTILINE)
        assert int(maxconn) < ServerConfig().max_connections, name


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[HAProxyProc, CacheServerProc]]:
    """A real server (auth off, 64 MiB) on loopback behind the real proxy."""
    ports = ProxyPorts.free()
    # A handshake timeout far past the proxy's 5 s inspect delay: a silent connection the
    # tests see closed at about 5 s was closed by the proxy, not by the server.
    args = [*ports.server_args(), "--handshake-timeout-s", str(SERVER_HANDSHAKE_S)]
    server = CacheServerProc(tmp_path, ports.server_grpc, extra_args=args)
    proxy = HAProxyProc(ports, tmp_path / "haproxy.log")
    server.start()
    try:
        proxy.start()
        yield proxy, server
    finally:
        proxy.stop()
        server.kill()


def _reaches_server(sock: socket.socket) -> bool:
    """Send the HTTP/2 preface: True when the server's SETTINGS come back, False when the
    proxy closed the connection."""
    try:
        sock.sendall(PREFACE + SETTINGS)
        return bool(sock.recv(9))
    except ConnectionError:
        return False


def _refused(source: str, host: str, port: int) -> bool:
    """Whether the proxy closes a new connection from ``source`` (at once: the reset may
    already come during the connect on loopback)."""
    try:
        sock = connect_from(source, host, port)
    except ConnectionError:
        return True
    with sock:
        return not _reaches_server(sock)


async def _lookup(address: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await cache_pb2_grpc.KVCacheStub(channel).Lookup(
                pb.LookupRequest(keys=bytes(16)), timeout=30
            )
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def _store_and_fetch_from(source: str, proxy: HAProxyProc) -> None:
    """A client at ``source`` stores 3 blocks through the proxy and fetches them over
    the bulk stream (the port the server announces: the proxy's)."""
    relay_host = f"127.0.0.{int(source.rsplit('.', 1)[1]) + 10}"
    bulk_target = f"{proxy.host}:{proxy.ports.bulk}"
    async with (
        relay_from(source, proxy.grpc_address, (relay_host, 0)) as address,
        relay_from(source, bulk_target, (relay_host, proxy.ports.bulk)),
    ):
        conn = ServerConnection(address, config(address), data_path=BulkSource)
        announce = conn.channel.unary_unary(
            method_path("OpenBulk"),
            request_serializer=pb.OpenBulkRequest.SerializeToString,
            response_deserializer=pb.OpenBulkReply.FromString,
        )
        reply = await announce(pb.OpenBulkRequest(), timeout=30)
        assert (reply.refused, reply.port) == ("", proxy.ports.bulk)
        keys = [key_of(100 + i) for i in range(3)]
        blobs = [blob_of(k, 256) for k in keys]
        assert all(r.ok for r in await conn.put(list(zip(keys, blobs, strict=True))))
        got = [(i, None if b is None else bytes(b)) async for i, b in conn.get(b"".join(keys))]
        assert got == list(enumerate(blobs))
        source_ = conn.data_blocks
        assert isinstance(source_, BulkSource)
        assert (source_.bulk_blocks, source_.grpc_calls) == (3, 0)
        await conn.close()


def test_a_source_past_its_slots_is_refused_while_another_stores_and_fetches(
    proxied: tuple[HAProxyProc, CacheServerProc],
) -> None:
    proxy, _ = proxied
    slots, _ = LIMITS["grpc"]
    hoarded = [connect_from("127.0.0.2", proxy.host, proxy.ports.grpc) for _ in range(slots)]
    try:
        assert all(_reaches_server(s) for s in hoarded)
        # One more from the same address: closed by the proxy.
        assert _refused("127.0.0.2", proxy.host, proxy.ports.grpc)

        async def both() -> None:
            async with relay_from("127.0.0.2", proxy.grpc_address) as address:
                assert await _lookup(address) == grpc.StatusCode.UNAVAILABLE
            await _store_and_fetch_from("127.0.0.3", proxy)

        asyncio.run(both())
    finally:
        for s in hoarded:
            s.close()


def test_health_frontend_gives_each_source_two_slots_and_answers_others(
    proxied: tuple[HAProxyProc, CacheServerProc],
) -> None:
    proxy, _ = proxied
    held = [connect_from("127.0.0.2", proxy.host, proxy.ports.health) for _ in range(2)]
    try:
        assert all(_reaches_server(s) for s in held)
        assert _refused("127.0.0.2", proxy.host, proxy.ports.health)

        async def check_from(source: str) -> int:
            async with (
                relay_from(source, proxy.health_address) as address,
                grpc.aio.insecure_channel(address) as channel,
            ):
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30
                )
                return int(reply.status)

        assert asyncio.run(check_from("127.0.0.4")) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for s in held:
            s.close()


@pytest.mark.parametrize("frontend", ["grpc", "bulk", "health"])
def test_a_connection_that_says_nothing_is_closed_by_the_proxy(
    proxied: tuple[HAProxyProc, CacheServerProc], frontend: str
) -> None:
    proxy, _ = proxied
    started = time.monotonic()
    with connect_from("127.0.0.5", proxy.host, getattr(proxy.ports, frontend)) as silent:
        try:
            closed = silent.recv(1) == b""
        except ConnectionError:
            closed = True
    # inspect-delay is 5 s; the server would wait SERVER_HANDSHAKE_S (the gRPC port; the
    # bulk listener's HELLO deadline is the same option) and recv's own timeout is 30 s.
    assert closed and 4.5 <= time.monotonic() - started < 30
