"""The blend correctness gate in a vLLM worker (the arithmetic: ``recompute/gate.py``).

At start-up in blend mode, once the worker has found the served model (``bind_model``),
:func:`calibrate` measures what the transformers gate measures, on vLLM's own modules
and weights through the plain forward of ``plain.py``:

- RoPE: in a full prefill of each calibration prompt, every layer's pre-RoPE K (vLLM's
  fused ``qkv_proj``) rotated with the RoPE the connector *describes* (``RopeSpec``: the
  rotation every store and fetch applies) must equal the K vLLM's own ``rotary_emb``
  produces (``kernels.rope_check.rotation_error``, relative to the largest |K|: the
  measure of the start-up RoPE check, ``rope_check.py``), within the model dtype's
  rounding (``GateThresholds.for_dtype``: bf16 rounds vLLM's own rotation).
- Answers: the full prefill's greedy answer (``ANSWER_TOKENS``) is the reference. The
  chunk is then computed as another request would have stored it (behind the context's
  first ``SOURCE_TOKENS`` tokens, the opening of the same system message), its post-RoPE
  K moved to its place in the prompt as the store and the fetch move it (un-rotated
  from its source positions, rotated to its target ones, both with the described RoPE),
  the context reused as an exact prefix, and the prompt blended under the configured
  policy and budget; KL(full || blend) and top-1 along the reference answer,
  teacher-forced.

:func:`judge` pools the figures against the thresholds. A refused gate leaves the engine
in prefix mode: the worker drops its layer loop and the verdict reaches the scheduler
half at start-up (vLLM's connector handshake, ``connector.py``), which then never makes
a blend claim and counts every request that would have had one (``blend_fallbacks``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from nopecache.client.chunking import ChunkSpan
from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.blend_loop import VllmStack
from nopecache.integrations.vllm.plain import PlainForward
from nopecache.kernels import RopeSpec
from nopecache.kernels.api import rotate
from nopecache.kernels.rope_check import rotation_error
from nopecache.recompute.gate import (
    ANSWER_TOKENS,
    CALIBRATION_PROMPTS,
    DEFAULT_THRESHOLDS,
    CalibrationPrompt,
    GateThresholds,
    GateVerdict,
    judge,
)
from nopecache.recompute.policies import RecomputePolicy, ReuseLayout

__all__ = ["SOURCE_TOKENS", "Tokenize", "calibrate", "moved_keys"]

SOURCE_TOKENS = 16
"""Tokens of the context the chunk is computed behind, as stored by another request."""

Tokenize = Callable[[str], Sequence[int]]
"""Text to token ids, no special tokens added."""


class _Projection:
    """Q/K/V of the running tokens (selective.Projection)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> None:
        self.k, self.v, self.q = k, v, q
        self.nope_k: torch.Tensor | None = None

    def queries(self, rows: torch.Tensor | None) -> torch.Tensor:
        return self.q if rows is None else self.q[rows]


class RopeProbeStack(VllmStack):
    """A VllmStack that checks, at every layer it projects, the described rotation of
    the model's pre-RoPE K against the post-RoPE K of the model's own rotary embedding
    (the largest :func:`rotation_error` seen is :attr:`error`)."""

    def __init__(self, model: nn.Module, rope: RopeSpec) -> None:
        """Probe ``model`` against the description ``rope``."""
        super().__init__(model)
        self.rope = rope
        self.error = 0.0

    def project(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> _Projection:
        """The layer's Q/K/V, as VllmStack's, after comparing the two rotations."""
        n = x.shape[0]
        attn = self.attns[layer]
        q, k, v = compat.qkv(attn, x)
        pre = k.reshape(n, self.num_kv_heads, self.head_dim).clone()  # rotary is in place
        q, k = compat.rope(attn, positions, q.clone(), k.clone())
        post = k.reshape(n, self.num_kv_heads, self.head_dim)
        self.error = max(self.error, rotation_error(pre, post, positions, self.rope))
        return _Projection(
            post,
            v.reshape(n, self.num_kv_heads, self.head_dim),
            q.reshape(n, self.num_heads, self.head_dim),
        )


def moved_keys(k: torch.Tensor, source: int, target: int, rope: RopeSpec) -> torch.Tensor:
    """Post-RoPE K ``[layers, n, kv_heads, head_dim]`` at positions ``source..`` moved to
    ``target..`` as a store (un-rotate) and a fetch (rotate) move it, in fp32."""
    layers, n, heads, dim = k.shape
    flat = k.transpose(0, 1).reshape(n, layers * heads, dim).float().contiguous()
    nope = rotate(flat, source, None, rope)
    return rotate(nope, None, target, rope).view(n, layers, heads, dim).transpose(0, 1)


def _pair(
    full: PlainForward,
    loop: PlainForward,
    rope: RopeSpec,
    ids: tuple[list[int], list[int], list[int]],
    policy: RecomputePolicy,
) -> tuple[torch.Tensor, torch.Tensor]:
    context, chunk, question = ids
    tokens = context + chunk + question
    kv = full.buffers(len(tokens) + ANSWER_TOKENS)
    first = full.prefill(tokens, kv)
    assert first is not None
    answer, reference = loop.greedy(tokens, kv, first, ANSWER_TOKENS)

    source = min(SOURCE_TOKENS, len(context))
    stored = loop.buffers(source + len(chunk))
    loop.prefill(context[:source] + chunk, stored, output=False)
    at, n = len(context), len(chunk)
    blended = loop.buffers(len(tokens) + ANSWER_TOKENS)
    blended.k[:, :at], blended.v[:, :at] = kv.k[:, :at], kv.v[:, :at]  # the exact prefix
    moved = moved_keys(stored.k[:, source : source + n], source, at, rope)
    blended.k[:, at : at + n] = moved.to(blended.k.dtype)
    blended.v[:, at : at + n] = stored.v[:, source : source + n]
    layout = ReuseLayout(len(tokens), at, (ChunkSpan(at, at + n),))
    first_blend = loop.prefill(tokens, blended, layout, policy)
    assert first_blend is not None
    return reference, loop.teacher_forced(tokens, blended, first_blend, answer)


@torch.no_grad()
def calibrate(
    model: nn.Module,
    tokenize: Tokenize,
    policy: RecomputePolicy,
    rope: RopeSpec,
    *,
    thresholds: GateThresholds = DEFAULT_THRESHOLDS,
    prompts: Sequence[CalibrationPrompt] = CALIBRATION_PROMPTS,
) -> GateVerdict:
    """Blend under ``policy`` against full prefills of ``model`` on ``prompts``, and the
    RoPE description ``rope`` against the model's rotary embedding (module docstring)."""
    probe = RopeProbeStack(model, rope)
    full, loop = PlainForward(model, probe), PlainForward(model)
    pairs = []
    for prompt in prompts:
        ids = tuple(
            [int(t) for t in tokenize(text)]
            for text in (prompt.context, prompt.chunk, prompt.question)
        )
        pairs.append(_pair(full, loop, rope, ids, policy))  # type: ignore[arg-type]
    return judge(policy.name, pairs, thresholds.for_dtype(probe.dtype), rope=probe.error)
