"""Tenants: disjoint key namespaces (A cannot look up, fetch, delete, overwrite or touch B's
blocks even knowing B's keys), per-tenant byte quotas with RESOURCE_EXHAUSTED, and the
ledger that accounts them. Real server, real CPU tier; the ledger also on its own."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from nopecache.cache_server.tenants import (
    ANONYMOUS,
    NAMESPACE_BYTES,
    QuotaLedger,
    Tenant,
    TenantError,
    check_distinct,
    namespace_tag,
    namespaced_keys,
)
from nopecache.cache_server.tiers.cpu import CpuTier
from nopecache.proto import cache_pb2 as pb
from tests.support.server_harness import PRESENT, REJECTED, STORED, get, key_of, make_block, put
from tests.support.tenants import ALICE, AUTH, BOB, tenant_serving

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


# -- namespaces ----------------------------------------------------------------------------
def test_namespaced_keys_prefix_every_key_with_the_tag() -> None:
    keys = [key_of(i) for i in range(5)]
    tag = namespace_tag("alice")
    assert len(tag) == NAMESPACE_BYTES
    assert namespaced_keys(tag, b"".join(keys)) == [tag + k for k in keys]
    assert namespaced_keys(tag, b"") == []
    assert Tenant.named("alice").stored_key(keys[0]) == tag + keys[0]
    assert ANONYMOUS.stored_key(keys[0]) == keys[0]


def test_tags_differ_per_tenant_and_are_stable() -> None:
    names = [f"tenant-{i}" for i in range(200)]
    assert len({namespace_tag(n) for n in names}) == 200
    assert namespace_tag("alice") == namespace_tag("alice")
    check_distinct(Tenant.named(n) for n in names)


@pytest.mark.parametrize(
    ("name", "quota", "message"),
    [
        ("", 0, "tenant name: '' must be"),
        ("-lead", 0, "tenant name: '-lead' must be"),
        ("a" * 65, 0, "must be 1-64 characters"),
        ("al ice", 0, "tenant name: 'al ice' must be"),
        ("alice", -1, "tenant alice: quota_bytes must be >= 0"),
    ],
)
def test_bad_tenant_is_refused_naming_the_field(name: str, quota: int, message: str) -> None:
    with pytest.raises(TenantError, match=message.replace("(", r"\(")):
        Tenant.named(name, quota)


def test_the_same_tenant_twice_is_refused() -> None:
    with pytest.raises(TenantError, match="tenant alice: defined twice"):
        check_distinct([Tenant.named("alice"), Tenant.named("alice", 5)])


# -- the ledger ----------------------------------------------------------------------------
class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ledger_admits_up_to_the_quota_and_releases() -> None:
    ledger = QuotaLedger()
    t = Tenant.named("t", quota_bytes=100)
    assert ledger.admit(t, b"k1", 60)
    assert not ledger.admit(t, b"k2", 41)
    assert ledger.admit(t, b"k2", 40)
    assert ledger.admit(t, b"k1", 60)  # already charged: no second charge
    assert (ledger.used_bytes(t), ledger.charged_keys(t)) == (100, 2)
    assert ledger.release(t, [b"k1", b"absent"]) == 60
    assert ledger.used_bytes(t) == 40
    # A named tenant without a quota is tracked (its Stats count its blocks), never refused;
    # the anonymous tenant without a quota is not tracked at all.
    unlimited = Tenant.named("u")
    assert ledger.admit(unlimited, b"k", 10**12)
    assert (ledger.used_bytes(unlimited), ledger.charged_keys(unlimited)) == (10**12, 1)
    assert ledger.admit(ANONYMOUS, b"k", 10**12)
    assert (ledger.used_bytes(ANONYMOUS), ledger.charged_keys(ANONYMOUS)) == (0, 0)


@pytest.mark.asyncio
async def test_reconcile_releases_what_no_tier_holds_and_is_rate_limited() -> None:
    clock = FakeClock()
    ledger = QuotaLedger(reconcile_interval_s=5.0, clock=clock)
    t = Tenant.named("t", quota_bytes=100)
    for key in (b"a", b"b", b"c"):
        assert ledger.admit(t, key, 30)
    present = {b"a"}

    async def lookup(keys: Sequence[bytes]) -> list[str | None]:
        return ["cpu" if k in present else None for k in keys]

    assert await ledger.reconcile(t, lookup) == 60
    assert ledger.used_bytes(t) == 30
    for key in (b"b", b"c"):
        assert ledger.admit(t, key, 30)
    clock.now += 4.9
    assert await ledger.reconcile(t, lookup) == 0  # too soon
    clock.now += 0.1
    assert await ledger.reconcile(t, lookup) == 60


@pytest.mark.asyncio
async def test_reconcile_keeps_a_key_charged_again_during_its_lookup() -> None:
    ledger = QuotaLedger(reconcile_interval_s=0.0)
    t = Tenant.named("t", quota_bytes=100)
    assert ledger.admit(t, b"a", 30)

    async def lookup(keys: Sequence[bytes]) -> list[str | None]:
        # While the lookup is in flight, the block is deleted and stored again.
        ledger.release(t, [b"a"])
        assert ledger.admit(t, b"a", 30)
        await asyncio.sleep(0)
        return [None for _ in keys]

    assert await ledger.reconcile(t, lookup) == 0
    assert ledger.used_bytes(t) == 30


# -- isolation on a real server ------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_tenant_cannot_reach_another_tenants_blocks() -> None:
    async with tenant_serving(AUTH) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        keys = [key_of(i) for i in range(3)]
        blobs = [make_block(k) for k in keys]
        results = await put(alice, zip(keys, blobs, strict=True), h.frame_bytes)
        assert [r.outcome for r in results] == [STORED] * 3
        cpu = h.running.store.tiers[0]
        assert isinstance(cpu, CpuTier)
        lru_before = cpu.lru_keys()

        lookup = await bob.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert lookup.tiers == b"\x00\x00\x00"
        got, _ = await get(bob, keys)
        assert got == [None, None, None]
        deleted = await bob.Delete(pb.DeleteRequest(keys=b"".join(keys)))
        assert deleted.deleted == 0
        # Bob's calls did not even touch alice's entries (no recency change to time).
        assert cpu.lru_keys() == lru_before

        # The same content under the same key is a new block for bob, not "already
        # present": a Put cannot probe whether another tenant holds it.
        again = await put(bob, [(keys[0], blobs[0])], h.frame_bytes)
        assert [r.outcome for r in again] == [STORED]
        assert [r.outcome for r in await put(alice, [(keys[0], blobs[0])], h.frame_bytes)] == [
            PRESENT
        ]
        got, _ = await get(alice, keys)
        assert got == blobs
        got, _ = await get(bob, keys)
        assert got == [blobs[0], None, None]

        # Stored keys are tag || client key, so both copies exist side by side.
        tag_a, tag_b = namespace_tag("alice"), namespace_tag("bob")
        where = await h.running.store.lookup([tag_a + keys[0], tag_b + keys[0], keys[0]])
        assert where == ["cpu", "cpu", None]

        await bob.Delete(pb.DeleteRequest(keys=keys[0]))
        got, _ = await get(alice, keys[:1])
        assert got == blobs[:1]


@pytest.mark.asyncio
async def test_put_checks_the_client_key_against_the_header_before_namespacing() -> None:
    async with tenant_serving(AUTH) as h:
        key, other = key_of(1), key_of(2)
        results = await put(h.stub(ALICE), [(other, make_block(key))], h.frame_bytes)
        assert (results[0].outcome, results[0].key) == (REJECTED, other)
        assert "key: PutFrame.key" in results[0].reason
        assert (
            h.sample(
                "nopecache_tenant_rejected_total", {"tenant": "alice", "reason": "invalid_block"}
            )
            == 1
        )


# -- quotas --------------------------------------------------------------------------------
BLOCK = len(make_block(key_of(0)))
# What a block is charged: one page of the SMALL config's CPU tier.
CHARGE = 4096
assert BLOCK < CHARGE


@pytest.mark.asyncio
async def test_quota_refuses_the_block_that_does_not_fit_and_delete_frees_room() -> None:
    config = replace(AUTH, tenant_quota=2 * CHARGE + CHARGE // 2)
    async with tenant_serving(config) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        keys = [key_of(i) for i in range(4)]
        results = await put(alice, [(k, make_block(k)) for k in keys[:3]], h.frame_bytes)
        assert [(r.outcome, r.code) for r in results] == [
            (STORED, 0),
            (STORED, 0),
            (REJECTED, EXHAUSTED),
        ]
        assert results[2].reason == (
            f"block #2: quota: tenant alice holds {2 * CHARGE} of its {config.tenant_quota}"
            f"-byte quota; this block needs {CHARGE} more ({BLOCK} bytes in {CHARGE}-byte pages)"
        )
        got, _ = await get(alice, keys[:3])
        assert got == [make_block(keys[0]), make_block(keys[1]), None]
        # Re-storing a block it holds costs nothing; another tenant has its own quota.
        again = await put(alice, [(keys[0], make_block(keys[0]))], h.frame_bytes)
        assert [r.outcome for r in again] == [PRESENT]
        theirs = await put(bob, [(k, make_block(k)) for k in keys[:2]], h.frame_bytes)
        assert [r.outcome for r in theirs] == [STORED, STORED]

        await alice.Delete(pb.DeleteRequest(keys=keys[0]))
        results = await put(alice, [(keys[3], make_block(keys[3]))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        s = h.sample
        assert s("nopecache_tenant_used_bytes", {"tenant": "alice"}) == 2 * CHARGE
        assert s("nopecache_tenant_quota_bytes", {"tenant": "alice"}) == config.tenant_quota
        assert (
            s("nopecache_tenant_rejected_total", {"tenant": "alice", "reason": "over_quota"}) == 1
        )
        assert (
            s("nopecache_requests_rejected_total", {"method": "Put", "reason": "over_quota"}) == 1
        )


@pytest.mark.asyncio
async def test_evicted_blocks_stop_counting_when_the_tier_drops_them(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[tenants.alice]\ntokens = ["{ALICE}"]\nquota = "{3 * CHARGE}"\n'
        f'[tenants.bob]\ntokens = ["{BOB}"]\n'
    )
    # Four 4 KiB pages: bob's four blocks push all of alice's out.
    config = replace(
        AUTH,
        auth_tokens="",
        auth_tokens_file=str(tokens),
        tiers=("cpu://?capacity=16KiB&page=4KiB&pinned=no",),
    )
    async with tenant_serving(config) as h:
        alice, bob = h.stub(ALICE), h.stub(BOB)
        mine = [key_of(i) for i in range(3)]
        assert [
            r.outcome for r in await put(alice, [(k, make_block(k)) for k in mine], 1 << 16)
        ] == [STORED] * 3
        theirs = [key_of(100 + i) for i in range(4)]
        assert [
            r.outcome for r in await put(bob, [(k, make_block(k)) for k in theirs], 1 << 16)
        ] == [STORED] * 4
        got, _ = await get(alice, mine)
        assert got == [None, None, None]
        assert h.sample("nopecache_tenant_used_bytes", {"tenant": "alice"}) == 0

        new = key_of(9)
        results = await put(alice, [(new, make_block(new))], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        assert h.sample("nopecache_tenant_used_bytes", {"tenant": "alice"}) == CHARGE
        assert h.running.service.quotas.used_bytes(Tenant.named("alice", 3 * CHARGE)) == CHARGE


@pytest.mark.asyncio
async def test_concurrent_puts_cannot_both_take_the_last_bytes() -> None:
    config = replace(AUTH, tenant_quota=3 * CHARGE)
    async with tenant_serving(config) as h:
        alice = h.stub(ALICE)
        keys = [key_of(i) for i in range(12)]
        replies = await asyncio.gather(
            *(put(alice, [(k, make_block(k))], h.frame_bytes) for k in keys)
        )
        outcomes = [r[0].outcome for r in replies]
        assert outcomes.count(STORED) == 3
        assert outcomes.count(REJECTED) == 9
        lookup = await alice.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert sum(lookup.tiers) == 3
