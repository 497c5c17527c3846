"""TLS on the gRPC port (server-auth and mutual) and TLS to Redis (``rediss://``), with a
throwaway CA, server and client certificates made at test time (``cryptography``).
Real handshakes on 127.0.0.1; the Redis part runs a real ``redis-server --tls-port``."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from nopecache.cache_server.config import ConfigError, ServerConfig
from nopecache.cache_server.tls import load_server_tls
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.redis_procs import free_ports
from tests.support.server_harness import SMALL, STORED, get, key_of, make_block, put
from tests.support.tenants import ALICE, AUTH, open_channel, rpc_code, tenant_serving
from tests.support.tls_ca import Issued, TestCa

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


# -- a throwaway PKI -----------------------------------------------------------------------
@dataclass(frozen=True)
class Pki:
    """The trusted CA with a server and a client certificate, and a rogue CA's client."""

    ca: TestCa
    server: Issued
    client: Issued
    rogue_ca: TestCa
    rogue_client: Issued


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Certificates for the whole module (EC P-256: generated in milliseconds)."""
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCa(directory, "ca"), TestCa(directory, "rogue")
    return Pki(
        ca=ca,
        server=ca.issue("server", server=True),
        client=ca.issue("client", server=False),
        rogue_ca=rogue,
        rogue_client=rogue.issue("client", server=False),
    )


def tls_config(pki: Pki, base: ServerConfig = SMALL, *, mutual: bool = False) -> ServerConfig:
    """``base`` with the server certificate (and the client CA when ``mutual``)."""
    return replace(
        base,
        tls_cert_file=str(pki.server.cert),
        tls_key_file=str(pki.server.key),
        tls_client_ca_file=str(pki.ca.pem) if mutual else "",
    )


def channel_credentials(ca: TestCa, client: Issued | None = None) -> grpc.ChannelCredentials:
    """Client credentials trusting ``ca``, presenting ``client`` when given."""
    return grpc.ssl_channel_credentials(
        root_certificates=ca.pem.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )


async def stats_code(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The status of one Stats call over a fresh channel."""
    async with open_channel(address, credentials=credentials) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        return await rpc_code(lambda: stub.Stats(pb.StatsRequest(), timeout=10))


