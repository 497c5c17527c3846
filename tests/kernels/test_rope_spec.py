"""RopeSpec against transformers' own RoPE: inv_freq bit for bit, attention scaling exactly."""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.codegen import modeling_codegen
from transformers.models.deepseek_v2 import modeling_deepseek_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gptj import modeling_gptj
from transformers.models.llama import modeling_llama
from transformers.models.phi.modeling_phi import PhiRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding

from nopecache.kernels.rope_spec import RopeSpec

# head_dim 64 (256 / 4): wide enough that llama3 and yarn hit all three frequency bands.
LLAMA = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
MLA = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "q_lora_rank": None,
}
YARN_DEEPSEEK = {
    "type": "yarn",
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
}
SHORT = [1.0 + i / 10 for i in range(8)]
LONG = [2.0 + i for i in range(8)]


@dataclasses.dataclass(frozen=True)
class Case:
    """One model config as config.json would hold it, with its HF config and rotary classes."""

    model_type: str
    json: dict[str, Any]
    config_cls: Callable[..., Any]
    rotary_cls: Callable[[Any], Any]
    seq_len: int | None = None

    def config(self) -> Any:
        return self.config_cls(**self.json)

    def as_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, **self.json}


def _llama(rope_scaling: dict[str, Any] | None, seq_len: int | None = None) -> Case:
    json: dict[str, Any] = {**LLAMA, "max_position_embeddings": 512, "rope_theta": 500000.0}
    if rope_scaling is not None:
        json["rope_scaling"] = rope_scaling
    cfg = transformers.LlamaConfig
    return Case("llama", json, cfg, modeling_llama.LlamaRotaryEmbedding, seq_len)


def _qwen2_yarn(**extra: Any) -> Case:
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, **extra}
    json = {**LLAMA, "max_position_embeddings": 512, "rope_theta": 1e6, "rope_scaling": scaling}
    return Case("qwen2", json, transformers.Qwen2Config, Qwen2RotaryEmbedding)


def _phi3(seq_len: int | None, top_level_original: bool = True, **scaling: Any) -> Case:
    json: dict[str, Any] = {
        **SMALL,
        "max_position_embeddings": 4096,
        "rope_scaling": {"short_factor": SHORT, "long_factor": LONG, **scaling},
    }
    if top_level_original:
        json["original_max_position_embeddings"] = 1024
    return Case("phi3", json, transformers.Phi3Config, Phi3RotaryEmbedding, seq_len)


def _deepseek(version: int, rope_scaling: dict[str, Any] | None) -> Case:
    json: dict[str, Any] = {**MLA, "max_position_embeddings": 5120, "rope_theta": 10000}
    if rope_scaling is not None:
        json["rope_scaling"] = rope_scaling
    if version == 2:
        v2 = modeling_deepseek_v2.DeepseekV2RotaryEmbedding
        return Case("deepseek_v2", json, transformers.DeepseekV2Config, v2)
    v3 = modeling_deepseek_v3.DeepseekV3RotaryEmbedding
    return Case("deepseek_v3", json, transformers.DeepseekV3Config, v3)


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES: dict[str, Case] = {
    "default": _llama(None),
    "linear": _llama({"type": "linear", "factor": 2.5}),
    "dynamic-init": _llama({"rope_type": "dynamic", "factor": 2.0}),
    "dynamic-below": _llama({"rope_type": "dynamic", "factor": 2.0}, seq_len=300),
    "dynamic-at-max": _llama({"rope_type": "dynamic", "factor": 2.0}, seq_len=512),
    "dynamic-above": _llama({"rope_type": "dynamic", "factor": 2.0}, seq_len=3000),
    "dynamic-above-int-factor": _llama({"rope_type": "dynamic", "factor": 3}, seq_len=1000),
    "llama3": _llama(LLAMA3),
    "yarn": _qwen2_yarn(),
    "yarn-mscale": _qwen2_yarn(mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2),
    "yarn-no-truncate": _qwen2_yarn(truncate=False),
    "yarn-attention-factor": _qwen2_yarn(attention_factor=1.25),
    "proportional": _llama({"rope_type": "proportional", "partial_rotary_factor": 0.25}),
    "longrope-init": _phi3(None, type="longrope"),
    "longrope-short": _phi3(1024, type="longrope"),
    "longrope-long": _phi3(1025, type="longrope"),
    "longrope-factor": _phi3(3000, type="longrope", factor=8.0, attention_factor=1.5),
    "longrope-su-alias": _phi3(5000, type="su", original_max_position_embeddings=2048),
    # Phi3Config's class attribute (4096) wins over the value inside rope_scaling.
    "longrope-class-original": _phi3(
        3000, top_level_original=False, type="longrope", original_max_position_embeddings=2048
    ),
    "partial-phi": Case(
        "phi", {**SMALL, "max_position_embeddings": 64}, transformers.PhiConfig, PhiRotaryEmbedding
    ),
    "partial-stablelm-linear": Case(
        "stablelm",
        {**SMALL, "rope_scaling": {"type": "linear", "factor": 3.0}, "rope_theta": 7.5e4},
        transformers.StableLmConfig,
        StableLmRotaryEmbedding,
    ),
    "partial-gpt-neox": Case(
        "gpt_neox",
        {**SMALL, "rotary_pct": 0.5, "rotary_emb_base": 12345},
        transformers.GPTNeoXConfig,
        GPTNeoXRotaryEmbedding,
    ),
    "mla-v3-default": _deepseek(3, None),
    "mla-v3-yarn": _deepseek(3, YARN_DEEPSEEK),
    "mla-v2-yarn": _deepseek(2, {**YARN_DEEPSEEK, "mscale": 0.707}),
}


