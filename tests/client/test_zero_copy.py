"""Same-host zero copy: the server's pool mapped read-only, read leases (real servers on
127.0.0.1, in process where the test inspects the tier, as a child process otherwise).

One test per safety rule: a tenant never maps another's pages and a nonce works once for
its own process; leases stay within their share; a SIGKILLed client's leases expire; a
leased page is never rewritten. And a fetch through the mapping places what gRPC places.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import secrets
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import torch

from nopecache.cache_server.config import ConfigError, ServerConfig
from nopecache.cache_server.tiers.cpu import CpuTier
from nopecache.client import ClientConfig, PagedKV
from nopecache.client.cost import CostConfig
from nopecache.client.errors import ArenaRefusedError
from nopecache.client.shm import ShmFastPath
from nopecache.client.transport import ServerConnection
from nopecache.client.zero_copy import Arena, lapsed, receive_arena_fd, release_batch
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import validate
from tests.support.server_harness import SMALL, Harness, key_of, make_block, put, serving
from tests.support.server_procs import CacheServerProc, start_cache_servers
from tests.support.shm_client import BIG, BIG_TOKENS, DIM, HEADS, LAYERS, client, config, kv
from tests.support.tenants import ALICE, BOB, open_channel
from tests.support.waiting import wait_until

# 4 MiB pool of 4 KiB pages; blocks of 2 layers x 64 tokens x 64 dims (32 KiB payload).
ZC = replace(SMALL, tiers=("cpu://?capacity=4MiB&page=4KiB&pinned=no",))


def block(i: int) -> tuple[bytes, bytes]:
    key = key_of(i)
    return key, make_block(key, tokens=64, head_dim=64, layers=2)


def tier_of(h: Harness) -> CpuTier:
    tier = h.running.store.tiers[0]
    assert isinstance(tier, CpuTier)
    return tier


def connection(address: str, fast: ShmFastPath, token: str | None = None) -> ServerConnection:
    cfg = ClientConfig(
        servers=(address,), cost=CostConfig(enabled=False), get_timeout_s=30.0, token=token
    )
    return ServerConnection(address, cfg, fast_path=fast)


async def blobs(conn: ServerConnection, keys: Sequence[bytes]) -> list[memoryview | None]:
    """Every block of ``keys``, views kept (so their leases are held until dropped)."""
    out: list[memoryview | None] = []
    async for _, blob in conn.get(b"".join(keys)):
        assert blob is None or isinstance(blob, memoryview)  # a host pool
        out.append(blob)
    return out


async def leased(
    h: Harness, n: int
) -> tuple[list[tuple[bytes, bytes]], ShmFastPath, ServerConnection, list[memoryview | None]]:
    """``n`` blocks stored, a new same-host connection, and its leased view of each block."""
    stored = [block(i) for i in range(n)]
    await put(h.stub, stored, 60000)
    fast = ShmFastPath("auto")
    conn = connection(h.running.address, fast)
    views = await blobs(conn, [k for k, _ in stored])
    assert fast.stats().leased_blocks == n
    return stored, fast, conn, views


@pytest_asyncio.fixture
async def zc() -> AsyncIterator[Harness]:
    async with serving(ZC) as h:
        yield h


# -- (1) tenants: no mapping of another tenant's pages; nonces once, for one process ---------
@pytest.mark.asyncio
async def test_a_server_of_two_tenants_offers_no_mapping_to_either() -> None:
    two = replace(ZC, auth_tokens=f"{ALICE} alice; {BOB} bob")
    async with serving(two) as h:
        for token in (ALICE, BOB):
            channel = open_channel(h.running.address, token=token)
            stub = cache_pb2_grpc.KVCacheStub(channel)
            reply = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid()))
            assert reply.nonce == b"" and reply.arena == b""
            assert "2 tenants" in reply.refused
            # Naming the pool without having been given it: refused, nothing leased.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LeaseGet(
                    pb.LeaseGetRequest(keys=key_of(1), arena=h.running.service.zero_copy.arena)
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "LeaseGetRequest.arena" in (err.value.details() or "")
            await channel.close(None)
        # A client of either tenant fetches through the copying paths, bytes intact.
        channel = open_channel(h.running.address, token=BOB)
        assert (await put(cache_pb2_grpc.KVCacheStub(channel), [block(1)], 60000))[0].outcome
        await channel.close(None)
        fast = ShmFastPath("auto")
        conn = connection(h.running.address, fast, token=BOB)
        got = await blobs(conn, [key_of(1)])
        assert got[0] is not None and bytes(got[0]) == block(1)[1]
        stats = fast.stats()
        assert stats.leased_blocks == 0 and stats.copied_blocks == 1
        await fast.close()
        await conn.close()


@pytest.mark.asyncio
async def test_a_nonce_is_for_one_use_by_the_process_it_was_issued_to() -> None:
    one = replace(ZC, auth_tokens=f"{ALICE} alice")
    async with serving(one) as h:
        channel = open_channel(h.running.address, token=ALICE)
        stub = cache_pb2_grpc.KVCacheStub(channel)
        offer = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid()))
        assert offer.refused == "" and len(offer.nonce) == 16
        fd = await asyncio.to_thread(receive_arena_fd, offer.socket, offer.nonce)
        try:
            assert os.fstat(fd).st_size == offer.size == 4 * 2**20
            # Read-only: no writable shared mapping, not even through a reopened descriptor.
            with pytest.raises(PermissionError):
                mmap.mmap(fd, offer.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(rw, offer.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
                with pytest.raises(PermissionError):
                    os.ftruncate(rw, 4096)  # shrinking it would fault the server
            finally:
                os.close(rw)
        finally:
            os.close(fd)
        # The same nonce again, a made-up one: a clear error, no descriptor.
        for nonce in (offer.nonce, secrets.token_bytes(16)):
            with pytest.raises(ArenaRefusedError, match="unknown, already used or expired"):
                await asyncio.to_thread(receive_arena_fd, offer.socket, nonce)
        # A nonce presented by another process than the one it was issued to: a child
        # that speaks the handshake with the socket module alone; the nonce is issued
        # once it is ready, so its 10 s are not spent starting Python on a busy machine.
        code = textwrap.dedent(
            """
            import socket, sys
            print("ready", flush=True)
            name, nonce = sys.stdin.readline().split()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect("\\0" + name)
                s.sendall(bytes.fromhex(nonce))
                msg, fds, _, _ = socket.recv_fds(s, 4097, 1)
            print("GOT A DESCRIPTOR" if fds else msg[1:].decode(), flush=True)
            """
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 120) == b"ready\n"
        offer = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid()))
        proc.stdin.write(f"{offer.socket} {offer.nonce.hex()}\n".encode())
        await proc.stdin.drain()
        out, _ = await proc.communicate()
        assert out.decode().strip() == (
            f"nonce: issued to pid {os.getpid()}, presented by pid {proc.pid}"
        )
        # A pid of 0 is a malformed request.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.OpenArena(pb.OpenArenaRequest(pid=0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "OpenArenaRequest.pid" in (err.value.details() or "")
        await channel.close(None)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd()}


# -- (2) the share ----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_leases_stay_within_their_share_and_the_rest_is_copied() -> None:
    # 5% of 4 MiB: five blocks of nine 4 KiB pages fit (184320 of 209715 bytes), not six.
    async with serving(replace(ZC, zero_copy_share=0.05)) as h:
        stored = [block(i) for i in range(12)]
        assert all(r.outcome == pb.PUT_OUTCOME_STORED for r in await put(h.stub, stored, 60000))
        fast = ShmFastPath("auto", space_wait_s=0.5)
        conn = connection(h.running.address, fast)
        keys = [k for k, _ in stored]
        first = await blobs(conn, keys)
        zero = h.running.service.zero_copy
        assert zero.held_bytes == 5 * 9 * 4096 <= zero.limit_bytes
        assert zero.leases == 5
        # Nothing of ours comes free within space_wait_s (every view is held): copied.
        assert (fast.stats().leased_blocks, fast.stats().copied_blocks) == (5, 7)
        # While those are held, the next Get is copied whole; every byte is right.
        second = await blobs(conn, keys)
        assert (fast.stats().leased_blocks, fast.stats().copied_blocks) == (5, 19)
        for (_, blob), a, b in zip(stored, first, second, strict=True):
            assert a is not None and b is not None and bytes(a) == bytes(b) == blob
        assert first[0] is not None and first[0].readonly  # a view of the read-only mapping
        del first, second, a, b
        source = fast.zero_copy_sources[0]
        await wait_until(lambda: source.released == 5, timeout_s=30)
        assert zero.held_bytes == 0 and zero.leases == 0
        # A consumer that lets go of each block once it has it (as placement does) gets
        # all twelve leased, in rounds of at most five held at once.
        most = 0
        async for index, view in conn.get(b"".join(keys)):
            assert view is not None and bytes(view) == stored[index][1]
            most = max(most, zero.leases)
            del view
        assert most <= 5
        assert (fast.stats().leased_blocks, fast.stats().copied_blocks) == (17, 19)
        await wait_until(lambda: zero.leases == 0, timeout_s=30)
        await fast.close()
        await conn.close()


def test_zero_copy_options_are_range_checked() -> None:
    for share in (0.0, -0.1, 0.51, float("nan")):
        with pytest.raises(ConfigError, match="zero_copy_share"):
            ServerConfig(zero_copy_share=share)
    for ttl in (0.0, 0.01, 3601.0):
        with pytest.raises(ConfigError, match="zero_copy_lease_ttl_s"):
            ServerConfig(zero_copy_lease_ttl_s=ttl)
    with pytest.raises(ValueError, match="zero_copy"):
        ClientConfig(servers=("127.0.0.1:1",), zero_copy="yes")  # type: ignore[arg-type]


# -- (3) a SIGKILLed client's leases expire -------------------------------------------------
@pytest.mark.asyncio
async def test_a_killed_clients_leases_expire_and_their_pages_are_reused() -> None:
    async with serving(replace(ZC, zero_copy_lease_ttl_s=1.0)) as h:
        stored = [block(i) for i in range(8)]
        await put(h.stub, stored, 60000)
        keys = b"".join(k for k, _ in stored)
        code = textwrap.dedent(
            f"""
            import asyncio, sys, time
            from nopecache.client import ClientConfig
            from nopecache.client.shm import ShmFastPath
            from nopecache.client.transport import ServerConnection

            async def main():
                fast = ShmFastPath("auto")
                conn = ServerConnection({h.running.address!r},
                                        ClientConfig(servers=({h.running.address!r},)),
                                        fast_path=fast)
                held = [b async for _, b in conn.get({keys!r})]
                print("leased", fast.stats().leased_blocks, flush=True)
                time.sleep(3600)  # holds every view (and its lease) until killed

            asyncio.run(main())
            """
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, env=_env()
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line.decode().split() == ["leased", "8"]
        zero, tier = h.running.service.zero_copy, tier_of(h)
        assert zero.leases == 8  # one per block
        # Deleted while leased: out of the index, its pages still held.
        deleted = await h.stub.Delete(pb.DeleteRequest(keys=keys))
        assert deleted.deleted == 8
        assert tier._table.free_pages == tier._table.n_pages - 8 * 9
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        # The server's timer ends the lease (1 s TTL; the wait is generous for a busy host).
        await wait_until(lambda: zero.leases == 0, timeout_s=60)
        assert zero.held_bytes == 0
        assert tier._table.free_pages == tier._table.n_pages
        tier.check_invariants()
        # The pages are reused: a full pool's worth of new blocks fits.
        fill = [block(100 + i) for i in range(4 * 2**20 // (9 * 4096))]
        for start in range(0, len(fill), 40):  # under max_request_bytes per Put
            results = await put(h.stub, fill[start : start + 40], 60000)
            assert all(r.outcome == pb.PUT_OUTCOME_STORED for r in results)
        assert tier._table.free_pages < 9


# -- (4) a leased page is never rewritten ---------------------------------------------------
@pytest.mark.asyncio
async def test_leased_blocks_keep_their_bytes_through_a_put_storm(zc: Harness) -> None:
    stored, fast, conn, held = await leased(zc, 10)
    # Overwrite them (deleted, then stored again with other bytes under the same keys) and
    # store ten pools' worth of new blocks: every free page is reused many times over.
    await zc.stub.Delete(pb.DeleteRequest(keys=b"".join(k for k, _ in stored)))
    other = [
        (k, make_block(key_of(1000 + i), tokens=64, head_dim=64, layers=2))
        for i, (k, _) in enumerate(stored)
    ]
    await put(zc.stub, other, 60000)
    for start in range(0, 1200, 60):
        await put(zc.stub, [block(10_000 + i) for i in range(start, start + 60)], 60000)
    tier = tier_of(zc)
    tier.check_invariants()
    for (_, blob), view in zip(stored, held, strict=True):
        assert view is not None
        assert bytes(view) == blob
        validate(view)  # checksums hold
    del held, view
    await wait_until(lambda: zc.running.service.zero_copy.leases == 0, timeout_s=30)
    await fast.close()
    await conn.close()


@pytest.mark.asyncio
async def test_a_stream_closed_early_releases_the_leases_it_did_not_hand_out(
    zc: Harness,
) -> None:
    stored = [block(i) for i in range(10)]
    await put(zc.stub, stored, 60000)
    fast = ShmFastPath("auto")
    conn = connection(zc.running.address, fast)
    zero = zc.running.service.zero_copy
    stream = conn.get(b"".join(k for k, _ in stored))
    _, first = await anext(stream)
    assert first is not None and bytes(first) == stored[0][1]
    assert zero.leases == 10
    await stream.aclose()  # type: ignore[attr-defined]  # an async generator
    # The nine never handed out are released now, not at their 30 s TTL (the wait is
    # generous for a loaded machine, and still well under the TTL).
    await wait_until(lambda: zero.leases == 1, timeout_s=20)
    del first
    await wait_until(lambda: zero.leases == 0, timeout_s=20)
    await fast.close()
    await conn.close()


@pytest.mark.asyncio
async def test_views_let_go_in_a_batch_are_released_in_one_call(zc: Harness) -> None:
    """A placement job lets go of its blocks inside ``release_batch``: their leases go in
    one ReleaseLeases once it ends, even when the loop runs in between (each view woke
    the loop for a call of its own before, on the placement's path)."""
    _, fast, conn, views = await leased(zc, 5)
    source = fast.zero_copy_sources[0]
    calls = source.release_calls
    loop = asyncio.get_running_loop()

    def let_go() -> None:  # on another thread, as the placement worker does
        with release_batch():
            views.pop(0)
            # Whatever the first release woke is done before the rest let go.
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=60)
            assert source.release_calls == calls
            views.clear()

    await asyncio.to_thread(let_go)
    await source.settle()
    assert (source.release_calls - calls, source.released) == (1, 5)
    assert zc.running.service.zero_copy.leases == 0
    await fast.close()
    await conn.close()


