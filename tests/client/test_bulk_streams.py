"""Several bulk streams to one server (``ClientConfig.bulk_streams``): a Get's keys dealt
out across the sockets, blocks yielded in key order, a broken stream turning the rest
into misses. Real server processes on loopback."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nopecache.client import storing
from nopecache.client.bulk import BulkSource
from nopecache.client.config import BULK_STREAMS_MAX
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.transport import ServerConnection
from tests.client.test_transport import blob_of, config
from tests.support.client_harness import PREFIX_BLOCK, client, kv, prompt
from tests.support.client_harness import config as harness_config
from tests.support.server_harness import key_of
from tests.support.server_procs import CacheServerProc, ServerFactory


def connection(server: CacheServerProc, streams: int) -> ServerConnection:
    return ServerConnection(
        server.address, config(server.address, bulk_streams=streams), data_path=BulkSource
    )


async def _split_in_order(server: CacheServerProc) -> None:
    keys = [key_of(i) for i in range(11)]
    blobs = [blob_of(k, 64 * (1 + i % 4)) for i, k in enumerate(keys)]  # sizes differ
    stored = [i for i in range(11) if i not in (4, 7)]  # two misses among the hits
    writer = connection(server, 1)
    assert all(r.ok for r in await writer.put([(keys[i], blobs[i]) for i in stored]))
    await writer.close()
    want = [(i, blobs[i] if i in stored else None) for i in range(11)]
    for streams in (1, 3, 16):
        conn = connection(server, streams)
        got = [(i, None if b is None else bytes(b)) async for i, b in conn.get(b"".join(keys))]
        source = conn.data_blocks
        assert isinstance(source, BulkSource)
        # Every stream went back to the idle list: as many sockets as the call used (at
        # most one per key), none of them on gRPC.
        assert (len(source._idle), source.grpc_calls) == (min(streams, 11), 0)
        assert source.bulk_blocks == len(stored)
        assert got == want, f"{streams} streams"
        # The same call again reuses the idle sockets.
        again = [(i, None if b is None else bytes(b)) async for i, b in conn.get(b"".join(keys))]
        assert again == want and len(source._idle) == min(streams, 11)
        await conn.close()


def test_keys_split_across_streams_come_back_in_key_order(cache_server: CacheServerProc) -> None:
    asyncio.run(_split_in_order(cache_server))


async def _killed_mid_get(server: CacheServerProc) -> None:
    conn = connection(server, 4)
    keys = [key_of(i) for i in range(48)]
    # 4 MiB each, 192 MiB in all: more than 4 loopback streams can hold in flight (socket
    # buffers of up to 32 MiB receive + 4 MiB send each here), so the kill always finds
    # blocks unsent, however fast the machine (24 MiB all arrived before it on an idle one).
    blobs = [blob_of(k, 16384) for k in keys]
    assert all(r.ok for r in await conn.put(list(zip(keys, blobs, strict=True))))
    stream = conn.get(b"".join(keys))
    got = [await anext(stream)]
    server.kill()
    got += [item async for item in stream]  # no exception: misses
    assert [i for i, _ in got] == list(range(48))
    received = [i for i, b in got if b is not None]
    assert received == list(range(len(received)))  # a prefix of the keys, then misses
    assert 1 <= len(received) < 48
    assert all(bytes(b) == blobs[i] for i, b in got if b is not None)
    assert conn.is_down()
    source = conn.data_blocks
    assert isinstance(source, BulkSource) and source._idle == []  # broken sockets not kept
    await conn.close()


def test_a_server_killed_mid_get_on_several_streams_turns_the_rest_into_misses(
    cache_servers: ServerFactory,
) -> None:
    (server,) = cache_servers(1, tiers=("cpu://?capacity=256MiB&pinned=no",))
    asyncio.run(_killed_mid_get(server))


@pytest.mark.parametrize("streams", [0, BULK_STREAMS_MAX + 1, 2.0, True])
def test_bulk_streams_out_of_range_is_refused_naming_the_field(streams: object) -> None:
    with pytest.raises(InvalidArgumentError, match="bulk_streams"):
        config("127.0.0.1:1", bulk_streams=streams)


def test_a_store_of_many_batches_keeps_two_in_flight_and_stores_every_block(
    cache_server: CacheServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each block its own Put batch (the batch size shrunk to one byte): the batches
    travel two at a time over the bulk stream, and every block is stored, counted once
    and fetched back exactly."""
    monkeypatch.setattr(storing, "_STORE_BATCH_BYTES", 1)
    tokens = prompt(96, seed=41)
    k, v = kv(96, seed=41)
    with client(harness_config([cache_server], "batches", shm="off")) as c:
        report = c.store(tokens, (k, v), position_independent=False)
        plan = c.lookup(tokens, allow_position_independent=False)
        result = c.fetch(plan, tokens)
        source = c.core.connection(cache_server.address).data_blocks
    blocks = 96 // PREFIX_BLOCK
    assert (report.stored, report.already_present, report.failed) == (blocks, 0, 0)
    assert isinstance(source, BulkSource) and source.bulk_puts == blocks
    assert plan.prefix_end == 96 and result.failed == ()
    assert result.k is not None and result.v is not None
    assert torch.equal(result.v, v)
