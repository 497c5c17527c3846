"""Hits placed together (``paged_part`` + ``place_parts``, what a fetch into a CPU cache does
with blocks that arrived together) leave exactly the bytes ``place_paged`` leaves placing
them one by one, in contiguous caches and in vLLM's CPU pages (strided views)."""

from __future__ import annotations

import pytest
import torch

from nopecache.client.chunking import ChunkSpan, token_array
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import BlockKey
from nopecache.client.placement import PagedKV, decode_for_hit, paged_part, place_paged, place_parts
from nopecache.client.plan import Hit, HitKind
from nopecache.kernels import RopeSpec
from nopecache.proto.block import DecodedBlock, StoredForm, encode_block

LAYERS, HEADS, DIM = 3, 2, 64
SPEC = RopeSpec.default(DIM, theta=100000.0)
BLOCK, BLOCKS = 8, 10
PROMPT = list(range(1000, 1060))


def _fingerprint(form: StoredForm, dtype: torch.dtype) -> ModelFingerprint:
    return ModelFingerprint.from_rope_spec(
        model="tiny",
        revision="r",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=dtype,
        form=form,
        rope=SPEC,
    )


def _decoded(
    form: StoredForm,
    target: tuple[int, int],
    source: tuple[int, int],
    positions: list[int] | None,
    dtype: torch.dtype,
    seed: int,
) -> tuple[DecodedBlock, Hit]:
    """A block whose tokens ``source`` land at ``target`` of PROMPT, and its hit."""
    key = BlockKey(bytes([seed] * 16))
    kind = HitKind.PREFIX if form is StoredForm.ROPE and positions else HitKind.POSITION_INDEPENDENT
    hit = Hit(key, ChunkSpan(*target), ChunkSpan(*source), form, kind)
    tokens = source[1]
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(LAYERS, tokens, HEADS, DIM, generator=g).to(dtype) for _ in range(2))
    fp = _fingerprint(form, dtype)
    blob = encode_block(
        key=key.value,
        fingerprint=fp.to_bytes(),
        form=form,
        k=k,
        v=v,
        token_ids=PROMPT[target[0] - source[0] : target[1]],
        source_positions=positions,
    )
    return decode_for_hit(blob, hit, token_array(PROMPT), fp, DIM), hit


def _hits(dtype: torch.dtype) -> list[tuple[DecodedBlock, Hit]]:
    """Nope hits side by side (one with context before its source), post-RoPE hits moved
    by a consecutive and a scattered source, one at its own positions, one with no slot."""
    return [
        _decoded(StoredForm.NOPE, (11, 20), (0, 9), None, dtype, 1),
        _decoded(StoredForm.NOPE, (20, 27), (3, 10), None, dtype, 2),
        _decoded(StoredForm.NOPE, (3, 6), (0, 3), None, dtype, 3),
        _decoded(StoredForm.ROPE, (27, 33), (0, 6), list(range(200, 206)), dtype, 4),
        _decoded(StoredForm.ROPE, (40, 44), (0, 4), [7, 3, 90, 12], dtype, 5),
        _decoded(StoredForm.ROPE, (33, 38), (0, 5), list(range(33, 38)), dtype, 6),
        _decoded(StoredForm.NOPE, (0, 3), (0, 3), None, dtype, 7),
    ]


def _slots() -> list[int]:
    """Slots of PROMPT's positions: pages in a shuffled order, position 0..2 and 38..39
    not written (an engine's own prefix, an unclaimed gap), one hole inside a hit."""
    table = [7, 2, 9, 0, 4, 1, 8, 3]
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(PROMPT))]
    for p in (0, 1, 2, 38, 39, 15):
        slots[p] = -1
    return slots


def _cache(dtype: torch.dtype, strided: bool) -> PagedKV:
    def pages() -> torch.Tensor:
        if not strided:
            return torch.full((BLOCKS, BLOCK, HEADS, DIM), -7.0, dtype=dtype)
        page = torch.full((BLOCKS, HEADS, BLOCK, DIM), -7.0, dtype=dtype)
        s_block, s_head = page.stride(0), page.stride(1)
        return page.as_strided((BLOCKS, BLOCK, HEADS, DIM), (s_block, 1, s_head, BLOCK))

    return PagedKV(
        [pages() for _ in range(LAYERS)],
        [pages() for _ in range(LAYERS)],
        torch.tensor(_slots(), dtype=torch.int64),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "cpu-pages"])
def test_hits_placed_together_equal_hits_placed_one_by_one(
    dtype: torch.dtype, strided: bool
) -> None:
    hits = _hits(dtype)
    one_by_one, together = _cache(dtype, strided), _cache(dtype, strided)
    for block, hit in hits:
        place_paged(block, hit, one_by_one, SPEC)
    parts = [paged_part(block, hit, together) for block, hit in hits]
    assert parts[-1] is None  # the hit whose positions the engine holds: nothing to place
    place_parts([p for p in parts if p is not None], together, SPEC)
    assert one_by_one.v_caches is not None and together.v_caches is not None
    for layer in range(LAYERS):
        assert torch.equal(together.k_caches[layer], one_by_one.k_caches[layer])
        assert torch.equal(together.v_caches[layer], one_by_one.v_caches[layer])
    # Something was written, and the slots of no hit were not.
    written = one_by_one.k_caches[0].reshape(-1, HEADS, DIM).ne(-7.0).any(-1).any(-1)
    assert int(written.sum()) == 9 + 7 + 3 + 6 + 4 + 5 - 1
