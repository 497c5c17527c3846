"""A Put of thousands of tiny blocks must not hold the server's event loop while it
stores them: other clients' calls get their turns. Real in-process server on loopback;
the test counts the turns the shared event loop gives a ticker task meanwhile."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import pytest

from tests.support.server_harness import (
    SMALL,
    STORED,
    frames_of,
    key_of,
    make_block,
    serving,
    stream,
)

BLOCKS = 8192
CONFIG = replace(
    SMALL,
    tiers=("cpu://?capacity=16MiB&page=512&pinned=no",),
    max_message_bytes=1024 * 1024,
    max_keys_per_request=BLOCKS,
    max_request_bytes=64 * 1024 * 1024,
)


@pytest.mark.asyncio
async def test_storing_a_put_of_many_tiny_blocks_yields_the_event_loop() -> None:
    async with serving(CONFIG) as h:
        (cpu,) = h.running.store.tiers
        blocks = [(key_of(i), make_block(key_of(i))) for i in range(BLOCKS)]
        # Another task of the server's loop notes how many blocks the tier holds at each of
        # its turns. Counting turns from the client's view of the call was racy on a loaded
        # machine (the client learnt that storing began some yields late); what the server
        # stores between two turns of another task does not depend on the machine's speed.
        seen: list[int] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                seen.append((await cpu.stats()).entries)  # stats() never yields
                await asyncio.sleep(0)

        watching = asyncio.ensure_future(ticker())
        reply = await h.stub.Put(stream(frames_of(blocks, h.frame_bytes)))
        done.set()
        await watching
        seen.append((await cpu.stats()).entries)
        assert [r.outcome for r in reply.results] == [STORED] * BLOCKS
        assert (seen[0], seen[-1]) == (0, BLOCKS)
        # At most YIELD_EVERY_BLOCKS (64) blocks stored between two turns of another task.
        assert max(b - a for a, b in itertools.pairwise(seen)) <= 64
