"""Block keys: pinned vectors, domain separation, and a different key for any difference."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from nopecache.client import (
    BlockKey,
    ChunkSpan,
    ContentChunker,
    FixedChunker,
    InvalidArgumentError,
    KeyedChunk,
    ModelFingerprint,
    content_chunks,
    content_key,
    prefix_chunks,
    prefix_key,
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

# Checked-in vectors: a change orphans every stored block, so it must be deliberate.
PINNED = {
    "content [1,2,3]": "cb03daff9dd5051db80559842b2fffb8",
    "content [1,2,3] tenant-a": "3d0a5589a37197fe4d25006887c0e2e7",
    "content [1,2,3] rope form": "051e0228016c8786d9d75b0a09ca47a0",
    "prefix 0..16": "7a6fa85da9254f000fe41d78818052fd",
    "prefix 16..32": "c266b901f8c9cf0d1a041cda8e303a7d",
}

PINNED_SCRIPT = """
from nopecache.client import ModelFingerprint, content_key, prefix_key
from nopecache.proto.block import StoredForm
def fp(form):
    return ModelFingerprint("HuggingFaceTB/SmolLM2-135M", "main", 30, 3, 64, "bfloat16",
                            form, bytes(range(16)))
first = prefix_key(fp(StoredForm.NOPE), "", list(range(16)), None)
print(content_key(fp(StoredForm.NOPE), "", [1, 2, 3]).hex())
print(content_key(fp(StoredForm.NOPE), "tenant-a", [1, 2, 3]).hex())
print(content_key(fp(StoredForm.ROPE), "", [1, 2, 3]).hex())
print(first.hex())
print(prefix_key(fp(StoredForm.NOPE), "", list(range(16, 32)), first).hex())
"""


def test_keys_match_the_pinned_vectors() -> None:
    first = prefix_key(FP, "", list(range(16)), None)
    got = {
        "content [1,2,3]": content_key(FP, "", [1, 2, 3]).hex(),
        "content [1,2,3] tenant-a": content_key(FP, "tenant-a", [1, 2, 3]).hex(),
        "content [1,2,3] rope form": content_key(
            dataclasses.replace(FP, form=StoredForm.ROPE), "", [1, 2, 3]
        ).hex(),
        "prefix 0..16": first.hex(),
        "prefix 16..32": prefix_key(FP, "", list(range(16, 32)), first).hex(),
    }
    assert got == PINNED


def test_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", PINNED_SCRIPT], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == list(PINNED.values())


def test_content_key_hashes_the_documented_encoding() -> None:
    tokens = [5, 70_000, 2**32 - 1]
    encoded = (
        b"nopecache.key\x00"
        + bytes([1, 1])  # version, kind = content
        + FP.digest()
        + (6).to_bytes(4, "little")
        + b"tenant"
        + (3).to_bytes(4, "little")
        + b"".join(t.to_bytes(4, "little") for t in tokens)
    )
    assert bytes(content_key(FP, "tenant", tokens)) == xxhash.xxh3_128_digest(encoded)


def test_prefix_key_hashes_the_documented_encoding() -> None:
    parent = BlockKey(bytes(range(100, 116)))
    tokens = [9, 8]
    body = (2).to_bytes(4, "little") + b"".join(t.to_bytes(4, "little") for t in tokens)
    head = b"nopecache.key\x00" + bytes([1, 2]) + FP.digest() + (0).to_bytes(4, "little")
    assert bytes(prefix_key(FP, "", tokens, None)) == xxhash.xxh3_128_digest(head + b"\x00" + body)
    assert bytes(prefix_key(FP, b"", tokens, parent)) == xxhash.xxh3_128_digest(
        head + b"\x01" + bytes(parent) + body
    )


# ---------------------------------------------------------------- BlockKey


def test_block_key_round_trips_and_orders() -> None:
    key = BlockKey(bytes.fromhex("00112233445566778899aabbccddeeff"))
    assert key.hex() == "00112233445566778899aabbccddeeff"
    assert BlockKey.from_hex(key.hex()) == key
    assert BlockKey(bytes(key)) == key
    assert BlockKey(bytearray(bytes(key))) == key  # type: ignore[arg-type]
    assert repr(key) == "BlockKey(00112233445566778899aabbccddeeff)"
    low, high = BlockKey(bytes(16)), BlockKey(b"\xff" * 16)
    assert sorted([high, key, low]) == [low, key, high]
    assert len({key, BlockKey(bytes(key)), low}) == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [(b"\x00" * 15, "must be 16 bytes, got 15"), ("00" * 16, "must be bytes, got str")],
)
def test_block_key_rejects_wrong_values(value: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"^BlockKey.value: {message}"):
        BlockKey(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["00" * 15, "zz" * 16, "00" * 17])
def test_block_key_from_hex_rejects_bad_text(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^text: "):
        BlockKey.from_hex(text)


# ---------------------------------------------------------------- separation


def test_content_and_prefix_keys_never_coincide() -> None:
    tokens = list(range(16))
    assert content_key(FP, "", tokens) != prefix_key(FP, "", tokens, None)
    # Not even when the content tokens spell out a prefix key's parent link.
    parent = prefix_key(FP, "", tokens, None)
    assert content_key(FP, "", tokens) != prefix_key(FP, "", tokens, parent)


def test_namespace_str_is_its_utf8_bytes() -> None:
    assert content_key(FP, "tenant-é", [1]) == content_key(FP, "tenant-é".encode(), [1])
    assert content_key(FP, "", [1]) != content_key(FP, "x", [1])


def test_token_containers_give_the_same_key() -> None:
    ids = [3, 1, 4, 1, 5]
    expected = content_key(FP, "", ids)
    for same in (tuple(ids), np.array(ids), np.array(ids, dtype="<u4"), torch.tensor(ids)):
        assert content_key(FP, "", same) == expected


VARIANTS: dict[str, object] = {
    "model": "other-model",
    "revision": "v2",
    "dtype": "float16",
    "form": StoredForm.ROPE,
    "num_layers": 29,
    "num_kv_heads": 6,
    "head_dim": 32,
    "rope_digest": bytes(16),
}


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    field=st.sampled_from(sorted(VARIANTS)),
    namespace=st.text(max_size=8),
)
def test_any_fingerprint_field_changes_both_keys(
    tokens: list[int], field: str, namespace: str
) -> None:
    other = dataclasses.replace(FP, **{field: VARIANTS[field]})  # type: ignore[arg-type]
    assert content_key(FP, namespace, tokens) != content_key(other, namespace, tokens)
    assert prefix_key(FP, namespace, tokens, None) != prefix_key(other, namespace, tokens, None)


@given(
    a=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    b=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    ns_a=st.one_of(st.text(max_size=6), st.binary(max_size=6)),
    ns_b=st.one_of(st.text(max_size=6), st.binary(max_size=6)),
)
def test_keys_are_equal_exactly_when_tokens_and_namespace_are(
    a: list[int], b: list[int], ns_a: str | bytes, ns_b: str | bytes
) -> None:
    def raw(ns: str | bytes) -> bytes:
        return ns.encode() if isinstance(ns, str) else ns

    same = a == b and raw(ns_a) == raw(ns_b)
    assert (content_key(FP, ns_a, a) == content_key(FP, ns_b, b)) == same
    assert (prefix_key(FP, ns_a, a, None) == prefix_key(FP, ns_b, b, None)) == same


# ---------------------------------------------------------------- batches


def test_content_chunks_key_each_span_by_its_tokens_alone() -> None:
    tokens = np.random.default_rng(0).integers(0, 50_000, 300)
    spans = ContentChunker().split(tokens)
    chunks = content_chunks(FP, "t", tokens, spans)
    assert [c.span for c in chunks] == spans
    assert chunks == [KeyedChunk(s, content_key(FP, "t", tokens[s.start : s.end])) for s in spans]
    # The same content at another offset of another prompt keeps its key.
    moved = np.concatenate([[1, 2, 3], tokens])
    s = spans[1]
    assert content_key(FP, "t", moved[s.start + 3 : s.end + 3]) == chunks[1].key


def test_prefix_chunks_form_a_parent_chain() -> None:
    tokens = list(range(1000, 1040))
    spans = FixedChunker(16).split(tokens)
    chain = prefix_chunks(FP, "", tokens, spans)
    first = prefix_key(FP, "", tokens[0:16], None)
    assert chain == [
        KeyedChunk(ChunkSpan(0, 16), first),
        KeyedChunk(ChunkSpan(16, 32), prefix_key(FP, "", tokens[16:32], first)),
    ]
    # A different earlier block changes every later key, unlike a content key.
    changed = [7, *tokens[1:]]
    later = prefix_chunks(FP, "", changed, spans)
    assert later[1].key != chain[1].key
    assert content_key(FP, "", changed[16:32]) == content_key(FP, "", tokens[16:32])


def test_prefix_chunks_must_tile_from_zero() -> None:
    tokens = list(range(40))
    with pytest.raises(InvalidArgumentError, match=r"^spans: a prefix chain must be contiguous"):
        prefix_chunks(FP, "", tokens, [ChunkSpan(16, 32)])
    with pytest.raises(InvalidArgumentError, match=r"^spans: .* ends past the 40 tokens"):
        content_chunks(FP, "", tokens, [ChunkSpan(30, 41)])


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: content_key(FP, "", []), "tokens"),
        (lambda: content_key(FP, "", [-1]), "tokens"),
        (lambda: content_key(FP, 7, [1]), "namespace"),  # type: ignore[arg-type]
        (lambda: content_key("fp", "", [1]), "fingerprint"),  # type: ignore[arg-type]
        (lambda: prefix_key(FP, "", [1], b"\x00" * 16), "parent"),  # type: ignore[arg-type]
        (lambda: prefix_key(FP, "", [], None), "tokens"),
        (lambda: content_chunks(FP, "", [1, 2], [(0, 1)]), "spans"),  # type: ignore[list-item]
    ],
)
def test_bad_arguments_raise_naming_the_argument(call: object, argument: str) -> None:
    assert callable(call)
    with pytest.raises(InvalidArgumentError) as err:
        call()
    assert err.value.argument == argument


def test_engine_page_keys_are_their_own_domain() -> None:
    """An engine's page hash keys a block apart from content and prefix keys, per
    fingerprint and namespace; str and its UTF-8 bytes are one hash."""
    from nopecache.client.keys import engine_page_key

    key = engine_page_key(FP, "", "abc")
    assert key == engine_page_key(FP, "", b"abc")
    assert key != engine_page_key(FP, "t", "abc")
    assert key != engine_page_key(dataclasses.replace(FP, model="other"), "", "abc")
    assert key != engine_page_key(FP, "", "abd")
    assert key not in {content_key(FP, "", [97, 98, 99]), prefix_key(FP, "", [97, 98, 99], None)}
    with pytest.raises(InvalidArgumentError, match="page_hash"):
        engine_page_key(FP, "", "")
