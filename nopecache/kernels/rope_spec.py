"""RopeSpec: everything needed to reproduce a model's rotary embedding on K.

Fields other modules rely on (do not rename):

    head_dim           last dim of K as cached (MLA: kv_lora_rank + qk_rope_head_dim)
    rotary_dim         number of rotated dims (even, <= head_dim - rotary_offset)
    rotary_offset      first rotated dim (0 normally; kv_lora_rank for MLA latents)
    layout             "neox" (rotate halves, HF Llama) or "gptj" (interleaved pairs)
    inv_freq           rotary_dim // 2 frequencies, one per rotated pair (fp32 values)
    attention_scaling  factor HF multiplies cos and sin by (YaRN mscale, LongRoPE); 1.0 otherwise
    scaling_type       "default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional"

Rotated pair i is (d[i], d[i + rotary_dim/2]) for neox and (d[2i], d[2i+1]) for gptj,
both counted from ``rotary_offset``; dims outside the rotated range pass through.

attention_scaling (YaRN, LongRoPE)
----------------------------------
Transformers folds the YaRN / LongRoPE attention factor ``s`` into the rotary tables
(``cos = cos(p·f) * s``, ``sin = sin(p·f) * s``, in fp32, i.e. times ``float32(s)``) and
applies them to Q and K alike, so every logit carries ``s²`` while the softmax scale stays
``head_dim ** -0.5``. For the cache this means::

    nope K      k                       no factor (what nopecache stores)
    post-RoPE K s · R(p·f) · k          the factor exactly once, rotated dims only

Dims outside the rotated range (partial rotary, the MLA latent) never carry ``s``. Moving
post-RoPE K from position a to b is ``R((b - a)·f)`` with no factor change; un-rotating
post-RoPE K to nope form divides by ``s`` once, and rotating nope K into an engine's cache
multiplies by ``s`` once. Rotating twice with the factor applied each time would leave
``s²`` on K, which is why the factor is a separate field and not baked into ``inv_freq``.

Dynamic NTK and LongRoPE depend on the sequence length
------------------------------------------------------
``seq_len`` below means what HF's rotary module sees: ``max(position_ids) + 1`` of a
forward call. ``dynamic``: up to ``max_position_embeddings`` the frequencies are the ones
HF computes at init (theta unchanged, Python-float arithmetic); beyond it HF's
``dynamic_rope_update`` recomputes theta from ``seq_len`` passed as an int64 tensor, so
the new theta is an fp32 value, and this module reproduces that fp32 path op for op.
HF's module keeps the largest length seen until a call shorter than the original maximum
resets it; a spec describes a fresh module at one ``seq_len``, so K cached under one
dynamic spec is only position-exact for reuse under the same spec. ``longrope``: the
short factors up to ``original_max_position_embeddings``, the long ones beyond it.
Frequencies are computed on the CPU like HF's init; HF recomputes dynamic / long
frequencies on the input's device, where a GPU ``pow`` may differ in the last ulp.

MLA (DeepSeek-V2/V3)
--------------------
The cached latent per token is ``[kv_lora_rank | qk_rope_head_dim]``: the normalised
compressed KV (never rotated) followed by the shared rope key ``k_pe``. Only the last
``qk_rope_head_dim`` dims rotate, with frequencies over ``qk_rope_head_dim`` (HF sets
``config.head_dim = qk_rope_head_dim``). Transformers 5.24 keeps the two parts as separate
cache tensors (latent as "keys", ``k_pe`` as "values"); engines such as vLLM store them
concatenated, which is the layout a spec describes. Layout of the rotated part as cached:

- ``deepseek_v2``: ``apply_rotary_emb`` multiplies interleaved pairs as complex numbers
  and keeps them interleaved -> ``gptj``.
- ``deepseek_v3``: with ``rope_interleave=True`` (the default) HF reads the projection as
  interleaved pairs but writes the rotated result de-interleaved (evens, then odds);
  without it, it uses ``rotate_half``. Either way the cached ``k_pe`` is half-split ->
  ``neox``. Engines that rotate in place (vLLM's DeepSeek path) keep pairs interleaved and
  need ``layout="gptj"``.

YaRN in DeepSeek configs sets ``mscale == mscale_all_dim`` (1.0), so ``attention_scaling``
is 1.0 and the length correction moves into the softmax scale instead:
``qk_head_dim ** -0.5 * (0.1 * mscale_all_dim * ln(factor) + 1) ** 2``. That scale acts
on Q·K, not on cached K, so it is not part of the spec.

Reading configs
---------------
A ``PretrainedConfig`` has its class defaults applied already. A config.json mapping is
read with the rules the transformers config classes apply (``rope_scaling`` wins over
``rope_parameters``; ``rope_theta`` / ``partial_rotary_factor`` inside it win over
top-level keys; ``type`` is the old name of ``rope_type``; a top-level
``original_max_position_embeddings`` wins for llama3 / yarn / longrope), plus the class
defaults of the families in ``_FAMILIES``. For other model types a missing ``rope_theta``
is an error rather than a guess. Layout comes from the family (unknown: neox, what
``rotate_half`` models use) unless ``layout=`` is given.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Layout = Literal["neox", "gptj"]

_DIGEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary-embedding parameters of one model's attention layers."""

    head_dim: int
    rotary_dim: int
    inv_freq: tuple[float, ...]
    layout: Layout = "neox"
    rotary_offset: int = 0
    attention_scaling: float = 1.0
    scaling_type: str = "default"

    def __post_init__(self) -> None:
        for name in ("head_dim", "rotary_dim", "rotary_offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be positive and even, got {self.rotary_dim}")
        if self.rotary_offset < 0 or self.rotary_offset + self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_offset {self.rotary_offset} + rotary_dim {self.rotary_dim} "
                f"exceeds head_dim {self.head_dim}"
            )
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(
                f"inv_freq has {len(self.inv_freq)} entries, expected rotary_dim // 2 = "
                f"{self.rotary_dim // 2}"
            )
        if not all(_is_real(f) and math.isfinite(f) and f >= 0 for f in self.inv_freq):
            raise ValueError(f"inv_freq must be finite numbers >= 0, got {self.inv_freq}")
        # Round to fp32 once here so equality, digest and tensor all see the kernel's values.
        fp32 = torch.tensor(self.inv_freq, dtype=torch.float32).tolist()
        object.__setattr__(self, "inv_freq", tuple(fp32))
        if self.layout not in ("neox", "gptj"):
            raise ValueError(f"layout must be 'neox' or 'gptj', got {self.layout!r}")
        scale = self.attention_scaling
        if not (_is_real(scale) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"attention_scaling must be a positive number, got {scale!r}")
        object.__setattr__(self, "attention_scaling", float(scale))
        if not isinstance(self.scaling_type, str) or not self.scaling_type:
            raise ValueError(f"scaling_type must be a non-empty str, got {self.scaling_type!r}")

    @classmethod
    def default(
        cls,
        head_dim: int,
        theta: float = 10000.0,
        rotary_dim: int | None = None,
        *,
        layout: Layout = "neox",
    ) -> RopeSpec:
        """Unscaled RoPE with base ``theta`` over ``rotary_dim`` (default: all) dims."""
        rd = head_dim if rotary_dim is None else rotary_dim
        if rd <= 0 or rd % 2:
            raise ValueError(f"rotary_dim must be positive and even, got {rd}")
        inv = _inv_freq_default(theta, rd)
        return cls(head_dim=head_dim, rotary_dim=rd, inv_freq=_as_tuple(inv), layout=layout)

    @classmethod
    def mla(
        cls,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        theta: float = 10000.0,
        *,
        layout: Layout = "neox",
        inv_freq: tuple[float, ...] | None = None,
        attention_scaling: float = 1.0,
        scaling_type: str = "default",
    ) -> RopeSpec:
        """MLA latent ``[kv_lora_rank | qk_rope_head_dim]``; only the trailing part rotates."""
        if not isinstance(kv_lora_rank, int) or kv_lora_rank <= 0:
            raise ValueError(f"kv_lora_rank must be a positive int, got {kv_lora_rank!r}")
        if not isinstance(qk_rope_head_dim, int) or qk_rope_head_dim <= 0 or qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be a positive even int, got {qk_rope_head_dim!r}"
            )
        freqs = (
            _as_tuple(_inv_freq_default(theta, qk_rope_head_dim)) if inv_freq is None else inv_freq
        )
        return cls(
            head_dim=kv_lora_rank + qk_rope_head_dim,
            rotary_dim=qk_rope_head_dim,
            inv_freq=freqs,
            layout=layout,
            rotary_offset=kv_lora_rank,
            attention_scaling=attention_scaling,
            scaling_type=scaling_type,
        )

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any] | PretrainedConfig,
        *,
        seq_len: int | None = None,
        layout: Layout | None = None,
    ) -> RopeSpec:
        """Spec equal to transformers' RoPE for ``config`` (config.json dict or PretrainedConfig).

        ``seq_len`` (max position id + 1 of a forward) matters for ``dynamic`` and
        ``longrope`` only; None means the frequencies HF's rotary module holds at init.
        ``layout`` overrides the family's layout (see the module docstring).
        """
        if seq_len is not None and (
            not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0
        ):
            raise ValueError(f"seq_len must be a positive int or None, got {seq_len!r}")
        if layout is not None and layout not in ("neox", "gptj"):
            raise ValueError(f"layout must be 'neox', 'gptj' or None, got {layout!r}")
        view = _ConfigView(config)
        family = _FAMILIES.get(view.model_type, _UNKNOWN_FAMILY)
        chosen: Layout = layout if layout is not None else family.layout
        if family.fixed_sinusoid:
            return _gptj_spec(view, chosen)
        if family.mla:
            kv_lora_rank = _int_field(view, "kv_lora_rank")
            rope_dim = _int_field(view, "qk_rope_head_dim")
            inv, scale, rope_type = _scaled_inv_freq(view, family, rope_dim, seq_len)
            return cls.mla(
                kv_lora_rank,
                rope_dim,
                layout=chosen,
                inv_freq=_as_tuple(inv),
                attention_scaling=scale,
                scaling_type=rope_type,
            )
        if view.get("kv_lora_rank") is not None:
            raise ValueError(
                f"config has kv_lora_rank (MLA) but model_type {view.model_type!r} is not a "
                "known MLA family; build the spec with RopeSpec.mla(...)"
            )
        head_dim = _head_dim(view, family)
        inv, scale, rope_type = _scaled_inv_freq(view, family, head_dim, seq_len)
        rotary_dim = 2 * inv.numel() if rope_type != "proportional" else head_dim
        return cls(
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            inv_freq=_as_tuple(inv),
            layout=chosen,
            attention_scaling=scale,
            scaling_type=rope_type,
        )

    def inv_freq_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Frequencies as an fp32 tensor ``[rotary_dim // 2]`` on ``device``."""
        return torch.tensor(self.inv_freq, dtype=torch.float32, device=device)

    def digest(self) -> bytes:
        """Stable 16-byte digest of every field (xxh3-128 over a fixed little-endian encoding)."""
        # Imported here: the kernels need only torch and triton (a bare GPU image runs them).
        import xxhash

        kind = self.scaling_type.encode()
        h = xxhash.xxh3_128()
        h.update(
            struct.pack(
                "<4sBIIIdBI",
                b"rope",
                _DIGEST_VERSION,
                self.head_dim,
                self.rotary_dim,
                self.rotary_offset,
                self.attention_scaling,
                0 if self.layout == "neox" else 1,
                len(kind),
            )
        )
        h.update(kind)
        # fp32 values, as the kernels use them.
        h.update(struct.pack(f"<{len(self.inv_freq)}f", *self.inv_freq))
        return h.digest()


# --------------------------------------------------------------------------- config reading


@dataclass(frozen=True, slots=True)
class _Family:
    """Class defaults and conventions of one transformers model family."""

    layout: Layout = "neox"
    theta: float | None = None  # class default when the config names none (None: required)
    partial_rotary_factor: float | None = None
    head_dim: int | None = None  # class default when the key is absent
    original_max_position_embeddings: int | None = None  # class attribute that always wins
    theta_key: str = "rope_theta"
    partial_key: str = "partial_rotary_factor"
    longrope_aliases: tuple[str, ...] = ()  # old rope types the config class maps to longrope
    mla: bool = False
    fixed_sinusoid: bool = False  # GPT-J/CodeGen: theta 10000, no scaling, `rotary_dim` dims


_UNKNOWN_FAMILY = _Family()
_THETA_10K = _Family(theta=10000.0)
_FAMILIES: dict[str, _Family] = {
    "llama": _THETA_10K,
    "mistral": _THETA_10K,
    "qwen2": _THETA_10K,
    "qwen2_moe": _THETA_10K,
    "qwen3": _Family(theta=10000.0, head_dim=128),
    "mixtral": _Family(theta=1000000.0),
    "gemma": _Family(theta=10000.0, head_dim=256),
    "phi": _Family(theta=10000.0, partial_rotary_factor=0.5),
    "phi3": _Family(
        theta=10000.0, original_max_position_embeddings=4096, longrope_aliases=("su", "yarn")
    ),
    "stablelm": _Family(theta=10000.0, partial_rotary_factor=0.25),
    "gpt_neox": _Family(
        theta=10000.0,
        partial_rotary_factor=0.25,
        theta_key="rotary_emb_base",
        partial_key="rotary_pct",
    ),
    "cohere": _Family(layout="gptj", theta=500000.0),
    "glm": _Family(layout="gptj", theta=10000.0, partial_rotary_factor=0.5, head_dim=128),
    "gptj": _Family(layout="gptj", fixed_sinusoid=True),
    "codegen": _Family(layout="gptj", fixed_sinusoid=True),
    "deepseek_v2": _Family(layout="gptj", theta=10000.0, mla=True),
    "deepseek_v3": _Family(layout="neox", theta=10000.0, mla=True),
}

# Old config.json files (GPT-J, GPT-2 style) use the short names.
_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
}


