"""Put memory within the budget under a slow-loris sweep (issue 36, finding 4).

Slow-loris Puts announce big blocks (reserved whole), send half, stall; the server cuts
them (the rate rule, or reclaimed when others wait for the room) and they come straight
back. What grew the server far past its budget (3.3x here before the fix) was the order
of a cut: the stream's room went back to the budget while its frames were still held (the
refusal's traceback keeps the stream's frames alive until the collector runs), so the
streams waiting for that room read theirs on top. Now a cut stream lets go of its bytes
first, then of its room.

A real server process (its RSS read from /proc), raw gRPC Put streams on loopback, frames
of 256 KiB. The sweep runs until the streams were cut and came back 16 times (events, not
a fixed time): the budget changed hands several times over; the peak RSS growth is
compared with the budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import key_of
from tests.support.server_procs import ServerFactory
from tests.support.tenants import open_channel

KiB = 1024
MiB = 1024 * KiB
BUDGET = 32 * MiB
SHARE = 16 * MiB
STREAMS = 16
FRAME = 256 * KiB
LIMITS = [
    "--max-message-bytes", "256KiB",
    "--max-block-bytes", "8MiB",
    "--max-request-bytes", "8MiB",
    "--max-inflight-bytes", "32MiB",
    "--max-inflight-bytes-per-client", "16MiB",
    "--stream-idle-timeout-s", "120",
    "--min-rate-window-s", "1",
]  # fmt: skip
OWN_CONNECTION = [
    ("grpc.max_send_message_length", FRAME),
    ("grpc.max_receive_message_length", FRAME),
    ("grpc.use_local_subchannel_pool", 1),
]
# A hang guard only: the sweep ends after CUTS cuts (a few windows of 1 s).
SWEEP_MOST_S = 90.0
CUTS = 16


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def sweep(address: str, pid: int, connections: int, idle: int) -> tuple[int, int]:
    """``STREAMS`` slow-loris Puts over ``connections`` connections, each announcing an
    8 MiB block, sending 4 MiB of it and stalling, again 0.1 s after each cut, until
    ``CUTS`` cuts; (peak RSS growth over ``idle``, cuts)."""
    channels = [open_channel(address, options=OWN_CONNECTION) for _ in range(connections)]
    stubs = [cache_pb2_grpc.KVCacheStub(c) for c in channels]
    await asyncio.gather(*(s.Lookup(pb.LookupRequest(keys=key_of(0))) for s in stubs))
    data = bytes(FRAME - 4096)
    cut = [0] * STREAMS
    done = asyncio.Event()

    async def frames(i: int) -> AsyncIterator[pb.PutFrame]:
        yield pb.PutFrame(key=key_of(i), total_size=8 * MiB, data=data)
        for _ in range(15):
            yield pb.PutFrame(data=data)
        await done.wait()

    async def loris(i: int) -> None:
        while not done.is_set():
            call = stubs[i % connections].Put(frames(i))
            try:
                await call
            except grpc.aio.AioRpcError:
                cut[i] += 1
                if sum(cut) >= CUTS:
                    done.set()
                await asyncio.sleep(0.1)

    tasks = [asyncio.ensure_future(loris(i)) for i in range(STREAMS)]
    peak = 0
    start = time.monotonic()
    while not done.is_set() and time.monotonic() - start < SWEEP_MOST_S:
        peak = max(peak, rss_bytes(pid) - idle)
        await asyncio.sleep(0.1)
    done.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in channels:
        await c.close(None)
    assert sum(cut) >= CUTS, f"the sweep did not cycle: cuts per stream {cut}"
    return peak, sum(cut)


@pytest.mark.asyncio
async def test_a_slow_loris_sweep_grows_rss_within_the_budget_and_each_share(
    cache_servers: ServerFactory,
) -> None:
    (server,) = cache_servers(1, extra_args=LIMITS)
    assert server.proc is not None
    pid = server.proc.pid
    await asyncio.sleep(0.5)  # the server's start-up allocations settle
    idle = rss_bytes(pid)
    # One client (one connection: one share) with all 16 streams: within 1.10x its share.
    tenant_peak, _ = await sweep(server.address, pid, 1, idle)
    assert tenant_peak <= 1.10 * SHARE, (
        f"one client's sweep grew RSS {tenant_peak / MiB:.1f} MiB for a {SHARE // MiB} MiB share"
    )
    # 16 clients, a stream each: within 1.10x the budget (measured from the same idle
    # RSS: what the first sweep left resident counts too).
    peak, _ = await sweep(server.address, pid, STREAMS, idle)
    assert peak <= 1.10 * BUDGET, (
        f"the sweep grew RSS {peak / MiB:.1f} MiB for a {BUDGET // MiB} MiB budget"
    )
