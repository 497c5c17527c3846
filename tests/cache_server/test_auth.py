"""Bearer-token authentication: token sources, the constant-time table, and the gate on a
real server. Calls without a valid token get UNAUTHENTICATED and change nothing stored;
health and reflection stay open.

The channel that sends a bearer token and the server with tenants live in
tests/support/tenants.py, shared with the other cache_server tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
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
from nopecache.cache_server.config import ConfigError, build_parser, load_config
from nopecache.cache_server.tenants import Tenant
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import (
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
from tests.support.tenants import (
    ALICE,
    AUTH,
    BOB,
    TenantHarness,
    open_channel,
    rpc_code,
    tenant_serving,
)

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


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
