"""The torch reference against transformers' own rotary embedding and apply functions.

Each case builds a small config of a real model family in-process, lets the model's
rotary module produce cos/sin for some positions and the model's own apply function
rotate K, and checks ``rotate(k_nope, None, positions, RopeSpec.from_hf_config(config))``
against it: in fp32 to ~1e-6 of each rotated pair, in bf16 within one bf16 ulp of the
fp32 result rounded once (transformers itself rounds cos/sin and every product to bf16
when run in bf16, so its bf16 output is not the yardstick). Pass-through dims are exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    GPTJConfig,
    LlamaConfig,
    PhiConfig,
    PretrainedConfig,
    Qwen2Config,
    StableLmConfig,
)
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek_v3
from transformers.models.gptj import modeling_gptj as hf_gptj
from transformers.models.llama import modeling_llama as hf_llama
from transformers.models.phi import modeling_phi as hf_phi
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2
from transformers.models.stablelm import modeling_stablelm as hf_stablelm

from nopecache.kernels import RopeSpec
from nopecache.kernels.reference import rope_tolerance, rotate_reference

TOKENS = 24
KV_HEADS = 2

# [tokens, heads, head_dim] nope K and positions -> post-RoPE K as the model computes it.
HfRope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Case:
    """A model config and the model's own way of applying RoPE to K."""

    name: str
    config: PretrainedConfig
    hf_rope: HfRope
    max_position: int