def _hf_rope(case: Case, config: Any) -> tuple[torch.Tensor, float]:
    """Frequencies and scaling a fresh HF rotary module uses in a forward of ``seq_len`` positions."""
    module = case.rotary_cls(config)
    if case.seq_len is not None:
        module(torch.zeros(1, 1, 1), torch.tensor([[case.seq_len - 1]]))
    return module.inv_freq, module.attention_scaling


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_exactly(name: str) -> None:
    case = CASES[name]
    config = case.config()
    inv_freq, scaling = _hf_rope(case, config)
    spec = RopeSpec.from_hf_config(config, seq_len=case.seq_len)
    assert torch.equal(spec.inv_freq_tensor(), inv_freq)
    assert spec.attention_scaling == scaling
    assert spec.scaling_type == config.rope_parameters["rope_type"]


@pytest.mark.parametrize("name", list(CASES))
def test_config_json_dict_equals_pretrained_config(name: str) -> None:
    case = CASES[name]
    config = case.config()
    spec = RopeSpec.from_hf_config(config, seq_len=case.seq_len)
    # Old-style config.json (rope_theta + rope_scaling) and what transformers 5 saves.
    assert RopeSpec.from_hf_config(case.as_dict(), seq_len=case.seq_len) == spec
    assert RopeSpec.from_hf_config(config.to_dict(), seq_len=case.seq_len) == spec


def test_cases_cover_every_transformers_rope_type() -> None:
    covered = {CASES[name].config().rope_parameters["rope_type"] for name in CASES}
    assert covered == set(ROPE_INIT_FUNCTIONS) | {"default"}


def test_rope_init_function_agrees_with_module() -> None:
    config = CASES["yarn"].config()
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config)
    spec = RopeSpec.from_hf_config(config)
    assert torch.equal(spec.inv_freq_tensor(), inv_freq)
    assert spec.attention_scaling == scaling == 1 + 0.1 * math.log(4.0)


def test_dynamic_follows_the_forward_update_not_the_int_init_path() -> None:
    # The forward passes seq_len as an int64 tensor (fp32 theta); an int seq_len gives a
    # Python-float theta. At this length the two differ, and the model uses the former.
    case = CASES["dynamic-above"]
    config = case.config()
    from_int, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=case.seq_len)
    spec = RopeSpec.from_hf_config(config, seq_len=case.seq_len)
    assert not torch.equal(spec.inv_freq_tensor(), from_int)
    below = RopeSpec.from_hf_config(config, seq_len=300)
    assert below == RopeSpec.from_hf_config(config) != spec


