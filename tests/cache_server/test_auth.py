"""Bearer-token authentication: token sources, the constant-time table, and the gate on a
real server. Calls without a valid token get UNAUTHENTICATED and change nothing stored;
health and reflection stay open.

The helpers at the top (a channel that sends a bearer token, a server with tenants) are
shared with test_tenants, test_limits, test_tls and test_fuzz.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nopecache.cache_server import auth
from nopecache.cache_server.auth import (
    AuthFailure,
    TokenTable,
    bearer_token,
    load_token_table,
    parse_token_lines,
)
from nopecache.cache_server.config import ConfigError, ServerConfig, build_parser, load_config
from nopecache.cache_server.main import RunningServer, start_server
from nopecache.cache_server.tenants import Tenant
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.cache_server.test_server import (
    SMALL,
    STORED,
    digest,
    frames_of,
    get,
    key_of,
    make_block,
    put,
    stream,
)

ALICE = "alice-token-7f3a9c1e5b2d4068"
BOB = "bob-token-2c8e6a4f1d3b5079"
AUTH = replace(SMALL, auth_tokens=f"{ALICE} alice; {BOB} bob")
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


# -- shared helpers ------------------------------------------------------------------------
class _Bearer:
    """Adds ``authorization: <value>`` to every call's metadata (a test-side client)."""

    def __init__(self, value: str) -> None:
        self._entry = ("authorization", value)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]


# grpc.aio files an interceptor under the first call kind it implements: one class per kind.
class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def bearer_interceptors(value: str) -> list[Any]:
    """Client interceptors that send ``authorization: <value>`` on every call."""
    return [_BearerUnaryUnary(value), _BearerUnaryStream(value), _BearerStreamUnary(value)]


def open_channel(
    address: str,
    *,
    token: str | None = None,
    authorization: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A channel to ``address`` that sends ``Bearer <token>`` (or a raw ``authorization``)."""
    value = authorization if authorization is not None else token and f"Bearer {token}"
    interceptors = bearer_interceptors(value) if value else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options, interceptors=interceptors)


class TenantHarness:
    """A running server plus one channel per token asked for (None: no token)."""

    def __init__(
        self, running: RunningServer, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        self.running = running
        self.config = running.config
        self.credentials = credentials
        self._channels: dict[str | None, grpc.aio.Channel] = {}

    @property
    def frame_bytes(self) -> int:
        """The largest frame data the server accepts."""
        return self.config.max_frame_data_bytes

    def channel(self, token: str | None) -> grpc.aio.Channel:
        """The channel that sends ``token`` (opened on first use, closed with the harness)."""
        if token not in self._channels:
            self._channels[token] = open_channel(
                self.running.address,
                token=token,
                credentials=self.credentials,
                options=self.config.grpc_options,
            )
        return self._channels[token]

    def stub(self, token: str | None) -> cache_pb2_grpc.KVCacheAsyncStub:
        """A KVCache stub whose calls carry ``token``."""
        return cache_pb2_grpc.KVCacheStub(self.channel(token))

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One metric sample of the server (0 when absent)."""
        value = self.running.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0

    async def close(self) -> None:
        """Close every channel and stop the server."""
        for channel in self._channels.values():
            await channel.close(None)
        await self.running.stop(grace_s=1.0)


class tenant_serving:
    """``async with tenant_serving(config) as h``: a server and its TenantHarness."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        server_credentials: grpc.ServerCredentials | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.config = config
        self.server_credentials = server_credentials
        self.channel_credentials = channel_credentials

    async def __aenter__(self) -> TenantHarness:
        running = await start_server(
            self.config, credentials=self.server_credentials, monitor_interval_s=0.2
        )
        self.harness = TenantHarness(running, self.channel_credentials)
        return self.harness

    async def __aexit__(self, *exc: object) -> None:
        await self.harness.close()


async def rpc_code(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status code a call ends with (streams are drained)."""
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# -- token sources -------------------------------------------------------------------------
def test_plain_text_tokens_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# team tokens\n{ALICE} alice\n\n{BOB}   bob  # second\n{ALICE}x alice\n")
    table = load_token_table(replace(SMALL, auth_tokens_file=str(path), tenant_quota=4096))
    assert table is not None and len(table) == 3
    assert [(t.name, t.quota_bytes) for t in table.tenants] == [("alice", 4096), ("bob", 4096)]
    assert table.match(ALICE) == table.match(ALICE + "x") == Tenant.named("alice", 4096)
    assert table.match(BOB) == Tenant.named("bob", 4096)


def test_toml_tokens_file_sets_quotas_per_tenant(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[tenants.alice]\ntokens = ["{ALICE}", "{ALICE}-next"]\nquota = "1MiB"\n'
        f'[tenants.bob]\ntokens = ["{BOB}"]\n'
    )
    table = load_token_table(replace(SMALL, auth_tokens_file=str(path), tenant_quota=100))
    assert table is not None
    assert table.match(ALICE) == table.match(ALICE + "-next") == Tenant.named("alice", 1 << 20)
    assert table.match(BOB) == Tenant.named("bob", 100)


def test_tokens_from_the_environment_and_a_file_combine(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{ALICE} alice\n")
    env = {"NOPECACHE_AUTH_TOKENS": f"{BOB} bob", "NOPECACHE_AUTH_TOKENS_FILE": str(path)}
    config = load_config([], env)
    assert config.auth_enabled
    assert BOB not in repr(config)
    table = load_token_table(config)
    assert table is not None
    assert [t.name for t in table.tenants] == ["alice", "bob"]


def test_auth_is_off_without_tokens() -> None:
    assert not SMALL.auth_enabled
    assert load_token_table(SMALL) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("short alice", "auth_tokens: entry 1: a token must be 16-4096 characters, got 5"),
        (f"{ALICE} alice extra", "auth_tokens: entry 1: expected 'TOKEN TENANT', got 3 fields"),
        (f"{ALICE}", "auth_tokens: entry 1: expected 'TOKEN TENANT', got 1 fields"),
        (f"{ALICE} alice;{ALICE} bob", "tokens: a token is listed twice (tenant bob)"),
        (f"{ALICE} al/ice", "auth_tokens: entry 1: tenant name: 'al/ice' must be"),
        ("\u00e9" * 20 + " alice", "auth_tokens: entry 1: a token must be printable ASCII"),
        ("# only a comment", "tokens: authentication is configured but lists no token"),
    ],
)
def test_bad_token_spec_is_refused_without_echoing_the_token(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_token_table(replace(SMALL, auth_tokens=spec))
    assert str(err.value).startswith(message), str(err.value)
    assert ALICE not in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.alice]\ntokens = []\n", "tenants.alice.tokens: must be a non-empty list"),
        (f'[tenants.alice]\ntokens = ["{ALICE}"]\nquota = "lots"\n', "tenants.alice.quota"),
        (f'[tenants.alice]\ntokens = ["{ALICE}"]\nrole = "x"\n', "unknown key(s) ['role']"),
        (f'[users.alice]\ntokens = ["{ALICE}"]\n', "unknown table(s) ['users']"),
        (f'[tenants.alice]\ntokens = ["{ALICE}"\n', "not valid TOML"),
    ],
)
def test_bad_toml_tokens_file_names_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_token_table(replace(SMALL, auth_tokens_file=str(path)))
    assert str(err.value).startswith(f"auth_tokens_file {path}"), str(err.value)
    assert message in str(err.value)
    assert ALICE not in str(err.value)


