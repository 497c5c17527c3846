"""The page-pool memory tiers: exact LRU eviction, capacity, allocator reuse, exact bytes."""

from __future__ import annotations

import array
import asyncio
import os
import random
import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from nopecache.cache_server.tiers import (
    Evicted,
    PutResult,
    PutStatus,
    TierClosedError,
    TierConfigError,
    tier_from_url,
)
from nopecache.cache_server.tiers.cpu import CpuTier, _parse_pinned
from nopecache.cache_server.tiers.cuda import CudaUnavailableError

PAGE = 100


def blob_of(tag: int, size: int) -> bytes:
    """Deterministic, non-repeating bytes so a misplaced page cannot go unnoticed."""
    return random.Random(tag).randbytes(size)


def small_tier(pages: int = 4) -> CpuTier:
    """A tier of ``pages`` pages of PAGE bytes."""
    return CpuTier(pages * PAGE, page_bytes=PAGE, pinned=False)


def test_url_builds_a_pool_of_whole_pages() -> None:
    tier = tier_from_url("cpu://?capacity=1000&page=256")
    assert isinstance(tier, CpuTier)
    assert tier.capacity_bytes == 768
    assert tier.page_bytes == 256
    assert tier.max_blob_bytes == 768
    assert tier.pinned is False  # off by default: no server path DMAs from this pool
    stats = asyncio.run(tier.stats())
    assert (stats.name, stats.url, stats.used_bytes, stats.capacity_bytes) == (
        "cpu",
        "cpu://?capacity=1000&page=256",
        0,
        768,
    )
    assert (stats.entries, stats.healthy) == (0, True)


