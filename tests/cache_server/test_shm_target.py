"""A shared-memory Get window takes a block as the tier's page runs: one gathering write of
the parts, in order, byte exact (the server copies from its pages, not from a read copy)."""

from __future__ import annotations

import asyncio
import random

from nopecache.cache_server.shm import ShmLimits, ShmSessions
from nopecache.client.shm import Segment
from nopecache.proto.shm_layout import HEADER_BYTES

SEGMENT = 8 * 1024 * 1024


async def _place_parts() -> None:
    table = ShmSessions(ShmLimits(max_segment_bytes=SEGMENT))
    seg = Segment.create(SEGMENT, prefix=f"nopecache-target-{random.getrandbits(32):x}-")
    try:
        attached = await table.attach("t", seg.name, seg.size, seg.nonce)
        assert attached.session, attached.refused
        rng = random.Random(3)
        # More runs than one pwritev takes, some empty, one larger than the rest together.
        parts = [memoryview(rng.randbytes(n)) for n in [0, 65536, 7, 0, 1_000_000]]
        parts += [memoryview(rng.randbytes(rng.randrange(1, 3000))) for _ in range(100)]
        want = b"".join(bytes(p) for p in parts)
        with table.target("t", attached.session, HEADER_BYTES, SEGMENT - HEADER_BYTES) as target:
            assert target.active
            first = target.place(parts)
            second = target.place(memoryview(b"tail"))
        assert first == HEADER_BYTES and second is not None and second >= first + len(want)
        assert seg.mm is not None
        assert seg.mm[first : first + len(want)] == want
        assert seg.mm[second : second + 4] == b"tail"
        # Too big for the rest of the window: not written, the caller sends data frames.
        with table.target("t", attached.session, HEADER_BYTES, 4096) as small:
            assert small.place(parts) is None
        table.close()
    finally:
        seg.close()


def test_a_block_given_as_page_runs_lands_whole_in_the_window() -> None:
    asyncio.run(_place_parts())