def test_llama3_case_covers_all_three_bands() -> None:
    spec = RopeSpec.from_hf_config(CASES["llama3"].config())
    plain = RopeSpec.default(64, theta=500000.0).inv_freq_tensor()
    inv = spec.inv_freq_tensor()
    kept = inv == plain
    divided = inv == plain / 8.0
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_longrope_switches_factor_sets_past_original_length() -> None:
    short = RopeSpec.from_hf_config(CASES["longrope-short"].config(), seq_len=1024)
    long = RopeSpec.from_hf_config(CASES["longrope-short"].config(), seq_len=1025)
    assert short == RopeSpec.from_hf_config(CASES["longrope-short"].config())
    base = RopeSpec.default(16).inv_freq_tensor()
    for spec, factors in ((short, SHORT), (long, LONG)):
        torch.testing.assert_close(spec.inv_freq_tensor() * torch.tensor(factors), base)
    # No factor: the context ratio 4096 / 1024 sets sqrt(1 + ln 4 / ln 1024).
    assert (
        short.attention_scaling
        == long.attention_scaling
        == math.sqrt(1 + math.log(4) / math.log(1024))
    )


def test_partial_rotary_and_proportional_shapes() -> None:
    assert RopeSpec.from_hf_config(CASES["partial-phi"].config()).rotary_dim == 8
    assert RopeSpec.from_hf_config(CASES["partial-stablelm-linear"].config()).rotary_dim == 4
    assert RopeSpec.from_hf_config(CASES["partial-gpt-neox"].config()).rotary_dim == 8
    prop = RopeSpec.from_hf_config(CASES["proportional"].config())
    assert (prop.head_dim, prop.rotary_dim) == (64, 64)
    assert prop.inv_freq[8:] == (0.0,) * 24 and all(f > 0 for f in prop.inv_freq[:8])


FAMILY_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "mixtral": "MixtralConfig",
    "qwen2": "Qwen2Config",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3": "Qwen3Config",
    "gemma": "GemmaConfig",
    "phi": "PhiConfig",
    "phi3": "Phi3Config",
    "stablelm": "StableLmConfig",
    "gpt_neox": "GPTNeoXConfig",
    "cohere": "CohereConfig",
    "glm": "GlmConfig",
}


@pytest.mark.parametrize("model_type", list(FAMILY_CONFIGS))
def test_family_class_defaults_for_minimal_config_json(model_type: str) -> None:
    # Only the sizes given: theta, head_dim and partial rotary come from each class's defaults.
    json = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4}
    config = getattr(transformers, FAMILY_CONFIGS[model_type])(**json)
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    (rotary_name,) = [n for n in dir(modeling) if n.endswith("RotaryEmbedding")]
    spec = RopeSpec.from_hf_config({"model_type": model_type, **json})
    assert spec == RopeSpec.from_hf_config(config)
    assert torch.equal(spec.inv_freq_tensor(), getattr(modeling, rotary_name)(config).inv_freq)