class _ConfigView:
    """Uniform read access to a config.json mapping or a PretrainedConfig object."""

    __slots__ = ("_config", "is_mapping")

    def __init__(self, config: object) -> None:
        self.is_mapping = isinstance(config, Mapping)
        if not self.is_mapping and not hasattr(config, "to_dict"):
            raise ValueError(
                f"config must be a Mapping or a transformers PretrainedConfig, got {type(config)}"
            )
        self._config = config

    @property
    def model_type(self) -> str:
        value = self.get("model_type")
        return value if isinstance(value, str) else ""

    def has(self, name: str) -> bool:
        if isinstance(self._config, Mapping):
            return name in self._config
        return hasattr(self._config, name)

    def get(self, name: str) -> Any:
        for key in _ALIASES.get(name, (name,)):
            if isinstance(self._config, Mapping):
                value = self._config.get(key)
            else:
                value = getattr(self._config, key, None)
            if value is not None:
                return value
        return None


def _int_field(view: _ConfigView, name: str) -> int:
    value = view.get(name)
    if value is None:
        raise ValueError(f"config is missing {name!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config field {name!r} must be a positive int, got {value!r}")
    return value


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(name: str, value: object) -> int | float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"rope_parameters field {name!r} must be a number, got {value!r}")
    return value


