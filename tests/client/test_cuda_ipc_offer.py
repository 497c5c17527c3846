"""Zero copy over CUDA IPC, what runs without a GPU: the offer, the handshake, the tenant
rule, the fallback, the wire, the device-block decode (real servers on 127.0.0.1).

This machine has no CUDA device, so no ``cuda://`` tier can start here. The server's side
of the offer does not look into the handle (opaque bytes that only go down the socket), so
these tests give a real ``cpu://`` tier of a real server a GPU's name and a handle of
made-up bytes (``_as_gpu_pool``): everything the server decides (kind, tenant, nonce, pid,
device leases without host views) and everything a client without CUDA does (refusal,
a log line, a counter, the copying paths) runs for real. Opening a real handle and placing
device to device is ``test_zero_copy_cuda.py`` (``gpu``-marked, ``make gpu-check``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import torch

from nopecache.cache_server.tiers.cpu import CpuTier
from nopecache.cache_server.zero_copy import ZeroCopy
from nopecache.client.chunking import ChunkSpan, token_array
from nopecache.client.cuda_arena import DeviceBlob, decode_device_block, host_view
from nopecache.client.errors import ArenaRefusedError
from nopecache.client.fetching import BlockPlacer
from nopecache.client.keys import BlockKey
from nopecache.client.metrics import ClientMetrics
from nopecache.client.placement import PagedKV
from nopecache.client.plan import Hit, HitKind
from nopecache.client.shm import ShmFastPath
from nopecache.client.zero_copy import receive_arena, receive_arena_fd
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.arena_layout import ArenaKind, CudaIpcHandle, unpack_runs
from nopecache.proto.block import (
    BlockChecksumError,
    BlockMismatchError,
    BlockSizeError,
    StoredForm,
    decode_block,
    encode_block,
    head_nbytes,
    parse,
    parse_head,
)
from tests.client.test_zero_copy import ZC, blobs, block, connection
from tests.support.server_harness import Harness, key_of, put, serving
from tests.support.tenants import ALICE, BOB, open_channel

GPU = "GPU-5b1f0e4c-8d2a-4f3e-9c71-0a6b2d9e8f10"
HANDLE = CudaIpcHandle(
    handle=bytes(range(64)),
    size_bytes=4 * 2**20,
    offset_bytes=0,
    ref_counter_handle=b"/torch_1234_5678_0",
    ref_counter_offset=8,
    event_handle=bytes(range(64, 128)),
    event_sync_required=True,
)


def _as_gpu_pool(h: Harness, tenants: tuple[str, ...] = ("anonymous",)) -> CpuTier:
    """The harness's cpu:// tier named a GPU pool with HANDLE as its IPC handle; the
    server's ZeroCopy made again over it, offered to ``tenants`` (see the module
    docstring)."""
    tier = h.running.store.tiers[0]
    assert isinstance(tier, CpuTier)
    tier.cuda_device_uuid = GPU
    tier.cuda_ipc_handle = lambda: HANDLE  # type: ignore[method-assign]
    service = h.running.service
    service.zero_copy = ZeroCopy(h.running.store, share=0.25, ttl_s=30.0)
    service.offer_zero_copy(tenants)
    assert service.zero_copy.kind is ArenaKind.CUDA_IPC
    return tier


@pytest_asyncio.fixture
async def gpu_pool() -> AsyncIterator[Harness]:
    async with serving(ZC) as h:
        _as_gpu_pool(h)
        yield h


# -- the wire ---------------------------------------------------------------------------------
def test_the_arena_kind_and_the_ipc_handle_round_trip_and_old_messages_read_as_before() -> None:
    assert (ArenaKind.HOST_MEMFD, ArenaKind.CUDA_IPC) == (
        pb.ARENA_KIND_HOST_MEMFD,
        pb.ARENA_KIND_CUDA_IPC,
    )
    reply = pb.OpenArenaReply(
        nonce=b"n" * 16, kind=pb.ARENA_KIND_CUDA_IPC, cuda_device_uuid=GPU, size=5
    )
    again = pb.OpenArenaReply.FromString(reply.SerializeToString())
    assert (again.kind, again.cuda_device_uuid, again.size) == (pb.ARENA_KIND_CUDA_IPC, GPU, 5)
    # A reply of a server that knows no kinds is a host memfd offer; a request of a client
    # that knows none does not accept CUDA IPC.
    old = pb.OpenArenaReply.FromString(pb.OpenArenaReply(nonce=b"n" * 16).SerializeToString())
    assert old.kind == pb.ARENA_KIND_HOST_MEMFD and old.cuda_device_uuid == ""
    req = pb.OpenArenaRequest.FromString(pb.OpenArenaRequest(pid=7).SerializeToString())
    assert req.accept_cuda_ipc is False
    msg = HANDLE.pack()
    assert msg[:1] == b"\x02" and int.from_bytes(msg[1:5], "little") == len(msg) - 5
    assert CudaIpcHandle.unpack(msg[5:]) == HANDLE
    with pytest.raises(ValueError, match=r"CudaIpcHandle\.size_bytes: must be an int >= 0"):
        replace(HANDLE, size_bytes=-1)
    with pytest.raises(ValueError, match=r"CudaIpcHandle\.handle: empty"):
        replace(HANDLE, handle=b"")
    with pytest.raises(ValueError, match="expected a list of 7 fields"):
        CudaIpcHandle.unpack(b"\x92\x01\x02")


# -- the offer: kind, handshake, tenants --------------------------------------------------------
@pytest.mark.asyncio
async def test_a_gpu_pool_goes_only_to_a_client_that_opens_cuda_ipc_and_only_down_the_socket(
    gpu_pool: Harness,
) -> None:
    stub = gpu_pool.stub
    # A client that did not say it opens CUDA IPC (an old one, or one without CUDA).
    offer = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid()))
    assert offer.nonce == b"" and offer.kind == pb.ARENA_KIND_CUDA_IPC
    assert offer.refused == (
        "the pool is in CUDA memory (cuda://) and this client does not open CUDA IPC "
        "(OpenArenaRequest.accept_cuda_ipc)"
    )
    offer = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid(), accept_cuda_ipc=True))
    assert offer.refused == "" and len(offer.nonce) == 16
    assert (offer.kind, offer.cuda_device_uuid, offer.size) == (
        pb.ARENA_KIND_CUDA_IPC,
        GPU,
        4 * 2**20,
    )
    # The handle never travels over gRPC: only the socket hands it over.
    assert HANDLE.handle not in offer.SerializeToString()
    got = await asyncio.to_thread(receive_arena, offer.socket, offer.nonce)
    assert got == HANDLE
    with pytest.raises(ArenaRefusedError, match="unknown, already used or expired"):
        await asyncio.to_thread(receive_arena, offer.socket, offer.nonce)
    # A reader of descriptors is told what it got instead.
    offer = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid(), accept_cuda_ipc=True))
    with pytest.raises(ArenaRefusedError, match="answered with a CUDA IPC handle"):
        await asyncio.to_thread(receive_arena_fd, offer.socket, offer.nonce)
    # Another process presenting our nonce gets one line, not the handle.
    code = textwrap.dedent(
        """
        import socket, sys
        print("ready", flush=True)
        name, nonce = sys.stdin.readline().split()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\\0" + name)
            s.sendall(bytes.fromhex(nonce))
            msg = b""
            while chunk := s.recv(4096):
                msg += chunk
        print(msg[:1].hex(), msg[1:].decode(errors="replace"), flush=True)
        """
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 120) == b"ready\n"
    offer = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid(), accept_cuda_ipc=True))
    proc.stdin.write(f"{offer.socket} {offer.nonce.hex()}\n".encode())
    await proc.stdin.drain()
    out, _ = await proc.communicate()
    assert out.decode().strip() == (
        f"01 nonce: issued to pid {os.getpid()}, presented by pid {proc.pid}"
    )


@pytest.mark.asyncio
async def test_a_gpu_pool_of_a_server_of_two_tenants_is_offered_to_neither() -> None:
    async with serving(replace(ZC, auth_tokens=f"{ALICE} alice; {BOB} bob")) as h:
        _as_gpu_pool(h, ("alice", "bob"))
        for token in (ALICE, BOB):
            channel = open_channel(h.running.address, token=token)
            stub = cache_pb2_grpc.KVCacheStub(channel)
            reply = await stub.OpenArena(pb.OpenArenaRequest(pid=os.getpid(), accept_cuda_ipc=True))
            assert reply.nonce == b"" and reply.kind == pb.ARENA_KIND_CUDA_IPC
            assert "2 tenants" in reply.refused
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LeaseGet(
                    pb.LeaseGetRequest(keys=key_of(1), arena=h.running.service.zero_copy.arena)
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            await channel.close(None)
        # The engine's client: refused for the tenants (not a CUDA IPC fallback), copies.
        fast = ShmFastPath("auto")
        conn = connection(h.running.address, fast, token=BOB)
        channel = open_channel(h.running.address, token=BOB)
        assert (await put(cache_pb2_grpc.KVCacheStub(channel), [block(1)], 60000))[0].outcome
        await channel.close(None)
        got = await blobs(conn, [key_of(1)])
        assert got[0] is not None and bytes(got[0]) == block(1)[1]
        stats = fast.stats()
        assert (stats.cuda_ipc_fallbacks, stats.leased_blocks, stats.copied_blocks) == (0, 0, 1)
        await fast.close()
        await conn.close()


@pytest.mark.asyncio
async def test_device_leases_hold_pages_without_host_views_and_end_on_release(
    gpu_pool: Harness,
) -> None:
    stored = [block(i) for i in range(3)]
    await put(gpu_pool.stub, stored, 60000)
    tier = gpu_pool.running.store.tiers[0]
    assert isinstance(tier, CpuTier)
    offer = await gpu_pool.stub.OpenArena(
        pb.OpenArenaRequest(pid=os.getpid(), accept_cuda_ipc=True)
    )
    reply = await gpu_pool.stub.LeaseGet(
        pb.LeaseGetRequest(keys=b"".join(k for k, _ in stored), arena=offer.arena)
    )
    assert reply.tried == 3 and bytes(reply.tiers) == b"\x01\x01\x01"
    runs = unpack_runs(reply.run_counts, reply.runs, 3)
    page = tier.page_bytes
    for (key, blob), key_runs in zip(stored, runs, strict=True):
        placement = tier._table.index[key]
        assert key_runs == [(placement.runs[0][0] * page, len(blob))]
        # The bytes at those offsets of the pool are the block's.
        offset, length = key_runs[0]
        assert bytes(tier._mem[offset : offset + length]) == blob
    zero = gpu_pool.running.service.zero_copy
    assert zero.leases == 3 and tier._table.leased_pages == 3 * 9
    released = await gpu_pool.stub.ReleaseLeases(pb.ReleaseLeasesRequest(leases=reply.leases))
    assert released.released == 3 and zero.leases == 0 and tier._table.leased_pages == 0


# -- the client without CUDA: a log line, a counter, the copying paths -------------------------
@pytest.mark.asyncio
@pytest.mark.parametrize("cuda_ipc", [None, True])
async def test_a_client_that_cannot_open_cuda_ipc_fetches_through_the_copying_paths(
    gpu_pool: Harness, cuda_ipc: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    """None: torch sees no GPU, so the client does not accept CUDA IPC and the server
    refuses; True: the client accepts, gets the handle, and cannot open it (no CUDA in
    this process). Either way: the blocks intact, from the copying paths, no error."""
    stored = [block(i) for i in range(4)]
    await put(gpu_pool.stub, stored, 60000)
    fast = ShmFastPath("auto", cuda_ipc=cuda_ipc)
    conn = connection(gpu_pool.running.address, fast)
    with caplog.at_level(logging.WARNING, logger="nopecache.client.zero_copy"):
        got = await blobs(conn, [k for k, _ in stored])
        again = await blobs(conn, [k for k, _ in stored])
    assert [bytes(b) for b in got if b is not None] == [b for _, b in stored]
    assert [bytes(b) for b in again if b is not None] == [b for _, b in stored]
    stats = fast.stats()
    assert stats.cuda_ipc_fallbacks == 1  # once per connection, not per call
    assert stats.leased_blocks == 0 and stats.copied_blocks == 8
    why = (
        "CUDA is not available in this process"
        if cuda_ipc
        else "the pool is in CUDA memory (cuda://) and this client does not open CUDA IPC"
    )
    lines = [r.getMessage() for r in caplog.records if "CUDA IPC" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0] and "copying paths" in lines[0]
    assert gpu_pool.running.service.zero_copy.leases == 0
    await fast.close()
    await conn.close()


# -- the device-block decode (on CPU tensors: the same code on a GPU's) ------------------------
def _blob(tokens: int = 16, compression: str = "none") -> tuple[bytes, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, tokens, 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(2, tokens, 2, 64, generator=g).to(torch.bfloat16)
    blob = encode_block(
        key=key_of(9),
        fingerprint=b"fp",
        form=StoredForm.NOPE,
        k=k,
        v=v,
        token_ids=list(range(tokens)),
        compression=compression,
    )
    return blob, k, v


def _pool_with(blob: bytes, at: int, size: int = 1 << 20) -> torch.Tensor:
    pool = torch.zeros(size, dtype=torch.uint8)
    pool[at : at + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return pool


@pytest.mark.parametrize("runs", [1, 3])
def test_a_block_in_a_pool_decodes_to_what_its_bytes_decode_to(runs: int) -> None:
    blob, k, v = _blob()
    pool = _pool_with(blob, 8192)
    cut = [0, *(len(blob) * i // runs for i in range(1, runs)), len(blob)]
    parts = [pool[8192 + a : 8192 + b] for a, b in itertools.pairwise(cut)]
    dev = DeviceBlob(parts)
    assert dev.nbytes == len(blob) and bytes(dev) == blob and bytes(host_view(dev)) == blob
    got = decode_device_block(dev, expect_key=key_of(9), expect_tokens=range(16))
    assert torch.equal(got.k, k) and got.v is not None and torch.equal(got.v, v)
    if runs == 1:  # a view of the pool itself, no copy
        assert got.k.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    assert got.header == decode_block(blob).header


def test_a_device_block_is_checked_like_a_host_one() -> None:
    blob, _, _ = _blob()
    with pytest.raises(BlockMismatchError, match="key: block holds"):
        decode_device_block(DeviceBlob([_pool_with(blob, 0)[: len(blob)]]), expect_key=key_of(1))
    with pytest.raises(BlockMismatchError, match="token_ids: first difference at index 3"):
        decode_device_block(
            DeviceBlob([_pool_with(blob, 0)[: len(blob)]]),
            expect_tokens=[0, 1, 2, 9, *range(4, 16)],
        )
    bad = bytearray(blob)
    bad[20] ^= 1  # a header byte
    with pytest.raises(BlockChecksumError, match="header_checksum"):
        decode_device_block(DeviceBlob([_pool_with(bytes(bad), 0)[: len(bad)]]))
    with pytest.raises(BlockSizeError, match="payload: blob holds"):
        decode_device_block(DeviceBlob([_pool_with(blob, 0)[: len(blob) - 64]]))
    # lz4 cannot be undone on a GPU: the block is brought to the host and checked in full.
    packed, k, _ = _blob(tokens=64, compression="lz4")
    got = decode_device_block(DeviceBlob([_pool_with(packed, 4096)[4096 : 4096 + len(packed)]]))
    assert torch.equal(got.k, k)


def test_a_header_parses_from_its_first_bytes_as_from_the_whole_blob() -> None:
    blob, _, _ = _blob(tokens=256)  # a header past the first 1 KiB
    need = head_nbytes(blob[:16], len(blob))
    assert need > 1024 and need % 64 == 0
    header, start = parse_head(blob[:need], len(blob))
    whole, payload = parse(blob)
    assert header == whole and len(blob) - start == payload.nbytes
    with pytest.raises(BlockSizeError, match=f"head: 1024 bytes given, the header takes {need}"):
        parse_head(blob[:1024], len(blob))
    with pytest.raises(BlockSizeError, match="shorter than the 16-byte prefix"):
        head_nbytes(blob[:8], len(blob))


@pytest.mark.parametrize("runs", [1, 2])
def test_the_placer_places_a_pool_block_as_it_places_the_same_bytes_from_the_host(
    runs: int,
) -> None:
    """BlockPlacer.place of a DeviceBlob (here views of a CPU tensor standing in for the
    device pool: the same torch code) writes the paged cache exactly as the host bytes do,
    through the same rerope_scatter_layers path, and a wrong key is a miss either way."""
    from tests.client.test_placement import KEY, SPEC, _block, _fingerprint, _kv

    k, v = _kv(16, seed=4)
    blob = _block(k, v, list(range(100, 116)))
    at = 3 * 4096
    pool = _pool_with(blob, at)
    cut = len(blob) // 2 if runs == 2 else len(blob)
    parts = [pool[at : at + cut]]
    if runs == 2:
        parts.append(pool[at + cut : at + len(blob)])
    prompt = token_array([1, 2, 3, 4, *range(100, 116), 5, 6, 7, 8])
    placer = BlockPlacer(_fingerprint(), _fingerprint(), SPEC, k.shape[-1], ClientMetrics())

    def paged() -> PagedKV:
        shape = (4, 8, k.shape[2], k.shape[3])
        return PagedKV(
            [torch.zeros(shape) for _ in range(k.shape[0])],
            [torch.zeros(shape) for _ in range(k.shape[0])],
            torch.arange(31, 7, -1, dtype=torch.int64),
        )

    def hit(key: BlockKey) -> Hit:
        kind = HitKind.POSITION_INDEPENDENT
        return Hit(key, ChunkSpan(4, 20), ChunkSpan(0, 16), StoredForm.NOPE, kind)

    caches = []
    for source in (memoryview(blob), DeviceBlob(parts)):
        into = paged()
        assert placer.place(source, [hit(KEY)], prompt, into, None, threading.Event())
        assert into.v_caches is not None
        caches.append([*into.k_caches, *into.v_caches])
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a, b) and bool(a.abs().sum() > 0)
    wrong = hit(BlockKey(key_of(3)))
    assert not placer.place(DeviceBlob(parts), [wrong], prompt, paged(), None, threading.Event())
