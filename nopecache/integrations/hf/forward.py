"""A layer-by-layer prefill of a Llama-family transformers model over partly cached KV.

Transformers' own forward computes every token of its input at every layer. Reuse with
selective recompute needs a different shape of work: at layer l only the *running*
tokens (misses, plus the reused tokens the policy still recomputes) are computed, their
queries attend to the whole prompt (cached KV where a token is not running), and their
fresh K and V overwrite the cached rows. This module hands the model's own submodules (norms, projections, MLP, rotary table,
LM head) to the loop of ``selective.py`` (shared with the vLLM connector), so the weights
and the arithmetic are the model's; the loop does the token bookkeeping and attention.

KV buffers are in prompt order, one row per position, in the block layout::

    k[layer]  [tokens, kv_heads, head_dim]   post-RoPE K at the token's position
    v[layer]  [tokens, kv_heads, head_dim]

so a causal mask is ``key_position <= query_position`` whatever mix of cached and fresh
rows a layer holds. When every token runs (a prefill with nothing reused) the attention
is called exactly as transformers' sdpa path calls it (``is_causal``, no mask), and the
logits are bit-identical to ``model(input_ids)``.

Supported: transformers 5.x (tested with 5.24) ``LlamaForCausalLM``,
``MistralForCausalLM`` without a sliding window and ``Qwen2ForCausalLM`` without sliding
layers, with ``attn_implementation`` ``sdpa`` or ``eager`` and RoPE types whose
frequencies do not depend on the sequence length. Anything else raises
:class:`UnsupportedModelError` when the adapter is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel

from nopecache.client.errors import InvalidArgumentError, NopecacheError
from nopecache.recompute.policies import RecomputePolicy, ReuseLayout
from nopecache.recompute.selective import run_selective

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
SUPPORTED_TRANSFORMERS_MAJOR = 5
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager"})
# Frequencies that change with the sequence length would make a cached K depend on the
# length of the prompt it was computed in, not only on its position.
UNSUPPORTED_ROPE_TYPES = frozenset({"dynamic", "longrope"})


class UnsupportedModelError(NopecacheError, TypeError):
    """The model is not one this adapter can run (architecture, options or library version)."""


@dataclass(frozen=True, slots=True)
class _Layer:
    """Typed handles to one decoder layer's submodules."""

    input_norm: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    post_norm: nn.Module
    mlp: nn.Module


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _module(owner: nn.Module, name: str, kind: type[ModuleT]) -> ModuleT:
    sub = getattr(owner, name, None)
    if not isinstance(sub, kind):
        raise UnsupportedModelError(
            f"model: {type(owner).__name__}.{name} is not a {kind.__name__} "
            f"(got {type(sub).__name__}); the layout is not Llama's"
        )
    return sub


def check_supported(model: PreTrainedModel) -> None:
    """Raise :class:`UnsupportedModelError` unless this adapter can run ``model`` exactly."""
    major = int(transformers.__version__.split(".")[0])
    if major != SUPPORTED_TRANSFORMERS_MAJOR:
        raise UnsupportedModelError(
            f"transformers {transformers.__version__}: supported are "
            f"{SUPPORTED_TRANSFORMERS_MAJOR}.x releases (tested with 5.24)"
        )
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model.config.model_type: {model_type!r} is not supported; supported are "
            f"{sorted(SUPPORTED_MODEL_TYPES)} (Llama-family attention without K/Q norms)"
        )
    window = getattr(config, "sliding_window", None)
    if window is not None and (
        model_type == "mistral" or getattr(config, "use_sliding_window", False)
    ):
        raise UnsupportedModelError(
            f"model.config.sliding_window: {window} (sliding-window attention "
            "is not supported; every query here attends to the whole prompt)"
        )
    attn = getattr(config, "_attn_implementation", None)
    if attn not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"model.config._attn_implementation: {attn!r}; supported are "
            f"{sorted(SUPPORTED_ATTENTION)}"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"model.config.rope_parameters: rope_type {rope_type!r} changes frequencies with "
            "the sequence length, so cached K would depend on the prompt length"
        )
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise UnsupportedModelError("model: no lm_head Linear (expected a *ForCausalLM model)")


