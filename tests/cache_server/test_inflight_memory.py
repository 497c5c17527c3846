"""The in-flight budget bounds the memory Puts really take (issue 25): bytes are counted
as they are buffered, not when a block is reserved, and a stream reads no frame before it
holds room for it, so streams that announce big blocks, send part of them and stall grow
the server's RSS by about the budget, not by what they send; and a block announced by a
tiny frame reserves only the bytes that arrived (no squatting on the budget for free).

A real server process (its RSS read from /proc) and raw gRPC streams on loopback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nopecache.cache_server.config import FRAME_OVERHEAD_BYTES
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import key_of, make_block
from tests.support.server_procs import ServerFactory
from tests.support.tenants import open_channel

MiB = 1024 * 1024
BUDGET = 64 * MiB
LIMITS = [
    "--max-message-bytes", "1MiB",
    "--max-block-bytes", "16MiB",
    "--max-request-bytes", "16MiB",
    "--max-inflight-bytes", "64MiB",
    "--max-inflight-bytes-per-client", "32MiB",
    "--stream-idle-timeout-s", "120",
]  # fmt: skip
FRAME = 1 * MiB - FRAME_OVERHEAD_BYTES
OWN_CONNECTION = [
    ("grpc.max_send_message_length", MiB),
    ("grpc.max_receive_message_length", MiB),
    ("grpc.use_local_subchannel_pool", 1),
]


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def settled(count: list[int], quiet_s: float = 1.5, most_s: float = 60.0) -> None:
    """Wait until ``count[0]`` stops changing for ``quiet_s`` (the server reads no more)."""
    last, since, start = -1, time.monotonic(), time.monotonic()
    while time.monotonic() - start < most_s:
        if count[0] != last:
            last, since = count[0], time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
async def test_stalled_puts_of_big_blocks_grow_rss_by_about_the_budget(
    cache_servers: ServerFactory,
) -> None:
    (server,) = cache_servers(1, extra_args=LIMITS)
    assert server.proc is not None
    pid = server.proc.pid
    channels = [open_channel(server.address, options=OWN_CONNECTION) for _ in range(4)]
    stubs = [cache_pb2_grpc.KVCacheStub(c) for c in channels]
    await asyncio.gather(*(s.Lookup(pb.LookupRequest(keys=key_of(0))) for s in stubs))
    idle = rss_bytes(pid)
    payload = bytes(range(256)) * (FRAME // 256) + bytes(FRAME % 256)
    sent = [0]
    release = asyncio.Event()

    async def stalled(i: int) -> AsyncIterator[pb.PutFrame]:
        # Announce a 16 MiB block, send 4 MiB of it, stall.
        yield pb.PutFrame(key=key_of(i), total_size=16 * MiB, data=payload)
        sent[0] += 1
        for _ in range(3):
            yield pb.PutFrame(data=payload)
            sent[0] += 1
        await release.wait()

    calls = [stubs[i % 4].Put(stalled(i)) for i in range(96)]
    await settled(sent)
    grown = rss_bytes(pid) - idle
    release.set()
    for call in calls:
        call.cancel()
    for c in channels:
        await c.close(None)
    # 96 streams offered 384 MiB (before the fix the server held all of it: +385 MiB).
    # It may hold the budget (plus its 1/16 overdraft) and what the transport buffers
    # around it: each waiting stream's HTTP/2 window (64 KiB) and the receive slices and
    # allocator slack of the frames being read, measured at +15..18 MiB over this 64 MiB
    # budget (1.23-1.28x) on one run and +40 MiB (1.63x) in a CI run: glibc's arenas and
    # gRPC's receive slices depend on which threads ran the reads. That part does not grow
    # with the bytes offered, so the bound is 2x the budget, far under the +385 MiB this
    # guards against; the 1.1x target of issue 25 is checked at the bench's scale
    # (bench/load.py, 512 MiB).
    bound = 2 * BUDGET
    assert grown <= bound, f"RSS grew {grown / MiB:.0f} MiB for a {BUDGET / MiB:.0f} MiB budget"


@pytest.mark.asyncio
async def test_a_block_announced_by_a_tiny_frame_reserves_only_what_arrived(
    cache_servers: ServerFactory,
) -> None:
    (server,) = cache_servers(1, extra_args=LIMITS)
    squatter_channels = [open_channel(server.address, options=OWN_CONNECTION) for _ in range(2)]
    victim_channel = open_channel(server.address, options=OWN_CONNECTION)
    squatters = [cache_pb2_grpc.KVCacheStub(c) for c in squatter_channels]
    victim = cache_pb2_grpc.KVCacheStub(victim_channel)
    release = asyncio.Event()
    opened = [0]

    async def squat(i: int) -> AsyncIterator[pb.PutFrame]:
        yield pb.PutFrame(key=key_of(i), total_size=16 * MiB, data=b"x")
        opened[0] += 1
        await release.wait()

    # Two squatting streams of 16 MiB would fill a squatter's 32 MiB share, and two
    # squatters the whole budget, if each 1-byte frame reserved its announced block.
    calls = [squatters[i % 2].Put(squat(i)) for i in range(8)]
    await asyncio.wait_for(_until(lambda: opened[0] == 8), 30)
    key = key_of(100)
    blob = make_block(key, tokens=4096, head_dim=64)  # ~1 MiB: needs budget room
    frames = [
        pb.PutFrame(key=key if n == 0 else b"", total_size=len(blob) if n == 0 else 0,
                    data=blob[n : n + FRAME])
        for n in range(0, len(blob), FRAME)
    ]  # fmt: skip
    for _ in range(3):
        reply = await victim.Put(_iterate(frames), timeout=10)
        assert reply.results[0].outcome in (pb.PUT_OUTCOME_STORED, pb.PUT_OUTCOME_ALREADY_PRESENT)
        got = [f async for f in victim.Get(pb.GetRequest(keys=key), timeout=10)]
        assert b"".join(f.data for f in got) == blob
    release.set()
    for call in calls:
        call.cancel()
    for c in squatter_channels:
        await c.close(None)
    await victim_channel.close(None)


async def _until(check: object) -> None:
    assert callable(check)
    while not check():
        await asyncio.sleep(0.01)


async def _iterate(frames: list[pb.PutFrame]) -> AsyncIterator[pb.PutFrame]:
    for f in frames:
        yield f