# -- gRPC ------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_tls_round_trip_and_plaintext_or_untrusted_clients_fail(pki: Pki) -> None:
    config = tls_config(pki)
    async with tenant_serving(config, channel_credentials=channel_credentials(pki.ca)) as h:
        assert h.running.tls
        key = key_of(1)
        results = await put(h.stub(None), [(key, make_block(key))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        got, _ = await get(h.stub(None), [key])
        assert got == [make_block(key)]
        address = h.running.address
        assert await stats_code(address, None) == UNAVAILABLE
        assert await stats_code(address, channel_credentials(pki.rogue_ca)) == UNAVAILABLE
        # The DNS name in the certificate works as well as the IP address.
        async with grpc.aio.secure_channel(
            address,
            channel_credentials(pki.ca),
            options=[("grpc.ssl_target_name_override", "localhost")],
        ) as channel:
            await cache_pb2_grpc.KVCacheStub(channel).Stats(pb.StatsRequest(), timeout=10)


@pytest.mark.asyncio
async def test_mutual_tls_requires_a_client_certificate_from_the_ca(pki: Pki) -> None:
    config = tls_config(pki, mutual=True)
    creds = channel_credentials(pki.ca, pki.client)
    async with tenant_serving(config, channel_credentials=creds) as h:
        key = key_of(2)
        results = await put(h.stub(None), [(key, make_block(key))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        address = h.running.address
        assert await stats_code(address, channel_credentials(pki.ca)) == UNAVAILABLE
        rogue = channel_credentials(pki.ca, pki.rogue_client)
        assert await stats_code(address, rogue) == UNAVAILABLE
        got, _ = await get(h.stub(None), [key])
        assert got == [make_block(key)]


@pytest.mark.asyncio
async def test_tokens_over_tls(pki: Pki) -> None:
    config = tls_config(pki, AUTH)
    async with tenant_serving(config, channel_credentials=channel_credentials(pki.ca)) as h:
        key = key_of(3)
        results = await put(h.stub(ALICE), [(key, make_block(key))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        assert await rpc_code(lambda: h.stub(None).Stats(pb.StatsRequest())) == (
            grpc.StatusCode.UNAUTHENTICATED
        )


def test_tls_options_are_checked(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^tls_key_file: tls_cert_file and tls_key_file go"):
        replace(SMALL, tls_cert_file=str(pki.server.cert))
    with pytest.raises(ConfigError, match=r"^tls_client_ca_file: client certificates need TLS"):
        replace(SMALL, tls_client_ca_file=str(pki.ca.pem))
    missing = replace(SMALL, tls_cert_file=str(tmp_path / "nope.crt"), tls_key_file="k")
    with pytest.raises(ConfigError, match=r"^tls_cert_file: cannot read .*nope\.crt"):
        load_server_tls(missing)
    swapped = replace(SMALL, tls_cert_file=str(pki.server.key), tls_key_file=str(pki.server.key))
    with pytest.raises(ConfigError, match=r"^tls_cert_file: not a PEM file with a CERTIFICATE"):
        load_server_tls(swapped)
    tls = load_server_tls(tls_config(pki, mutual=True))
    assert tls is not None and tls.mutual
    assert load_server_tls(SMALL) is None


# -- Redis over TLS ------------------------------------------------------------------------
@dataclass
class TlsRedis:
    """A redis-server that only listens with TLS and requires client certificates."""

    port: int
    proc: subprocess.Popen[bytes]

    def url(self, pki: Pki) -> str:
        """The ``rediss://`` tier URL with the CA and the client certificate."""
        return (
            f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={pki.ca.pem}"
            f"&ssl_certfile={pki.client.cert}&ssl_keyfile={pki.client.key}"
            "&ssl_cert_reqs=required"
        )

    def client(self, pki: Pki) -> redis.Redis:
        """A synchronous TLS client for inspection."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(pki.ca.pem),
            ssl_certfile=str(pki.client.cert),
            ssl_keyfile=str(pki.client.key),
            socket_timeout=5,
        )


@pytest.fixture
def tls_redis(pki: Pki, tmp_path: Path) -> Iterator[TlsRedis]:
    """redis-server --tls-port on a free port (skipped when built without TLS)."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server not found on PATH (make redis-server)", pytrace=False)
    port = free_ports(1)[0]
    log = tmp_path / "redis-tls.log"
    cmd = [
        "redis-server",
        *("--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"),
        *("--tls-cert-file", str(pki.server.cert), "--tls-key-file", str(pki.server.key)),
        *("--tls-ca-cert-file", str(pki.ca.pem), "--tls-auth-clients", "yes"),
        *("--save", "", "--appendonly", "no", "--dir", str(tmp_path), "--logfile", str(log)),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = TlsRedis(port, proc)
    deadline = time.monotonic() + 60  # a hang guard: redis-server answers in milliseconds
    try:
        while True:
            if proc.poll() is not None:
                err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")
                text = err + (log.read_text(errors="replace") if log.exists() else "")
                if "tls" in text.lower():
                    pytest.skip(f"redis-server has no TLS support: {text.strip()[-300:]}")
                raise RuntimeError(f"redis-server --tls-port exited: {text[-2000:]}")
            try:
                with server.client(pki) as c:
                    if c.ping():
                        break
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("TLS redis-server did not answer PING")
            time.sleep(0.05)
        yield server
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.asyncio
async def test_rediss_tier_stores_blocks_over_tls(pki: Pki, tls_redis: TlsRedis) -> None:
    config = replace(
        SMALL,
        tiers=("cpu://?capacity=16KiB&page=4KiB&pinned=no", tls_redis.url(pki)),
        write_through=True,
    )
    async with tenant_serving(config) as h:
        key = key_of(4)
        results = await put(h.stub(None), [(key, make_block(key))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        stats = await h.stub(None).Stats(pb.StatsRequest())
        assert [(t.name, t.healthy) for t in stats.tiers] == [("cpu", True), ("redis", True)]
        with tls_redis.client(pki) as c:
            assert c.exists(b"nc:" + key) == 1
        # Deleted from the CPU tier only, the block comes back from Redis over TLS.
        await h.running.store.tiers[0].delete(key)
        got, frames = await get(h.stub(None), [key])
        assert got == [make_block(key)]
        assert frames[0].tier == 2
    # A plaintext client cannot talk to this Redis at all.
    plain = redis.Redis(
        host="127.0.0.1", port=tls_redis.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        plain.ping()
    plain.close()
