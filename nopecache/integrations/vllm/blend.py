"""Blend mode's claim arithmetic and start-up check (``pi_reuse="blend"``).

vLLM's connector API claims a prefix: positions ``[num_computed_tokens, end)`` that the
worker supplies before the step's forward. Blend mode claims up to the end of the last
cached hit anywhere in the prompt, gaps included, and the worker makes the whole range
right before vLLM reads it (``blend_loop.py``)::

    prompt     |local|exact hits |  miss  | PI hit | miss | PI hit |   rest   |last|
    claim            [start .................................... end)
    worker           placed as is  computed  re-rotated  ...        (vLLM computes)
                                   by the layer loop, with the policy's PI tokens

``end`` is cut at vLLM's block size and never reaches the prompt's last token. The claim
is taken when the cost model says it pays (:func:`blend_pays`); otherwise the request
gets the plain prefix claim. Once the rates are measured, the claim ends where it saves
the most (:func:`blend_saving` at each hit's end, :func:`blend_claim_ends`), not always at
the last hit: misses between the last useful hit and a small one near the prompt's end
(a chat's three-token generation prompt is a stored chunk too) are left to vLLM's own
prefill, which is faster than the layer loop, instead of costing the whole claim.

Only Llama-family models (Llama, Mistral without a sliding window, Qwen2) on vLLM's CPU
attention backend run the loop; :func:`blend_unsupported_reason` names what else stops
it. An engine that fails the check logs the reason at start-up and claims prefixes only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.client.plan import ReusePlan
from nopecache.integrations.vllm import compat
from nopecache.recompute.policies import ReuseLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "BLEND_ARCHITECTURES",
    "blend_claim_end",
    "blend_claim_ends",
    "blend_layout",
    "blend_pays",
    "blend_saving",
    "blend_unsupported_reason",
]

BLEND_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
"""vLLM model classes whose decoder layers the loop drives (see blend_loop.py)."""


def blend_claim_end(plan: ReusePlan, *, start: int, limit: int, block_size: int) -> int:
    """The end of the last hit (exact or position-independent), cut at ``limit`` and
    aligned down to a block; ``start`` when that is not past it."""
    end = plan.prefix_end
    for hit in plan.hits:
        end = max(end, hit.target.end)
    end = min(end, limit)
    end -= end % block_size
    return max(end, start)


def blend_claim_ends(plan: ReusePlan, *, start: int, limit: int, block_size: int) -> list[int]:
    """Every end a blend claim may take past ``start``, nearest first: each hit's end (exact
    or position-independent), cut at ``limit`` and aligned down to a block. The last is
    :func:`blend_claim_end`."""
    ends = {plan.prefix_end, *(hit.target.end for hit in plan.hits)}
    out = {min(end, limit) - min(end, limit) % block_size for end in ends}
    return sorted(end for end in out if end > start)


def blend_layout(
    plan: ReusePlan, start: int, end: int, loaded: torch.Tensor | None = None
) -> ReuseLayout:
    """What the layer loop sees of positions ``[0, end)``.

    ``[0, start)`` are vLLM's own (exact); ``[start, plan.prefix_end)`` are exact hits;
    position-independent hits inside ``[prefix, end)`` are the reused chunks; every other
    position is a miss. With ``loaded`` (the fetch's bool mask over the plan's tokens) a
    hit that did not load becomes misses, and the exact prefix ends at its first
    unloaded position.
    """
    prefix = min(max(start, plan.prefix_end), end)
    if loaded is not None and prefix > start:
        gaps = torch.nonzero(~loaded[start:prefix]).flatten()
        if gaps.numel():
            prefix = start + int(gaps[0])
    chunks: list[ChunkSpan] = []
    for hit in plan.hits:
        lo, hi = max(hit.target.start, prefix), min(hit.target.end, end)
        if lo >= hi:
            continue
        if loaded is not None and not bool(loaded[lo:hi].all()):
            continue
        chunks.append(ChunkSpan(lo, hi))
    return ReuseLayout(end, prefix, tuple(chunks))


def blend_saving(
    layout: ReuseLayout,
    recompute_fraction: float,
    *,
    prefill_tokens_per_s: float,
    fetch_s: float,
    loop_tokens_per_s: float | None = None,
) -> float:
    """Seconds a blend claim saves over the prefix claim of the same prompt (negative: it
    costs more); :func:`blend_pays` says when it is worth taking."""
    span = layout.num_tokens - layout.prefix_end
    loop_tokens = span - layout.num_pi * (1.0 - recompute_fraction)
    loop_rate = loop_tokens_per_s or prefill_tokens_per_s
    return span / prefill_tokens_per_s - fetch_s - loop_tokens / loop_rate


def blend_pays(
    layout: ReuseLayout,
    recompute_fraction: float,
    *,
    prefill_tokens_per_s: float,
    fetch_s: float,
    loop_tokens_per_s: float | None = None,
) -> bool:
    """True when a blend claim beats the prefix claim of the same prompt.

    Past the exact prefix, the prefix claim leaves vLLM to prefill every position of the
    range (at ``prefill_tokens_per_s``); the blend claim fetches the hits (``fetch_s``) and
    computes the misses and the policy's share of the reused tokens in the layer loop,
    at ``loop_tokens_per_s`` (the loop's measured rate; vLLM's own before any
    measurement). ``recompute_fraction`` 1 (every reused token recomputed) saves nothing
    and is still claimed: it is the setting that checks the loop against vLLM's forward.
    """
    if not layout.num_pi:
        return False
    if recompute_fraction >= 1.0:
        return True
    saving = blend_saving(
        layout,
        recompute_fraction,
        prefill_tokens_per_s=prefill_tokens_per_s,
        fetch_s=fetch_s,
        loop_tokens_per_s=loop_tokens_per_s,
    )
    return saving > 0


def blend_unsupported_reason(vllm_config: VllmConfig) -> str | None:
    """Why this engine cannot run blend mode (None: it can), from vLLM's config."""
    names = compat.architectures(vllm_config)
    if not names or names[0] not in BLEND_ARCHITECTURES:
        return (
            f"model architecture {names or None} is not one the layer loop runs "
            f"({', '.join(sorted(BLEND_ARCHITECTURES))})"
        )
    hf_config = compat.hf_text_config(vllm_config)
    window = getattr(hf_config, "sliding_window", None)
    sliding = window is not None and (
        names[0] == "MistralForCausalLM" or getattr(hf_config, "use_sliding_window", False)
    )
    layer_types = getattr(hf_config, "layer_types", None) or ()
    if sliding or any(t != "full_attention" for t in layer_types):
        return f"sliding-window attention (sliding_window={window}) is not supported"
    for norm in ("q_norm", "k_norm", "qk_norm"):
        if getattr(hf_config, f"use_{norm}", False):
            return f"attention with {norm} is not supported"
    if not compat.platform_is_cpu():
        return (
            f"platform {compat.platform_name()!r}: blend mode runs on the CPU attention "
            "backend only"
        )
    backend = compat.attention_backend_name(vllm_config)
    if backend is not None and backend != "CPU_ATTN":
        return f"attention backend {backend}: blend mode runs on CPU_ATTN only"
    return None
