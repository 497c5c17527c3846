"""A Put that changes nothing charges nothing (bench/fuzz.py, seed 0 input 366): a block
answered ALREADY_PRESENT under a key that holds a smaller block used to be charged the
bigger size, so the tenant's Stats (its used bytes) grew by a page while the tier kept
the old block and its entries did not change. Real server on loopback, with auth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nopecache.proto import cache_pb2 as pb
from tests.support.server_harness import PRESENT, STORED, key_of, make_block, put
from tests.support.tenants import ALICE, AUTH, tenant_serving


async def used(stub: object) -> tuple[int, int]:
    """(used bytes, entries) the tenant's Stats shows, summed over tiers."""
    stats = await stub.Stats(pb.StatsRequest())  # type: ignore[attr-defined]
    return sum(t.used_bytes for t in stats.tiers), sum(t.entries for t in stats.tiers)


@pytest.mark.asyncio
async def test_an_already_present_block_keeps_the_charge_of_what_is_stored() -> None:
    async with tenant_serving(replace(AUTH, tenant_quota=1024 * 1024)) as h:
        alice = h.stub(ALICE)
        key = key_of(366)
        small = make_block(key)  # one 4 KiB page
        bigger = make_block(key, tokens=64, head_dim=32)  # a few pages
        assert [r.outcome for r in await put(alice, [(key, small)], h.frame_bytes)] == [STORED]
        before = await used(alice)
        assert before == (4096, 1)
        assert [r.outcome for r in await put(alice, [(key, bigger)], h.frame_bytes)] == [PRESENT]
        assert await used(alice) == before
        # The tier still serves the block stored first.
        got = [f async for f in alice.Get(pb.GetRequest(keys=key))]
        assert b"".join(f.data for f in got) == small