class LlamaStack:
    """The submodules of a Llama-family causal LM, and the prefill loop over them."""

    def __init__(self, model: PreTrainedModel) -> None:
        check_supported(model)
        config = model.config
        base = _module(model, "model", nn.Module)
        self.model = model
        self.embed = _module(base, "embed_tokens", nn.Embedding)
        self.norm = _module(base, "norm", nn.Module)
        self.rotary = _module(base, "rotary_emb", nn.Module)
        self.lm_head = _module(model, "lm_head", nn.Linear)
        layers = _module(base, "layers", nn.ModuleList)
        self.layers: list[_Layer] = []
        for layer in layers:
            attn = _module(layer, "self_attn", nn.Module)
            for forbidden in ("q_norm", "k_norm"):
                if hasattr(attn, forbidden):
                    raise UnsupportedModelError(
                        f"model: attention has {forbidden}; K is not the k_proj output"
                    )
            self.layers.append(
                _Layer(
                    _module(layer, "input_layernorm", nn.Module),
                    _module(attn, "q_proj", nn.Linear),
                    _module(attn, "k_proj", nn.Linear),
                    _module(attn, "v_proj", nn.Linear),
                    _module(attn, "o_proj", nn.Linear),
                    _module(layer, "post_attention_layernorm", nn.Module),
                    _module(layer, "mlp", nn.Module),
                )
            )
        self.num_layers = len(self.layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        head_dim = getattr(config, "head_dim", None)
        self.head_dim = int(head_dim or config.hidden_size // config.num_attention_heads)
        self.scaling = self.head_dim**-0.5
        self.dtype: torch.dtype = self.embed.weight.dtype
        self.device: torch.device = self.embed.weight.device

    def kv_shape(self, tokens: int) -> tuple[int, int, int, int]:
        """Shape of K (and V) for ``tokens`` tokens: ``[layers, tokens, kv_heads, head_dim]``."""
        return (self.num_layers, tokens, self.num_kv_heads, self.head_dim)

    def rope_tables(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's cos and sin ``[1, tokens, head_dim]`` for positions ``0..tokens-1``."""
        positions = torch.arange(tokens, device=self.device)[None]
        probe = torch.empty((1, tokens, 1), dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, position_ids=positions)
        return cos, sin

    def rotate_keys(self, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE K ``[n, kv_heads, head_dim]`` rotated to ``positions`` as this stack's
        prefill rotates every layer's K (the model's rotary table, transformers' order)."""
        probe = torch.empty((1, k.shape[0], 1), dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, position_ids=positions.to(self.device)[None])
        return _apply_rope(k, cos[0][:, None], sin[0][:, None])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same operations in the same order as transformers' apply_rotary_pos_emb, so a token
    # computed here matches the model's own forward bit for bit.
    return (x * cos) + (_rotate_half(x) * sin)


class _HFProjection:
    """K/V of the running tokens now, their queries once the policy has narrowed them."""

    def __init__(
        self,
        stack: LlamaStack,
        layer: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        capture: bool,
    ) -> None:
        n = x.shape[0]
        self._stack, self._layer, self._x, self._cos, self._sin = stack, layer, x, cos, sin
        k = layer.k_proj(x).view(n, stack.num_kv_heads, stack.head_dim)
        self.v = layer.v_proj(x).view(n, stack.num_kv_heads, stack.head_dim)
        self.nope_k = k if capture else None
        self.k = _apply_rope(k, cos, sin)

    def queries(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Post-RoPE queries of ``rows`` (computed here: only for the tokens that go on)."""
        x, cos, sin = self._x, self._cos, self._sin
        if rows is not None:
            x, cos, sin = x[rows], cos[rows], sin[rows]
        stack = self._stack
        q = self._layer.q_proj(x).view(x.shape[0], stack.num_heads, stack.head_dim)
        return _apply_rope(q, cos, sin)


class _HFStackRun:
    """LlamaStack as the selective loop's Stack for one prompt (its rotary tables)."""

    def __init__(self, stack: LlamaStack, tokens: int, capture: bool) -> None:
        self.stack = stack
        self.num_layers = stack.num_layers
        self.num_heads = stack.num_heads
        self.num_kv_heads = stack.num_kv_heads
        self.head_dim = stack.head_dim
        self.scaling = stack.scaling
        self.dtype = stack.dtype
        self.device = stack.device
        cos, sin = stack.rope_tables(tokens)
        self._cos, self._sin = cos[0], sin[0]  # [tokens, head_dim]
        self._capture = capture

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stack.embed(ids)

    def attention_input(
        self, layer: int, stream: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return stream, self.stack.layers[layer].input_norm(stream)

    def project(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> _HFProjection:
        cos = self._cos[positions][:, None]  # [n, 1, head_dim]
        sin = self._sin[positions][:, None]
        return _HFProjection(self.stack, self.stack.layers[layer], x, cos, sin, self._capture)

    def finish_layer(self, layer: int, stream: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        mods = self.stack.layers[layer]
        stream = stream + mods.o_proj(attn)
        return stream + mods.mlp(mods.post_norm(stream))

    def select(self, stream: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return stream[keep]


class _BufferKV:
    """The prompt's K/V as plain ``[layers, tokens, kv_heads, head_dim]`` buffers."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cached_k: torch.Tensor | None,
        cached_v: torch.Tensor | None,
    ) -> None:
        self.k, self.v, self._cached_k, self._cached_v = k, v, cached_k, cached_v

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def cached(self, index: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._cached_k is not None and self._cached_v is not None
        return self._cached_k[index, rows], self._cached_v[index, rows]

    def commit(self, index: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Nothing to do: the buffers are the KV."""


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    """Result of one prefill: last-token logits, the prompt's KV, and what it cost."""

    logits: torch.Tensor
    """``[vocab]`` logits after the prompt's last token (fp32)."""
    k: torch.Tensor
    """``[layers, tokens, kv_heads, head_dim]`` post-RoPE K of every prompt token."""
    v: torch.Tensor
    """``[layers, tokens, kv_heads, head_dim]`` V of every prompt token."""
    computed: torch.Tensor
    """``[layers]`` int64: tokens whose KV was computed at each layer (misses included)."""
    recomputed: torch.Tensor
    """``[layers]`` int64: reused position-independent tokens recomputed at each layer."""
    layout: ReuseLayout
    nope_k: torch.Tensor | None = None
    """``[layers, tokens, kv_heads, head_dim]`` pre-RoPE K, when capture was asked for
    (rows of tokens not computed at a layer are zeros)."""
    budget: float = 0.0
    """The policy's configured budget (share of the reused token-layers)."""

    @property
    def recompute_fraction(self) -> float:
        """Share of the reused position-independent token-layers that were recomputed."""
        total = self.layout.num_pi * int(self.recomputed.numel())
        return float(self.recomputed.sum()) / total if total else 0.0

    @property
    def budget_error_pp(self) -> float:
        """Realised minus configured recompute share, in percentage points (0 if none reused)."""
        if not self.layout.num_pi:
            return 0.0
        return 100.0 * (self.recompute_fraction - self.budget)


@torch.no_grad()
def selective_prefill(
    stack: LlamaStack,
    input_ids: torch.Tensor,
    layout: ReuseLayout,
    policy: RecomputePolicy,
    cached_k: torch.Tensor | None = None,
    cached_v: torch.Tensor | None = None,
    *,
    capture: bool = False,
) -> PrefillOutput:
    """Prefill ``input_ids`` ``[tokens]`` over cached KV, recomputing what ``policy`` selects.

    ``cached_k``/``cached_v`` ``[layers, tokens, kv_heads, head_dim]`` hold post-RoPE K and
    V at the rows ``layout`` marks as reused (other rows are ignored); they are not
    modified. ``layout`` must leave the last token a miss. ``capture`` also returns the
    pre-RoPE K of every computed row (what a store of the prompt needs).
    """
    tokens = int(input_ids.numel())
    if input_ids.dim() != 1 or tokens == 0:
        raise InvalidArgumentError("input_ids", f"must be 1-D and non-empty, got {input_ids.shape}")
    if layout.num_tokens != tokens:
        raise InvalidArgumentError(
            "layout", f"covers {layout.num_tokens} tokens, input_ids has {tokens}"
        )
    if bool(layout.reused_mask()[-1]):
        raise InvalidArgumentError("layout", "the last token must be a miss (it gives the logits)")
    shape = stack.kv_shape(tokens)
    if layout.reused_tokens:
        for name, t in (("cached_k", cached_k), ("cached_v", cached_v)):
            if t is None or tuple(t.shape) != shape:
                got = None if t is None else tuple(t.shape)
                raise InvalidArgumentError(name, f"shape {got}, expected {shape}")

    k_out = torch.empty(shape, dtype=stack.dtype, device=stack.device)
    v_out = torch.empty(shape, dtype=stack.dtype, device=stack.device)
    reused = layout.reused_mask()
    if cached_k is not None and cached_v is not None and layout.reused_tokens:
        rows = reused.nonzero().squeeze(1)
        k_out[:, rows] = cached_k[:, rows].to(stack.dtype)
        v_out[:, rows] = cached_v[:, rows].to(stack.dtype)
    nope = torch.zeros(shape, dtype=stack.dtype, device=stack.device) if capture else None
    run = run_selective(
        _HFStackRun(stack, tokens, capture),
        _BufferKV(k_out, v_out, cached_k, cached_v),
        input_ids,
        layout,
        policy,
        capture=nope,
    )
    last = stack.norm(run.stream[-1:])
    logits = stack.lm_head(last)[-1].float()
    return PrefillOutput(
        logits, k_out, v_out, run.computed, run.recomputed, layout, nope, float(policy.budget)
    )
