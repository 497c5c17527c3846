"""A slow bulk reader is judged by what it acknowledges (issue 36, finding 5): one that
reads steadily at 128 KiB/s gets its multi-MiB block whole, however the server's send
buffer drains (the kernel wakes a writer only once a third of the buffer is free, seconds
apart at that pace); one that stops reading is still cut.

A real server on loopback; the reader is a plain socket with a small receive buffer.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import pytest

from nopecache.proto.bulk import ENTRY, encode_get
from tests.support.bulk_wire import BOUNDED, open_bulk, recv_exact, welcomed
from tests.support.server_harness import STORED, Harness, key_of, make_block, put, serving
from tests.support.waiting import wait_until

KiB = 1024
MiB = 1024 * KiB
SLOW = replace(
    BOUNDED,
    max_block_bytes=8 * MiB,
    max_request_bytes=8 * MiB,
    # The old measure, silence at the send buffer, cut a reader after 0.5 s without a
    # writable wake-up; the rate rule asks 32 KiB/s over each 1 s of waiting.
    stream_idle_timeout_s=0.5,
    min_stream_rate=32 * KiB,
    min_rate_window_s=1.0,
)
READ_RATE = 128 * KiB


async def stored_block(h: Harness, tokens: int) -> tuple[bytes, bytes]:
    """A block of ``tokens`` tokens (256 bytes each), stored."""
    key = key_of(tokens)
    blob = make_block(key, tokens=tokens, head_dim=64)
    assert [r.outcome for r in await put(h.stub, [(key, blob)], h.frame_bytes)] == [STORED]
    return key, blob


def read_slowly(sock: socket.socket, n: int, rate: int, slow_for_s: float) -> bytes:
    """``n`` bytes, read at ``rate`` bytes per second (16 KiB at a time on schedule) for
    ``slow_for_s``, then as fast as they come (fewer when the peer closes first)."""
    out = bytearray()
    start = time.monotonic()
    sock.settimeout(10)
    while len(out) < n:
        if time.monotonic() - start < slow_for_s:
            time.sleep(max(0.0, start + len(out) / rate - time.monotonic()))
        part = sock.recv(min(16 * KiB, n - len(out)))
        if not part:
            break
        out += part
    return bytes(out)


@pytest.mark.asyncio
async def test_a_steady_slow_bulk_reader_gets_its_whole_block() -> None:
    async with serving(SLOW) as h:
        # 8 MiB: loopback buffers take about 5 MiB at once (the server's send buffer grows
        # to 4 MiB), the rest waits for the reader. Read at 128 KiB/s for 6 s, several
        # windows, with no writable wake-up (a third of 4 MiB is 10 s at that pace), then
        # the rest at once.
        key, blob = await stored_block(h, tokens=32000)
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        with sock:
            await asyncio.to_thread(sock.sendall, encode_get(key))
            n = ENTRY.size + len(blob)
            got = await asyncio.to_thread(read_slowly, sock, n, READ_RATE, 6.0)
        assert len(got) == ENTRY.size + len(blob)
        assert got[ENTRY.size :] == blob
        assert h.running.service.inflight.cut_slow == 0


@pytest.mark.asyncio
async def test_a_bulk_reader_that_stops_reading_is_still_cut() -> None:
    async with serving(SLOW) as h:
        key, blob = await stored_block(h, tokens=32000)
        budget = h.running.service.inflight
        sock = await asyncio.to_thread(welcomed, await open_bulk(h))
        with sock:
            await asyncio.to_thread(sock.sendall, encode_get(key))
            got = await asyncio.to_thread(read_slowly, sock, 256 * KiB, READ_RATE, 2.0)
            # It stops: nothing more is acknowledged, and within the window it is cut.
            await wait_until(lambda: budget.cut_slow == 1, timeout_s=30)
            await wait_until(lambda: budget.used_bytes == 0)
            rest = await asyncio.to_thread(recv_exact, sock, len(blob))
        assert len(got) + len(rest) < ENTRY.size + len(blob)
