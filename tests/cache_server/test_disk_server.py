"""The disk tier inside real servers: demotion from memory and promotion back, a server
process restarted on the same directory serving its blocks bit-exact, a SIGKILL in the
middle of writes, a disk that fills up (RLIMIT_FSIZE), damage found under a running server,
and ``nopecache-admin stats``/``drain`` over it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from nopecache.cache_server.tiers.disk import DiskTier
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL, STORED, get, key_of, make_block, put, serving
from tests.support.server_procs import CacheServerProc, ServerFactory
from tests.support.waiting import wait_until

# Four 4 KiB pages: each test block (about 1.3 KiB) takes one, so the fifth put evicts.
CPU = "cpu://?capacity=16KiB&page=4KiB&pinned=no"
# A hang guard, not a timing: each wait is for an event that takes well under a second on
# an idle machine; a loaded 2-core machine may take many times that.
HANG_S = 60.0


def disk_url(path: Path, pages: int = 16) -> str:
    """A disk tier of ``pages`` 4 KiB pages under ``path``."""
    return f"file://{path}?capacity={pages * 4}KiB&page=4KiB"


def block(i: int) -> tuple[bytes, bytes]:
    """Key and block ``i`` (about 1.3 KiB)."""
    k = key_of(i)
    return k, make_block(k, tokens=8, head_dim=32)


@pytest.mark.asyncio
async def test_memory_evictions_land_on_disk_and_a_hit_comes_back_up(tmp_path: Path) -> None:
    config = replace(SMALL, tiers=(CPU, disk_url(tmp_path / "disk")))
    async with serving(config) as h:
        blocks = [block(i) for i in range(6)]
        for k, b in blocks:
            assert [r.outcome for r in await put(h.stub, [(k, b)], h.frame_bytes)] == [STORED]
        keys = [k for k, _ in blocks]
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert list(lookup.tier_names) == ["cpu", "disk"]
        assert lookup.tiers == b"\x02\x02\x01\x01\x01\x01"
        assert h.sample("nopecache_demotions_total", {"from_tier": "cpu", "to_tier": "disk"}) == 2

        got, frames = await get(h.stub, [keys[0]])
        assert got == [blocks[0][1]]
        assert frames[0].tier == 2
        # keys[0] went back to memory (and stays on disk: inclusive); keys[2], the LRU of
        # the memory tier, went down.
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert lookup.tiers == b"\x01\x02\x02\x01\x01\x01"
        assert h.sample("nopecache_promotions_total", {"from_tier": "disk", "to_tier": "cpu"}) == 1
        assert h.sample("nopecache_hits_total", {"tier": "disk"}) == 1

        # Bytes flipped on disk under the running server: a miss, counted, deleted.
        disk = h.running.store.tiers[1]
        assert isinstance(disk, DiskTier)
        placement = disk.placement(keys[1])
        assert placement is not None and keys[1] not in await _in_cpu(h.stub, keys)
        slab = tmp_path / "disk" / "slab-000.bin"
        with slab.open("r+b") as f:
            f.seek(placement.runs[0][0] * 4096 + 500)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
        got, _ = await get(h.stub, keys)
        assert got == [b if i != 1 else None for i, (_, b) in enumerate(blocks)]
        await wait_until(
            lambda: h.sample("nopecache_corrupt_blocks_total", {"tier": "disk"}) == 1, HANG_S
        )
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=keys[1]))
        assert lookup.tiers == b"\x00"


async def _in_cpu(stub: cache_pb2_grpc.KVCacheAsyncStub, keys: list[bytes]) -> set[bytes]:
    lookup = await stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
    return {k for k, code in zip(keys, lookup.tiers, strict=True) if code == 1}


def _put_sync(stub: cache_pb2_grpc.KVCacheStub, k: bytes, b: bytes) -> int:
    frames = iter([pb.PutFrame(key=k, total_size=len(b), data=b)])
    reply = stub.Put(frames, timeout=HANG_S)
    return int(reply.results[0].outcome)


def _get_sync(stub: cache_pb2_grpc.KVCacheStub, keys: list[bytes]) -> list[tuple[int, bytes]]:
    """(tier code, bytes) per key (0, b"") for a miss; one block per frame here."""
    out = [(0, b"")] * len(keys)
    for frame in stub.Get(pb.GetRequest(keys=b"".join(keys)), timeout=HANG_S):
        if frame.tier:
            out[frame.index] = (frame.tier, frame.data)
    return out


def test_a_restarted_server_serves_the_disk_bit_exact(
    cache_servers: ServerFactory, tmp_path: Path
) -> None:
    tiers = (CPU, disk_url(tmp_path / "disk"))
    (server,) = cache_servers(1, tiers=tiers)
    blocks = [block(i) for i in range(12)]
    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        for k, b in blocks:
            assert _put_sync(stub, k, b) == pb.PUT_OUTCOME_STORED
    server.stop()  # SIGTERM: in-flight writes finish, the slabs are synced
    assert server.proc is not None and server.proc.returncode == 0

    server.start()
    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        got = _get_sync(stub, [k for k, _ in blocks])
        # The last four were only in memory; the eight demoted before are all on disk.
        assert got[:8] == [(2, b) for _, b in blocks[:8]]
        assert got[8:] == [(0, b"")] * 4
        stats = stub.Stats(pb.StatsRequest(), timeout=HANG_S)
        assert [(t.name, t.healthy) for t in stats.tiers] == [("cpu", True), ("disk", True)]
    assert "disk tier" in server.log_tail(100_000) and "block(s) found in" in server.log_tail()


def test_sigkill_mid_writes_then_restart_serves_nothing_wrong(
    cache_servers: ServerFactory, tmp_path: Path
) -> None:
    tiers = (CPU, disk_url(tmp_path / "disk", pages=64))
    (server,) = cache_servers(1, tiers=tiers)
    blocks = [block(i) for i in range(200)]
    acked: list[int] = []
    tenth = threading.Event()

    def writer() -> None:
        with grpc.insecure_channel(server.address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            for i, (k, b) in enumerate(blocks):
                try:
                    _put_sync(stub, k, b)
                except grpc.RpcError:
                    return  # the server died under us
                acked.append(i)
                if len(acked) == 10:
                    tenth.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert tenth.wait(HANG_S)
    server.kill()  # SIGKILL while Puts (and so demotions to disk) keep coming
    thread.join(HANG_S)
    assert not thread.is_alive()

    server.start()
    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        got = _get_sync(stub, [k for k, _ in blocks])
    served = [i for i, (tier, _) in enumerate(got) if tier]
    # Whatever comes back is exactly what was stored; every block acked before the last
    # five in memory plus the 64 disk pages is served (older ones were evicted).
    assert all(got[i][1] == blocks[i][1] for i in served)
    assert all(tier in (0, 2) for tier, _ in got)
    assert served, "nothing survived the restart"
    assert max(served) <= max(acked) + 1


class _FsizeLimitedServer(CacheServerProc):
    """A server whose files may not grow past ``fsize`` bytes (RLIMIT_FSIZE): its writes
    past that fail with EFBIG, as writes to a full disk fail with ENOSPC (Python ignores
    SIGXFSZ, so the process lives on)."""

    fsize = 16 * 4096

    def command(self) -> list[str]:
        """The server's command line behind a setrlimit + exec."""
        wrapper = (
            "import os, resource, sys;"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({self.fsize}, {self.fsize}));"
            "os.execv(sys.executable, sys.argv[1:])"
        )
        return [sys.executable, "-c", wrapper, *super().command()]


