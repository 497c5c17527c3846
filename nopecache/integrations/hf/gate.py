"""The blend correctness gate on a transformers model (see ``recompute/gate.py``).

:func:`calibrate` runs the built-in calibration prompts through an :class:`HFEngine`: a
full prefill gives the reference answer; the chunk is then computed on its own (behind
the engine's sink prefix), its nope K re-rotated to its place in the prompt with the
RoPE the engine *describes* (``engine.rope``, the rotation every fetch applies) and
reused under the policy, the context reused as an exact prefix. The full prefill's own
pre-RoPE K, rotated with that description, must equal its post-RoPE K. Nothing is stored:
the gate measures the model and its RoPE description, not a server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.kernels.api import rotate
from nopecache.recompute.gate import (
    ANSWER_TOKENS,
    CALIBRATION_PROMPTS,
    DEFAULT_THRESHOLDS,
    CalibrationPrompt,
    GateThresholds,
    GateVerdict,
    judge,
    rope_error,
)
from nopecache.recompute.policies import RecomputePolicy, ReuseLayout

if TYPE_CHECKING:
    from nopecache.integrations.hf.adapter import HFEngine

__all__ = ["Tokenize", "calibrate"]

Tokenize = Callable[[str], Sequence[int]]
"""Text to token ids, without special tokens added (e.g. a tokenizer's
``lambda s: tokenizer(s, add_special_tokens=False).input_ids``)."""


def _described(engine: HFEngine, nope: torch.Tensor, at: int) -> torch.Tensor:
    """Nope K ``[layers, n, heads, dim]`` rotated to positions ``at..`` as fetches rotate it."""
    layers, n, heads, dim = nope.shape
    flat = nope.transpose(0, 1).reshape(n, layers * heads, dim).float()
    return rotate(flat, None, at, engine.rope).view(n, layers, heads, dim).transpose(0, 1)


def _pair(
    engine: HFEngine, tokenize: Tokenize, prompt: CalibrationPrompt, policy: RecomputePolicy
) -> tuple[torch.Tensor, torch.Tensor, float]:
    from nopecache.integrations.hf.adapter import ReusedKV

    context, chunk, question = (
        [int(t) for t in tokenize(text)] for text in (prompt.context, prompt.chunk, prompt.question)
    )
    tokens = context + chunk + question
    full = engine.prefill(tokens, capture=True)
    answer = engine.generate(full, ANSWER_TOKENS)
    reference = engine.continuation_logits(full, answer[:-1]).log_softmax(-1)

    assert full.nope_k is not None
    error = rope_error(_described(engine, full.nope_k, 0), full.k)

    at = len(context)
    stored = engine.chunk_kv(chunk)
    n = stored.num_tokens
    k, v = full.k.clone(), full.v.clone()  # the context rows: an exact prefix
    k[:, at : at + n] = _described(engine, stored.k_nope, at).to(k.dtype)
    v[:, at : at + n] = stored.v.to(v.dtype)
    layout = ReuseLayout(len(tokens), at, (ChunkSpan(at, at + n),))
    blended = engine.prefill(tokens, ReusedKV(k, v, layout), policy, gate=False)
    return reference, engine.continuation_logits(blended, answer[:-1]).log_softmax(-1), error


@torch.no_grad()
def calibrate(
    engine: HFEngine,
    tokenize: Tokenize,
    policy: RecomputePolicy,
    *,
    thresholds: GateThresholds = DEFAULT_THRESHOLDS,
    prompts: Sequence[CalibrationPrompt] = CALIBRATION_PROMPTS,
) -> GateVerdict:
    """Blend under ``policy`` against full prefills on ``prompts`` (see the module doc)."""
    measured = [_pair(engine, tokenize, p, policy) for p in prompts]
    pairs = [(full, blend) for full, blend, _ in measured]
    rope = max(e for _, _, e in measured)
    return judge(policy.name, pairs, thresholds.for_dtype(engine.stack.dtype), rope=rope)