def _number(params: Mapping[str, Any], name: str, rope_type: str) -> int | float:
    # Ints stay ints: HF keeps the config's Python type and torch promotes them the same way.
    if name not in params:
        raise ValueError(f"{rope_type} RoPE needs rope_parameters/rope_scaling field {name!r}")
    return _check_number(name, params[name])


def _head_dim(view: _ConfigView, family: _Family) -> int:
    # `head_dim or hidden_size // num_attention_heads`, as every HF rope function reads it.
    if view.is_mapping and not view.has("head_dim") and family.head_dim is not None:
        return family.head_dim
    head_dim = view.get("head_dim")
    if head_dim:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise ValueError(f"config field 'head_dim' must be a positive int, got {head_dim!r}")
        return head_dim
    return _int_field(view, "hidden_size") // _int_field(view, "num_attention_heads")


def _rope_parameters(view: _ConfigView, family: _Family) -> tuple[dict[str, Any], str]:
    """Standardized copy of the config's rope parameters and the rope type."""
    if view.is_mapping:
        raw = view.get("rope_scaling") or view.get("rope_parameters") or {}
    else:
        raw = view.get("rope_parameters") or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"rope_parameters/rope_scaling must be a mapping, got {raw!r}")
    if any(isinstance(v, Mapping) for v in raw.values()):
        raise ValueError(
            f"rope_parameters per layer type ({sorted(raw)}) are not supported; "
            "build one spec per layer type"
        )
    params = dict(raw)  # never mutate the caller's config
    if "rope_theta" not in params:
        top = view.get(family.theta_key)
        params["rope_theta"] = top if top is not None else family.theta
    if params["rope_theta"] is None:
        raise ValueError(
            f"config has no 'rope_theta' and model_type {view.model_type!r} has no known default"
        )
    if "partial_rotary_factor" not in params:
        prf = view.get(family.partial_key)
        if prf is None and view.is_mapping:
            prf = family.partial_rotary_factor
        if prf is not None:
            params["partial_rotary_factor"] = prf
    rope_type = params["rope_type"] if "rope_type" in params else params.get("type", "default")
    if not isinstance(rope_type, str):
        raise ValueError(f"rope_type must be a string, got {rope_type!r}")
    if rope_type in family.longrope_aliases:
        rope_type = "longrope"
    if rope_type in ("llama3", "yarn", "longrope"):
        # HF gives a top-level `original_max_position_embeddings` (Phi-3) priority.
        if view.has("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = view.get(
                "original_max_position_embeddings"
            )
        elif view.is_mapping and family.original_max_position_embeddings is not None:
            params["original_max_position_embeddings"] = family.original_max_position_embeddings
        elif "original_max_position_embeddings" not in params:
            params["original_max_position_embeddings"] = _int_field(view, "max_position_embeddings")
    return params, rope_type