@pytest.mark.parametrize("model_type", ["gptj", "codegen"])
def test_gptj_family_matches_sinusoid_table(model_type: str) -> None:
    json: dict[str, Any] = {"n_embd": 64, "n_head": 4, "rotary_dim": 8, "n_positions": 64}
    json["rope_theta"] = 5.0  # ignored: GPT-J hardcodes base 10000
    modeling = modeling_gptj if model_type == "gptj" else modeling_codegen
    config_cls = transformers.GPTJConfig if model_type == "gptj" else transformers.CodeGenConfig
    spec = RopeSpec.from_hf_config(config_cls(**json))
    assert RopeSpec.from_hf_config({"model_type": model_type, **json}) == spec
    assert (spec.head_dim, spec.rotary_dim, spec.layout) == (16, 8, "gptj")
    angles = torch.arange(64, dtype=torch.int64).float()[:, None] * spec.inv_freq_tensor()
    table = torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)
    assert torch.equal(table, modeling.create_sinusoidal_positions(64, 8))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """What the spec's layout means: rotate pair i of [tokens, head_dim] by (cos[:, i], sin[:, i])."""
    lo, hi = spec.rotary_offset, spec.rotary_offset + spec.rotary_dim
    rot = x[:, lo:hi]
    if spec.layout == "neox":
        a, b = rot.chunk(2, dim=-1)
        out = torch.cat((a * cos + (-b) * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rot[:, 0::2], rot[:, 1::2]
        out = torch.stack((a * cos + (-b) * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((x[:, :lo], out, x[:, hi:]), dim=-1)


# The layout tests feed HF's own cos/sin tables (inv_freq equality is tested above), so
# they check only which dims pair up and where results land.
POS = torch.tensor([0, 1, 7, 300, 5000])


def test_neox_layout_matches_rotate_half() -> None:
    config = CASES["yarn"].config()
    spec = RopeSpec.from_hf_config(config)
    y = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = Qwen2RotaryEmbedding(config)(y, POS[None])
    hf, _ = modeling_llama.apply_rotary_pos_emb(y[None, None], y[None, None], cos, sin)
    assert torch.equal(_rotate(y, cos[0, :, :32], sin[0, :, :32], spec), hf[0, 0])


def test_gptj_layout_matches_rotate_every_two() -> None:
    spec = RopeSpec.from_hf_config(transformers.GPTJConfig(n_embd=64, n_head=4, rotary_dim=8))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    sin, cos = modeling_gptj.create_sinusoidal_positions(5001, 8)[POS].chunk(2, dim=-1)
    hf_rot = modeling_gptj.apply_rotary_pos_emb(x[None, :, None, :8], sin[None], cos[None])
    expected = torch.cat((hf_rot[0, :, 0], x[:, 8:]), dim=-1)  # GPT-J passes dims >= rotary_dim
    assert torch.equal(_rotate(x, cos, sin, spec), expected)


def test_mla_deepseek_v3_cached_rope_part_is_half_split() -> None:
    config = CASES["mla-v3-yarn"].config()
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_offset, spec.rotary_dim, spec.layout) == (24, 16, 8, "neox")
    assert config.rope_interleave
    # HF reads k_pe as interleaved pairs and writes the result half-split: the cached form
    # is the neox rotation of the de-interleaved projection.
    k_pe = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    cos, sin = modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)(k_pe, POS[None])
    hf, _ = modeling_deepseek_v3.apply_rotary_pos_emb_interleave(
        k_pe[None, None], k_pe[None, None], cos, sin
    )
    latent = torch.cat((torch.ones(5, 16), k_pe[:, 0::2], k_pe[:, 1::2]), dim=-1)
    ours = _rotate(latent, cos[0, :, :4], sin[0, :, :4], spec)
    assert torch.equal(ours[:, 16:], hf[0, 0]) and torch.equal(ours[:, :16], latent[:, :16])


def test_mla_deepseek_v2_keeps_pairs_interleaved() -> None:
    config = CASES["mla-v2-yarn"].config()
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_offset, spec.rotary_dim, spec.layout) == (24, 16, 8, "gptj")
    assert spec.attention_scaling != 1.0  # mscale 0.707 vs mscale_all_dim 1.0
    k_pe = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(2))
    freqs_cis = modeling_deepseek_v2.DeepseekV2RotaryEmbedding(config)(k_pe, POS[None])
    _, hf = modeling_deepseek_v2.apply_rotary_emb(k_pe[:, None], k_pe[:, None], freqs_cis)
    latent = torch.cat((torch.zeros(5, 16), k_pe[0]), dim=-1)
    ours = _rotate(latent, freqs_cis.real[0], freqs_cis.imag[0], spec)
    # HF multiplies complex numbers, which may round differently from the real form.
    torch.testing.assert_close(ours[:, 16:], hf[0, 0], rtol=2e-6, atol=2e-6)


def test_mla_constructor_matches_config() -> None:
    spec = RopeSpec.from_hf_config(CASES["mla-v3-default"].config())
    assert spec == RopeSpec.mla(16, 8, theta=10000)
    assert RopeSpec.from_hf_config(CASES["mla-v3-default"].config(), layout="gptj").layout == "gptj"


def test_explicit_layout_overrides_family() -> None:
    config = CASES["default"].config()
    assert RopeSpec.from_hf_config(config).layout == "neox"
    assert RopeSpec.from_hf_config(config, layout="gptj").layout == "gptj"
    assert RopeSpec.from_hf_config(config) == RopeSpec.default(64, theta=500000.0)


