"""The Admin service on a real server: a corrupt request is INVALID_ARGUMENT naming the field
(issue 36, finding 6: it was UNKNOWN), and without tokens it is not served beyond loopback
unless ``admin_listen`` says so, with a warning when it is open (it was open on the port).

127.0.0.2 stands for an address other hosts reach (admin_exposure.py: only 127.0.0.1, ::1
and localhost count as this machine only); tests listen on loopback addresses only.
"""

from __future__ import annotations

import logging
import queue
import re
import signal
import subprocess
import sys
import threading
from dataclasses import replace

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.cache_server.admin_service import _METHODS
from nopecache.cache_server.config import ConfigError
from nopecache.cache_server.roles import ADMIN_SERVICE_NAME
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL, STORED, key_of, make_block, put, serving
from tests.support.tenants import ALICE, AUTH

ELSEWHERE = replace(SMALL, host="127.0.0.2")
ADMIN = "admin-token-5e1d9b7c3a2f4680"
_OFF = "Admin service off"
_OPEN = "Admin service open without tokens on 127.0.0.2"


def corrupt(request: type[Message], field_name: str) -> bytes:
    """A record of ``field_name`` cut short: a length past the end, or a varint cut in two."""
    field = request.DESCRIPTOR.fields_by_name[field_name]
    if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        return bytes([field.number << 3 | 2, 9]) + b"ab"
    return bytes([field.number << 3 | 0, 0x80])


async def raw_call(
    channel: grpc.aio.Channel, method: str, body: bytes
) -> tuple[grpc.StatusCode, str]:
    """The status of an Admin ``method`` called with ``body`` as its serialized request."""
    call = channel.unary_unary(f"/{ADMIN_SERVICE_NAME}/{method}", None, None)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call(body, timeout=10)
    return failed.value.code(), failed.value.details() or ""


