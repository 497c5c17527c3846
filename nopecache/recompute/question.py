"""Recompute chosen by the question: rank reused tokens by what the question reads of them.

The deviation policies of ``policies.py`` rank a reused token by how far its cached K/V
drifted from the fresh one; a token can drift a lot and matter little to this prompt.
:class:`QuestionAware` ranks by relevance instead (ProphetKV's idea): at an early check
layer the *question* (every token after the last reused chunk: the user's question, the
newest turn) attends over the prompt, and the reused tokens it attends to most are the
ones worth recomputing. Optionally the attention is weighted by the token's V (or K and
V) drift at that layer, which estimates the change the stale token causes in the
question's attention output (``attention * |V fresh - V cached|``).

It is paid out of the same budget with the same accounting as every other policy:
the same :class:`~nopecache.recompute.policies.Schedule` as
``selective(budget, check_layer=..., start=...)`` (chunk-start tokens, candidates run up
to the check layer, the budget left keeps the best), so ``recompute_fraction`` and
``budget_error_pp`` mean what they mean for the others. Only the ranking differs.

The question's queries come from the selective loop (``selective.run_selective``): in the
transformers adapter the question is inside the prefill (its misses run at every layer);
in vLLM's blend loop the claimed range ends before the question, so the loop runs the
question's tokens up to the check layer on the side (``lookahead``), reads their
attention, and drops them (vLLM computes them itself in its forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from nopecache.client.errors import InvalidArgumentError
from nopecache.recompute.policies import (
    LayerState,
    Probe,
    RecomputePolicy,
    ReuseLayout,
    Schedule,
    Selective,
    chunk_lengths,
    head_deviation,
    round_half_up,
    spread_equally,
    start_mask,
    top_share,
)

__all__ = ["HEADS", "QUESTION_SCORES", "QuestionAware", "question", "question_scores"]

QuestionScore = Literal["attention", "attention_v", "attention_kv"]
"""``attention``: the question's mean attention to the token; ``attention_v`` /
``attention_kv``: that times the L2 drift of the token's V (or K and V) at the check layer."""

QUESTION_SCORES: tuple[QuestionScore, ...] = ("attention", "attention_v", "attention_kv")

Heads = Literal["mean", "max"]
"""How the KV heads' scores combine: their sum (``mean``), or the largest (``max``: a token
one head reads hard is kept even if the others ignore it)."""

HEADS: tuple[Heads, ...] = ("mean", "max")


def question_scores(state: LayerState, score: QuestionScore, heads: Heads) -> torch.Tensor:
    """Rank ``[n]`` of the running reused tokens (higher = recompute first)."""
    if state.attention is None:
        raise InvalidArgumentError("state.attention", "a question score needs the attention")
    per_head = state.attention.float()  # [kv_heads, n]
    if score != "attention":
        per_head = per_head * head_deviation(state, "v" if score == "attention_v" else "kv").sqrt()
    return per_head.sum(0) if heads == "mean" else per_head.amax(0)