def _to_hf(k: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] -> [batch=1, heads, tokens, dim], the layout HF attention uses."""
    return k.transpose(0, 1)[None]


def _from_hf(k: torch.Tensor) -> torch.Tensor:
    return k[0].transpose(0, 1)


def _rotate_half_family(
    rotary_cls: type, apply: Callable[..., tuple[torch.Tensor, ...]]
) -> Callable[[PretrainedConfig], HfRope]:
    """Llama-style families: cos/sin from the rotary module, ``apply_rotary_pos_emb``,
    the first ``rotary_ndims`` dims rotated and the rest passed through (Phi, StableLM)."""

    def build(config: PretrainedConfig) -> HfRope:
        rotary = rotary_cls(config)

        def hf_rope(k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            cos, sin = rotary(k, pos[None])
            rd = cos.shape[-1]
            kh = _to_hf(k)
            _, rot = apply(kh[..., :rd], kh[..., :rd], cos, sin)
            return _from_hf(torch.cat((rot, kh[..., rd:]), dim=-1))

        return hf_rope

    return build


def _llama3() -> Case:
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    build = _rotate_half_family(hf_llama.LlamaRotaryEmbedding, hf_llama.apply_rotary_pos_emb)
    return Case("llama3", config, build(config), 131071)


def _qwen2() -> Case:
    config = Qwen2Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    build = _rotate_half_family(hf_qwen2.Qwen2RotaryEmbedding, hf_qwen2.apply_rotary_pos_emb)
    return Case("qwen2", config, build(config), 32767)


def _qwen2_yarn() -> Case:
    config = Qwen2Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    )
    build = _rotate_half_family(hf_qwen2.Qwen2RotaryEmbedding, hf_qwen2.apply_rotary_pos_emb)
    return Case("qwen2-yarn", config, build(config), 131071)


def _phi() -> Case:
    # Phi-2's geometry scaled down: head_dim 40, 40% rotated (16 dims), theta 1e4.
    config = PhiConfig(
        hidden_size=160,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.4},
    )
    build = _rotate_half_family(hf_phi.PhiRotaryEmbedding, hf_phi.apply_rotary_pos_emb)
    return Case("phi-partial", config, build(config), 2047)


def _stablelm() -> Case:
    config = StableLmConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    )
    build = _rotate_half_family(
        hf_stablelm.StableLmRotaryEmbedding, hf_stablelm.apply_rotary_pos_emb
    )
    return Case("stablelm-partial", config, build(config), 4095)


def _gptj() -> Case:
    config = GPTJConfig(n_embd=128, n_head=4, rotary_dim=16, n_positions=2048)
    rotary = hf_gptj.GPTJRotaryEmbedding(config)

    def hf_rope(k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        sin, cos = rotary(k, pos[None])
        kh = k[None]  # GPT-J rotates in [batch, tokens, heads, dim]
        rot = hf_gptj.apply_rotary_pos_emb(kh[..., :16], sin, cos)
        return torch.cat((rot, kh[..., 16:]), dim=-1)[0]

    return Case("gptj-interleaved", config, hf_rope, 2047)


def _deepseek_v3() -> Case:
    # The cached MLA latent is [normalised compressed kv (32) | k_pe (16)]. HF reads k_pe
    # as interleaved pairs and writes it rotated and de-interleaved, so the nope form the
    # spec rotates (neox) is the projection's k_pe de-interleaved: evens, then odds.
    config = DeepseekV3Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    rotary = hf_deepseek_v3.DeepseekV3RotaryEmbedding(config)

    def hf_rope(latent_nope: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, k_pe = latent_nope[..., :32], latent_nope[..., 32:]
        projected = torch.stack((k_pe[..., :8], k_pe[..., 8:]), dim=-1).flatten(-2)
        cos, sin = rotary(latent_nope, pos[None])
        kh = _to_hf(projected)
        _, rot = hf_deepseek_v3.apply_rotary_pos_emb_interleave(kh, kh, cos, sin)
        return torch.cat((c, _from_hf(rot)), dim=-1)

    return Case("deepseek-v3-mla", config, hf_rope, 163839)


CASES = [_llama3, _qwen2, _qwen2_yarn, _phi, _stablelm, _gptj, _deepseek_v3]


@pytest.fixture(scope="module", params=CASES, ids=lambda f: f.__name__.strip("_"))
def case(request: pytest.FixtureRequest) -> Case:
    factory: Callable[[], Case] = request.param
    return factory()


def _inputs(case: Case, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(len(case.name))
    k = torch.randn(TOKENS, KV_HEADS, spec.head_dim, generator=gen)
    # Small positions, a contiguous run, and some near the model's maximum.
    pos = torch.cat(
        (
            torch.tensor([0, 1, 7, 100]),
            torch.arange(case.max_position // 3, case.max_position // 3 + TOKENS - 8),
            torch.tensor(
                [
                    case.max_position // 2,
                    case.max_position - 17,
                    case.max_position - 1,
                    case.max_position,
                ]
            ),
        )
    )
    return k, pos


def _assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> None:
    err = (actual.double() - expected.double()).abs()
    worst = (err - tol).max()
    assert bool((err <= tol).all()), f"max excess over tolerance {worst.item():.3g}"


def test_spec_describes_the_case(case: Case) -> None:
    spec = RopeSpec.from_hf_config(case.config)
    expected_layout = "gptj" if case.name.startswith("gptj") else "neox"
    assert spec.layout == expected_layout
    if case.name == "deepseek-v3-mla":
        assert (spec.rotary_offset, spec.rotary_dim, spec.head_dim) == (32, 16, 48)
    if case.name == "qwen2-yarn":
        assert spec.attention_scaling > 1.0  # the case exercises the YaRN factor


def test_fp32_matches_transformers(case: Case) -> None:
    spec = RopeSpec.from_hf_config(case.config)
    k, pos = _inputs(case, spec)
    expected = case.hf_rope(k, pos)
    actual = rotate_reference(k, None, pos, spec)
    _assert_within(actual, expected, rope_tolerance(expected, spec, torch.float32, ulps=8))


def test_bf16_within_one_ulp_of_transformers_fp32(case: Case) -> None:
    spec = RopeSpec.from_hf_config(case.config)
    k, pos = _inputs(case, spec)
    k16 = k.to(torch.bfloat16)
    expected = case.hf_rope(k16.float(), pos).to(torch.bfloat16)
    actual = rotate_reference(k16, None, pos, spec)
    assert actual.dtype == torch.bfloat16
    _assert_within(actual, expected, rope_tolerance(expected, spec, torch.bfloat16))


def test_unrotating_transformers_output_recovers_nope_k(case: Case) -> None:
    spec = RopeSpec.from_hf_config(case.config)
    k, pos = _inputs(case, spec)
    post = case.hf_rope(k, pos)
    back = rotate_reference(post, pos, None, spec)
    _assert_within(back, k, rope_tolerance(k, spec, torch.float32, ulps=8))


def test_moving_transformers_output_equals_transformers_at_new_positions(case: Case) -> None:
    spec = RopeSpec.from_hf_config(case.config)
    k, pos = _inputs(case, spec)
    shifted = (pos + 501).clamp(max=case.max_position)
    moved = rotate_reference(case.hf_rope(k, pos), pos, shifted, spec)
    expected = case.hf_rope(k, shifted)
    # The source carries fp32 rounding of its own angle, so allow the two roundings of
    # both ends (one angle error each, ~|angle| * 2**-24) on top of the arithmetic.
    angle_ulps = 8 + 2 * float(shifted.max()) * max(spec.inv_freq)
    _assert_within(moved, expected, rope_tolerance(expected, spec, torch.float32, ulps=angle_ulps))
