"""Progress, not silence (issue 36, finding 1): a stream that holds in-flight budget keeps
``min_stream_rate`` over ``min_rate_window_s`` of waiting for its peer, or is cut and its
room returned; an honest slow stream above the rate is not cut.

The drip squatter of the issue: a Put (gRPC or bulk) announces a 64 MiB block, so the
server reserves it whole, then sends one byte every 0.5 s. It is never silent, so the
silence cut (``stream_idle_timeout_s``, 60 s here) never fires; two of them hold the
whole budget. A real server on loopback; every client on its own connection (without
auth each connection has its own share).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.bulk import BLOCK, ENTRY, ERROR_CODE, PUT_REPLY_CODE, encode_put
from tests.support.bulk_wire import open_bulk, recv_exact, welcomed
from tests.support.server_harness import (
    SMALL,
    STORED,
    Harness,
    frames_of,
    get,
    key_of,
    make_block,
    put,
    serving,
)
from tests.support.waiting import wait_until

MiB = 1024 * 1024
KiB = 1024
WINDOW_S = 2.0
RATED = replace(
    SMALL,
    tiers=("cpu://?capacity=64MiB&pinned=no",),
    max_message_bytes=1 * MiB,
    max_block_bytes=64 * MiB,
    max_request_bytes=64 * MiB,
    max_inflight_bytes=128 * MiB,
    max_inflight_bytes_per_client=64 * MiB,
    # Only the rate rule may cut a stream that holds budget; silence is not the measure.
    stream_idle_timeout_s=60.0,
    min_stream_rate=64 * KiB,
    min_rate_window_s=WINDOW_S,
)
DRIP_S = 0.5
# A squatter is cut once WINDOW_S of waiting has passed (plus the drip period it is in);
# the rest is room for a loaded machine (the test waits on the events, not on this).
CUT_WITHIN_S = WINDOW_S + DRIP_S + 8.0
RATE_CUT = (
    "the client sent fewer than 64KiB/s (min_stream_rate) over 2 s of waiting "
    "(min_rate_window_s), holding "
)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def own_channel(h: Harness) -> grpc.aio.Channel:
    """A channel on a connection of its own (its own share of the budget)."""
    return grpc.aio.insecure_channel(
        h.running.address, options=[*RATED.grpc_options, *OWN_CONNECTION]
    )


async def drip(key: bytes, stop: asyncio.Event) -> AsyncIterator[pb.PutFrame]:
    """Announce a 64 MiB block with one byte, then one more byte every 0.5 s."""
    yield pb.PutFrame(key=key, total_size=64 * MiB, data=b"x")
    while not stop.is_set():
        await asyncio.sleep(DRIP_S)
        yield pb.PutFrame(data=b"x")


def bulk_drip(sock: socket.socket, key: bytes, stop: asyncio.Event) -> tuple[int, bytes]:
    """The bulk drip (in a thread): a PUT of one 64 MiB block, one byte every 0.5 s; the
    server's answer once it cuts the connection."""
    sock.sendall(encode_put(1) + BLOCK.pack(64 * MiB, key) + b"x")
    sock.settimeout(DRIP_S)
    while not stop.is_set():
        try:
            head = sock.recv(ENTRY.size, socket.MSG_PEEK)
        except TimeoutError:
            head = b""
        if head:
            sock.settimeout(5)
            code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
            return code, recv_exact(sock, size)
        try:
            sock.sendall(b"x")
        except OSError:
            break
    return -1, b""


async def paced_put(h: Harness, key: bytes, blob: bytes, rate: int) -> list[pb.PutResult]:
    """Put ``blob`` in 64 KiB frames sent at ``rate`` bytes per second."""
    frames = frames_of([(key, blob)], 64 * KiB)

    async def paced() -> AsyncIterator[pb.PutFrame]:
        start = time.monotonic()
        sent = 0
        for f in frames:
            # Sent on schedule: a late frame is not made up for by a burst.
            await asyncio.sleep(max(0.0, start + sent / rate - time.monotonic()))
            sent += len(f.data)
            yield f

    reply = await h.stub.Put(paced(), timeout=60)
    return list(reply.results)


async def victim_put_and_get(h: Harness, i: int) -> None:
    """Another client stores a 1 MiB block and reads it back (it needs budget room)."""
    key = key_of(i)
    blob = make_block(key, tokens=4096, head_dim=64)
    results = await asyncio.wait_for(put(h.stub, [(key, blob)], 64 * KiB), 30)
    assert [r.outcome for r in results] == [STORED]
    blobs, _ = await asyncio.wait_for(get(h.stub, [key]), 30)
    assert blobs == [blob]


