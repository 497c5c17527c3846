"""The client against secured servers: TLS and mutual TLS channels, bearer tokens on every
call, tenants kept apart, and refusals (wrong token, busy server) as misses, never raised.

Real ``python -m nopecache.cache_server`` processes on loopback with a throwaway PKI
(tests/support/tls_ca.py); the client under test is the synchronous :class:`CacheClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.client import CacheClient, InvalidArgumentError
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import StoredForm
from tests.support.client_harness import CHUNKER, DIM, PREFIX_BLOCK, SPEC, fingerprint, kv, prompt
from tests.support.redis_procs import free_ports
from tests.support.server_procs import CacheServerProc
from tests.support.tls_ca import Issued, TestCa

ALICE = "alice-token-5b1e9d3c7a2f4068"
ALICE_2 = "alice-second-token-0d4c8b2a6e"  # a second token of the same tenant
BOB = "bob-token-8f2a6c4e1b3d5079"
CAROL = "carol-token-3e7b1d5f9a2c4068"
WRONG = "wrong-token-9c3a7e1f5b2d4068"
TOKENS = f"{ALICE} alice; {ALICE_2} alice; {BOB} bob; {CAROL} carol"
MAX_STREAMS = 4
TOKENS_PER_PROMPT = 64  # four prefix blocks of 16 tokens


@dataclass(frozen=True)
class Pki:
    """A CA with a server certificate (127.0.0.1) and a client certificate."""

    ca: TestCa
    server: Issued
    client: Issued


class SecureServerProc(CacheServerProc):
    """A cache server whose readiness is checked over TLS (with ``credentials``)."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        credentials: grpc.ChannelCredentials | None,
        extra_args: tuple[str, ...],
    ) -> None:
        super().__init__(workdir, port, extra_args=extra_args)
        self.credentials = credentials

    def start(self, timeout_s: float = 60.0) -> None:  # a hang guard, as CacheServerProc's
        """Start the server and wait until its health service says SERVING."""
        if self.credentials is None:
            super().start(timeout_s)
            return
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout_s
        request = health_pb2.HealthCheckRequest(service="nopecache.v1.KVCache")
        with grpc.secure_channel(self.address, self.credentials) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited:\n{self.log_tail()}")
                with contextlib.suppress(grpc.RpcError):
                    if (
                        stub.Check(request, timeout=1.0).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"server not SERVING after {timeout_s}s:\n{self.log_tail()}")
                time.sleep(0.05)


@dataclass(frozen=True)
class Servers:
    """The three servers of the module: TLS, mutual TLS, and bearer tokens (plaintext)."""

    pki: Pki
    tls: SecureServerProc
    mtls: SecureServerProc
    auth: SecureServerProc


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """One server of each kind for the whole module (killed at the end)."""
    directory = tmp_path_factory.mktemp("client-security")
    ca = TestCa(directory, "ca")
    pki = Pki(ca, ca.issue("server", server=True), ca.issue("client", server=False))
    trust = pki.ca.pem.read_bytes()
    server_tls = ("--tls-cert-file", str(pki.server.cert), "--tls-key-file", str(pki.server.key))
    tls_port, mtls_port, auth_port = free_ports(3)
    tls = SecureServerProc(
        directory,
        tls_port,
        grpc.ssl_channel_credentials(trust),
        extra_args=server_tls,
    )
    mtls = SecureServerProc(
        directory,
        mtls_port,
        grpc.ssl_channel_credentials(
            trust, pki.client.key.read_bytes(), pki.client.cert.read_bytes()
        ),
        extra_args=(*server_tls, "--tls-client-ca-file", str(pki.ca.pem)),
    )
    auth = SecureServerProc(
        directory,
        auth_port,
        None,
        extra_args=("--auth-tokens", TOKENS, "--max-streams-per-client", str(MAX_STREAMS)),
    )
    started: list[SecureServerProc] = []
    try:
        for server in (tls, mtls, auth):
            server.start()
            started.append(server)
        yield Servers(pki, tls, mtls, auth)
    finally:
        for server in started:
            server.kill()


def url(server: CacheServerProc, namespace: str, *, tls: bool = False, **params: str) -> str:
    """A client URL: no retries, no cost model, shared memory off, one namespace."""
    query = {
        "retry_max_attempts": "1",
        "cost_enabled": "false",
        "shm": "off",
        "namespace": namespace,
        **params,
    }
    scheme = "nopecaches" if tls else "nopecache"
    return f"{scheme}://{server.address}?" + "&".join(f"{k}={v}" for k, v in query.items())


