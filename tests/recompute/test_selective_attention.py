"""The selective loop's attention over a subset of running positions (selective.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from nopecache.recompute import selective

SCALE = 0.25


def _one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The reference: one masked call over every key."""
    mask = torch.arange(k.shape[2])[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)


@pytest.mark.parametrize("block", [1, 3, 64])
@pytest.mark.parametrize(
    "positions",
    [list(range(7)), [0, 2, 3, 9, 10, 11, 15, 19], [5, 19], [19]],
    ids=["leading", "scattered", "two", "last"],
)
def test_blocks_of_queries_equal_one_masked_call(
    block: int, positions: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    pos = torch.tensor(positions)
    q = torch.randn(1, 4, len(positions), 16)
    k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    monkeypatch.setattr(selective, "QUERY_BLOCK", block)
    got = selective._attend_up_to(q, k, v, pos, SCALE)
    want = _one_call(q, k, v, pos)
    assert got.shape == want.shape == (1, 4, len(positions), 16)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_a_block_never_reads_keys_past_its_last_position() -> None:
    # Keys after a block's last position are poisoned: a read of one makes the output NaN.
    pos = torch.tensor([0, 1, 2, 3])
    q = torch.randn(1, 2, 4, 8)
    k, v = torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8)
    k[:, :, 4:], v[:, :, 4:] = float("nan"), float("nan")
    out = selective._attend_up_to(q, k, v, pos, SCALE)
    assert not out.isnan().any()
    assert torch.allclose(out, _one_call(q, k[:, :, :4], v[:, :, :4], pos), atol=1e-6)


def test_no_running_tokens_attend_to_nothing() -> None:
    out = selective._attend_up_to(
        torch.empty(1, 4, 0, 16),
        torch.randn(1, 2, 5, 16),
        torch.randn(1, 2, 5, 16),
        torch.empty(0, dtype=torch.int64),
        SCALE,
    )
    assert out.shape == (1, 4, 0, 16)
