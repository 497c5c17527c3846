"""The disk tier over real slab files: exact LRU, bytes back bit-exact after a restart, and
damage (flipped bytes, a truncated slab, a torn record, a full disk) as counted misses."""

from __future__ import annotations

import errno
import logging
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from nopecache.cache_server.store import TieredStore
from nopecache.cache_server.tiers import Evicted, PutStatus, TierConfigError, tier_from_url
from nopecache.cache_server.tiers.cpu import CpuTier
from nopecache.cache_server.tiers.disk import DiskTier
from nopecache.cache_server.tiers.disk_record import FIXED_BYTES
from tests.support.redis_procs import RedisProc

PAGE = 4096
# Each test blob takes one 4 KiB page with its record header (56 + 16 bytes in front).
BLOB = 3000


def key(i: int) -> bytes:
    """A 16-byte key."""
    return i.to_bytes(2, "little") * 8


def blob(i: int, size: int = BLOB) -> bytes:
    """Deterministic, non-repeating bytes: a misplaced or stale page cannot go unnoticed."""
    return random.Random(i).randbytes(size)


def open_tier(path: Path, pages: int = 4, **options: str) -> DiskTier:
    """A disk tier of ``pages`` pages of 4 KiB under ``path``, built from its URL."""
    query = "".join(f"&{k}={v}" for k, v in options.items())
    tier = tier_from_url(f"file://{path}?capacity={pages * PAGE}&page={PAGE}{query}")
    assert isinstance(tier, DiskTier)
    return tier


@pytest_asyncio.fixture
async def disk(tmp_path: Path) -> AsyncIterator[DiskTier]:
    """A 4-page tier, closed after the test."""
    tier = open_tier(tmp_path / "disk")
    yield tier
    await tier.close()


def flip(tier: DiskTier, k: bytes, offset: int) -> None:
    """Flip one byte of ``k``'s record, ``offset`` bytes into it, in the slab file itself."""
    placement = tier.placement(k)
    assert placement is not None
    ((fd, at, _),) = tier.slabs.segments(placement.runs[:1])
    path = Path(f"/proc/self/fd/{fd}").resolve()
    with path.open("r+b") as f:
        f.seek(at + offset)
        byte = f.read(1)
        f.seek(at + offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_url_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match="'capacity' is required"):
        tier_from_url(f"file://{tmp_path}")
    with pytest.raises(TierConfigError, match="file:///absolute/directory"):
        tier_from_url("file://host/dir?capacity=1MiB")
    with pytest.raises(TierConfigError, match="direct must be auto, yes or no"):
        tier_from_url(f"file://{tmp_path}?capacity=1MiB&direct=maybe")
    with pytest.raises(TierConfigError, match="multiple of 4096"):
        tier_from_url(f"file://{tmp_path}?capacity=1MiB&page=5000")
    with pytest.raises(TierConfigError, match="unknown option 'ttl'"):
        tier_from_url(f"file://{tmp_path}?capacity=1MiB&ttl=3")