@pytest.mark.asyncio
async def test_a_view_lapses_before_its_lease_ends_on_the_server() -> None:
    """A view is trusted only until its lease's end, counted from before the LeaseGet was
    sent, minus a margin (2 s of a 20 s TTL): placement treats a lapsed view as failed."""
    async with serving(replace(ZC, zero_copy_lease_ttl_s=20.0)) as h:
        await put(h.stub, [block(1)], 60000)
        fast = ShmFastPath("auto")
        conn = connection(h.running.address, fast)
        before = time.monotonic()
        held = await blobs(conn, [key_of(1)])
        after = time.monotonic()
        view = held[0]
        assert view is not None and fast.stats().leased_blocks == 1
        deadline = view.obj.lease_deadline  # type: ignore[attr-defined]
        assert before + 18.0 <= deadline <= after + 18.0
        assert not lapsed(view) and not lapsed(memoryview(block(1)[1]))
        view.obj.lease_deadline = time.monotonic()  # type: ignore[attr-defined]
        assert lapsed(view)
        held.clear()
        view = None
        await wait_until(lambda: h.running.service.zero_copy.leases == 0, timeout_s=30)
        await fast.close()
        await conn.close()


# -- end to end: the same placement as gRPC ---------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServerProc]:
    (proc,) = start_cache_servers(
        1, tmp_path_factory.mktemp("zc-server"), tiers=("cpu://?capacity=96MiB&pinned=no",)
    )
    with client(config(proc, shm="off")) as c:
        assert c.store(BIG, kv(BIG_TOKENS, seed=7), 0, position_independent=False).failed == 0
    yield proc
    proc.kill()


