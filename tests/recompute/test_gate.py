"""The gate's arithmetic (recompute/gate.py) on small synthetic distributions (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from nopecache.client.errors import InvalidArgumentError
from nopecache.recompute.gate import GateThresholds, divergence, judge, rope_error


def _logprobs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows).log()


def test_divergence_is_kl_and_top1_per_token() -> None:
    full = _logprobs([[0.5, 0.5], [0.9, 0.1]])
    blend = _logprobs([[0.5, 0.5], [0.1, 0.9]])
    kl, agree = divergence(full, blend)
    want = 0.9 * math.log(0.9 / 0.1) + 0.1 * math.log(0.1 / 0.9)
    assert kl.tolist() == pytest.approx([0.0, want])
    assert agree.tolist() == [True, False]
    with pytest.raises(InvalidArgumentError, match="blend"):
        divergence(full, blend[:1])


def test_judge_pools_every_answer_token_against_the_thresholds() -> None:
    same = _logprobs([[0.7, 0.3]] * 3)
    flipped = _logprobs([[0.3, 0.7]])
    verdict = judge("p", [(same, same), (_logprobs([[0.7, 0.3]]), flipped)])
    assert (verdict.tokens, verdict.prompts) == (4, 2)
    assert verdict.top1 == 0.75
    assert verdict.kl == pytest.approx(0.4 * math.log(0.7 / 0.3) / 4)
    assert verdict.passed
    strict = judge(
        "p", [(same, same), (_logprobs([[0.7, 0.3]]), flipped)], GateThresholds(0.5, 0.8)
    )
    assert not strict.passed and "top-1 0.750 (min 0.8)" in strict.reason()
    assert not judge("p", [(same, same)], rope=0.01).passed  # a wrong RoPE fails on its own
    with pytest.raises(InvalidArgumentError, match="pairs"):
        judge("p", [])


def test_rope_error_is_relative_to_the_largest_key() -> None:
    model = torch.tensor([[2.0, -4.0]])
    assert rope_error(model, model) == 0.0
    assert rope_error(torch.tensor([[2.0, -3.0]]), model) == 0.25


def test_thresholds_for_a_16_bit_model_allow_its_own_rounding() -> None:
    t = GateThresholds()
    assert t.for_dtype(torch.float32) is t  # 4 eps of fp32 is far below 1e-3
    bf16 = t.for_dtype(torch.bfloat16)
    assert bf16.max_rope_error == 4 * 2**-7 and (bf16.max_kl, bf16.min_top1) == (0.5, 0.6)
    assert t.for_dtype(torch.float16).max_rope_error == 4 * 2**-10
    loose = GateThresholds(max_rope_error=0.1)
    assert loose.for_dtype(torch.bfloat16) is loose