def _scaled_inv_freq(
    view: _ConfigView, family: _Family, head_dim: int, seq_len: int | None
) -> tuple[torch.Tensor, float, str]:
    """inv_freq, attention scaling and rope type, as transformers computes them."""
    params, rope_type = _rope_parameters(view, family)
    base = _number(params, "rope_theta", rope_type)
    prf = params.get("partial_rotary_factor", 1.0)
    if not isinstance(prf, (int, float)) or isinstance(prf, bool) or not 0 < prf <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {prf!r}")
    dim = int(head_dim * prf)
    if rope_type != "proportional" and (dim <= 0 or dim % 2):
        raise ValueError(
            f"rotary dims int(head_dim {head_dim} * partial_rotary_factor {prf}) = {dim} "
            "must be positive and even"
        )
    if rope_type == "default":
        return _inv_freq_default(base, dim), 1.0, rope_type
    if rope_type == "linear":
        inv = _inv_freq_default(base, dim)
        inv /= _number(params, "factor", rope_type)
        return inv, 1.0, rope_type
    if rope_type == "dynamic":
        factor = _number(params, "factor", rope_type)
        max_pos = _int_field(view, "max_position_embeddings")
        return _inv_freq_dynamic(base, dim, factor, max_pos, seq_len), 1.0, rope_type
    if rope_type == "llama3":
        return _inv_freq_llama3(base, dim, params), 1.0, rope_type
    if rope_type == "yarn":
        inv, scale = _yarn(base, dim, params, view)
        return inv, scale, rope_type
    if rope_type == "longrope":
        inv, scale = _longrope(base, dim, params, view, seq_len)
        return inv, scale, rope_type
    if rope_type == "proportional":
        factor = _check_number("factor", params.get("factor", 1.0))
        return _inv_freq_proportional(base, head_dim, prf, factor), 1.0, rope_type
    raise ValueError(f"unknown rope type {rope_type!r} (rope_parameters/rope_scaling 'rope_type')")


