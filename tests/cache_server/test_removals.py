"""The removal feed (WatchRemovals): keys that leave the cache reach every watcher.

A real server in process on loopback, real tiers: a Delete, an eviction the CPU tier makes
to fit new blocks (no tier below: the blocks are gone), an Admin Flush. The feed itself
(removals.py) is checked for namespaces and for a watcher that falls behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from nopecache.cache_server.removals import Removal, RemovalFeed
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL, STORED, Harness, key_of, make_block, put, serving

pytestmark = pytest.mark.asyncio

# A hang guard only: an event reaches a watcher within milliseconds on an idle machine.
EVENT_TIMEOUT_S = 30.0

Events = AsyncIterator[pb.RemovalEvent]


async def _watch(h: Harness) -> tuple[grpc.aio.UnaryStreamCall, Events]:
    call = h.stub.WatchRemovals(pb.WatchRemovalsRequest())
    events = call.__aiter__()
    opening = await asyncio.wait_for(events.__anext__(), EVENT_TIMEOUT_S)
    assert opening == pb.RemovalEvent()  # open: nothing removed yet
    return call, events


async def _next(events: Events) -> pb.RemovalEvent:
    return await asyncio.wait_for(events.__anext__(), EVENT_TIMEOUT_S)


def _keys(event: pb.RemovalEvent) -> list[bytes]:
    return [event.keys[i : i + 16] for i in range(0, len(event.keys), 16)]


async def test_deleted_keys_reach_the_watcher(harness: Harness) -> None:
    keys = [key_of(i) for i in range(3)]
    results = await put(harness.stub, [(k, make_block(k)) for k in keys], harness.frame_bytes)
    assert [r.outcome for r in results] == [STORED] * 3
    call, events = await _watch(harness)
    await harness.stub.Delete(pb.DeleteRequest(keys=keys[0] + keys[2]))
    event = await _next(events)
    assert _keys(event) == [keys[0], keys[2]]
    assert not event.cleared and not event.lost
    call.cancel()


async def test_blocks_evicted_with_no_tier_below_reach_the_watcher() -> None:
    # 16 pages of 4 KiB: each block takes one page, so the 17th put evicts the oldest.
    config = replace(SMALL, tiers=("cpu://?capacity=64KiB&page=4KiB&pinned=no",))
    async with serving(config) as h:
        keys = [key_of(i) for i in range(20)]
        call, events = await _watch(h)
        for key in keys:
            (result,) = await put(h.stub, [(key, make_block(key))], h.frame_bytes)
            assert result.outcome == STORED
        gone: list[bytes] = []
        while len(gone) < 4:
            gone += _keys(await _next(events))
        looked = await h.stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        missing = [k for k, tier in zip(keys, looked.tiers, strict=True) if tier == 0]
        assert gone == missing == keys[:4]  # LRU: the first four stored
        call.cancel()


async def test_a_flush_clears_the_watchers_namespace(harness: Harness) -> None:
    key = key_of(7)
    await put(harness.stub, [(key, make_block(key))], harness.frame_bytes)
    call, events = await _watch(harness)
    admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(harness.channel)
    reply = await admin.Flush(pb.FlushRequest())
    assert reply.deleted == 1
    event = await _next(events)
    assert event.cleared and not event.keys
    call.cancel()


async def test_a_closed_watch_is_no_longer_fed(harness: Harness) -> None:
    call, _ = await _watch(harness)
    kv = harness.running.service
    assert kv.removals.watchers == 1
    call.cancel()
    await asyncio.wait_for(_until(lambda: kv.removals.watchers == 0), EVENT_TIMEOUT_S)


async def _until(done: object) -> None:
    assert callable(done)
    while not done():
        await asyncio.sleep(0.01)


async def test_the_feed_keeps_namespaces_apart() -> None:
    feed = RemovalFeed()
    alice, bob, anonymous = feed.watch(b"A" * 8), feed.watch(b"B" * 8), feed.watch(b"")
    feed.gone([b"A" * 8 + key_of(1), b"B" * 8 + key_of(2), key_of(3)])
    assert await alice.next() == Removal(keys=key_of(1))
    assert await bob.next() == Removal(keys=key_of(2))
    assert await anonymous.next() == Removal(keys=key_of(3))  # 16-byte keys only
    feed.cleared(b"A" * 8)
    assert await alice.next() == Removal(cleared=True)
    assert bob.pending() == anonymous.pending() == 0
    feed.cleared(b"")  # everything: every watcher
    assert [w.pending() for w in (alice, bob, anonymous)] == [1, 1, 1]


async def test_a_watcher_that_falls_behind_gets_one_lost_event() -> None:
    feed = RemovalFeed(limit=3)
    watcher = feed.watch(b"")
    for i in range(4):
        feed.gone([key_of(i)])
    assert watcher.pending() == 1
    assert await watcher.next() == Removal(lost=True)
    feed.gone([key_of(9)])
    assert await watcher.next() == Removal(keys=key_of(9))


async def test_a_watch_is_not_counted_in_flight(harness: Harness) -> None:
    call, _ = await _watch(harness)
    admin: cache_pb2_grpc.AdminAsyncStub = cache_pb2_grpc.AdminStub(harness.channel)
    stats = await admin.AdminStats(pb.AdminStatsRequest())
    assert stats.in_flight == 0  # a Drain would not wait on the open watch
    call.cancel()
