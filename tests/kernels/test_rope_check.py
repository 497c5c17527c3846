"""The RoPE check's arithmetic (kernels/rope_check.py), against the torch reference.

The engine's rotation here is the kernel API itself (a rotation the spec reproduces
exactly), the identity (a layer that does not rotate) and the kernel with another
spec (a mismatch); the vLLM and transformers rotary modules are checked in their
integrations' tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nopecache.kernels import RopeSpec
from nopecache.kernels.api import rotate
from nopecache.kernels.rope_check import (
    EngineRotation,
    RopeFigure,
    check_positions,
    check_rope,
    relative_error,
    rotation_error,
)

SPEC = RopeSpec.from_hf_config(
    {"head_dim": 8, "hidden_size": 32, "num_attention_heads": 4, "rope_theta": 10000.0}
)


def _as(spec: RopeSpec) -> EngineRotation:
    """An engine that rotates exactly as the kernel API does with ``spec``."""
    return lambda positions, k: rotate(k, None, positions, spec)


def test_positions_are_the_ends_and_the_middle() -> None:
    assert check_positions(2048) == (0, 1, 1024, 2047)
    assert check_positions(3) == (0, 1, 2)
    assert check_positions(1) == (0,)
    with pytest.raises(ValueError, match="max_len: must be >= 1, got 0"):
        check_positions(0)


def test_relative_error_is_over_the_largest_engine_value() -> None:
    engine = torch.tensor([[2.0, -4.0]])
    assert relative_error(torch.tensor([[2.0, -3.0]]), engine) == 0.25
    assert relative_error(torch.zeros(1, 2), torch.zeros(1, 2)) == 0.0
    with pytest.raises(ValueError, match=r"described: shape \(2,\) != the engine's \(1, 2\)"):
        relative_error(torch.zeros(2), engine)


def test_the_spec_against_itself_passes_exactly() -> None:
    check = check_rope(
        {"a": _as(SPEC), "b": _as(SPEC)},
        SPEC,
        positions=(0, 1, 64, 127),
        kv_heads=2,
        dtype=torch.float32,
        bound=1e-3,
    )
    assert check.passed and check.failures == () and check.max_error == 0.0
    assert [(f.layer, f.position) for f in check.figures] == [
        (layer, p) for layer in "ab" for p in (0, 1, 64, 127)
    ]
    assert check.summary() == (
        "RoPE check passed: 2 layers at positions [0, 1, 64, 127], largest error "
        "0.000e+00 (bound 1.000e-03)"
    )


def test_a_layer_that_does_not_rotate_fails_past_position_zero() -> None:
    gptj = dataclasses.replace(SPEC, layout="gptj")
    check = check_rope(
        {"same": _as(SPEC), "none": None, "gptj": _as(gptj)},
        SPEC,
        positions=(0, 1, 64),
        kv_heads=2,
        dtype=torch.float32,
        bound=1e-3,
    )
    assert not check.passed
    assert [(f.layer, f.position) for f in check.failures] == [
        ("none", 1),
        ("none", 64),
        ("gptj", 1),
        ("gptj", 64),
    ]
    none_1 = check.failures[0]
    assert not none_1.rotary and none_1.error > 0.1
    assert str(none_1).startswith("none (no rotary embedding) at position 1: error ")
    assert str(none_1).endswith(" (bound 1.000e-03)")
    assert check.report().splitlines() == [str(f) for f in check.figures]
    assert check.summary().endswith(", 4 figures over the bound")


def test_rotation_error_is_the_figure() -> None:
    pre = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([0, 5, 9])
    post = rotate(pre, None, pos, SPEC)
    assert rotation_error(pre, post, pos, SPEC) == 0.0
    assert rotation_error(pre, pre, pos, SPEC) > 0.1
    assert RopeFigure("x", 1, 2e-3, 1e-3).passed is False


@pytest.mark.gpu
def test_on_cuda_the_check_runs_on_the_device() -> None:
    # A CUDA engine's layers rotate on the GPU; the spec's rotation runs the Triton kernel.
    check = check_rope(
        {"a": _as(SPEC)},
        SPEC,
        positions=(0, 1, 64, 127),
        kv_heads=2,
        dtype=torch.bfloat16,
        bound=4 * 2**-7,
        device="cuda",
    )
    assert check.passed, check.report()
