"""The CUDA tier's copy path: staging pieces (CPU, exact), and on a GPU its round trips
through a staging buffer smaller than a block, evictions read before their pages are
rewritten, and copies interleaved with deletes from other coroutines.

The GPU tests use ``asyncio.run`` rather than the pytest-asyncio plugin: ``make gpu-check``
runs them on an image that has torch, triton and pytest only."""

from __future__ import annotations

import asyncio
import random

import pytest

from nopecache.cache_server.tiers import tier_from_url
from nopecache.cache_server.tiers.base import Evicted, PutResult, PutStatus, TierConfigError
from nopecache.cache_server.tiers.cpu import Placement
from nopecache.cache_server.tiers.cuda import CudaTier, staging_pieces


def blob_of(tag: int, size: int) -> bytes:
    return random.Random(tag).randbytes(size)


def test_staging_pieces_pack_runs_and_split_at_the_buffer_size() -> None:
    # Pages of 10 B; a 43 B block on runs (3 pages at 0, 2 pages at 7): 30 + 13 bytes.
    block = Placement(runs=((0, 3), (7, 2)), size=43)
    assert staging_pieces(block, 10, 100) == [[(0, 0, 30), (70, 30, 13)]]
    # A 20 B staging buffer: pieces of whole 20 B, runs cut where the buffer fills.
    assert staging_pieces(block, 10, 20) == [
        [(0, 0, 20)],
        [(20, 0, 10), (70, 10, 10)],
        [(80, 0, 3)],
    ]
    assert staging_pieces(Placement(runs=(), size=0), 10, 20) == [[]]


def test_staging_option_is_parsed_and_checked() -> None:
    with pytest.raises(TierConfigError, match="staging"):
        CudaTier.from_url("cuda://0?capacity=4KiB&staging=lots")


@pytest.mark.gpu
def test_cuda_tier_round_trip_and_lru() -> None:
    asyncio.run(_round_trip_and_lru())


async def _round_trip_and_lru() -> None:
    tier = tier_from_url("cuda://0?capacity=4KiB&page=1KiB")
    assert isinstance(tier, CudaTier)
    blobs = [blob_of(i, 1000 + i) for i in range(5)]
    for i in range(4):
        assert (await tier.put(b"k%d" % i, blobs[i])).status is PutStatus.STORED
    assert await tier.get(b"k0") == blobs[0]
    result = await tier.put(b"k4", blobs[4])
    assert result == PutResult(PutStatus.STORED, (Evicted(b"k1", blobs[1]),))
    await tier.delete(b"k2")
    await tier.delete(b"k0")
    scattered = blob_of(9, 2048 + 5)  # 3 pages across the holes (one must be evicted)
    await tier.put(b"s", scattered)
    assert await tier.get(b"s") == scattered
    assert await tier.get(b"k4") == blobs[4]
    tier.check_invariants()
    await tier.close()


@pytest.mark.gpu
def test_blocks_larger_than_the_staging_buffer_round_trip() -> None:
    asyncio.run(_blocks_larger_than_the_staging_buffer_round_trip())


async def _blocks_larger_than_the_staging_buffer_round_trip() -> None:
    tier = tier_from_url("cuda://0?capacity=64KiB&page=1KiB&staging=2KiB")
    assert isinstance(tier, CudaTier)
    blobs = {b"a": blob_of(1, 5000), b"b": blob_of(2, 1), b"c": blob_of(3, 2048)}
    for key, blob in blobs.items():
        assert (await tier.put(key, blob)).status is PutStatus.STORED
    got = await tier.get_many([b"c", b"x", b"a", b"b"])
    assert got == [blobs[b"c"], None, blobs[b"a"], blobs[b"b"]]
    await tier.delete(b"b")  # a hole: the next block spans two runs
    big = blob_of(4, 9000)
    await tier.put(b"d", big)
    assert await tier.get(b"d") == big
    tier.check_invariants()
    await tier.close()


@pytest.mark.gpu
def test_evicted_blocks_are_read_before_their_pages_are_rewritten() -> None:
    asyncio.run(_evicted_blocks_are_read_before_their_pages_are_rewritten())


async def _evicted_blocks_are_read_before_their_pages_are_rewritten() -> None:
    tier = tier_from_url("cuda://0?capacity=4KiB&page=1KiB&staging=1KiB")
    blobs = [blob_of(i, 1000 + i) for i in range(6)]
    for i in range(4):
        await tier.put(b"k%d" % i, blobs[i])
    result = await tier.put(b"big", blob_of(9, 2048 + 7))  # 3 pages: evicts k0, k1, k2
    assert result == PutResult(
        PutStatus.STORED, tuple(Evicted(b"k%d" % i, blobs[i]) for i in range(3))
    )
    assert await tier.get(b"big") == blob_of(9, 2048 + 7)
    assert await tier.get(b"k3") == blobs[3]
    await tier.close()


@pytest.mark.gpu
def test_concurrent_gets_puts_and_deletes_never_mix_bytes() -> None:
    asyncio.run(_concurrent_gets_puts_and_deletes_never_mix_bytes())


async def _concurrent_gets_puts_and_deletes_never_mix_bytes() -> None:
    tier = tier_from_url("cuda://0?capacity=32KiB&page=1KiB&staging=3KiB")
    assert isinstance(tier, CudaTier)
    blobs = {b"k%d" % i: blob_of(i, 700 + 311 * i) for i in range(24)}

    async def writer(keys: list[bytes]) -> None:
        for key in keys:
            await tier.put(key, blobs[key])

    async def reader() -> None:
        for _ in range(40):
            key = random.choice(list(blobs))
            got = await tier.get(key)
            assert got is None or got == blobs[key]

    async def deleter() -> None:
        for key in list(blobs)[::3]:
            await tier.delete(key)
            await asyncio.sleep(0)

    keys = list(blobs)
    await asyncio.gather(writer(keys[:12]), writer(keys[12:]), reader(), reader(), deleter())
    for key, blob in blobs.items():
        got = await tier.get(key)
        assert got is None or got == blob
    tier.check_invariants()
    await tier.close()
