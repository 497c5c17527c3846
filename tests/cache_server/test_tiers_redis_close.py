"""A Redis tier closes without raising when its connections cannot close in time.

Found in a loaded ``make test``: a store's teardown raised redis-py's "Timed out closing
connection". Closing is shutdown: a connection that will not close cleanly is dropped,
logged and never turned into an error that stops the rest of the shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from nopecache.cache_server.tiers.base import PutStatus
from nopecache.cache_server.tiers.redis import RedisTier
from tests.support.redis_procs import RedisProc


@pytest.mark.asyncio
async def test_close_with_a_write_stuck_on_a_paused_redis_does_not_raise(
    redis_disposable: RedisProc,
) -> None:
    # timeout=1: redis-py bounds each close by it. The test waits on the events below,
    # not on this figure.
    tier = RedisTier.from_url(redis_disposable.url + "?timeout=1")
    assert await tier.contains_many([b"warm"]) == [False]  # a connection exists and works
    assert redis_disposable.proc is not None
    os.kill(redis_disposable.proc.pid, signal.SIGSTOP)
    try:
        # 64 MiB of incompressible bytes: more than the kernel's socket buffers hold, so
        # the write stays queued in the transport while Redis reads nothing.
        blob = os.urandom(64 * 1024 * 1024)
        stuck = asyncio.create_task(tier.put(b"big", blob))
        while not stuck.done() and not _writes_pending(tier):
            await asyncio.sleep(0.01)
        assert not stuck.done()
        await tier.close()  # raised redis TimeoutError before the fix
        assert (await stuck).status is PutStatus.UNAVAILABLE  # nothing stored, nothing raised
    finally:
        os.kill(redis_disposable.proc.pid, signal.SIGCONT)


def _writes_pending(tier: RedisTier) -> bool:
    """Whether any of the tier's connections has bytes queued that Redis has not read."""
    pool = getattr(tier._client, "connection_pool", None)  # a single-node URL: redis.Redis
    for conn in getattr(pool, "_in_use_connections", ()):
        writer = getattr(conn, "_writer", None)
        if writer is not None and writer.transport.get_write_buffer_size() > 0:
            return True
    return False