@pytest.mark.asyncio
async def test_every_admin_method_answers_invalid_argument_naming_the_field() -> None:
    async with serving(SMALL) as h:
        results = await put(h.stub, [(key_of(0), make_block(key_of(0)))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        for method, (request, _) in _METHODS.items():
            for field in request.DESCRIPTOR.fields:
                code, details = await raw_call(h.channel, method, corrupt(request, field.name))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, field.name)
                name = f"{request.DESCRIPTOR.name}.{field.name}"
                assert details.startswith(f"{name}: "), details
        # A string field that is not UTF-8, and a tag cut short (no field to name: its byte).
        bad_utf8 = bytes([1 << 3 | 2, 2]) + b"\xff\xfe"
        code, details = await raw_call(h.channel, "Flush", bad_utf8)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("FlushRequest.tenant: not valid UTF-8 (")
        code, details = await raw_call(h.channel, "AdminStats", b"\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("AdminStatsRequest: tag at byte 0: truncated varint (")
        # Nothing was flushed, drained or unpinned by the refused requests.
        admin = cache_pb2_grpc.AdminStub(h.channel)
        where = await admin.AdminLookup(pb.AdminLookupRequest(keys=key_of(0)))
        assert where.tiers == b"\x01"
        assert (await admin.AdminStats(pb.AdminStatsRequest())).draining is False


@pytest.mark.asyncio
async def test_without_tokens_admin_is_off_on_a_reachable_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="nopecache.cache_server"):
        async with serving(ELSEWHERE) as h:
            assert h.running.address.startswith("127.0.0.2:")
            results = await put(h.stub, [(key_of(1), make_block(key_of(1)))], h.frame_bytes)
            assert [r.outcome for r in results] == [STORED]
            admin = cache_pb2_grpc.AdminStub(h.channel)
            for call in (
                lambda: admin.Flush(pb.FlushRequest(all=True), timeout=10),
                lambda: admin.Drain(pb.DrainRequest(), timeout=10),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call()
                assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert h.running.admin_port is None
            # The block is still there and Puts are still taken: nothing flushed, no drain.
            assert (await h.stub.Lookup(pb.LookupRequest(keys=key_of(1)))).tiers == b"\x01"
            assert not h.running.service.puts.draining
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w for w in warnings if w.startswith(_OFF)] == [
        f"{_OFF}: no admin or tenant token is configured and the gRPC port listens on "
        "127.0.0.2, where anyone who reaches it could flush, set quotas and drain. Set "
        "admin_tokens (--admin-tokens-file), or serve it on loopback with --admin-listen "
        "127.0.0.1:PORT, or open on the gRPC port with --admin-listen port"
    ]


@pytest.mark.asyncio
async def test_admin_listen_on_loopback_serves_admin_there_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = replace(ELSEWHERE, admin_listen="127.0.0.1:0")
    with caplog.at_level(logging.WARNING, logger="nopecache.cache_server"):
        async with serving(config) as h:
            assert h.running.admin_port is not None
            results = await put(h.stub, [(key_of(2), make_block(key_of(2)))], h.frame_bytes)
            assert [r.outcome for r in results] == [STORED]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await cache_pb2_grpc.AdminStub(h.channel).Flush(pb.FlushRequest(all=True))
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            async with grpc.aio.insecure_channel(f"127.0.0.1:{h.running.admin_port}") as local:
                admin = cache_pb2_grpc.AdminStub(local)
                assert (await admin.Flush(pb.FlushRequest(all=True), timeout=10)).deleted == 1
                # The loopback listener serves Admin only: no data plane there.
                with pytest.raises(grpc.aio.AioRpcError) as no_kv:
                    await cache_pb2_grpc.KVCacheStub(local).Lookup(
                        pb.LookupRequest(keys=key_of(2)), timeout=10
                    )
                assert no_kv.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert (await h.stub.Lookup(pb.LookupRequest(keys=key_of(2)))).tiers == b"\x00"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("where", ["port", "127.0.0.2:0"])
@pytest.mark.asyncio
async def test_admin_open_beyond_loopback_when_asked_with_a_warning(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = replace(ELSEWHERE, admin_listen=where)
    with caplog.at_level(logging.WARNING, logger="nopecache.cache_server"):
        async with serving(config) as h:
            address = h.running.address
            if where != "port":
                assert h.running.admin_port is not None
                address = f"127.0.0.2:{h.running.admin_port}"
            async with grpc.aio.insecure_channel(address) as channel:
                stats = await cache_pb2_grpc.AdminStub(channel).AdminStats(
                    pb.AdminStatsRequest(), timeout=10
                )
                assert stats.draining is False
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"{_OPEN}: anyone who reaches it can flush every tenant, set quotas and drain this "
        "server (admin_listen); set admin_tokens (--admin-tokens-file) to require a token"
    ]


@pytest.mark.parametrize("admin_tokens", [ADMIN, ""], ids=["admin-token", "tenant-tokens-only"])
@pytest.mark.asyncio
async def test_with_tokens_admin_stays_on_the_port_and_asks_for_them(
    admin_tokens: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = replace(AUTH, host="127.0.0.2", admin_tokens=admin_tokens)
    token = admin_tokens or ALICE
    with caplog.at_level(logging.WARNING, logger="nopecache.cache_server"):
        async with serving(config) as h:
            admin = cache_pb2_grpc.AdminStub(h.channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await admin.GetQuota(pb.GetQuotaRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = await admin.GetQuota(
                pb.GetQuotaRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=10
            )
            names = ["alice", "bob"] if token == ADMIN else ["alice"]
            assert sorted(q.tenant for q in reply.tenants) == names
    assert [r.getMessage() for r in caplog.records if "Admin service" in r.getMessage()] == []


@pytest.mark.parametrize("where", ["127.0.0.1", "127.0.0.1:port", ":80", "open"])
def test_admin_listen_values_are_checked(where: str) -> None:
    with pytest.raises(ConfigError, match=r"^admin_listen: expected HOST:PORT"):
        replace(SMALL, admin_listen=where)


_HEALTH_LINE = re.compile(r"health service on its own listener 127\.0\.0\.1:(\d+)")
_START_TIMEOUT_S = 60.0  # a hang guard: the lines come ~1 s after the start on an idle machine


def test_the_server_process_warns_at_start_up_and_serves_probes_apart() -> None:
    """``nopecache-server --host 127.0.0.2`` without tokens: the warning is on stderr, and
    the health listener it reports answers SERVING."""
    cmd = [sys.executable, "-m", "nopecache.cache_server", "--host", "127.0.0.2", "--port", "0"]
    cmd += ["--no-metrics", "--tier", "cpu://?capacity=4MiB&pinned=no"]
    cmd += ["--health-listen", "127.0.0.1:0", "--shutdown-grace-s", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ports: queue.Queue[int | None] = queue.Queue()

    def read_stderr() -> None:
        # A thread, not select() on the pipe: one read may buffer several lines.
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if match := _HEALTH_LINE.search(line):
                ports.put(int(match[1]))
        ports.put(None)  # the process closed stderr (it exited)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        port = ports.get(timeout=_START_TIMEOUT_S)
        assert port is not None, "".join(lines)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=_START_TIMEOUT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=_START_TIMEOUT_S)
        reader.join(timeout=_START_TIMEOUT_S)
        if proc.stderr is not None:
            proc.stderr.close()
    text = "".join(lines)
    assert f"WARNING nopecache.cache_server: {_OFF}: no admin or tenant token" in text, text
    assert "listening on 127.0.0.2:" in text