def _gptj_spec(view: _ConfigView, layout: Layout) -> RopeSpec:
    # GPT-J / CodeGen ignore rope_theta and rope_scaling: base 10000 over `rotary_dim` dims.
    head_dim = _int_field(view, "hidden_size") // _int_field(view, "num_attention_heads")
    rotary_dim = view.get("rotary_dim")
    if rotary_dim is None:
        # HF sizes its table by hidden_size then, which only runs when there is one head.
        rotary_dim = head_dim
    if (
        not isinstance(rotary_dim, int)
        or rotary_dim <= 0
        or rotary_dim % 2
        or rotary_dim > head_dim
    ):
        raise ValueError(f"rotary_dim must be a positive even int <= head_dim, got {rotary_dim!r}")
    # int64 arange / int promotes to fp32, as in GPT-J's create_sinusoidal_positions.
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64) / rotary_dim))
    return RopeSpec(
        head_dim=head_dim, rotary_dim=rotary_dim, inv_freq=_as_tuple(inv), layout=layout
    )


# --------------------------------------------------------------------------- frequency math
# Each function repeats transformers' tensor ops in the same order and dtypes, so the fp32
# results are bit-identical (modeling_rope_utils.py and the models' default rope).


def _as_tuple(inv: torch.Tensor) -> tuple[float, ...]:
    return tuple(inv.to(torch.float32).tolist())


