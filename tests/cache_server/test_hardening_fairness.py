"""A Put of thousands of tiny blocks must not hold the server's event loop while it
stores them: other clients' calls get their turns. Real in-process server on loopback;
the test counts the turns the shared event loop gives a ticker task meanwhile."""

from __future__ import annotations

import asyncio
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
        blocks = [(key_of(i), make_block(key_of(i))) for i in range(BLOCKS)]
        call = h.stub.Put(stream(frames_of(blocks, h.frame_bytes)))
        # The server sends its initial metadata when every block is in and checked, right
        # before it starts storing them (service.Put).
        await call.initial_metadata()
        turns = 0
        reply_task = asyncio.ensure_future(call)
        while not reply_task.done():
            await asyncio.sleep(0)
            turns += 1
        reply = reply_task.result()
        assert [r.outcome for r in reply.results] == [STORED] * BLOCKS
        # One turn at least every YIELD_EVERY_BLOCKS (64) blocks stored.
        assert turns >= BLOCKS // 64
