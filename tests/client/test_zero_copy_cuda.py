"""Zero copy over CUDA IPC on a real GPU (``gpu``-marked: ``make gpu-check``).

A real server with a ``cuda://`` tier runs as a child process (CUDA IPC opens a handle in
another process only); this process is the engine's client: it opens the pool over CUDA
IPC and places device to device. One test each: a fetch into a CUDA paged cache places
bit for bit what the copying path places; a leased block keeps its bytes through an
eviction storm; a SIGKILLed client's leases expire; a block being written is not leased.
``test_cuda_ipc_offer.py`` covers what runs without a GPU.

Not run on the machine this was written on (no GPU there): first run in ``make gpu-check``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc.aio
import pytest
import torch

from nopecache.cache_server.tiers.base import PutStatus
from nopecache.client import PagedKV
from nopecache.client.cuda_arena import CudaArena, DeviceBlob
from nopecache.client.shm import ShmFastPath
from nopecache.client.transport import ServerConnection
from nopecache.client.zero_copy import ZeroCopySource
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.client.test_zero_copy import block, connection
from tests.support.server_harness import key_of, put
from tests.support.server_procs import CacheServerProc, start_cache_servers
from tests.support.shm_client import BIG, BIG_TOKENS, DIM, HEADS, LAYERS, client, config, kv
from tests.support.waiting import wait_until

pytestmark = pytest.mark.gpu

SMALL_POOL = "cuda://0?capacity=4MiB&page=4KiB"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd()}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServerProc]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    (proc,) = start_cache_servers(
        1, tmp_path_factory.mktemp("zc-cuda"), tiers=("cuda://0?capacity=96MiB",)
    )
    with client(config(proc, shm="off")) as c:
        assert c.store(BIG, kv(BIG_TOKENS, seed=7), 0, position_independent=False).failed == 0
    yield proc
    proc.kill()


def small_server(workdir: Path, *extra: str) -> CacheServerProc:
    (proc,) = start_cache_servers(1, workdir, tiers=(SMALL_POOL,), extra_args=extra)
    return proc


def test_a_fetch_from_the_gpu_pool_places_what_the_copying_path_places(
    server: CacheServerProc,
) -> None:
    device = torch.device("cuda")
    pages = BIG_TOKENS // 16
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(3))
    slots = (table[:, None] * 16 + torch.arange(16)).reshape(-1).to(device)
    caches = []
    fast = ShmFastPath("auto")
    for fast_path, shm in ((None, "off"), (fast, "auto")):
        shape = (pages, 16, HEADS, DIM)
        k_caches = [torch.zeros(shape, device=device) for _ in range(LAYERS)]
        v_caches = [torch.zeros(shape, device=device) for _ in range(LAYERS)]
        with client(config(server, shm, zero_copy=True), fast_path) as c:
            plan = c.lookup(BIG, allow_position_independent=False)
            result = c.fetch(plan, BIG, into=PagedKV(k_caches, v_caches, slots))
            assert result.ready is not None
            result.ready.synchronize()
            assert result.failed == () and result.placed_tokens == BIG_TOKENS
            if fast_path is not None:
                source = fast.zero_copy_sources[0]
                assert isinstance(source.arena, CudaArena)
                assert source.arena.device == device
                # Every lease comes back once the GPU finished reading its pages.
                asyncio.run(wait_until(functools.partial(_released, source, 12), timeout_s=60))
                # Device to device: nothing went through the host staging ring.
                assert c.core._placer.staging.direct_copies == 0
        caches.append(k_caches + v_caches)
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b)
    stats = fast.stats()
    assert (stats.leased_blocks, stats.copied_blocks, stats.cuda_ipc_fallbacks) == (12, 0, 0)


def _released(source: ZeroCopySource, n: int) -> bool:
    return source.released == n


async def _held(conn: ServerConnection, keys: list[bytes]) -> list[DeviceBlob]:
    out = []
    async for _, blob in conn.get(b"".join(keys)):
        assert isinstance(blob, DeviceBlob)
        out.append(blob)
    return out


def test_a_leased_gpu_block_keeps_its_bytes_through_an_eviction_storm(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    proc = small_server(tmp_path)
    try:
        asyncio.run(_eviction_storm(proc.address))
    finally:
        proc.kill()


async def _eviction_storm(address: str) -> None:
    channel = grpc.aio.insecure_channel(address)
    stub = cache_pb2_grpc.KVCacheStub(channel)
    stored = [block(i) for i in range(10)]
    await put(stub, stored, 60000)
    fast = ShmFastPath("auto")
    conn = connection(address, fast)
    held = await _held(conn, [k for k, _ in stored])
    assert fast.stats().leased_blocks == 10
    # Four pools' worth of other blocks: every unleased page is rewritten, several times.
    storm = [block(1000 + i) for i in range(4 * 4 * 2**20 // (9 * 4096))]
    for start in range(0, len(storm), 40):
        results = await put(stub, storm[start : start + 40], 60000)
        assert all(r.outcome == pb.PUT_OUTCOME_STORED for r in results)
    for (_, want), view in zip(stored, held, strict=True):
        assert bytes(view) == want
    source = fast.zero_copy_sources[0]
    held.clear()
    await source.settle()
    assert source.released == 10
    await fast.close()
    await conn.close()
    await channel.close(None)


def test_a_killed_clients_gpu_leases_expire(tmp_path: Path) -> None:
    """A child leases blocks until the share is full and is SIGKILLed: while it holds them
    nobody else gets a lease; after the TTL (1 s) the server has ended them."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # 7 blocks of 9 pages (36 KiB) fit in 0.07 of 4 MiB, an 8th does not.
    proc = small_server(tmp_path, "--zero-copy-lease-ttl-s", "1", "--zero-copy-share", "0.07")
    try:
        asyncio.run(_killed(proc.address))
    finally:
        proc.kill()