def _arange_exponent(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim


def _inv_freq_default(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** _arange_exponent(dim))


def _inv_freq_dynamic(
    base: float, dim: int, factor: float, max_pos: int, seq_len: int | None
) -> torch.Tensor:
    exponent = dim / (dim - 2)
    if seq_len is None or seq_len <= max_pos:
        # HF's init value; its forward only recomputes when the length grows past it.
        new_base: float | torch.Tensor = (
            base * ((factor * max_pos / max_pos) - (factor - 1)) ** exponent
        )
    else:
        # dynamic_rope_update passes seq_len as an int64 tensor: this theta is fp32.
        length = torch.tensor(seq_len, dtype=torch.int64)
        length = torch.maximum(length, torch.tensor(max_pos, dtype=length.dtype))
        new_base = base * ((factor * length / max_pos) - (factor - 1)) ** exponent
    return 1.0 / (new_base ** _arange_exponent(dim))


def _inv_freq_llama3(base: float, dim: int, params: Mapping[str, Any]) -> torch.Tensor:
    factor = _number(params, "factor", "llama3")
    low_freq_factor = _number(params, "low_freq_factor", "llama3")
    high_freq_factor = _number(params, "high_freq_factor", "llama3")
    old_context_len = _number(params, "original_max_position_embeddings", "llama3")
    if high_freq_factor == low_freq_factor:
        raise ValueError("llama3 RoPE needs high_freq_factor != low_freq_factor")
    inv_freq = _inv_freq_default(base, dim)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    base: float, dim: int, params: Mapping[str, Any], view: _ConfigView
) -> tuple[torch.Tensor, float]:
    if "factor" not in params:
        raise ValueError("yarn RoPE needs rope_parameters/rope_scaling field 'factor'")
    original = _number(params, "original_max_position_embeddings", "yarn")
    factor = params["factor"]
    if factor is None:
        # DeepSeek-style: the ratio of the context lengths.
        factor = _int_field(view, "max_position_embeddings") / original
    factor = _check_number("factor", factor)
    attention_factor = params.get("attention_factor")
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = _yarn_mscale(factor)
    attention_factor = _check_number("attention_factor", attention_factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        # The dim index whose wavelength fits `num_rotations` times in the original context.
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low: float = correction_dim(beta_fast)
    high: float = correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _longrope(
    base: float, dim: int, params: Mapping[str, Any], view: _ConfigView, seq_len: int | None
) -> tuple[torch.Tensor, float]:
    original = _number(params, "original_max_position_embeddings", "longrope")
    factors: dict[str, list[float]] = {}
    for name in ("short_factor", "long_factor"):
        value = params.get(name)
        if not isinstance(value, (list, tuple)) or len(value) != dim // 2:
            raise ValueError(
                f"longrope RoPE needs {name!r} as a list of {dim // 2} numbers, got {value!r}"
            )
        factors[name] = list(value)
    factor = params.get("factor")
    if factor is None:
        # Phi-3 style: the ratio of the context lengths.
        factor = _int_field(view, "max_position_embeddings") / original
    factor = _check_number("factor", factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    attention_factor = _check_number("attention_factor", attention_factor)
    chosen = "long_factor" if seq_len and seq_len > original else "short_factor"
    ext_factors = torch.tensor(factors[chosen], dtype=torch.float32)
    inv_freq = 1.0 / (ext_factors * base ** _arange_exponent(dim))
    return inv_freq, float(attention_factor)


def _inv_freq_proportional(base: float, head_dim: int, prf: float, factor: float) -> torch.Tensor:
    # Gemma-4 style: the first angles use exponents over the whole head, the rest stay 0
    # (identity pairs), so the spec rotates all dims and zeros leave the nope pairs alone.
    rope_angles = int(prf * head_dim // 2)
    exponent = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).to(dtype=torch.float)
    inv_freq = 1.0 / (base ** (exponent / head_dim))
    nope_angles = head_dim // 2 - rope_angles
    if nope_angles > 0:
        inv_freq = torch.cat((inv_freq, torch.zeros(nope_angles, dtype=torch.float32)))
    inv_freq /= factor
    return inv_freq
