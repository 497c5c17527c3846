"""The CPU scatter's batched paths against one-layer, one-row-at-a-time placement.

``rerope_scatter_layers`` rotates every layer of a chunk at once and writes strided caches
(vLLM's CPU pages) in slice copies per run of consecutive slots. Both must put exactly the
bytes the plain path puts: ``rotate_reference`` per layer (one layer per call), then one
indexed assignment per token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nopecache.kernels import RopeSpec, api, reference
from nopecache.kernels.reference import rotate_reference
from nopecache.kernels.rope_spec import Layout

SPECS = {
    "full": RopeSpec.default(head_dim=64, theta=100000.0),
    "partial": RopeSpec.default(head_dim=40, rotary_dim=20),
    "mla": RopeSpec.mla(kv_lora_rank=24, qk_rope_head_dim=16),
}
BLOCK = 8
BLOCKS = 12
HEADS = 3
LAYERS = 3


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _pages(dim: int, dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """One layer's K (or V) pages ``[BLOCKS, BLOCK, HEADS, dim]``: contiguous, or vLLM's
    CPU page layout (K transposed per (block, head) page: a strided view)."""
    if not strided:
        return torch.zeros(BLOCKS, BLOCK, HEADS, dim, dtype=dtype)
    page = torch.zeros(BLOCKS, HEADS, BLOCK, dim, dtype=dtype)
    s_block, s_head = page.stride(0), page.stride(1)
    return page.as_strided((BLOCKS, BLOCK, HEADS, dim), (s_block, 1, s_head, BLOCK))


SLOTS = {
    # one run of consecutive slots
    "run": list(range(9, 30)),
    # whole blocks in a shuffled order (a block table)
    "blocks": [s for b in (7, 2, 9) for s in range(b * BLOCK, b * BLOCK + BLOCK)],
    # runs across block boundaries, with skipped positions inside
    "runs": [5, 6, 7, *range(8, 16), -1, *range(30, 40), 50, 51, 52, 53, -1],
    # one token per run: the indexed assignment
    "scattered": [17, 3, 44, 0, 29, 11, 38],
}


@pytest.mark.parametrize("geometry", list(SPECS))
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("slots_kind", list(SLOTS))
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "cpu-pages"])
@pytest.mark.parametrize("source", ["nope", "int", "tensor", "same"])
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "small-chunks"])
def test_batched_scatter_equals_per_layer_rotation_and_indexed_writes(
    geometry: str,
    layout: Layout,
    dtype: torch.dtype,
    slots_kind: str,
    strided: bool,
    source: str,
    chunked: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = dataclasses.replace(SPECS[geometry], layout=layout, attention_scaling=1.2)
    if chunked:  # chunks of 3 tokens of every layer (block mode rounds up to a block)
        monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 3 * LAYERS * HEADS * spec.rotary_dim)
    slots = torch.tensor(SLOTS[slots_kind])
    tokens = slots.numel()
    dim = spec.head_dim
    k = _randn(LAYERS, tokens, HEADS, dim, seed=1, dtype=dtype)
    v = _randn(LAYERS, tokens, HEADS, 32, seed=2, dtype=dtype)
    to_pos = 21
    from_pos: int | torch.Tensor | None = {
        "nope": None,
        "int": 3,
        "tensor": torch.tensor([(7 * i) % 50 for i in range(tokens)]),
        "same": to_pos,
    }[source]
    k_caches = [_pages(dim, dtype, strided) for _ in range(LAYERS)]
    v_caches = [_pages(32, dtype, strided) for _ in range(LAYERS)]
    api.rerope_scatter_layers(
        k, v, to_pos, slots, k_caches, v_caches, spec, from_positions=from_pos
    )
    keep = slots >= 0
    # Strided caches take slice copies per run except where runs are a token or two.
    assert (reference._block_runs(slots[keep], BLOCK) is None) == (slots_kind == "scattered")
    blocks, offsets = slots[keep] // BLOCK, slots[keep] % BLOCK
    for layer in range(LAYERS):
        if source == "same":
            want_k = k[layer]
        else:
            want_k = rotate_reference(k[layer], from_pos, to_pos, spec)
        expected_k = torch.zeros(BLOCKS, BLOCK, HEADS, dim, dtype=dtype)
        expected_v = torch.zeros(BLOCKS, BLOCK, HEADS, 32, dtype=dtype)
        for i in range(int(keep.sum())):
            token = int(keep.nonzero()[i])
            expected_k[blocks[i], offsets[i]] = want_k[token]
            expected_v[blocks[i], offsets[i]] = v[layer, token]
        assert torch.equal(k_caches[layer], expected_k), f"K of layer {layer}"
        assert torch.equal(v_caches[layer], expected_v), f"V of layer {layer}"


@pytest.mark.parametrize(
    ("slots", "runs"),
    [
        ([8, 9, 10, 11], [(0, 4, 1, 0)]),
        ([6, 7, 8, 9, 10, 11, 12, 13], [(0, 2, 0, 6), (2, 8, 1, 0)]),
        ([40, 41, 42, 43, 2, 3, 4, 5], [(0, 4, 5, 0), (4, 8, 0, 2)]),
        (
            [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
            [(0, 2, 0, 6), (2, 10, 1, 0), (10, 12, 2, 0)],
        ),
        ([1, 9, 17, 25, 33], None),  # a run per token: one indexed assignment instead
        ([6, 7, 8, 9, 30, 31], None),  # runs of two tokens on average
    ],
)
def test_block_runs_split_at_gaps_and_block_starts(
    slots: list[int], runs: list[tuple[int, int, int, int]] | None
) -> None:
    assert reference._block_runs(torch.tensor(slots), 8) == runs
