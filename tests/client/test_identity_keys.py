"""Keys fold in what beside the tokens shapes KV (InputIdentity): adapters, salts, images."""

from __future__ import annotations

import struct

import pytest
import xxhash

from nopecache.client import (
    ChunkSpan,
    InputFeature,
    InputIdentity,
    InvalidArgumentError,
    ModelFingerprint,
    content_chunks,
    prefix_chunks,
)
from nopecache.proto.block import StoredForm

FP = ModelFingerprint(
    model="HuggingFaceTB/SmolLM2-135M",
    revision="main",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    dtype="bfloat16",
    form=StoredForm.NOPE,
    rope_digest=bytes(range(16)),
)
TOKENS = list(range(100, 132))  # 32 tokens
SPANS = [ChunkSpan(0, 16), ChunkSpan(16, 32)]
IMAGE_A = InputFeature(4, 12, "mm", b"image-a")
IMAGE_B = InputFeature(4, 12, "mm", b"image-b")


def _content(identity: InputIdentity | None, spans: list[ChunkSpan] = SPANS) -> list[bytes]:
    return [bytes(c.key) for c in content_chunks(FP, "", TOKENS, spans, identity)]


def _prefix(identity: InputIdentity | None) -> list[bytes]:
    return [bytes(c.key) for c in prefix_chunks(FP, "", TOKENS, SPANS, identity)]


def test_an_empty_identity_keys_as_plain_text() -> None:
    assert _content(InputIdentity()) == _content(None)
    assert _prefix(InputIdentity()) == _prefix(None)


def test_request_bytes_change_every_block() -> None:
    adapter_a, adapter_b = InputIdentity(b"lora-a"), InputIdentity(b"lora-b")
    for keys in (_content, _prefix):
        plain, a, b = keys(None), keys(adapter_a), keys(adapter_b)
        for i in range(2):
            assert len({plain[i], a[i], b[i]}) == 3


def test_an_image_changes_the_blocks_it_overlaps_and_the_chain_after_it() -> None:
    a, b = InputIdentity(features=(IMAGE_A,)), InputIdentity(features=(IMAGE_B,))
    plain_c, a_c, b_c = _content(None), _content(a), _content(b)
    assert len({plain_c[0], a_c[0], b_c[0]}) == 3  # the block with the image
    assert plain_c[1] == a_c[1] == b_c[1]  # a content block without it is plain text
    plain_p, a_p, b_p = _prefix(None), _prefix(a), _prefix(b)
    assert len({plain_p[0], a_p[0], b_p[0]}) == 3
    assert len({plain_p[1], a_p[1], b_p[1]}) == 3  # chained after the image


def test_an_image_at_another_place_in_the_block_is_another_key() -> None:
    moved = InputIdentity(features=(InputFeature(5, 13, "mm", b"image-a"),))
    assert _content(moved)[0] != _content(InputIdentity(features=(IMAGE_A,)))[0]


def test_content_keys_of_a_moved_chunk_with_its_image_are_equal() -> None:
    """Offsets are relative to the chunk: the same image in the same chunk elsewhere in a
    prompt is the same block."""
    here = content_chunks(
        FP, "", TOKENS[:16], [ChunkSpan(0, 16)], InputIdentity(features=(IMAGE_A,))
    )
    moved_tokens = [7] * 40 + TOKENS[:16]
    moved_image = InputFeature(44, 52, "mm", b"image-a")
    there = content_chunks(
        FP, "", moved_tokens, [ChunkSpan(40, 56)], InputIdentity(features=(moved_image,))
    )
    assert here[0].key == there[0].key


def test_a_chunk_holding_part_of_an_image_is_keyed_by_the_whole_image() -> None:
    spanning = InputFeature(10, 20, "mm", b"image-a")
    other = InputFeature(10, 20, "mm", b"image-b")
    first_a = _content(InputIdentity(features=(spanning,)))
    first_b = _content(InputIdentity(features=(other,)))
    assert first_a[0] != first_b[0] and first_a[1] != first_b[1]


def test_identified_keys_hash_the_documented_encoding() -> None:
    identity = InputIdentity(b"req", (IMAGE_A,))
    tokens = TOKENS[:16]
    span_bytes = (
        struct.pack("<I", 3)
        + b"req"
        + struct.pack("<I", 1)
        + bytes([2])
        + b"mm"
        + struct.pack("<I", 7)
        + b"image-a"
        + struct.pack("<qI", 4, 8)
    )
    assert identity.span_bytes(0, 16) == span_bytes
    encoded = (
        b"nopecache.key\x00"
        + bytes([1, 4])  # version, kind = content with identity
        + FP.digest()
        + (0).to_bytes(4, "little")
        + (16).to_bytes(4, "little")
        + b"".join(t.to_bytes(4, "little") for t in tokens)
        + span_bytes
    )
    (chunk,) = content_chunks(FP, "", tokens, [ChunkSpan(0, 16)], identity)
    assert bytes(chunk.key) == xxhash.xxh3_128_digest(encoded)


def test_features_are_order_free_and_validated() -> None:
    other = InputFeature(20, 24, "prompt_embeds", b"\x01" * 32)
    assert InputIdentity(features=(other, IMAGE_A)) == InputIdentity(features=(IMAGE_A, other))
    with pytest.raises(InvalidArgumentError, match="end"):
        InputFeature(4, 4, "mm", b"x")
    with pytest.raises(InvalidArgumentError, match="digest"):
        InputFeature(0, 4, "mm", b"")
    with pytest.raises(InvalidArgumentError, match="features"):
        InputIdentity(features=("image",))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="identity"):
        content_chunks(FP, "", TOKENS, SPANS, b"lora")  # type: ignore[arg-type]
