"""The gRPC cache server in-process on a loopback port: round trips, framing, misses,
concurrency, health, reflection and metrics. Real grpc.aio on both ends, real CPU tier.

The harness, block builder, framing and digest of everything stored live in
tests/support/server_harness.py, shared with the other cache_server tests.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from nopecache.cache_server.main import tier_health_name
from nopecache.cache_server.metrics import METRIC_NAMES
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import (
    PRESENT,
    SMALL,
    STORED,
    Harness,
    get,
    key_of,
    make_block,
    put,
    serving,
)


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_put_lookup_get_round_trip_is_bit_exact(harness: Harness) -> None:
    keys = [key_of(i) for i in range(3)]
    blobs = [make_block(k, tokens=3 + i) for i, k in enumerate(keys)]
    results = await put(harness.stub, zip(keys, blobs, strict=True), harness.frame_bytes)
    assert [(r.key, r.outcome, r.code, r.reason) for r in results] == [
        (k, STORED, 0, "") for k in keys
    ]

    absent = key_of(99)
    reply = await harness.stub.Lookup(pb.LookupRequest(keys=b"".join([keys[0], absent, *keys[1:]])))
    assert reply.tiers == b"\x01\x00\x01\x01"
    assert list(reply.tier_names) == ["cpu"]

    got, frames = await get(harness.stub, [*keys, absent])
    assert got == [*blobs, None]
    assert [(f.index, f.tier, f.total_size) for f in frames] == [
        (0, 1, len(blobs[0])),
        (1, 1, len(blobs[1])),
        (2, 1, len(blobs[2])),
        (3, 0, 0),
    ]
    assert list(frames[0].tier_names) == ["cpu"]
    assert all(not f.tier_names for f in frames[1:])

    again = await put(harness.stub, [(keys[1], blobs[1])], harness.frame_bytes)
    assert [(r.key, r.outcome) for r in again] == [(keys[1], PRESENT)]


@pytest.mark.asyncio
async def test_multi_frame_blocks_round_trip(harness: Harness) -> None:
    frame = harness.frame_bytes
    # ~260 KiB: five frames each way, the last one partial.
    keys = [key_of(10), key_of(11)]
    blobs = [make_block(keys[0], tokens=1000, head_dim=64), make_block(keys[1], tokens=3)]
    assert 4 * frame < len(blobs[0]) < 5 * frame
    results = await put(harness.stub, zip(keys, blobs, strict=True), frame_bytes=frame)
    assert [r.outcome for r in results] == [STORED, STORED]

    got, frames = await get(harness.stub, keys)
    assert got == blobs
    first_block = [f for f in frames if f.index == 0]
    assert len(first_block) == 5
    assert [len(f.data) for f in first_block[:-1]] == [frame] * (len(first_block) - 1)
    assert first_block[0].total_size == len(blobs[0])
    assert all(f.tier == 0 and f.total_size == 0 for f in first_block[1:])


@pytest.mark.asyncio
async def test_small_client_frames_are_reassembled(harness: Harness) -> None:
    key = key_of(20)
    blob = make_block(key, tokens=50, head_dim=16)
    results = await put(harness.stub, [(key, blob)], frame_bytes=1000)
    assert [r.outcome for r in results] == [STORED]
    got, _ = await get(harness.stub, [key])
    assert got == [blob]


@pytest.mark.asyncio
async def test_misses_are_normal_entries(harness: Harness) -> None:
    hit = key_of(30)
    blob = make_block(hit)
    await put(harness.stub, [(hit, blob)], harness.frame_bytes)
    misses = [key_of(31), key_of(32)]
    got, frames = await get(harness.stub, [misses[0], hit, misses[1]])
    assert got == [None, blob, None]
    assert [(f.index, f.tier, f.total_size, f.data) for f in frames] == [
        (0, 0, 0, b""),
        (1, 1, len(blob), blob),
        (2, 0, 0, b""),
    ]
    empty, frames = await get(harness.stub, [])
    assert (empty, frames) == ([], [])
    lookup = await harness.stub.Lookup(pb.LookupRequest(keys=b""))
    assert lookup.tiers == b""


@pytest.mark.asyncio
async def test_delete_removes_only_present_keys(harness: Harness) -> None:
    keys = [key_of(i) for i in range(40, 44)]
    await put(harness.stub, [(k, make_block(k)) for k in keys[:3]], harness.frame_bytes)
    reply = await harness.stub.Delete(pb.DeleteRequest(keys=keys[0] + keys[3] + keys[2]))
    assert reply.deleted == 2
    lookup = await harness.stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
    assert lookup.tiers == b"\x00\x01\x00\x00"


@pytest.mark.asyncio
async def test_stats_reports_limits_and_tiers(harness: Harness) -> None:
    key = key_of(50)
    blob = make_block(key)
    await put(harness.stub, [(key, blob)], harness.frame_bytes)
    stats = await harness.stub.Stats(pb.StatsRequest())
    limits = stats.server.limits
    assert (
        limits.max_message_bytes,
        limits.max_frame_data_bytes,
        limits.max_block_bytes,
        limits.max_request_bytes,
        limits.max_keys_per_request,
        limits.key_bytes,
    ) == (65536, 65536 - 4096, 1 << 20, 2 << 20, 64, 16)
    assert stats.server.api_version == 1
    assert stats.server.version
    assert stats.server.host_id
    assert list(stats.server.tier_names) == ["cpu"]
    [tier] = stats.tiers
    # The 4 KiB pages round the block up to whole pages.
    assert (tier.name, tier.capacity_bytes, tier.entries, tier.healthy) == (
        "cpu",
        4 << 20,
        1,
        True,
    )
    assert tier.used_bytes == -(-len(blob) // 4096) * 4096


@pytest.mark.asyncio
async def test_concurrent_clients_each_get_their_own_blocks(harness: Harness) -> None:
    async def client(n: int) -> None:
        async with grpc.aio.insecure_channel(
            harness.running.address, options=harness.config.grpc_options
        ) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            keys = [key_of(1000 * n + i) for i in range(6)]
            blobs = [make_block(k, tokens=20 + 40 * i, head_dim=32) for i, k in enumerate(keys)]
            for _ in range(3):
                results = await put(stub, zip(keys, blobs, strict=True), frame_bytes=7000)
                assert {r.outcome for r in results} <= {STORED, PRESENT}
                got, _ = await get(stub, keys)
                assert got == blobs

    await asyncio.gather(*(client(n) for n in range(8)))
    stats = await harness.stub.Stats(pb.StatsRequest())
    assert stats.tiers[0].entries == 48


@pytest.mark.asyncio
async def test_lru_eviction_is_counted_and_the_oldest_block_goes() -> None:
    config = replace(SMALL, tiers=("cpu://?capacity=16KiB&page=4KiB&pinned=no",))
    async with serving(config) as h:
        keys = [key_of(i) for i in range(60, 65)]
        for k in keys:  # one 4 KiB page each: the fifth evicts the least recently used
            results = await put(h.stub, [(k, make_block(k, tokens=8, head_dim=32))], h.frame_bytes)
            assert [r.outcome for r in results] == [STORED]
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=b"".join(keys)))
        assert lookup.tiers == b"\x00\x01\x01\x01\x01"
        registry = h.running.metrics.registry
        assert registry.get_sample_value("nopecache_evictions_total", {"tier": "cpu"}) == 1.0


# -- health, reflection, metrics -----------------------------------------------------------
@pytest.mark.asyncio
async def test_health_reports_server_service_and_tiers(harness: Harness) -> None:
    stub = health_pb2_grpc.HealthStub(harness.channel)
    serving_ = health_pb2.HealthCheckResponse.SERVING
    for name in ("", "nopecache.v1.KVCache", tier_health_name("cpu")):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == serving_, name
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Check(health_pb2.HealthCheckRequest(service=tier_health_name("redis")))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.asyncio
async def test_reflection_lists_and_describes_the_service(harness: Harness) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(harness.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="nopecache.v1.KVCache"),
    ]
    replies = [r async for r in stub.ServerReflectionInfo(stream_requests(requests))]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"nopecache.v1.KVCache", "grpc.health.v1.Health"} <= names
    files = replies[1].file_descriptor_response.file_descriptor_proto
    assert len(files) == 1
    assert b"nopecache/proto/cache.proto" in files[0]


async def stream_requests(
    requests: Sequence[reflection_pb2.ServerReflectionRequest],
) -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
    """An async iterator over reflection requests."""
    for r in requests:
        yield r


@pytest.mark.asyncio
async def test_metrics_endpoint_exposes_every_metric() -> None:
    # The tenant families need the flag (test_hardening_quotas checks they are off without).
    config = replace(SMALL, metrics=True, metrics_port=0, metrics_tenant_labels=True)
    async with serving(config) as h:
        key = key_of(70)
        await put(h.stub, [(key, make_block(key))], h.frame_bytes)
        await get(h.stub, [key, key_of(71)])
        with pytest.raises(grpc.aio.AioRpcError):
            await h.stub.Lookup(pb.LookupRequest(keys=b"short"))
        endpoint = h.running.metrics_endpoint
        assert endpoint is not None and endpoint.port > 0
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        text = (await asyncio.to_thread(_fetch, url)).decode()
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in text, name
    assert 'nopecache_hits_total{tier="cpu"} 1.0' in text
    assert "nopecache_misses_total 1.0" in text
    assert 'nopecache_requests_rejected_total{method="Lookup",reason="bad_keys"} 1.0' in text
    assert 'nopecache_put_blocks_total{outcome="stored"} 1.0' in text
    assert 'nopecache_tier_healthy{tier="cpu"} 1.0' in text
    assert 'nopecache_request_duration_seconds_count{method="Get"} 1.0' in text


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body