@pytest.mark.asyncio
async def test_slabs_are_preallocated_and_a_second_user_is_refused(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, pages=8, files="2")
    try:
        sizes = sorted(p.stat().st_size for p in tmp_path.glob("slab-*.bin"))
        assert sizes == [4 * PAGE, 4 * PAGE]
        assert tier.slabs.preallocated
        with pytest.raises(TierConfigError, match="in use by another server process"):
            open_tier(tmp_path, pages=8, files="2")
        # A record may cross the slab boundary: pages 3 and 4 live in different files.
        assert tier.slabs.segments(((3, 2),))[0][1:] == (3 * PAGE, PAGE)
        assert tier.slabs.segments(((3, 2),))[1][1:] == (0, PAGE)
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_round_trip_and_exact_lru_eviction(disk: DiskTier) -> None:
    for i in range(4):
        assert (await disk.put(key(i), blob(i))).status is PutStatus.STORED
    assert (await disk.put(key(0), blob(0))).status is PutStatus.ALREADY_PRESENT
    assert await disk.get(key(1)) == blob(1)  # key 1 becomes the most recent
    assert disk.lru_keys() == [key(2), key(3), key(0), key(1)]
    result = await disk.put(key(4), blob(4))
    assert result.status is PutStatus.STORED
    assert result.evicted == (Evicted(key(2), blob(2)),)
    result = await disk.put(key(5), blob(5), keep_evicted=False)
    assert result.evicted == (Evicted(key(3), None),)
    assert await disk.contains_many([key(i) for i in range(6)]) == [
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    assert [await disk.get(key(i)) for i in (0, 1, 4, 5)] == [blob(i) for i in (0, 1, 4, 5)]
    # Two pages for a blob past one: evicts the two least recently used.
    result = await disk.put(key(6), blob(6, 2 * BLOB))
    assert [e.key for e in result.evicted] == [key(0), key(1)]
    assert await disk.get(key(6)) == blob(6, 2 * BLOB)
    stats = await disk.stats()
    assert (stats.name, stats.used_bytes, stats.capacity_bytes, stats.entries) == (
        "disk",
        4 * PAGE,
        4 * PAGE,
        3,
    )
    assert (await disk.put(key(7), blob(7, 5 * PAGE))).status is PutStatus.TOO_LARGE
    assert disk.corrupt_values == 0 and disk.healthy


@pytest.mark.asyncio
async def test_a_restart_serves_every_block_bit_exact_and_deletes_stay_deleted(
    tmp_path: Path,
) -> None:
    tier = open_tier(tmp_path, pages=8)
    sizes = [BLOB, 2 * BLOB, 100, BLOB, 3 * BLOB]
    for i, size in enumerate(sizes):
        assert (await tier.put(key(i), blob(i, size))).status is PutStatus.STORED
    assert await tier.delete(key(3))
    await tier.close()

    tier = open_tier(tmp_path, pages=8)
    try:
        assert tier.rebuilt.heads_read <= 8
        assert tier.lru_keys() == [key(0), key(1), key(2), key(4)]  # write order
        assert [await tier.get(key(i)) for i in range(5)] == [
            blob(0, BLOB),
            blob(1, 2 * BLOB),
            blob(2, 100),
            None,
            blob(4, 3 * BLOB),
        ]
        assert (await tier.stats()).entries == 4
        # New records take the generations after the old ones: no conflict on the next start.
        assert (await tier.put(key(3), blob(33))).status is PutStatus.STORED
        assert tier.rebuilt.next_generation == 6
    finally:
        await tier.close()
    tier = open_tier(tmp_path, pages=8)
    try:
        assert await tier.get(key(3)) == blob(33)
        assert tier.corrupt_values == 0
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_a_flipped_payload_byte_is_a_counted_miss_and_is_deleted(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    try:
        await tier.put(key(0), blob(0))
        await tier.put(key(1), blob(1))
        flip(tier, key(0), FIXED_BYTES + 16 + 8 + 1000)  # 1000 bytes into the payload
        assert await tier.get(key(0)) is None
        assert tier.corrupt_values == 1
        assert await tier.contains_many([key(0), key(1)]) == [False, True]
        assert await tier.get(key(1)) == blob(1)
    finally:
        await tier.close()
    # Deleted means its header is gone: a restart does not find it either.
    tier = open_tier(tmp_path)
    try:
        assert tier.lru_keys() == [key(1)]
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_a_flipped_header_byte_is_a_counted_miss(disk: DiskTier) -> None:
    await disk.put(key(0), blob(0))
    flip(disk, key(0), 20)  # the generation field: only the MAC notices
    assert await disk.get(key(0)) is None
    assert disk.corrupt_values == 1
    assert disk.lru_keys() == []


@pytest.mark.asyncio
async def test_a_slab_truncated_under_the_tier_turns_into_counted_misses(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    try:
        for i in range(4):
            await tier.put(key(i), blob(i))
        os.truncate(tmp_path / "slab-000.bin", 2 * PAGE)  # pages 2 and 3 are gone
        got = [await tier.get(key(i)) for i in range(4)]
        assert got == [blob(0), blob(1), None, None]
        assert tier.corrupt_values == 2
        assert tier.healthy  # damage is not a failing disk
        assert (await tier.put(key(9), blob(9))).status is PutStatus.STORED
        assert await tier.get(key(9)) == blob(9)
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_a_torn_record_found_after_a_restart_is_counted_never_served(
    tmp_path: Path,
) -> None:
    tier = open_tier(tmp_path)
    await tier.put(key(0), blob(0))
    await tier.put(key(1), blob(1, 2 * BLOB))
    placement = tier.placement(key(1))
    assert placement is not None
    await tier.close()
    # What a crash mid-write leaves: the header and the first page written, the rest not.
    second_page = (placement.runs[0][0] + 1) * PAGE
    with (tmp_path / "slab-000.bin").open("r+b") as f:
        f.seek(second_page)
        f.write(bytes(PAGE))
    tier = open_tier(tmp_path)
    try:
        assert tier.lru_keys() == [key(0), key(1)]  # the header alone looks fine
        assert await tier.get(key(1)) is None
        assert tier.corrupt_values == 1
        assert await tier.get(key(0)) == blob(0)
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_a_full_disk_is_unavailable_and_unhealthy_then_recovers(disk: DiskTier) -> None:
    await disk.put(key(0), blob(0))
    ((fd, _, _),) = disk.slabs.segments(((0, 1),))
    saved = os.dup(fd)
    full = os.open("/dev/full", os.O_RDWR)  # every write: ENOSPC, as a full filesystem
    try:
        os.dup2(full, fd)
        result = await disk.put(key(1), blob(1))
        assert result.status is PutStatus.UNAVAILABLE
        assert not disk.healthy
        assert await disk.contains_many([key(1)]) == [False]
        assert (await disk.stats()).entries == 1
        os.dup2(saved, fd)
        assert (await disk.put(key(1), blob(1))).status is PutStatus.STORED
        assert disk.healthy
        assert [await disk.get(key(0)), await disk.get(key(1))] == [blob(0), blob(1)]
    finally:
        os.close(full)
        os.close(saved)


class _Pins:
    """A KeepSet over a plain set."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def holds(self, k: bytes) -> bool:
        return k in self.keys

    def pinned_keys(self) -> list[bytes]:
        return list(self.keys)


@pytest.mark.asyncio
async def test_pinned_blocks_are_never_evicted(disk: DiskTier) -> None:
    pins = _Pins({key(0)})
    disk.keep = pins
    for i in range(4):
        await disk.put(key(i), blob(i))
    result = await disk.put(key(4), blob(4))
    assert [e.key for e in result.evicted] == [key(1)]  # key 0 is the LRU, but pinned
    pins.keys.update(disk.lru_keys())
    result = await disk.put(key(5), blob(5))
    assert (result.status, result.evicted) == (PutStatus.FULL, ())
    assert sorted(disk.lru_keys()) == sorted([key(0), key(2), key(3), key(4)])


@pytest.mark.asyncio
async def test_o_direct_falls_back_with_a_log_line_where_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linux >= 6.6 takes O_DIRECT on tmpfs too, and no filesystem that refuses it can be
    # mounted unprivileged: the refusal (EINVAL at open, as tmpfs, FUSE and some network
    # filesystems answer) is played by wrapping os.open.
    real_open = os.open

    def refusing_open(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    caplog.set_level(logging.INFO, logger="nopecache.cache_server.tiers.disk_file")
    monkeypatch.setattr(os, "open", refusing_open)
    tier = open_tier(tmp_path)
    monkeypatch.undo()
    try:
        assert not tier.direct
        assert "refuses O_DIRECT; reading and writing through the page cache" in caplog.text
        await tier.put(key(0), blob(0))
        assert await tier.get(key(0)) == blob(0)
    finally:
        await tier.close()
    with pytest.raises(TierConfigError, match="direct=yes but the filesystem refuses O_DIRECT"):
        monkeypatch.setattr(os, "open", refusing_open)
        try:
            open_tier(tmp_path, direct="yes")
        finally:
            monkeypatch.undo()


@pytest.mark.asyncio
async def test_a_changed_layout_starts_empty(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    await tier.put(key(0), blob(0))
    await tier.close()
    tier = open_tier(tmp_path, pages=8)
    try:
        assert tier.lru_keys() == []
    finally:
        await tier.close()


@pytest.mark.asyncio
async def test_evictions_skip_a_failing_disk_to_the_tier_below(
    tmp_path: Path, redis_clean: RedisProc
) -> None:
    cpu = CpuTier(2 * PAGE, page_bytes=PAGE, pinned=False)
    disk = open_tier(tmp_path)
    store = TieredStore([cpu, disk, tier_from_url(redis_clean.url)])
    ((fd, _, _),) = disk.slabs.segments(((0, 1),))
    full = os.open("/dev/full", os.O_RDWR)
    try:
        os.dup2(full, fd)  # the disk is full from now on
        for i in range(3):
            await store.put(key(i), blob(i))
        # key 0, evicted from memory, could not be written to disk: Redis holds it.
        assert await store.lookup([key(0), key(1), key(2)]) == ["redis", "cpu", "cpu"]
        assert not disk.healthy
        assert await store.get(key(0)) == (blob(0), "redis")
    finally:
        os.close(full)
        await store.close()
