"""The wire contract's frame codecs and GetFrame assembler (proto/frames.py): byte-identical
to the generated protobuf classes, views instead of copies, and every broken stream a
WireError naming what broke."""

from __future__ import annotations

import pytest

from nopecache.client.buffers import BufferPool
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.frames import (
    GetEntry,
    GetFrameAssembler,
    WireError,
    decode_get_frame,
    encode_get_frame,
    encode_put_frame,
)

KEY = bytes(range(16))


@pytest.mark.parametrize(
    ("key", "total", "data"),
    [(KEY, 70000, b"x" * 300), (b"", 0, b"abc" * 1000), (KEY, 5, b"")],
)
def test_put_frames_are_the_protobuf_encoding(key: bytes, total: int, data: bytes) -> None:
    encoded = encode_put_frame(key, total, memoryview(data))
    assert encoded == pb.PutFrame(key=key, total_size=total, data=data).SerializeToString()


def test_get_frames_with_shm_fields_are_the_protobuf_encoding() -> None:
    for args, shm in (
        ((3, 1, 4096, b"", [b"cpu"]), (8192, 4096)),
        ((0, 2, 70, b"", []), (4160, 70)),
    ):
        want = pb.GetFrame(
            index=args[0],
            tier=args[1],
            total_size=args[2],
            tier_names=[n.decode() for n in args[4]],
            shm_offset=shm[0],
            shm_length=shm[1],
        ).SerializeToString()
        assert encode_get_frame(*args, shm) == want


def test_get_frames_decode_like_protobuf_and_view_the_message() -> None:
    raw = pb.GetFrame(
        index=300, tier=2, total_size=1 << 33, data=b"payload", tier_names=["cpu", "redis"]
    ).SerializeToString()
    frame = decode_get_frame(raw)
    assert (frame.index, frame.tier, frame.total_size, bytes(frame.data)) == (
        300,
        2,
        1 << 33,
        b"payload",
    )
    assert frame.data.obj is raw  # a view, not a copy
    small = decode_get_frame(pb.GetFrame(index=4).SerializeToString())
    assert (small.index, small.tier, small.total_size) == (4, 0, 0)
    shm = decode_get_frame(pb.GetFrame(tier=1, shm_offset=8192, shm_length=70).SerializeToString())
    assert (shm.shm_offset, shm.shm_length, shm.data.nbytes) == (8192, 70, 0)
    # Unknown (reserved) fields are skipped as protobuf does.
    assert decode_get_frame(b"\x08\x01" + b"\x50\x05" + b"\x22\x01z").index == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x08", "GetFrame field 1: message ends inside a varint"),
        (b"\x22\x05ab", "GetFrame field 4: length runs past the message"),
        (b"\x08\x01\x23", "GetFrame field 4: unsupported wire type 3"),
        (b"\x0a\x01x", "GetFrame field 1: expected a varint, got bytes"),
        (b"\x42\x01x", "GetFrame field 8: expected a varint, got bytes"),
        (b"\x00\x01", "GetFrame: field number 0 is invalid"),
    ],
)
def test_malformed_get_frames_are_wire_errors(raw: bytes, message: str) -> None:
    with pytest.raises(WireError) as err:
        decode_get_frame(raw)
    assert str(err.value) == message


def frame(**fields: object) -> bytes:
    return pb.GetFrame(**fields).SerializeToString()  # type: ignore[arg-type]


def test_assembler_yields_misses_views_shm_blocks_and_pooled_reassemblies() -> None:
    pool = BufferPool()
    frames = GetFrameAssembler(4, pool.take)
    single = frame(index=1, tier=1, total_size=3, data=b"abc")
    got = [
        frames.feed(frame(index=0, tier_names=["cpu"])),
        frames.feed(single),
        frames.feed(frame(index=2, tier=1, total_size=5, shm_offset=4096, shm_length=5)),
        frames.feed(frame(index=3, tier=1, total_size=6, data=b"xyz")),
        frames.feed(frame(index=3, data=b"uvw")),
    ]
    frames.finish()
    assert got[0] == GetEntry(0, None)
    assert got[1] is not None and got[1].blob is not None and got[1].blob.obj is single
    assert got[2] == GetEntry(2, None, 4096, 5)
    assert got[3] is None  # block 3 still arriving
    last = got[4]
    assert last is not None and last.index == 3 and last.blob is not None
    assert bytes(last.blob) == b"xyzuvw"
    pool.give(last.blob)
    assert pool.pooled_bytes == 1024 * 1024  # the reassembly buffer came from the pool


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        ([frame(index=1)], "GetFrame.index: got 1, expected 0"),
        ([frame(index=0, data=b"x")], "GetFrame: miss of key 0 carries data"),
        ([frame(index=0, tier=1, total_size=2, data=b"xyz")], "GetFrame.total_size: 2 for"),
        ([frame(index=0, tier=1, total_size=9)], "neither data nor shm_length"),
        (
            [frame(index=0, tier=1, total_size=9, shm_offset=4096, shm_length=8)],
            "GetFrame.shm_length: 8 for a block of 9 bytes",
        ),
        (
            [frame(index=0, tier=1, total_size=4, data=b"ab"), frame(index=1, data=b"cd")],
            "GetFrame: expected more of block 0, got index 1",
        ),
        (
            [frame(index=0, tier=1, total_size=4, data=b"ab"), frame(index=0, data=b"cde")],
            "GetFrame: expected more of block 0",
        ),
        ([frame(index=0, tier=1, total_size=4, data=b"ab")], "Get stream ended after 0 of 2"),
        ([frame(index=0)], "Get stream ended after 1 of 2 keys"),
    ],
)
def test_assembler_refuses_broken_streams(stream: list[bytes], message: str) -> None:
    frames = GetFrameAssembler(2, BufferPool().take)
    with pytest.raises(WireError, match=message):
        for raw in stream:
            frames.feed(raw)
        frames.finish()


def test_pool_warm_prefaults_buffers_a_take_then_reuses() -> None:
    pool = BufferPool(max_bytes=3 * 1024 * 1024)
    assert pool.warm(1_500_000, 2) == 1  # a second 2 MiB buffer would pass max_bytes
    assert pool.pooled_bytes == 2 * 1024 * 1024
    view = pool.take(2_000_000)
    assert pool.pooled_bytes == 0 and view.nbytes == 2_000_000
