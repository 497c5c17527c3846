"""Bad requests get INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the field, and change
nothing stored: every test compares a digest of all stored blobs before and after.

Put semantics under test: a malformed *block* is rejected in the reply (other blocks of
the stream are stored); broken *framing* or a *request limit* aborts the stream and
stores none of its blocks, not even the valid ones before the fault.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc
import pytest
import pytest_asyncio

from nopecache.proto import cache_pb2 as pb
from tests.support.server_harness import (
    PRESENT,
    REJECTED,
    SMALL,
    STORED,
    Harness,
    digest,
    frames_of,
    get,
    key_of,
    make_block,
    put,
    serving,
    stream,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# Keys stored before every test, and the keys the digest covers.
BASE_KEYS = [key_of(i) for i in range(5)]
ALL_KEYS = [*BASE_KEYS, *(key_of(i) for i in range(100, 110))]


@pytest_asyncio.fixture
async def seeded() -> AsyncIterator[Harness]:
    """A SMALL server holding five valid blocks."""
    async with serving(SMALL) as h:
        results = await put(h.stub, [(k, make_block(k)) for k in BASE_KEYS], h.frame_bytes)
        assert [r.outcome for r in results] == [STORED] * 5
        yield h


def rejected_count(h: Harness, method: str, reason: str) -> float:
    """The rejection counter for (method, reason)."""
    value = h.running.metrics.registry.get_sample_value(
        "nopecache_requests_rejected_total", {"method": method, "reason": reason}
    )
    return value or 0.0


def flip(blob: bytes, offset: int) -> bytes:
    """``blob`` with one byte inverted (negative offsets count from the end)."""
    b = bytearray(blob)
    b[offset] ^= 0xFF
    return bytes(b)


NEW = key_of(100)
GOOD = make_block(NEW)
OTHER = key_of(101)

# (case id, frame key, blob, field the reason must name)
BAD_BLOCKS: list[tuple[str, bytes, bytes, str]] = [
    ("payload byte flipped", NEW, flip(GOOD, -1), "checksum:"),
    ("header byte flipped", NEW, flip(GOOD, 20), "header_checksum:"),
    ("magic", NEW, b"XXXX" + GOOD[4:], "magic:"),
    ("truncated", NEW, GOOD[:-2], "payload:"),
    ("trailing bytes", NEW, GOOD + b"\x00", "payload:"),
    ("shorter than prefix", NEW, GOOD[:10], "blob:"),
    ("key differs from header", OTHER, GOOD, "key:"),
    ("stored key with a different block", BASE_KEYS[0], GOOD, "key:"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "key", "blob", "field"), BAD_BLOCKS, ids=[c[0] for c in BAD_BLOCKS]
)
async def test_bad_block_is_rejected_naming_the_field(
    seeded: Harness, case: str, key: bytes, blob: bytes, field: str
) -> None:
    before = await digest(seeded.stub, ALL_KEYS)
    results = await put(seeded.stub, [(key, blob)], seeded.frame_bytes)
    assert len(results) == 1
    result = results[0]
    assert (result.key, result.outcome, result.code) == (key, REJECTED, INVALID.value[0])
    assert result.reason.startswith("block #0: ")
    assert field in result.reason, result.reason
    assert await digest(seeded.stub, ALL_KEYS) == before
    assert rejected_count(seeded, "Put", "invalid_block") == 1.0


@pytest.mark.asyncio
async def test_bad_block_in_a_stream_rejects_only_that_block(seeded: Harness) -> None:
    keys = [key_of(i) for i in range(100, 104)]
    blobs = [make_block(k, tokens=30) for k in keys]
    blobs[2] = flip(blobs[2], -5)
    results = await put(seeded.stub, zip(keys, blobs, strict=True), frame_bytes=500)
    assert [r.outcome for r in results] == [STORED, STORED, REJECTED, STORED]
    assert results[2].reason == "block #2: checksum: payload bytes do not match their xxh3-64"
    got, _ = await get(seeded.stub, keys)
    assert got == [blobs[0], blobs[1], None, blobs[3]]


@pytest.mark.asyncio
async def test_valid_duplicate_leaves_the_stored_block(seeded: Harness) -> None:
    before = await digest(seeded.stub, ALL_KEYS)
    results = await put(seeded.stub, [(BASE_KEYS[1], make_block(BASE_KEYS[1]))], 1000)
    assert [r.outcome for r in results] == [PRESENT]
    assert await digest(seeded.stub, ALL_KEYS) == before


def _good_then(*tail: pb.PutFrame) -> list[pb.PutFrame]:
    """Two complete valid new blocks, then ``tail``."""
    blocks = [(key_of(102), make_block(key_of(102))), (key_of(103), make_block(key_of(103)))]
    return [*frames_of(blocks, 100), *tail]


_BLOB = make_block(key_of(104), tokens=16)
# (case id, frames, status, message start) - every stream starts with two valid blocks.
BAD_STREAMS: list[tuple[str, list[pb.PutFrame], grpc.StatusCode, str]] = [
    (
        "continuation without a block",
        [pb.PutFrame(data=b"abc")],
        INVALID,
        "PutFrame.key: the first frame of a block must carry its key",
    ),
    (
        "new block before the last is complete",
        [
            pb.PutFrame(key=key_of(104), total_size=len(_BLOB), data=_BLOB[:10]),
            pb.PutFrame(key=key_of(105), total_size=len(_BLOB), data=_BLOB),
        ],
        INVALID,
        "PutFrame.key: block #3 started before block #2 was complete (10 of",
    ),
    (
        "more data than total_size in one frame",
        [pb.PutFrame(key=key_of(104), total_size=10, data=_BLOB[:11])],
        INVALID,
        "PutFrame.data: block #2 got 11 bytes, more than its total_size 10",
    ),
    (
        "more data than total_size across frames",
        [
            pb.PutFrame(key=key_of(104), total_size=len(_BLOB), data=_BLOB),
            pb.PutFrame(key=key_of(105), total_size=12, data=_BLOB[:10]),
            pb.PutFrame(data=_BLOB[:3]),
        ],
        INVALID,
        "PutFrame.data: block #3 got 13 bytes, more than its total_size 12",
    ),
    (
        "stream ends inside a block",
        [pb.PutFrame(key=key_of(104), total_size=len(_BLOB), data=_BLOB[:-1])],
        INVALID,
        "PutFrame.data: the stream ended inside block #2",
    ),
    (
        "short key",
        [pb.PutFrame(key=b"k" * 15, total_size=len(_BLOB), data=_BLOB)],
        INVALID,
        "PutFrame.key: block #2 key is 15 bytes, not 16",
    ),
    (
        "no total_size",
        [pb.PutFrame(key=key_of(104), data=_BLOB)],
        INVALID,
        "PutFrame.total_size: block #2 must give its size (> 0)",
    ),
    (
        "block over max_block_bytes",
        [pb.PutFrame(key=key_of(104), total_size=SMALL.max_block_bytes + 1, data=b"x")],
        EXHAUSTED,
        f"PutFrame.total_size: block #2 is {SMALL.max_block_bytes + 1} bytes, over max_block_bytes",
    ),
    (
        "stream over max_request_bytes",
        [
            # A complete block of max_block_bytes, then one more announced: over the 2 MiB.
            *frames_of([(key_of(104), bytes(SMALL.max_block_bytes))], 60_000),
            pb.PutFrame(key=key_of(105), total_size=SMALL.max_block_bytes, data=b"x"),
        ],
        EXHAUSTED,
        "PutFrame.total_size: the stream's blocks add up to",
    ),
    (
        "more blocks than max_keys_per_request",
        [
            f
            for i in range(SMALL.max_keys_per_request - 1)
            for f in frames_of([(key_of(200 + i), make_block(key_of(200 + i)))], 10_000)
        ],
        EXHAUSTED,
        "PutFrame.key: more than max_keys_per_request 64 blocks in one Put",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "tail", "code", "message"), BAD_STREAMS, ids=[c[0] for c in BAD_STREAMS]
)
async def test_bad_stream_aborts_and_stores_nothing(
    seeded: Harness, case: str, tail: list[pb.PutFrame], code: grpc.StatusCode, message: str
) -> None:
    before = await digest(seeded.stub, ALL_KEYS)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await seeded.stub.Put(stream(_good_then(*tail)))
    assert err.value.code() == code
    assert (err.value.details() or "").startswith(message), err.value.details()
    # The two valid blocks before the fault were not stored either.
    assert await digest(seeded.stub, ALL_KEYS) == before
    lookup = await seeded.stub.Lookup(pb.LookupRequest(keys=key_of(102) + key_of(103)))
    assert lookup.tiers == b"\x00\x00"


KeyCall = Callable[[Harness, bytes], object]
KEY_CALLS: dict[str, KeyCall] = {
    "LookupRequest.keys": lambda h, k: h.stub.Lookup(pb.LookupRequest(keys=k)),
    "GetRequest.keys": lambda h, k: get_all(h, k),
    "DeleteRequest.keys": lambda h, k: h.stub.Delete(pb.DeleteRequest(keys=k)),
}


async def get_all(h: Harness, packed: bytes) -> list[pb.GetFrame]:
    """Drain a Get stream of packed keys."""
    return [f async for f in h.stub.Get(pb.GetRequest(keys=packed))]


@pytest.mark.asyncio
@pytest.mark.parametrize("field", sorted(KEY_CALLS))
async def test_packed_keys_of_wrong_length_are_invalid(seeded: Harness, field: str) -> None:
    before = await digest(seeded.stub, ALL_KEYS)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await KEY_CALLS[field](seeded, BASE_KEYS[0] + b"\x01" * 5)  # type: ignore[misc]
    assert err.value.code() == INVALID
    assert err.value.details() == (f"{field}: 21 bytes is not a multiple of the 16-byte key")
    assert await digest(seeded.stub, ALL_KEYS) == before


@pytest.mark.asyncio
@pytest.mark.parametrize("field", sorted(KEY_CALLS))
async def test_too_many_keys_is_resource_exhausted(seeded: Harness, field: str) -> None:
    before = await digest(seeded.stub, ALL_KEYS)
    too_many = b"".join(BASE_KEYS) * 13  # 65 keys, over the limit of 64
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await KEY_CALLS[field](seeded, too_many)  # type: ignore[misc]
    assert err.value.code() == EXHAUSTED
    assert err.value.details() == f"{field}: 65 keys exceeds max_keys_per_request 64"
    assert await digest(seeded.stub, ALL_KEYS) == before
    method = field.split("Request")[0]
    assert rejected_count(seeded, method, "too_many_keys") == 1.0


@pytest.mark.asyncio
async def test_message_over_max_message_bytes_is_resource_exhausted(seeded: Harness) -> None:
    before = await digest(seeded.stub, ALL_KEYS)
    blob = make_block(key_of(106), tokens=300, head_dim=64)
    assert len(blob) > SMALL.max_message_bytes
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await put(seeded.stub, [(key_of(106), blob)], frame_bytes=len(blob))
    assert err.value.code() == EXHAUSTED
    assert await digest(seeded.stub, ALL_KEYS) == before


@pytest.mark.asyncio
async def test_block_larger_than_every_tier_is_rejected_in_the_reply() -> None:
    config = replace(SMALL, tiers=("cpu://?capacity=64KiB&page=4KiB&pinned=no",))
    async with serving(config) as h:
        small_key, big_key = key_of(107), key_of(108)
        small, big = make_block(small_key), make_block(big_key, tokens=300, head_dim=64)
        assert config.max_block_bytes > len(big) > 64 * 1024
        results = await put(h.stub, [(big_key, big), (small_key, small)], h.frame_bytes)
        assert [(r.outcome, r.code) for r in results] == [
            (REJECTED, EXHAUSTED.value[0]),
            (STORED, 0),
        ]
        assert results[0].reason == (
            f"blob: {len(big)} bytes exceeds the largest tier limit of 65536 bytes"
        )
        got, _ = await get(h.stub, [big_key, small_key])
        assert got == [None, small]
        assert rejected_count(h, "Put", "no_tier_fits") == 1.0