BAD_CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({**LLAMA, "model_type": "llama", "rope_scaling": {"type": "banana", "factor": 2}}, "banana"),
    ({**LLAMA, "model_type": "llama", "rope_scaling": {"type": "linear"}}, "'factor'"),
    ({**LLAMA, "model_type": "llama", "rope_scaling": {"type": "linear", "factor": "2"}}, "factor"),
    (
        {**LLAMA, "model_type": "llama", "rope_scaling": {**LLAMA3, "low_freq_factor": None}},
        "low_freq",
    ),
    (
        {**LLAMA, "model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2}},
        "max_position",
    ),
    ({"model_type": "llama", "num_attention_heads": 4}, "hidden_size"),
    ({"model_type": "llama", "hidden_size": 64}, "num_attention_heads"),
    ({**LLAMA, "model_type": "my_model"}, "rope_theta"),
    ({**LLAMA, "model_type": "llama", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    (
        {
            **SMALL,
            "model_type": "phi3",
            "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": LONG},
        },
        "short_factor",
    ),
    (
        {
            **LLAMA,
            "model_type": "gemma3",
            "rope_theta": 1.0,
            "rope_parameters": {"full_attention": {}},
        },
        "rope_parameters",
    ),
    (
        {k: v for k, v in MLA.items() if k != "kv_lora_rank"} | {"model_type": "deepseek_v3"},
        "kv_lora_rank",
    ),
    ({**MLA, "model_type": "some_mla_model", "rope_theta": 1e4}, "kv_lora_rank"),
]


@pytest.mark.parametrize(("config", "field"), BAD_CONFIGS)
def test_bad_config_raises_naming_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RopeSpec.from_hf_config(config)


def test_bad_arguments_raise_naming_them() -> None:
    config = CASES["default"].as_dict()
    with pytest.raises(ValueError, match="seq_len"):
        RopeSpec.from_hf_config(config, seq_len=0)
    with pytest.raises(ValueError, match="layout"):
        RopeSpec.from_hf_config(config, layout="interleaved")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="config"):
        RopeSpec.from_hf_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rotary_dim": 3, "inv_freq": (1.0,)}, "rotary_dim"),
        ({"rotary_offset": 6}, "rotary_offset"),
        ({"inv_freq": (1.0,)}, "inv_freq"),
        ({"inv_freq": (1.0, -0.5)}, "inv_freq"),
        ({"inv_freq": (1.0, "0.5")}, "inv_freq"),
        ({"layout": "half"}, "layout"),
        ({"attention_scaling": 0.0}, "attention_scaling"),
        ({"head_dim": 8.0}, "head_dim"),
        ({"scaling_type": ""}, "scaling_type"),
    ],
)
def test_spec_validation(fields: dict[str, Any], match: str) -> None:
    good: dict[str, Any] = {"head_dim": 8, "rotary_dim": 4, "inv_freq": (1.0, 0.01)}
    with pytest.raises(ValueError, match=match):
        RopeSpec(**(good | fields))


def test_inv_freq_is_rounded_to_fp32() -> None:
    spec = RopeSpec(head_dim=2, rotary_dim=2, inv_freq=(0.1,))
    assert spec.inv_freq == (torch.tensor(0.1, dtype=torch.float32).item(),)
    assert spec == RopeSpec(head_dim=2, rotary_dim=2, inv_freq=(0.1 + 1e-12,))
    assert spec.inv_freq_tensor().dtype == torch.float32


BASE = RopeSpec(head_dim=8, rotary_dim=4, inv_freq=(1.0, 0.01))
VARIANTS: dict[str, RopeSpec] = {
    "head_dim": dataclasses.replace(BASE, head_dim=10),
    "rotary_dim": dataclasses.replace(BASE, rotary_dim=6, inv_freq=(1.0, 0.01, 0.001)),
    "inv_freq": dataclasses.replace(
        BASE, inv_freq=(1.0, torch.nextafter(torch.tensor(0.01), torch.tensor(1.0)).item())
    ),
    "layout": dataclasses.replace(BASE, layout="gptj"),
    "rotary_offset": dataclasses.replace(BASE, rotary_offset=2),
    "attention_scaling": dataclasses.replace(BASE, attention_scaling=1.0 + 2**-52),
    "scaling_type": dataclasses.replace(BASE, scaling_type="linear"),
}


def test_digest_covers_every_field() -> None:
    assert set(VARIANTS) == {f.name for f in dataclasses.fields(RopeSpec)}
    digests = {BASE.digest()} | {v.digest() for v in VARIANTS.values()}
    assert len(digests) == len(VARIANTS) + 1
    assert all(len(d) == 16 for d in digests)


def test_digest_equal_for_equal_specs_and_pinned() -> None:
    again = RopeSpec(head_dim=8, rotary_dim=4, inv_freq=(1.0, 0.01))
    assert again.digest() == BASE.digest()
    config = CASES["mla-v3-yarn"]
    from_dict = RopeSpec.from_hf_config(config.as_dict()).digest()
    assert from_dict == RopeSpec.from_hf_config(config.config()).digest()
    # A fixed encoding and xxh3: the same bytes in every process and on every host.
    assert RopeSpec.default(64).digest().hex() == "90e204ab6295b820cda33f04efff4c15"