@dataclass(frozen=True, slots=True)
class QuestionAware(RecomputePolicy):
    """Chunk-start tokens (a ``start`` share of the budget), then the candidates the
    question attends to most at ``check_layer`` (see the module doc)."""

    budget: float
    check_layer: int = 1
    score: QuestionScore = "attention"
    start: float = 0.0
    heads: Heads = "mean"
    label: str = ""
    prescan: bool = False
    """Rank before layer 0 on the cached layer-0 keys (no candidates: see the module doc)."""

    def __post_init__(self) -> None:
        # The budget, check layer and start share are validated as Selective's.
        plan = Selective(self.budget, self.check_layer, "v", self.start)
        object.__setattr__(self, "budget", plan.budget)
        if self.check_layer is None:
            raise InvalidArgumentError("check_layer", "the question is read at a check layer")
        if not isinstance(self.prescan, bool):
            raise InvalidArgumentError("prescan", f"must be a bool, got {self.prescan!r}")
        if self.prescan and self.score != "attention":
            raise InvalidArgumentError(
                "score", "a prescan ranks by attention only (no fresh KV to compare yet)"
            )
        if self.score not in QUESTION_SCORES:
            raise InvalidArgumentError(
                "score", f"must be one of {QUESTION_SCORES}, got {self.score!r}"
            )
        if self.heads not in HEADS:
            raise InvalidArgumentError("heads", f"must be one of {HEADS}, got {self.heads!r}")

    @property
    def name(self) -> str:
        """The label, else ``question(budget,start[,layer=][,score][,max])``."""
        if self.label:
            return self.label
        extra = "".join(
            (
                f",layer={self.check_layer}" if self.check_layer != 1 else "",
                f",{self.score}" if self.score != "attention" else "",
                ",max" if self.heads == "max" else "",
                ",prescan" if self.prescan else "",
            )
        )
        return f"question({self.budget:g},{self.start:g}{extra})"

    @property
    def wants_attention(self) -> bool:
        """True: the ranking is the question's attention."""
        return True

    @property
    def probe(self) -> Probe:
        """The question's tokens."""
        return "question"

    def _plan(self) -> Selective:
        return Selective(self.budget, self.check_layer, "v", self.start)

    def schedule(self, layout: ReuseLayout, num_layers: int) -> Schedule:
        """Selective's schedule for this budget, check layer and start share; with
        ``prescan`` the chunk-start share and ``keep`` ranked tokens, all at every layer."""
        if not self.prescan:
            return self._plan().schedule(layout, num_layers)
        n = layout.num_pi
        total = round_half_up(self.budget * n)
        first = spread_equally(round_half_up(self.start * self.budget * n), chunk_lengths(layout))
        pinned = start_mask(layout, first)
        nothing = torch.zeros(n, dtype=torch.bool)
        return _PrescanSchedule(n, num_layers, pinned, nothing, None, max(0, total - sum(first)))

    def initial_ranked(
        self, layout: ReuseLayout, num_layers: int, attention: torch.Tensor
    ) -> torch.Tensor:
        """The chunk-start tokens and the ``keep`` tokens the question attends to most at
        layer 0 (prescan); :meth:`initial` otherwise."""
        if not self.prescan:
            return self.initial(layout, num_layers)
        plan = self.schedule(layout, num_layers)
        scores = attention.float()
        ranked = scores.sum(0) if self.heads == "mean" else scores.amax(0)
        return top_share(ranked.masked_fill(plan.start, -math.inf), plan.keep) | plan.start

    def check_layers(self) -> frozenset[int]:
        """The check layer (none with ``prescan``)."""
        return frozenset() if self.prescan else frozenset({self.check_layer})

    def narrow(self, state: LayerState) -> torch.Tensor:
        """Keep the chunk-start tokens and the candidates the question reads most."""
        plan = self.schedule(state.layout, state.num_layers)
        if plan.check_layer != state.layer:
            return torch.ones(state.running.shape, dtype=torch.bool)
        pinned = plan.start[state.running]
        scores = question_scores(state, self.score, self.heads).masked_fill(pinned, -math.inf)
        return top_share(scores, plan.keep) | pinned


@dataclass(frozen=True, slots=True)
class _PrescanSchedule(Schedule):
    @property
    def token_layers(self) -> int:
        """Start and kept tokens, every layer."""
        return (int(self.start.sum()) + self.keep) * self.num_layers


def question(
    budget: float,
    start: float = 0.0,
    *,
    check_layer: int = 1,
    score: QuestionScore = "attention",
    heads: Heads = "mean",
    prescan: bool = False,
) -> QuestionAware:
    """Recompute chosen by the question's attention (see :class:`QuestionAware`)."""
    return QuestionAware(budget, check_layer, score, start, heads, prescan=prescan)


def question_default(budget: float) -> QuestionAware:
    """The question-aware setting tuned on bench/quality.py's tuning half (what the engines'
    ``recompute_policy="question"`` names): half the budget on chunk starts, half on the
    tokens the question attends to most at layer 0 (prescan). On the tuning half (31
    prompts, budget 0.15, dialog sink) it closed 0.718 of the KL gap against 0.694 without
    chunk starts, 0.708 / 0.689 ranked at check layer 0 / 1, and first_k's 0.713, but kept
    10 of 13 facts against first_k's 11: not the default (``DEFAULT_POLICY``)."""
    return question(budget, 0.5, prescan=True)