def test_url_sizes_accept_units() -> None:
    tier = tier_from_url("cpu://?capacity=1MiB&page=64KiB&pinned=no")
    assert isinstance(tier, CpuTier)
    assert (tier.capacity_bytes, tier.page_bytes, tier.pinned) == (1024**2, 65536, False)


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("cpu://", "option 'capacity' is required"),
        ("cpu://?capacity=lots", "capacity: cannot parse 'lots'"),
        ("cpu://?capacity=1KiB&page=2KiB", "smaller than one page"),
        ("cpu://?capacity=1KiB&colour=red", "unknown option 'colour'"),
        ("cpu://?capacity=1KiB&capacity=2KiB", "option 'capacity' given twice"),
        ("cpu://somehost?capacity=1KiB", "takes no host or path"),
        ("cpu://?capacity=1KiB&pinned=maybe", "pinned must be auto, yes or no"),
        ("ftp://host/x", "unknown tier scheme 'ftp'"),
    ],
)
def test_bad_urls_are_refused_with_the_part_named(url: str, fragment: str) -> None:
    with pytest.raises(TierConfigError) as info:
        tier_from_url(url)
    assert fragment in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_pinned_memory_without_cuda_is_refused() -> None:
    with pytest.raises(TierConfigError, match="pinned=yes needs CUDA"):
        tier_from_url("cpu://?capacity=1KiB&page=1KiB&pinned=yes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_tier_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(CudaUnavailableError, match="CUDA is not available"):
        tier_from_url("cuda://0?capacity=1MiB")


@pytest.mark.asyncio
async def test_eviction_order_is_exact_lru_and_get_refreshes() -> None:
    tier = small_tier(pages=4)
    a, b, c, d, e, f, g = (bytes([k]) * 8 for k in b"abcdefg")
    blobs = {k: blob_of(i, PAGE) for i, k in enumerate((a, b, c, d, e, f))}
    for key in (a, b, c, d):
        assert await tier.put(key, blobs[key]) == PutResult(PutStatus.STORED)
    assert await tier.get(a) == blobs[a]  # a becomes most recent
    assert await tier.put(e, blobs[e]) == PutResult(PutStatus.STORED, (Evicted(b, blobs[b]),))
    assert tier.lru_keys() == [c, d, a, e]
    # A lookup is a query: it must not save c.
    assert await tier.contains_many([c, b, e]) == [True, False, True]
    assert await tier.put(f, blobs[f]) == PutResult(PutStatus.STORED, (Evicted(c, blobs[c]),))
    # A 3-page blob evicts the three least recent, oldest first.
    blob_g = blob_of(99, 2 * PAGE + 50)
    result = await tier.put(g, blob_g)
    assert result == PutResult(
        PutStatus.STORED, (Evicted(d, blobs[d]), Evicted(a, blobs[a]), Evicted(e, blobs[e]))
    )
    assert tier.lru_keys() == [f, g]
    assert await tier.get(g) == blob_g
    tier.check_invariants()


@pytest.mark.asyncio
async def test_put_of_a_present_key_keeps_the_bytes_and_refreshes() -> None:
    tier = small_tier(pages=2)
    first, second = blob_of(1, 10), blob_of(2, 10)
    assert (await tier.put(b"k1", first)).status is PutStatus.STORED
    assert (await tier.put(b"k2", second)).status is PutStatus.STORED
    assert await tier.put(b"k1", blob_of(3, 10)) == PutResult(PutStatus.ALREADY_PRESENT)
    assert await tier.get(b"k1") == first
    assert tier.lru_keys() == [b"k2", b"k1"]


@pytest.mark.asyncio
async def test_evicted_blobs_are_omitted_on_request() -> None:
    tier = small_tier(pages=1)
    await tier.put(b"old", b"x" * PAGE)
    result = await tier.put(b"new", b"y", keep_evicted=False)
    assert result == PutResult(PutStatus.STORED, (Evicted(b"old", None),))


@pytest.mark.asyncio
async def test_too_large_blob_changes_nothing() -> None:
    tier = small_tier(pages=2)
    await tier.put(b"keep", b"k" * PAGE)
    assert await tier.put(b"big", b"b" * (2 * PAGE + 1)) == PutResult(PutStatus.TOO_LARGE)
    assert tier.lru_keys() == [b"keep"]
    assert await tier.get(b"keep") == b"k" * PAGE
    # Exactly the capacity fits (after evicting everything else).
    full = blob_of(5, 2 * PAGE)
    assert await tier.put(b"full", full) == PutResult(
        PutStatus.STORED, (Evicted(b"keep", b"k" * PAGE),)
    )
    assert await tier.get(b"full") == full


@pytest.mark.asyncio
async def test_bytes_are_exact_across_scattered_pages() -> None:
    tier = CpuTier(8 * 64, page_bytes=64, pinned=False)
    for i in range(8):
        await tier.put(b"k%d" % i, blob_of(i, 64))
    for i in (1, 3, 5, 6):
        assert await tier.delete(b"k%d" % i)
    scattered = blob_of(42, 3 * 64 + 17)  # 4 pages, the last one partial
    assert await tier.put(b"s", scattered) == PutResult(PutStatus.STORED)
    placement = tier.placement(b"s")
    assert placement is not None
    assert sorted(start for start, _ in placement.runs) == [1, 3, 5, 6]
    got = await tier.get(b"s")
    assert type(got) is bytes
    assert got == scattered
    for i in (0, 2, 4, 7):
        assert await tier.get(b"k%d" % i) == blob_of(i, 64)
    tier.check_invariants()


@pytest.mark.asyncio
async def test_returned_and_source_buffers_are_independent_of_the_pool() -> None:
    tier = small_tier(pages=1)
    source = bytearray(blob_of(7, PAGE))
    await tier.put(b"a", source)
    source[:] = bytes(PAGE)  # the caller reuses its buffer
    got = await tier.get(b"a")
    assert got == blob_of(7, PAGE)
    await tier.put(b"b", blob_of(8, PAGE))  # overwrites the only page
    assert got == blob_of(7, PAGE)
    assert await tier.get(b"b") == blob_of(8, PAGE)


@pytest.mark.asyncio
async def test_typed_memoryviews_are_stored_as_raw_bytes() -> None:
    tier = small_tier(pages=1)
    values = array.array("H", [1, 2, 0xFFFF])
    await tier.put(b"h", memoryview(values))
    assert await tier.get(b"h") == values.tobytes()


@pytest.mark.asyncio
async def test_empty_blob_and_batched_calls() -> None:
    tier = small_tier(pages=2)
    await tier.put(b"empty", b"")
    await tier.put(b"one", b"1")
    assert await tier.get_many([b"one", b"none", b"empty"]) == [b"1", None, b""]
    assert await tier.contains(b"empty")
    assert await tier.delete_many([b"empty", b"none", b"one"]) == [True, False, True]
    stats = await tier.stats()
    assert (stats.used_bytes, stats.entries) == (0, 0)


@pytest.mark.asyncio
async def test_allocator_reuses_every_page_after_churn() -> None:
    pages = 32
    tier = CpuTier(pages * 16, page_bytes=16, pinned=False)
    rng = random.Random(0)
    live: dict[bytes, bytes] = {}
    for step in range(400):
        key = b"k%d" % rng.randrange(40)
        if key in live and rng.random() < 0.4:
            assert await tier.delete(key)
            del live[key]
            continue
        blob = blob_of(step, rng.randrange(0, 5 * 16))
        result = await tier.put(key, blob)
        if result.status is PutStatus.STORED:
            live[key] = blob
        for entry in result.evicted:
            assert live.pop(entry.key) == entry.blob
        tier.check_invariants()
    stats = await tier.stats()
    assert stats.used_bytes == sum(-(-len(b) // 16) * 16 for b in live.values())
    for key, blob in live.items():
        assert await tier.get(key) == blob
    assert sum(await tier.delete_many(list(live))) == len(live)
    stats = await tier.stats()
    assert (stats.used_bytes, stats.entries) == (0, 0)
    # No page leaked and none is stranded: a blob of the whole pool fits with no eviction.
    assert await tier.put(b"all", blob_of(1, pages * 16)) == PutResult(PutStatus.STORED)
    assert await tier.get(b"all") == blob_of(1, pages * 16)
    tier.check_invariants()


@pytest.mark.asyncio
async def test_closed_tier_refuses_operations() -> None:
    tier = small_tier()
    await tier.put(b"a", b"a")
    await tier.close()
    with pytest.raises(TierClosedError):
        await tier.get(b"a")
    with pytest.raises(TierClosedError):
        await tier.put(b"b", b"b")
    assert not (await tier.stats()).healthy


class CpuTierMatchesLruModel(RuleBasedStateMachine):
    """Random put/get/delete sequences against a plain LRU model of pages."""

    PAGES = 6

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tier = CpuTier(self.PAGES * 8, page_bytes=8, pinned=False)
        self.model: OrderedDict[bytes, bytes] = OrderedDict()
        self.serial = 0

    def pages(self, blob: bytes) -> int:
        """Pages the tier must use for ``blob``."""
        return -(-len(blob) // 8)

    @rule(key=st.binary(min_size=1, max_size=1), size=st.integers(0, 8 * PAGES + 8))
    def put(self, key: bytes, size: int) -> None:
        self.serial += 1
        blob = blob_of(self.serial, size)
        result = self.loop.run_until_complete(self.tier.put(key, blob))
        if key in self.model:
            assert result == PutResult(PutStatus.ALREADY_PRESENT)
            self.model.move_to_end(key)
            return
        if self.pages(blob) > self.PAGES:
            assert result == PutResult(PutStatus.TOO_LARGE)
            return
        expected = []
        while sum(map(self.pages, self.model.values())) + self.pages(blob) > self.PAGES:
            old_key, old_blob = self.model.popitem(last=False)
            expected.append(Evicted(old_key, old_blob))
        self.model[key] = blob
        assert result == PutResult(PutStatus.STORED, tuple(expected))

    @rule(key=st.binary(min_size=1, max_size=1))
    def get(self, key: bytes) -> None:
        got = self.loop.run_until_complete(self.tier.get(key))
        assert got == self.model.get(key)
        if key in self.model:
            self.model.move_to_end(key)

    @rule(key=st.binary(min_size=1, max_size=1))
    def delete(self, key: bytes) -> None:
        removed = self.loop.run_until_complete(self.tier.delete(key))
        assert removed == (self.model.pop(key, None) is not None)

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        stats = self.loop.run_until_complete(self.tier.stats())
        assert stats.used_bytes == 8 * sum(map(self.pages, self.model.values()))
        assert stats.capacity_bytes == 8 * self.PAGES
        assert stats.used_bytes <= stats.capacity_bytes
        assert stats.entries == len(self.model)
        assert self.tier.lru_keys() == list(self.model)
        self.tier.check_invariants()

    def teardown(self) -> None:
        self.loop.run_until_complete(self.tier.close())
        self.loop.close()


TestCpuTierMatchesLruModel = CpuTierMatchesLruModel.TestCase


# Run in a fresh interpreter: the test process has torch loaded already.
_LAZY_POOL_SCRIPT = textwrap.dedent(
    """
    import asyncio, os, sys
    if sys.argv[1] == "blocked":
        sys.modules["torch"] = None  # any import of torch now raises ImportError
    from nopecache.cache_server.tiers import tier_from_url

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    pinned = f"&pinned={sys.argv[2]}" if sys.argv[2] else ""  # "": the default
    tier = tier_from_url("cpu://?capacity=64MiB&page=64KiB" + pinned)
    grown = rss() - before
    assert asyncio.run(tier.put(b"k", b"x" * 100_000)).status.name == "STORED"
    assert asyncio.run(tier.get(b"k")) == b"x" * 100_000
    print(tier.pinned, tier.capacity_bytes, grown < 16 * 1024**2, "torch" in sys.modules)
    """
)
_GPU_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def test_pinned_is_off_by_default_and_never_imports_torch() -> None:
    # Off, not auto: with a GPU present auto would pin (and create a CUDA context).
    assert _parse_pinned({}, "cpu://?capacity=1KiB") is False
    proc = subprocess.run(
        [sys.executable, "-c", _LAZY_POOL_SCRIPT, "allowed", ""],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", str(64 * 1024**2), "True", "False"]


@pytest.mark.parametrize("torch_import", ["blocked", "allowed"])
def test_pinned_auto_without_a_gpu_neither_imports_torch_nor_touches_the_pool(
    torch_import: str,
) -> None:
    """pinned=auto builds an unpinned pool where torch cannot even be imported, imports torch
    only when a GPU device file exists, and a 64 MiB pool does not add 64 MiB to RSS."""
    proc = subprocess.run(
        [sys.executable, "-c", _LAZY_POOL_SCRIPT, torch_import, "auto"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    pinned, capacity, lazy, torch_loaded = proc.stdout.split()
    may_have_gpu = any(os.path.exists(f) for f in _GPU_FILES)
    assert (capacity, lazy) == (str(64 * 1024**2), "True")
    if torch_import == "blocked":
        assert (pinned, torch_loaded) == ("False", "True")  # True: the None placeholder
    elif not may_have_gpu:
        assert (pinned, torch_loaded) == ("False", "False")
    else:
        assert torch_loaded == "True"


def test_get_into_copies_the_pages_straight_into_the_buffer() -> None:
    async def run() -> None:
        tier = small_tier(4)
        a, b = blob_of(1, PAGE * 2 + 7), blob_of(2, PAGE)
        await tier.put(b"a", a)
        await tier.put(b"b", b)
        out = bytearray(PAGE * 3)
        assert await tier.get_into(b"a", memoryview(out)) == len(a)
        assert bytes(out[: len(a)]) == a
        assert tier.lru_keys() == [b"b", b"a"]  # a hit refreshes recency, as get does
        small = bytearray(PAGE)
        before = bytes(small)
        assert await tier.get_into(b"a", memoryview(small)) == len(a)  # needs more room
        assert bytes(small) == before and tier.lru_keys() == [b"b", b"a"]
        assert await tier.get_into(b"b", memoryview(small)) == PAGE
        assert bytes(small) == b and tier.lru_keys() == [b"a", b"b"]
        assert await tier.get_into(b"zz", memoryview(out)) is None

    asyncio.run(run())
