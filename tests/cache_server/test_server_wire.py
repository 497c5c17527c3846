"""The wire contract's hand-written PutFrame/GetFrame codec (proto/frames.py) agrees with the generated protobuf
classes byte for byte, and malformed frames are refused with the field named."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nopecache.proto import cache_pb2 as pb
from nopecache.proto.frames import WireError, decode_put_frame, encode_get_frame
from nopecache.proto.wire import encode_varint
from tests.support.server_harness import SMALL, digest, key_of, make_block, serving

U32 = st.integers(min_value=0, max_value=2**32 - 1)
U64 = st.integers(min_value=0, max_value=2**64 - 1)
NAMES = st.lists(st.sampled_from(["cuda", "cpu", "redis", "x" * 200]), max_size=3)


@given(index=U32, tier=U32, total=U64, data=st.binary(max_size=300), names=NAMES)
def test_encode_get_frame_matches_protobuf(
    index: int, tier: int, total: int, data: bytes, names: list[str]
) -> None:
    expected = pb.GetFrame(
        index=index, tier=tier, total_size=total, data=data, tier_names=names
    ).SerializeToString()
    encoded = encode_get_frame(index, tier, total, memoryview(data), [n.encode() for n in names])
    assert encoded == expected


@given(key=st.binary(max_size=40), total=U64, data=st.binary(max_size=300))
def test_decode_put_frame_reads_protobuf(key: bytes, total: int, data: bytes) -> None:
    raw = pb.PutFrame(key=key, total_size=total, data=data).SerializeToString()
    got_key, got_total, got_data = decode_put_frame(raw)
    assert (got_key, got_total, bytes(got_data)) == (key, total, data)
    assert got_data.obj is raw  # a view into the message, not a copy


def test_decode_put_frame_skips_unknown_fields_and_keeps_the_last_value() -> None:
    known = pb.PutFrame(key=b"k" * 16, total_size=5, data=b"first").SerializeToString()
    unknown = (
        b"\x48"
        + encode_varint(300)  # field 9, varint
        + b"\x62\x03abc"  # field 12, bytes
        + b"\x69"
        + bytes(8)  # field 13, fixed64
        + b"\x75"
        + bytes(4)  # field 14, fixed32
    )
    later = pb.PutFrame(data=b"second").SerializeToString()
    key, total, data = decode_put_frame(known + unknown + later)
    assert (key, total, bytes(data)) == (b"k" * 16, 5, b"second")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x10\x80", "PutFrame.total_size: message ends inside a varint"),
        (b"\x10" + b"\xff" * 10 + b"\x01", "PutFrame.total_size: varint longer than 10 bytes"),
        (b"\x1a\x05abc", "PutFrame.data: length 5 runs past the end of the message"),
        (b"\x08\x01", "PutFrame.key: expected length-delimited bytes, got a varint"),
        (b"\x12\x01a", "PutFrame.total_size: expected a varint, got length-delimited bytes"),
        (b"\x0d\x00\x00\x00\x00", "PutFrame.key: unsupported wire type 5"),
        (b"\x4b", "PutFrame field 9: unsupported wire type 3"),
        (b"\x00", "PutFrame: field number 0 is invalid"),
        (b"\x49\x00", "PutFrame: the last field runs past the end of the message"),
    ],
)
def test_malformed_put_frames_name_the_field(raw: bytes, message: str) -> None:
    with pytest.raises(WireError) as err:
        decode_put_frame(raw)
    assert str(err.value) == message


@given(st.binary(max_size=64))
def test_garbage_is_a_wire_error_or_a_frame(raw: bytes) -> None:
    try:
        key, total, data = decode_put_frame(raw)
    except WireError:
        return
    assert isinstance(key, bytes) and total >= 0 and len(data) <= len(raw)


@pytest.mark.asyncio
async def test_garbage_frame_on_the_wire_is_invalid_argument() -> None:
    keys = [key_of(i) for i in range(3)]
    blob = make_block(keys[0])
    good = pb.PutFrame(key=keys[0], total_size=len(blob), data=blob).SerializeToString()

    async def frames() -> AsyncIterator[bytes]:
        yield good
        yield b"\x1a\x05abc"

    async with serving(SMALL) as h:
        before = await digest(h.stub, keys)
        put = h.channel.stream_unary(
            "/nopecache.v1.KVCache/Put",
            request_serializer=None,
            response_deserializer=pb.PutReply.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await put(frames())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "PutFrame.data: length 5 runs past the end of the message"
        assert await digest(h.stub, keys) == before