def client(config_url: str) -> CacheClient:
    """A CacheClient of client_harness's tiny model, prefix blocks stored post-RoPE."""
    return CacheClient(
        config_url,
        fingerprint=fingerprint(StoredForm.ROPE),
        rope=SPEC,
        v_head_dim=DIM,
        prefix_block_tokens=PREFIX_BLOCK,
        chunker=CHUNKER,
    )


def round_trip(c: CacheClient, seed: int) -> tuple[int, int]:
    """Store a prompt's prefix blocks (post-RoPE K), fetch them back, check bit-exactness;
    (blocks stored, tokens fetched)."""
    tokens = prompt(TOKENS_PER_PROMPT, seed=seed)
    k, v = kv(TOKENS_PER_PROMPT, seed=seed)
    report = c.store(tokens, (k, v), 0, form="rope", position_independent=False)
    plan = c.lookup(tokens)
    result = c.fetch(plan, tokens)
    if result.failed or plan.prefix_end != TOKENS_PER_PROMPT:
        return report.stored, int(result.mask.sum())
    assert result.k is not None and result.v is not None
    assert torch.equal(result.k, k) and torch.equal(result.v, v)
    return report.stored, int(result.mask.sum())


def reused(c: CacheClient, seed: int) -> int:
    """Tokens of the prompt of ``seed`` that ``c`` finds cached."""
    return c.lookup(prompt(TOKENS_PER_PROMPT, seed=seed)).reused_tokens


# -- TLS ---------------------------------------------------------------------------------------
def test_tls_channel_stores_and_fetches_bit_exact(servers: Servers) -> None:
    ca = servers.pki.ca.pem
    with client(url(servers.tls, "tls", tls=True, tls_ca_file=str(ca))) as c:
        assert round_trip(c, seed=1) == (4, TOKENS_PER_PROMPT)
    # Plaintext to a TLS port: the handshake fails, and that is a miss, not an exception.
    with client(url(servers.tls, "tls", down_backoff="60s")) as c:
        assert round_trip(c, seed=1) == (0, 0)
        assert c.stats().server_errors == {servers.tls.address: 1}  # Stats, then backed off


def test_mutual_tls_needs_the_client_certificate(servers: Servers) -> None:
    pki = servers.pki
    files = {"tls_ca_file": str(pki.ca.pem)}
    mutual = {**files, "tls_cert_file": str(pki.client.cert), "tls_key_file": str(pki.client.key)}
    with client(url(servers.mtls, "mtls", tls=True, **mutual)) as c:
        assert round_trip(c, seed=2) == (4, TOKENS_PER_PROMPT)
    with client(url(servers.mtls, "mtls", tls=True, **files)) as c:
        assert round_trip(c, seed=2) == (0, 0)
        assert reused(c, seed=2) == 0