@pytest.mark.asyncio
async def test_a_grpc_drip_squatter_is_cut_within_the_window_and_its_room_returned() -> None:
    async with serving(RATED) as h:
        budget = h.running.service.inflight
        stop = asyncio.Event()
        channels = [own_channel(h) for _ in range(2)]
        calls = [
            cache_pb2_grpc.KVCacheStub(c).Put(drip(key_of(100 + i), stop))
            for i, c in enumerate(channels)
        ]
        # Both hold their announced block: the budget is full.
        await wait_until(lambda: budget.used_bytes == 128 * MiB, timeout_s=30)
        held_at = time.monotonic()
        victim = asyncio.ensure_future(victim_put_and_get(h, 1))
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, CUT_WITHIN_S)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert err.value.details() == (
                f"PutFrame: {RATE_CUT}{64 * MiB} bytes of the in-flight budget: the stream "
                "is cut and nothing of it is stored"
            )
        assert time.monotonic() - held_at <= CUT_WITHIN_S
        stop.set()
        await victim  # the room came back: another client's Put and Get succeed
        await wait_until(lambda: budget.used_bytes == 0)
        assert budget.cut_slow == 2
        for c in channels:
            await c.close(None)


@pytest.mark.asyncio
async def test_a_bulk_drip_squatter_is_cut_within_the_window_and_its_room_returned() -> None:
    async with serving(RATED) as h:
        budget = h.running.service.inflight
        stop = asyncio.Event()
        channels = [own_channel(h) for _ in range(2)]
        socks = []
        for c in channels:  # each bulk connection counts against the gRPC one that asked
            socks.append(await asyncio.to_thread(welcomed, await open_bulk(Harness(h.running, c))))
        drips = [
            asyncio.ensure_future(asyncio.to_thread(bulk_drip, s, key_of(200 + i), stop))
            for i, s in enumerate(socks)
        ]
        await wait_until(lambda: budget.used_bytes == 128 * MiB, timeout_s=30)
        held_at = time.monotonic()
        victim = asyncio.ensure_future(victim_put_and_get(h, 2))
        answers = await asyncio.wait_for(asyncio.gather(*drips), CUT_WITHIN_S)
        assert time.monotonic() - held_at <= CUT_WITHIN_S
        stop.set()
        assert (
            answers
            == [
                (
                    ERROR_CODE,
                    f"PUT: {RATE_CUT}{64 * MiB} bytes of the in-flight budget: the stream is cut "
                    "and nothing of it is stored".encode(),
                )
            ]
            * 2
        )
        await victim
        await wait_until(lambda: budget.used_bytes == 0)
        for s in socks:
            s.close()
        for c in channels:
            await c.close(None)


@pytest.mark.asyncio
async def test_an_honest_slow_put_above_the_minimum_rate_completes_beside_drip_squatters() -> None:
    async with serving(RATED) as h:
        budget = h.running.service.inflight
        stop = asyncio.Event()
        channels = [own_channel(h) for _ in range(2)]
        calls = [
            asyncio.ensure_future(cache_pb2_grpc.KVCacheStub(c).Put(drip(key_of(300 + i), stop)))
            for i, c in enumerate(channels)
        ]
        await wait_until(lambda: budget.used_bytes == 128 * MiB, timeout_s=30)
        # 2 MiB at 640 KiB/s: ten times the minimum rate, a tenth of what a loopback Put
        # moves on a loaded machine; it waits for the squatters' room first, then takes
        # about 3 s, sending a frame every 0.1 s.
        key = key_of(3)
        blob = make_block(key, tokens=8192, head_dim=64)
        results = await paced_put(h, key, blob, 640 * KiB)
        assert [r.outcome for r in results] == [STORED]
        blobs, _ = await get(h.stub, [key])
        assert blobs == [blob]
        stop.set()
        await asyncio.gather(*calls, return_exceptions=True)
        for c in channels:
            await c.close(None)


@pytest.mark.asyncio
async def test_an_honest_slow_bulk_put_above_the_minimum_rate_completes() -> None:
    async with serving(RATED) as h:
        key = key_of(4)
        blob = make_block(key, tokens=8192, head_dim=64)  # 2 MiB
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))

        def send_slowly() -> tuple[int, bytes]:
            # 640 KiB/s in 64 KiB pieces: ten times the minimum rate.
            sock.sendall(encode_put(1) + BLOCK.pack(len(blob), key))
            start = time.monotonic()
            for at in range(0, len(blob), 64 * KiB):
                time.sleep(max(0.0, start + at / (640 * KiB) - time.monotonic()))
                sock.sendall(blob[at : at + 64 * KiB])
            sock.settimeout(30)
            code, size = ENTRY.unpack(recv_exact(sock, ENTRY.size))
            return code, recv_exact(sock, size)

        with sock:
            code, body = await asyncio.to_thread(send_slowly)
        assert code == PUT_REPLY_CODE
        assert [r.outcome for r in pb.PutReply.FromString(body).results] == [STORED]
