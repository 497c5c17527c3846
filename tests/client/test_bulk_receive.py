"""The bulk stream's receiver hashes a block's payload as it lands and verification
compares that digest: an intact block is placed, one corrupted in transit never is, and a
pooled buffer never carries a digest into its next block. Real sockets (a socketpair),
real encoded blocks, the client's real placer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nopecache.client import bulk
from nopecache.client.buffers import BufferPool, note_payload_xxh3, payload_xxh3
from nopecache.client.chunking import ChunkSpan, token_array
from nopecache.client.fetching import BlockPlacer
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import BlockKey
from nopecache.client.metrics import ClientMetrics
from nopecache.client.placement import PagedKV
from nopecache.client.plan import Hit, HitKind
from nopecache.kernels import RopeSpec
from nopecache.proto.block import (
    BlockChecksumError,
    BlockHeaderError,
    StoredForm,
    decode_block,
    encode_block,
    parse,
)
from nopecache.proto.bulk import ENTRY

LAYERS, TOKENS, HEADS, DIM = 2, 4, 2, 8
SPEC = RopeSpec.default(DIM)
KEY = BlockKey(bytes(range(16)))
PROMPT = [11, 12, 13, 14]
SENTINEL = -7.0
# Only a guard against a hang: a few hundred bytes cross a socketpair in microseconds.
DEADLINE_S = 120.0


def _fingerprint() -> ModelFingerprint:
    return ModelFingerprint.from_rope_spec(
        model="tiny",
        revision="r",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=torch.float32,
        form=StoredForm.ROPE,
        rope=SPEC,
    )


def _kv() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shape = (LAYERS, TOKENS, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _blob(k: torch.Tensor, v: torch.Tensor) -> bytes:
    return encode_block(
        key=KEY.value,
        fingerprint=_fingerprint().to_bytes(),
        form=StoredForm.ROPE,
        k=k,
        v=v,
        token_ids=PROMPT,
        source_positions=list(range(TOKENS)),
    )


def _received(data: bytes, pool: BufferPool) -> memoryview:
    """``data`` sent as one bulk GET entry and received by the client's ``_receive``."""
    a, b = bulk.socket.socketpair()
    sender = threading.Thread(target=a.sendall, args=(ENTRY.pack(1, len(data)) + data,))
    sender.start()
    try:
        view = bulk._receive(b, pool, 1, len(data), 0, time.monotonic() + DEADLINE_S)
    finally:
        sender.join()
        a.close()
        b.close()
    assert view is not None
    return view


def _placer(metrics: ClientMetrics) -> BlockPlacer:
    fp = _fingerprint()
    return BlockPlacer(fp, fp, SPEC, DIM, metrics)


def _paged() -> PagedKV:
    shape = (2, 4, HEADS, DIM)  # 8 slots, 4 of them written
    return PagedKV(
        [torch.full(shape, SENTINEL) for _ in range(LAYERS)],
        [torch.full(shape, SENTINEL) for _ in range(LAYERS)],
        torch.tensor([4, 5, 6, 7], dtype=torch.int64),
    )


def _place(view: memoryview, paged: PagedKV, metrics: ClientMetrics) -> bool:
    hit = Hit(KEY, ChunkSpan(0, TOKENS), ChunkSpan(0, TOKENS), StoredForm.ROPE, HitKind.PREFIX)
    return _placer(metrics).place(view, [hit], token_array(PROMPT), paged, None, threading.Event())


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pieces of 100 bytes: the 256-byte payload arrives and is hashed in three, the last
    # one short (what a block of many MiB does with HASH_PIECE).
    monkeypatch.setattr(bulk, "HASH_PIECE", 100)


def test_an_intact_block_is_hashed_as_it_lands_and_placed() -> None:
    k, v = _kv()
    blob = _blob(k, v)
    view = _received(blob, BufferPool())
    assert bytes(view) == blob
    assert payload_xxh3(view) == parse(blob)[0].checksum
    paged, metrics = _paged(), ClientMetrics()
    assert _place(view, paged, metrics)
    for layer in range(LAYERS):
        assert torch.equal(paged.k_caches[layer][1], k[layer])
        assert torch.equal(paged.v_caches[layer][1], v[layer])  # type: ignore[index]
        assert bool((paged.k_caches[layer][0] == SENTINEL).all())
    assert metrics.snapshot().verify_failures == 0


@pytest.mark.parametrize("at", [0, 99, 100, 255], ids=["first", "piece-end", "piece-2", "last"])
def test_a_payload_byte_flipped_in_transit_is_never_placed(at: int) -> None:
    k, v = _kv()
    blob = bytearray(_blob(k, v))
    start = len(blob) - 2 * LAYERS * TOKENS * HEADS * DIM * 4
    blob[start + at] ^= 0x10  # the header (and its checksum) intact: only the payload lies
    view = _received(bytes(blob), BufferPool())
    assert payload_xxh3(view) != parse(blob)[0].checksum
    with pytest.raises(BlockChecksumError, match=r"^checksum: payload bytes"):
        decode_block(view, payload_xxh3=payload_xxh3(view))
    paged, metrics = _paged(), ClientMetrics()
    assert not _place(view, paged, metrics)
    for caches in (paged.k_caches, paged.v_caches):
        assert caches is not None
        assert all(bool((c == SENTINEL).all()) for c in caches)  # not one byte written
    assert metrics.snapshot().verify_failures == 1


def test_verification_compares_the_digest_noted_at_receipt() -> None:
    # The bytes are intact but the digest noted on the buffer is not theirs: the block
    # fails, so the placer used the receiver's digest rather than reading the payload.
    k, v = _kv()
    blob = _blob(k, v)
    view = _received(blob, BufferPool())
    digest = payload_xxh3(view)
    assert digest is not None
    note_payload_xxh3(view, digest ^ 1)
    paged, metrics = _paged(), ClientMetrics()
    assert not _place(view, paged, metrics)
    assert metrics.snapshot().verify_failures == 1


def test_a_reused_buffer_forgets_its_digest() -> None:
    pool = BufferPool()
    k, v = _kv()
    view = _received(_blob(k, v), pool)
    assert payload_xxh3(view) is not None
    assert payload_xxh3(view[:-1]) is None  # a view of another length: not the one received
    buffer = view.obj
    pool.give(view)
    again = pool.take(view.nbytes)
    assert again.obj is buffer  # the same memory, reused
    assert payload_xxh3(again) is None
    assert payload_xxh3(memoryview(bytearray(view.nbytes))) is None  # not a pooled buffer


def test_bytes_that_are_not_a_block_arrive_whole_without_a_digest() -> None:
    data = bytes(range(256)) * 2
    view = _received(data, BufferPool())
    assert bytes(view) == data
    assert payload_xxh3(view) is None
    with pytest.raises(BlockHeaderError, match=r"^magic: "):
        decode_block(view)