def test_a_full_disk_means_misses_and_an_unhealthy_tier_never_a_crash(tmp_path: Path) -> None:
    from tests.support.redis_procs import free_ports

    # 64 pages asked for, 16 writable: the slabs cannot be preallocated, and writes past
    # the first 16 pages fail.
    server = _FsizeLimitedServer(
        tmp_path / "srv", free_ports(1)[0], tiers=(CPU, disk_url(tmp_path / "disk", pages=64))
    )
    server.start()
    try:
        blocks = [block(i) for i in range(40)]
        with grpc.insecure_channel(server.address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            for k, b in blocks:
                assert _put_sync(stub, k, b) == pb.PUT_OUTCOME_STORED
            got = _get_sync(stub, [k for k, _ in blocks[-4:]])
            assert got == [(1, b) for _, b in blocks[-4:]]  # memory is untouched
            stats = stub.Stats(pb.StatsRequest(), timeout=HANG_S)
            disk = stats.tiers[1]
            assert (disk.name, disk.healthy) == ("disk", False)
            assert 0 < disk.entries <= 16
            served = _get_sync(stub, [k for k, _ in blocks[:36]])
            on_disk = [i for i, (tier, _) in enumerate(served) if tier == 2]
            assert len(on_disk) == disk.entries
            assert all(served[i][1] == blocks[i][1] for i in on_disk)
        assert server.running()
        log = server.log_tail(100_000)
        assert "cannot preallocate" in log and "unhealthy" in log
    finally:
        server.kill()


def test_admin_stats_lists_the_disk_tier_and_drain_flushes(
    cache_servers: ServerFactory, tmp_path: Path
) -> None:
    (server,) = cache_servers(1, tiers=(CPU, disk_url(tmp_path / "disk")))
    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        for k, b in (block(i) for i in range(6)):
            _put_sync(stub, k, b)
    admin = [sys.executable, "-m", "nopecache.admin.cli", "--url", f"nopecache://{server.address}"]
    out = subprocess.run(
        [*admin, "--json", "stats"], capture_output=True, text=True, timeout=HANG_S, check=True
    )
    tiers = {t["tier"]: t for t in json.loads(out.stdout)["tiers"]}
    assert tiers["disk"]["entries"] == 2 and tiers["disk"]["healthy"] is True
    drained = subprocess.run(
        [*admin, "drain", "--wait"], capture_output=True, text=True, timeout=HANG_S
    )
    assert drained.returncode == 0, drained.stderr
    # Drained and synced: a SIGKILL now loses nothing that was on disk.
    server.kill()
    server.start()
    with grpc.insecure_channel(server.address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        assert [t for t, _ in _get_sync(stub, [key_of(0), key_of(1)])] == [2, 2]
