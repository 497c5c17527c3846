"""Blocks the server must never store or serve: compression bombs on Put, and values in
Redis that are not the block asked for (a bomb, garbage that is valid lz4, another key's
block, an empty value). Real in-process gRPC server on loopback, real redis-server."""

from __future__ import annotations

from dataclasses import replace

import grpc
import lz4.frame
import pytest

from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import StoredForm, build_block
from tests.support.redis_procs import RedisProc
from tests.support.server_harness import (
    REJECTED,
    SMALL,
    STORED,
    Harness,
    get,
    key_of,
    make_block,
    put,
    serving,
)

CPU = "cpu://?capacity=1MiB&page=4KiB&pinned=no"
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def bomb(key: bytes, payload_bytes: int) -> bytes:
    """A valid lz4 block whose zero payload expands to ``payload_bytes``."""
    head_dim = payload_bytes // 4096
    return build_block(
        key=key,
        fingerprint=b"test-model",
        form=StoredForm.NOPE,
        dtype="float16",
        shape=(1, 1024, 1, head_dim),
        v_head_dim=head_dim,
        token_ids=list(range(1024)),
        payload=bytes(payload_bytes),
        compression="lz4",
    )


def corrupt_count(h: Harness, tier: str) -> float:
    value = h.running.metrics.registry.get_sample_value(
        "nopecache_corrupt_blocks_total", {"tier": tier}
    )
    return value or 0.0


@pytest.mark.asyncio
async def test_a_compression_bomb_is_refused_before_it_is_decompressed() -> None:
    async with serving(SMALL) as h:
        key, good_key = key_of(1), key_of(2)
        blob = bomb(key, 8 * 1024 * 1024)
        assert len(blob) < SMALL.max_block_bytes  # small on the wire, 8 MiB once expanded
        good = make_block(good_key)
        results = await put(h.stub, [(key, blob), (good_key, good)], h.frame_bytes)
        assert [(r.outcome, r.code) for r in results] == [(REJECTED, INVALID), (STORED, 0)]
        assert results[0].reason == (
            "block #0: payload_nbytes: 8388608 bytes uncompressed, over the limit of "
            "1048576 (max_block_bytes)"
        )
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=key + good_key))
        assert lookup.tiers == b"\x00\x01"


def _redis_cases(key: bytes) -> dict[str, bytes]:
    """Values planted in Redis under ``key``, none of them the block of ``key``."""
    return {
        "bomb": lz4.frame.compress(make_block(key, tokens=4096, head_dim=64)),  # 2 MiB block
        "garbage": lz4.frame.compress(b"valid lz4, not a block" * 10),
        "other_key": lz4.frame.compress(make_block(key_of(999))),
        "empty": b"",
        "bad_frame": b"\x04\x22\x4d\x18 truncated",
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["bomb", "garbage", "other_key", "empty", "bad_frame"])
@pytest.mark.parametrize("tiers", ["cpu+redis", "redis"])
async def test_a_bad_redis_value_is_a_miss_deleted_counted_and_repairable(
    redis_clean: RedisProc, case: str, tiers: str
) -> None:
    tier_urls = (CPU, redis_clean.url) if tiers == "cpu+redis" else (redis_clean.url,)
    config = replace(SMALL, tiers=tier_urls)
    key = key_of(7)
    raw = redis_clean.client()
    raw.set(b"nc:" + key, _redis_cases(key)[case])
    async with serving(config) as h:
        got, frames = await get(h.stub, [key])
        assert got == [None]
        assert [(f.index, f.tier) for f in frames] == [(0, 0)]
        assert raw.exists(b"nc:" + key) == 0
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=key))
        assert lookup.tiers == b"\x00"  # not promoted, and gone from Redis
        # Counted once (the damaged-lz4 cases by the tier itself, the others by the store).
        await h.running.refresh_tiers()
        assert corrupt_count(h, "redis") == 1.0
        # The key can be stored again: a real Put is not answered ALREADY_PRESENT.
        good = make_block(key)
        results = await put(h.stub, [(key, good)], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED]
        got, _ = await get(h.stub, [key])
        assert got == [good]


@pytest.mark.asyncio
async def test_a_good_redis_value_is_still_served_and_promoted(redis_clean: RedisProc) -> None:
    config = replace(SMALL, tiers=(CPU, redis_clean.url))
    key = key_of(8)
    good = make_block(key)
    redis_clean.client().set(b"nc:" + key, lz4.frame.compress(good))
    async with serving(config) as h:
        got, frames = await get(h.stub, [key])
        assert got == [good]
        assert frames[0].tier == 2
        lookup = await h.stub.Lookup(pb.LookupRequest(keys=key))
        assert lookup.tiers == b"\x01"
        assert corrupt_count(h, "redis") == 0.0