def test_unreadable_tls_file_is_refused_at_construction(servers: Servers, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-ca.pem"
    with pytest.raises(InvalidArgumentError, match=r"^tls_ca_file: cannot read .*no-such-ca"):
        client(url(servers.tls, "x", tls=True, tls_ca_file=str(missing)))
    empty = tmp_path / "empty.key"
    empty.write_bytes(b"")
    cert = str(servers.pki.client.cert)
    with pytest.raises(InvalidArgumentError, match=r"^tls_key_file: .*empty\.key' is empty"):
        client(url(servers.tls, "x", tls=True, tls_cert_file=cert, tls_key_file=str(empty)))


# -- tokens and tenants --------------------------------------------------------------------------
def test_right_token_works_and_a_wrong_one_is_a_logged_miss(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    with client(url(servers.auth, "tok", token=ALICE)) as alice:
        assert round_trip(alice, seed=3) == (4, TOKENS_PER_PROMPT)
        with (
            caplog.at_level(logging.ERROR, logger="nopecache.client.transport"),
            client(url(servers.auth, "tok", token=WRONG)) as wrong,
        ):
            assert reused(wrong, seed=3) == 0  # alice's blocks are not visible
            assert round_trip(wrong, seed=4) == (0, 0)
            assert round_trip(wrong, seed=5) == (0, 0)
            conn = wrong.core.connection(servers.auth.address)
            # Refused once, then left alone: no call per request to a server that
            # will refuse it again.
            assert conn.is_down() and conn.down_until - time.monotonic() > 20
            assert wrong.stats().server_errors == {servers.auth.address: 1}
        refusals = [r for r in caplog.records if "refused this client's credentials" in r.message]
        assert len(refusals) == 1 and "UNAUTHENTICATED" in refusals[0].message
        assert WRONG not in caplog.text  # the token itself never reaches the log
        # Nothing the wrong token sent was stored.
        assert (reused(alice, seed=4), reused(alice, seed=5)) == (0, 0)
        assert reused(alice, seed=3) == TOKENS_PER_PROMPT


def test_tenants_do_not_see_each_others_blocks(servers: Servers) -> None:
    with (
        client(url(servers.auth, "shared", token=ALICE)) as alice,
        client(url(servers.auth, "shared", token=ALICE_2)) as alice_2,
        client(url(servers.auth, "shared", token=BOB)) as bob,
    ):
        assert round_trip(alice, seed=6) == (4, TOKENS_PER_PROMPT)
        tokens = prompt(TOKENS_PER_PROMPT, seed=6)
        # Same namespace, same model, same prompt: only the tenant differs.
        assert bob.lookup(tokens).reused_tokens == 0
        fetched = bob.fetch(alice.lookup(tokens), tokens)  # alice's plan through bob
        assert len(fetched.placed) == 0 and len(fetched.failed) == 4
        assert alice_2.lookup(tokens).reused_tokens == TOKENS_PER_PROMPT  # alice's own token
        # Bob's store of the same prompt makes his own copy; alice's stays hers.
        assert round_trip(bob, seed=6) == (4, TOKENS_PER_PROMPT)
        assert alice.lookup(tokens).reused_tokens == TOKENS_PER_PROMPT


def _stats_code(address: str, token: str) -> grpc.StatusCode:
    """The status of one Stats call with ``token`` (a side channel, not the client)."""
    with grpc.insecure_channel(address) as channel:
        try:
            cache_pb2_grpc.KVCacheStub(channel).Stats(
                pb.StatsRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=5
            )
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def _wait_for(address: str, token: str, code: grpc.StatusCode) -> None:
    # Returns as soon as Stats answers ``code``; 60 s only bounds a hang on a loaded machine.
    deadline = time.monotonic() + 60
    while _stats_code(address, token) != code:
        assert time.monotonic() < deadline, f"Stats never answered {code.name}"
        time.sleep(0.05)


async def _open_streams(
    address: str, token: str, n: int
) -> tuple[grpc.aio.Channel, list[grpc.aio.StreamUnaryCall]]:
    """``n`` Put streams of ``token``'s tenant left open (no frame sent), and their channel."""
    channel = grpc.aio.insecure_channel(address)
    put = channel.stream_unary(
        "/nopecache.v1.KVCache/Put",
        request_serializer=None,
        response_deserializer=pb.PutReply.FromString,
    )
    metadata = (("authorization", f"Bearer {token}"),)
    return channel, [put(None, metadata=metadata, timeout=30) for _ in range(n)]


async def _close_streams(channel: grpc.aio.Channel, calls: list[grpc.aio.StreamUnaryCall]) -> None:
    for call in calls:
        call.cancel()
    await channel.close(None)


def test_a_busy_server_is_a_miss_for_that_call_only(servers: Servers) -> None:
    """RESOURCE_EXHAUSTED (max_streams_per_client) turns that call into misses; the server
    is not marked down, so the next call is served."""
    address = servers.auth.address
    with client(url(servers.auth, "busy", token=CAROL)) as carol:
        assert round_trip(carol, seed=7) == (4, TOKENS_PER_PROMPT)
        loop = carol._loop  # the held streams live on the client's loop thread, beside it
        channel, calls = asyncio.run_coroutine_threadsafe(
            _open_streams(address, CAROL, MAX_STREAMS), loop
        ).result(10)
        try:
            _wait_for(address, CAROL, grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert reused(carol, seed=7) == 0
            assert not carol.core.connection(address).is_down()
        finally:
            asyncio.run_coroutine_threadsafe(_close_streams(channel, calls), loop).result(10)
        _wait_for(address, CAROL, grpc.StatusCode.OK)
        assert reused(carol, seed=7) == TOKENS_PER_PROMPT
        assert carol.stats().server_errors == {address: 1}


def test_shared_memory_calls_carry_the_token(servers: Servers) -> None:
    """AttachShm and the shared-memory Get pass the gate with the token: blocks come
    through the segment, none is refused back to gRPC."""
    with client(url(servers.auth, "shm", token=ALICE, shm="auto")) as alice:
        assert round_trip(alice, seed=8) == (4, TOKENS_PER_PROMPT)
        assert alice.core.shm is not None
        stats = alice.core.shm.stats()
    assert (stats.shm_blocks, stats.grpc_blocks, stats.refused) == (4, 0, 0)
