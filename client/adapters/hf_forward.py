"""A layer-by-layer prefill of a Llama-family transformers model over partly cached KV.

Transformers' own forward computes every token of its input at every layer. Reuse with
selective recompute needs a different shape of work: at layer l only the *running*
tokens (misses, plus the reused tokens the policy still recomputes) are computed, their
queries attend to the whole prompt (cached KV where a token is not running), and their
fresh K and V overwrite the cached rows. This module drives the model's own submodules
(norms, projections, MLP, rotary table, LM head) through that loop, so the weights and
the arithmetic are the model's; only the attention call and the token bookkeeping are
here.

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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import transformers
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from nopecache.client.adapters.recompute import LayerState, RecomputePolicy, ReuseLayout
from nopecache.client.errors import InvalidArgumentError, NopecacheError

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
SUPPORTED_TRANSFORMERS_MAJOR = 5
SUPPORTED_ATTENTION = frozenset({"sdpa", "eager"})
# Frequencies that change with the sequence length would make a cached K depend on the
# length of the prompt it was computed in, not only on its position.
UNSUPPORTED_ROPE_TYPES = frozenset({"dynamic", "longrope"})
PROBE_TOKENS = 16
"""Last prompt tokens whose attention an attention-weighted policy reads."""


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same operations in the same order as transformers' apply_rotary_pos_emb, so a token
    # computed here matches the model's own forward bit for bit.
    return (x * cos) + (_rotate_half(x) * sin)


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


PolicyHook = Callable[[LayerState], torch.Tensor]


def _probe_attention(
    stack: LlamaStack,
    layer: _Layer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    running: torch.Tensor,
    k_layer: torch.Tensor,
    pi_rows: torch.Tensor,
) -> torch.Tensor:
    """Mean attention ``[kv_heads, n]`` the last running tokens pay to the ``pi_rows``.

    ``x``, ``cos``, ``sin`` are the layer's normed input and rotary tables of the running
    tokens; the prompt's last tokens are misses, so they are always running.
    """
    m = min(PROBE_TOKENS, int(running.numel()))
    q = layer.q_proj(x[:, -m:]).view(1, m, stack.num_heads, stack.head_dim).transpose(1, 2)
    probe_q = _apply_rope(q, cos[:, :, -m:], sin[:, :, -m:])[0]  # [heads, m, dim]
    group = stack.num_heads // stack.num_kv_heads
    keys = k_layer.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, T, dim]
    logits = torch.matmul(probe_q, keys.transpose(1, 2)) * stack.scaling
    future = torch.arange(k_layer.shape[0])[None, :] > running[-m:, None]
    probs = logits.masked_fill(future, -torch.inf).softmax(-1)  # [heads, m, T]
    per_head = probs[:, :, pi_rows].mean(1)  # [heads, n]
    return per_head.view(stack.num_kv_heads, group, -1).mean(1)


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

    # Running tokens: misses always; reused PI tokens as the policy says; prefix never.
    pi_start = policy.initial(layout, stack.num_layers)
    is_pi = torch.zeros(tokens, dtype=torch.bool)
    is_pi[layout.pi_tokens[pi_start]] = True
    running = (~reused | is_pi).nonzero().squeeze(1)
    pi_of_token = torch.full((tokens,), -1, dtype=torch.int64)
    pi_of_token[layout.pi_tokens] = torch.arange(layout.num_pi)
    checks = policy.check_layers()
    cos_all, sin_all = stack.rope_tables(tokens)
    hidden = stack.embed(input_ids.to(stack.device)[running][None])
    computed = torch.zeros(stack.num_layers, dtype=torch.int64)
    recomputed = torch.zeros(stack.num_layers, dtype=torch.int64)

    for index, layer in enumerate(stack.layers):
        n = int(running.numel())
        full = n == tokens
        running_pi = running[pi_of_token[running] >= 0]
        computed[index] = n
        recomputed[index] = running_pi.numel()
        x = layer.input_norm(hidden)
        k = layer.k_proj(x).view(1, n, stack.num_kv_heads, stack.head_dim).transpose(1, 2)
        v = layer.v_proj(x).view(1, n, stack.num_kv_heads, stack.head_dim).transpose(1, 2)
        if nope is not None:
            nope[index, running] = k[0].transpose(0, 1)
        cos = (cos_all if full else cos_all[:, running])[:, None]
        sin = (sin_all if full else sin_all[:, running])[:, None]
        k = _apply_rope(k, cos, sin)
        k_rows, v_rows = k[0].transpose(0, 1), v[0].transpose(0, 1)  # [n, kv_heads, dim]

        k_out[index, running] = k_rows
        v_out[index, running] = v_rows
        keep: torch.Tensor | None = None
        if index in checks and running_pi.numel():
            at = (pi_of_token[running] >= 0).nonzero().squeeze(1)
            assert cached_k is not None and cached_v is not None  # reused tokens need them
            state = LayerState(
                layer=index,
                num_layers=stack.num_layers,
                layout=layout,
                running=pi_of_token[running_pi],
                fresh_k=k_rows[at],
                fresh_v=v_rows[at],
                cached_k=cached_k[index, running_pi],
                cached_v=cached_v[index, running_pi],
                attention=(
                    _probe_attention(stack, layer, x, cos, sin, running, k_out[index], running_pi)
                    if policy.wants_attention
                    else None
                ),
            )
            keep = torch.ones(n, dtype=torch.bool)
            keep[at] = policy.narrow(state)

        keys = k_out[index].transpose(0, 1)[None]  # [1, kv_heads, T, dim]
        values = v_out[index].transpose(0, 1)[None]
        if keep is not None:
            # Queries, attention and MLP only for the tokens that go on.
            x, cos, sin = x[:, keep], cos[:, :, keep], sin[:, :, keep]
            hidden = hidden[:, keep]
            running = running[keep]
        q = layer.q_proj(x).view(1, x.shape[1], stack.num_heads, stack.head_dim).transpose(1, 2)
        q = _apply_rope(q, cos, sin)
        if full and keep is None:
            # transformers' sdpa call for a maskless causal prefill: bit-identical output.
            attn = F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=stack.scaling, enable_gqa=True
            )
        else:
            mask = torch.arange(tokens, device=stack.device)[None, :] <= running[:, None]
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=stack.scaling, enable_gqa=True
            )
        attn = attn.transpose(1, 2).contiguous().reshape(1, int(running.numel()), -1)
        hidden = hidden + layer.o_proj(attn)
        hidden = hidden + layer.mlp(layer.post_norm(hidden))

    last = stack.norm(hidden[:, -1:])
    logits = stack.lm_head(last)[0, -1].float()
    return PrefillOutput(
        logits, k_out, v_out, computed, recomputed, layout, nope, float(policy.budget)
    )
