"""Quotas that hold against a tenant playing games: charged in the tiers' pages, on every
Put (keys seen before included), released when the tiers drop a block; and Stats that show
a tenant only its own blocks. Real in-process server on loopback with bearer tokens."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.tenants import QuotaLedger, Tenant
from nopecache.proto import cache_pb2 as pb
from tests.support.server_harness import REJECTED, STORED, key_of, make_block, put
from tests.support.tenants import ALICE, AUTH, BOB, tenant_serving

PAGE = 16 * 1024
# Sixteen 16 KiB pages.
CPU = f"cpu://?capacity={16 * PAGE}&page={PAGE}&pinned=no"
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def config_with_quota(tmp_path: Path, alice_quota: int) -> ServerConfig:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[tenants.alice]\ntokens = ["{ALICE}"]\nquota = "{alice_quota}"\n'
        f'[tenants.bob]\ntokens = ["{BOB}"]\n'
    )
    return replace(AUTH, auth_tokens="", auth_tokens_file=str(tokens), tiers=(CPU,))


def one_page_block(key: bytes) -> bytes:
    """A block just under one page."""
    blob = make_block(key, tokens=60, head_dim=64)
    assert PAGE - 1024 < len(blob) <= PAGE
    return blob


@pytest.mark.asyncio
async def test_tiny_blocks_are_charged_a_page_so_a_small_quota_cannot_flush_the_cache(
    tmp_path: Path,
) -> None:
    async with tenant_serving(config_with_quota(tmp_path, 4 * PAGE)) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        theirs = [key_of(100 + i) for i in range(12)]
        results = await put(bob, [(k, one_page_block(k)) for k in theirs], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED] * 12
        # 40 blocks of ~200 bytes: 8 KB of bytes, but each takes a whole page.
        mine = [key_of(i) for i in range(40)]
        tiny = make_block(mine[0])
        assert len(tiny) < 512
        results = await put(alice, [(k, make_block(k)) for k in mine], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED] * 4 + [REJECTED] * 36
        assert {r.code for r in results[4:]} == {EXHAUSTED}
        assert results[4].reason == (
            f"block #4: quota: tenant alice holds {4 * PAGE} of its {4 * PAGE}-byte quota; "
            f"this block needs {PAGE} more ({len(tiny)} bytes in {PAGE}-byte pages)"
        )
        # Bob's twelve pages plus alice's four fill the sixteen: nothing of bob's went.
        lookup = await bob.Lookup(pb.LookupRequest(keys=b"".join(theirs)))
        assert lookup.tiers == b"\x01" * 12


@pytest.mark.asyncio
async def test_re_putting_evicted_keys_with_big_blocks_is_charged(tmp_path: Path) -> None:
    async with tenant_serving(config_with_quota(tmp_path, 4 * PAGE)) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        mine = [key_of(i) for i in range(4)]
        results = await put(alice, [(k, make_block(k)) for k in mine], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED] * 4
        # Bob's traffic pushes alice's tiny blocks out of the cache.
        theirs = [key_of(100 + i) for i in range(16)]
        await put(bob, [(k, one_page_block(k)) for k in theirs], h.frame_bytes)
        assert (await alice.Lookup(pb.LookupRequest(keys=b"".join(mine)))).tiers == b"\x00" * 4
        quotas = h.running.service.quotas
        assert quotas.charged_keys(h.running.gate.tenants[0]) == 0
        # The same keys again, now with blocks of four pages each: only one fits.
        big = [make_block(k, tokens=240, head_dim=64) for k in mine]
        assert 3 * PAGE < len(big[0]) <= 4 * PAGE
        results = await put(alice, list(zip(mine, big, strict=True)), h.frame_bytes)
        assert [r.outcome for r in results] == [STORED, REJECTED, REJECTED, REJECTED]
        stats = await alice.Stats(pb.StatsRequest())
        assert [(t.name, t.used_bytes, t.entries) for t in stats.tiers] == [("cpu", 4 * PAGE, 1)]


def test_a_key_seen_before_pays_for_a_bigger_block_in_pages() -> None:
    ledger = QuotaLedger(unit_bytes=PAGE)
    alice = Tenant.named("alice", quota_bytes=4 * PAGE)
    assert ledger.admit(alice, b"k", 100)
    assert ledger.used_bytes(alice) == PAGE
    # Still charged (say the tier dropped it unseen): a bigger block pays the difference.
    assert not ledger.admit(alice, b"k", 4 * PAGE + 1)
    assert ledger.admit(alice, b"k", 3 * PAGE + 1)
    assert (ledger.used_bytes(alice), ledger.charged_keys(alice)) == (4 * PAGE, 1)
    assert ledger.admit(alice, b"k", 10)  # smaller: keeps the charge
    assert ledger.used_bytes(alice) == 4 * PAGE
    assert ledger.forget([b"k", b"other"]) == ["alice"]
    assert ledger.used_bytes(alice) == 0


@pytest.mark.asyncio
async def test_a_tenant_without_quota_is_recounted_as_its_charges_double() -> None:
    ledger = QuotaLedger()
    bob = Tenant.named("bob")
    for i in range(4095):
        assert ledger.admit(bob, i.to_bytes(24, "little"), 10)
    assert not ledger.sweep_due(bob)
    assert ledger.admit(bob, b"last".ljust(24, b"\0"), 10)
    assert ledger.sweep_due(bob)
    kept = {i.to_bytes(24, "little") for i in range(100)}

    async def lookup(keys: Sequence[bytes]) -> list[str | None]:
        return ["redis" if k in kept else None for k in keys]

    assert await ledger.sweep(bob, lookup) == (4096 - 100) * 10
    assert (ledger.charged_keys(bob), ledger.sweep_due(bob)) == (100, False)


@pytest.mark.asyncio
async def test_stats_show_a_tenant_only_its_own_blocks(tmp_path: Path) -> None:
    async with tenant_serving(config_with_quota(tmp_path, 8 * PAGE)) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        theirs = [key_of(100 + i) for i in range(5)]
        await put(bob, [(k, one_page_block(k)) for k in theirs], h.frame_bytes)
        mine = [key_of(i) for i in range(2)]
        await put(alice, [(k, make_block(k)) for k in mine], h.frame_bytes)
        a = await alice.Stats(pb.StatsRequest())
        b = await bob.Stats(pb.StatsRequest())
        assert [(t.name, t.used_bytes, t.entries, t.capacity_bytes) for t in a.tiers] == [
            ("cpu", 2 * PAGE, 2, 16 * PAGE)
        ]
        assert [(t.name, t.used_bytes, t.entries) for t in b.tiers] == [("cpu", 5 * PAGE, 5)]


@pytest.mark.asyncio
@pytest.mark.parametrize("tenant_labels", [False, True])
async def test_the_metrics_port_names_tenants_only_when_asked(tenant_labels: bool) -> None:
    config = replace(AUTH, metrics=True, metrics_port=0, metrics_tenant_labels=tenant_labels)
    async with tenant_serving(config) as h:
        key = key_of(1)
        assert [r.outcome for r in await put(h.stub(ALICE), [(key, make_block(key))], 1 << 16)] == [
            STORED
        ]
        endpoint = h.running.metrics_endpoint
        assert endpoint is not None
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        text = body.decode()
        assert "nopecache_put_bytes_total" in text
        assert ("alice" in text) is tenant_labels
        assert ("nopecache_tenant_" in text) is tenant_labels
        # The registry itself keeps them either way (tests and in-process users).
        assert h.sample("nopecache_tenant_put_bytes_total", {"tenant": "alice"}) > 0