def test_missing_tokens_file_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^auth_tokens_file .*/absent: cannot read"):
        load_token_table(replace(SMALL, auth_tokens_file=str(tmp_path / "absent")))


def test_help_documents_the_security_options() -> None:
    text = " ".join(build_parser().format_help().split())
    for flag in (
        "--tls-cert-file",
        "--tls-key-file",
        "--tls-client-ca-file",
        "--auth-tokens-file",
        "--auth-tokens",
        "--tenant-quota",
        "--max-streams-per-client",
    ):
        assert flag in text, flag
    assert "health and reflection stay open" in text


# -- the table and the header --------------------------------------------------------------
def test_match_compares_every_token_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    pairs = parse_token_lines(";".join(f"token-number-{i:06d} t{i}" for i in range(20)), "t", 0)
    table = TokenTable(pairs)
    calls: list[int] = []
    real = auth.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for token, expected in [
        ("token-number-000000", "t0"),
        ("token-number-000019", "t19"),
        ("token-number-00001", None),  # a prefix of real tokens
        ("token-number-0000190", None),  # a real token plus one character
    ]:
        calls.clear()
        tenant = table.match(token)
        assert (tenant.name if tenant else None) == expected
        assert len(calls) == 20


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ([("authorization", f"Bearer {ALICE}")], ALICE),
        ([("authorization", f"bearer {ALICE}")], ALICE),
        ([("x-other", "1"), ("authorization", f"  Bearer   {ALICE} ")], ALICE),
        ([], AuthFailure("missing", "")),
        (None, AuthFailure("missing", "")),
        ([("authorization", f"Basic {ALICE}")], AuthFailure("malformed", "")),
        ([("authorization", "Bearer ")], AuthFailure("malformed", "")),
        ([("authorization", f"Bearer {ALICE}")] * 2, AuthFailure("malformed", "")),
        ([("authorization", ALICE.encode())], AuthFailure("malformed", "")),
    ],
)
def test_bearer_token_parsing(
    metadata: list[tuple[str, str | bytes]] | None, expected: str | AuthFailure
) -> None:
    got = bearer_token(metadata)
    if isinstance(expected, AuthFailure):
        assert isinstance(got, AuthFailure) and got.reason == expected.reason
        assert got.message.startswith("authorization: ")
    else:
        assert got == expected


# -- the gate on a real server -------------------------------------------------------------
KEYS = [key_of(i) for i in range(4)]