def test_a_fetch_from_the_mapping_places_what_grpc_places(server: CacheServerProc) -> None:
    pages = BIG_TOKENS // 16
    table = torch.randperm(pages, generator=torch.Generator().manual_seed(3))
    slots = (table[:, None] * 16 + torch.arange(16)).reshape(-1)
    caches = []
    fast = ShmFastPath("auto")
    for fast_path, shm in ((None, "off"), (fast, "auto")):
        shape = (pages, 16, HEADS, DIM)
        k_caches = [torch.zeros(shape) for _ in range(LAYERS)]
        v_caches = [torch.zeros(shape) for _ in range(LAYERS)]
        with client(config(server, shm, zero_copy=True), fast_path) as c:
            plan = c.lookup(BIG, allow_position_independent=False)
            result = c.fetch(plan, BIG, into=PagedKV(k_caches, v_caches, slots))
            assert result.failed == () and result.placed_tokens == BIG_TOKENS
        caches.append(k_caches + v_caches)
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b)
    stats = fast.stats()
    assert (stats.leased_blocks, stats.copied_blocks) == (12, 0)
    assert stats.leased_bytes > 12 * 2**20 and stats.shm_blocks == stats.grpc_blocks == 0


# -- CUDA: the mapping page-locked, one DMA per tensor ---------------------------------------
@pytest.mark.gpu
def test_on_cuda_blocks_go_from_the_mapping_to_the_gpu_in_one_dma(server: CacheServerProc) -> None:
    """The mapping is registered with cudaHostRegister, every K and V tensor of the fetch
    is copied straight from it (no staging copy), and the cache holds what gRPC places."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
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
                arena = fast.zero_copy_sources[0].arena
                assert isinstance(arena, Arena) and arena.cuda_registered
                assert c.core._placer.staging.direct_copies == 2 * 12  # K and V per block
        caches.append(k_caches + v_caches)
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b)
    assert fast.stats().leased_blocks == 12