async def _killed(address: str) -> None:
    channel = grpc.aio.insecure_channel(address)
    stub = cache_pb2_grpc.KVCacheStub(channel)
    stored = [block(i) for i in range(8)]
    await put(stub, stored, 60000)
    keys = b"".join(k for k, _ in stored[:7])
    code = textwrap.dedent(
        f"""
        import asyncio, time
        import torch  # the client opens CUDA IPC where torch sees a GPU
        from nopecache.client import ClientConfig
        from nopecache.client.shm import ShmFastPath
        from nopecache.client.transport import ServerConnection

        async def main():
            fast = ShmFastPath("auto")
            conn = ServerConnection({address!r}, ClientConfig(servers=({address!r},)),
                                    fast_path=fast)
            held = [b async for _, b in conn.get({keys!r})]
            print("leased", fast.stats().leased_blocks, type(held[0]).__name__, flush=True)
            time.sleep(3600)  # holds every block (and its lease) until killed

        asyncio.run(main())
        """
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, env=_env()
    )
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), 120)
    assert line.decode().split() == ["leased", "7", "DeviceBlob"]
    offer = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid(), accept_cuda_ipc=True))
    assert offer.kind == pb.ARENA_KIND_CUDA_IPC and offer.refused == ""

    async def leased() -> bool:
        reply = await stub.LeaseGet(pb.LeaseGetRequest(keys=key_of(7), arena=offer.arena))
        if reply.leases:
            await stub.ReleaseLeases(pb.ReleaseLeasesRequest(leases=reply.leases))
        return reply.tried == 1

    assert not await leased()  # the child's leases hold the share
    child.send_signal(signal.SIGKILL)
    await child.wait()
    # The server's timers end them (1 s TTL; the wait is generous for a busy host).
    await wait_until(leased, timeout_s=60, interval_s=0.1)
    await channel.close(None)


def test_a_gpu_block_is_not_leased_while_its_pages_are_written() -> None:
    asyncio.run(_write_guard())


async def _write_guard() -> None:
    from nopecache.cache_server.tiers.cuda import CudaTier

    tier = CudaTier(2**20, page_bytes=4096)
    key, blob = block(1)
    gate = threading.Event()
    tier._copier.submit(gate.wait)  # the copy thread is busy: the put waits behind it
    putting = asyncio.create_task(tier.put(key, blob))
    await wait_until(lambda: tier._writing is not None, timeout_s=30)
    assert tier.lease(key, host_views=False) is None  # allocated, not written yet
    gate.set()
    assert (await putting).status is PutStatus.STORED
    lease = tier.lease(key, host_views=False)
    assert lease is not None and lease.views == []
    pool = tier._pool_tensor()
    offset = lease.placement.runs[0][0] * 4096
    assert bytes(pool[offset : offset + len(blob)].cpu().numpy()) == blob
    lease.release()
    await tier.close()


def test_a_gpu_put_that_only_leased_pages_could_hold_is_unavailable() -> None:
    asyncio.run(_leased_room())


async def _leased_room() -> None:
    from nopecache.cache_server.tiers.cuda import CudaTier

    tier = CudaTier(4 * 4096, page_bytes=4096)
    assert (await tier.put(b"a", bytes(range(256)) * 32)).status is PutStatus.STORED  # 2 pages
    lease = tier.lease(b"a", host_views=False)
    assert lease is not None
    # 3 pages: only by evicting "a", whose pages are leased: refused, nothing evicted.
    assert (await tier.put(b"b", bytes(3 * 4096))).status is PutStatus.UNAVAILABLE
    assert await tier.get(b"a") == bytes(range(256)) * 32
    lease.release()
    assert (await tier.put(b"b", bytes(3 * 4096))).status is PutStatus.STORED
    await tier.close()