@pytest_asyncio.fixture
async def seeded() -> AsyncIterator[TenantHarness]:
    """An AUTH server where alice stored four blocks."""
    async with tenant_serving(AUTH) as h:
        results = await put(h.stub(ALICE), [(k, make_block(k)) for k in KEYS], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED] * 4
        yield h


def _every_call(
    stub: cache_pb2_grpc.KVCacheAsyncStub, frame_bytes: int
) -> dict[str, Callable[[], Any]]:
    """One call per method that would change or reveal alice's blocks if admitted."""
    new = key_of(50)
    return {
        "Lookup": lambda: stub.Lookup(pb.LookupRequest(keys=b"".join(KEYS))),
        "Get": lambda: stub.Get(pb.GetRequest(keys=b"".join(KEYS))),
        "Delete": lambda: stub.Delete(pb.DeleteRequest(keys=b"".join(KEYS))),
        "Stats": lambda: stub.Stats(pb.StatsRequest()),
        "Put": lambda: stub.Put(stream(frames_of([(new, make_block(new))], frame_bytes))),
    }


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "authorization", "reason"),
    [
        ("no token", None, "missing"),
        ("wrong token", f"Bearer {ALICE[:-1]}Z", "invalid"),
        ("token of nobody", "Bearer " + "x" * 40, "invalid"),
        ("not a bearer", f"Basic {ALICE}", "malformed"),
    ],
)
async def test_calls_without_a_valid_token_are_unauthenticated_and_change_nothing(
    seeded: TenantHarness, case: str, authorization: str | None, reason: str
) -> None:
    alice = seeded.stub(ALICE)
    everything = [*KEYS, key_of(50)]
    before = await digest(alice, everything)
    async with open_channel(seeded.running.address, authorization=authorization) as channel:
        intruder = cache_pb2_grpc.KVCacheStub(channel)
        for method, call in _every_call(intruder, seeded.frame_bytes).items():
            assert await rpc_code(call) == UNAUTHENTICATED, method
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await intruder.Stats(pb.StatsRequest())
    details = err.value.details() or ""
    assert details.startswith("authorization: ")
    assert ALICE not in details
    assert await digest(alice, everything) == before
    assert seeded.sample("nopecache_auth_failures_total", {"reason": reason}) == 6
    assert seeded.sample("nopecache_tenant_requests_total", {"tenant": "alice", "method": "Get"})


@pytest.mark.asyncio
async def test_garbage_request_with_a_wrong_token_is_unauthenticated_not_parsed(
    seeded: TenantHarness,
) -> None:
    async with open_channel(seeded.running.address, token=BOB + "0") as channel:
        call = channel.unary_unary(
            "/nopecache.v1.KVCache/Lookup", request_serializer=None, response_deserializer=None
        )
        assert await rpc_code(lambda: call(b"\x0a\xff\xff")) == UNAUTHENTICATED


@pytest.mark.asyncio
async def test_health_and_reflection_need_no_token(seeded: TenantHarness) -> None:
    channel = seeded.channel(None)
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service="nopecache.v1.KVCache"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def one() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    replies = [r async for r in reflection.ServerReflectionInfo(one())]
    names = {s.name for s in replies[0].list_services_response.service}
    assert "nopecache.v1.KVCache" in names


@pytest.mark.asyncio
async def test_valid_tokens_are_served_and_counted_per_tenant(seeded: TenantHarness) -> None:
    got, _ = await get(seeded.stub(ALICE), KEYS)
    assert got == [make_block(k) for k in KEYS]
    lookup = await seeded.stub(BOB).Lookup(pb.LookupRequest(keys=b"".join(KEYS)))
    assert lookup.tiers == bytes(4)
    s = seeded.sample
    assert s("nopecache_tenant_requests_total", {"tenant": "alice", "method": "Put"}) == 1
    assert s("nopecache_tenant_requests_total", {"tenant": "alice", "method": "Get"}) == 1
    assert s("nopecache_tenant_requests_total", {"tenant": "bob", "method": "Lookup"}) == 1
    blob_bytes = sum(len(make_block(k)) for k in KEYS)
    assert s("nopecache_tenant_put_bytes_total", {"tenant": "alice"}) == blob_bytes
    assert s("nopecache_tenant_get_bytes_total", {"tenant": "alice"}) == blob_bytes


@pytest.mark.asyncio
async def test_anonymous_server_tags_calls_with_the_anonymous_tenant() -> None:
    async with tenant_serving(SMALL) as h:
        key = key_of(7)
        await put(h.stub(None), [(key, make_block(key))], h.frame_bytes)
        # Without auth, a stray token is ignored, not refused.
        got, _ = await get(h.stub("whatever-token-0000"), [key])
        assert got == [make_block(key)]
        assert h.sample("nopecache_tenant_requests_total", {"tenant": "anonymous", "method": "Get"})
        assert h.sample("nopecache_auth_failures_total", {"reason": "missing"}) == 0


def test_config_repr_hides_inline_tokens() -> None:
    assert ALICE not in repr(AUTH)
    assert "auth_tokens" not in {f.name for f in dataclasses.fields(AUTH) if f.repr}
