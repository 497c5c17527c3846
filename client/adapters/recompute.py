"""Recompute policies: which reused tokens a prefill computes again, and up to which layer.

Position-independent reuse is approximate after layer 0: a chunk's K and V at layer l
depend on what preceded the chunk when it was cached. A policy buys quality back by
recomputing some of the chunk's tokens in this request: a recomputed token runs the
layer like a miss (its query attends to the whole prompt) and its fresh K and V replace
the cached ones. Exact-prefix tokens are lossless and never recomputed; misses always run.

A token's hidden state exists only while it is computed from layer 0 (the cache holds
K and V, not hidden states), so the recomputed set can only shrink going up::

    layer      0    1    2   ...  L-1
    misses     ####################       every layer
    chunk A    ####################       (selected)
    chunk B    ######                     (dropped after layer 1)
    chunk C    .                          (cached KV at every layer)

A policy answers two questions, both on tensors (no per-token Python loops):

* :meth:`RecomputePolicy.initial`: which reused tokens start at layer 0;
* :meth:`RecomputePolicy.narrow`, called at each layer of :meth:`check_layers` after the
  layer's fresh K and V of the running tokens are known (and written: a token dropped
  at layer l still contributes its fresh layer-l KV): which of them keep running.

Cost is counted in token-layers: a reused token recomputed at layer l counts once for l,
the layer where it is dropped included (its K and V were computed there).

Policies here:

=====================  =========================================================
``none()``             reuse every cached token as is
``first_k(k)``         the first ``k`` tokens of every reused chunk (EPIC-style)
``deviation(r, c)``    every token up to layer ``c``, then the ``r`` share whose
                       K and V deviate most from the cached ones (CacheBlend-style)
``gradual(steps)``     deviation selections at several layers, each within the last
``blend(r, k)``        each chunk's first ``k`` tokens plus the ``r`` share whose V
                       deviates most at layer 1 (the default, ``DEFAULT_POLICY``)
``selective(...)``     the general form: steps, a score, the chunk's first tokens
=====================  =========================================================
"""

from __future__ import annotations

import abc
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import InvalidArgumentError

Score = Literal["k", "v", "kv", "kv_attention"]
"""How a step ranks running tokens (higher = recompute first):

``k`` / ``v`` / ``kv``: squared L2 distance between fresh and cached K, V or both (summed
over heads); ``kv_attention``: the ``kv`` distance of each head weighted by the attention
the prompt's last tokens pay to the token in that head, summed over heads.
"""

SCORES: tuple[Score, ...] = ("k", "v", "kv", "kv_attention")


@dataclass(frozen=True, slots=True)
class ReuseLayout:
    """Which tokens of a prompt come from the cache, and how.

    ``[0, prefix_end)`` is an exact prefix (lossless); ``chunks`` are position-independent
    reused spans (approximate), ordered, disjoint and after the prefix; every other token
    is a miss. The derived index tensors are built once here, on the CPU.
    """

    num_tokens: int
    prefix_end: int = 0
    chunks: tuple[ChunkSpan, ...] = ()
    pi_tokens: torch.Tensor = field(init=False, repr=False, compare=False)
    """Prompt positions of the position-independent reused tokens, ascending ``[n_pi]``."""
    chunk_index: torch.Tensor = field(init=False, repr=False, compare=False)
    """Which chunk each of ``pi_tokens`` belongs to ``[n_pi]``."""
    chunk_offset: torch.Tensor = field(init=False, repr=False, compare=False)
    """Offset of each of ``pi_tokens`` inside its chunk ``[n_pi]``."""

    def __post_init__(self) -> None:
        for name in ("num_tokens", "prefix_end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(name, f"must be an int >= 0, got {value!r}")
        if self.prefix_end > self.num_tokens:
            raise InvalidArgumentError(
                "prefix_end", f"{self.prefix_end} is past the prompt's {self.num_tokens} tokens"
            )
        chunks = tuple(self.chunks)
        start = self.prefix_end
        for span in chunks:
            if not isinstance(span, ChunkSpan):
                raise InvalidArgumentError("chunks", f"must be ChunkSpans, got {span!r}")
            if span.start < start:
                raise InvalidArgumentError(
                    "chunks", f"{span} overlaps the prefix or an earlier chunk (starts < {start})"
                )
            if span.end > self.num_tokens:
                raise InvalidArgumentError(
                    "chunks", f"{span} ends past the prompt's {self.num_tokens} tokens"
                )
            start = span.end
        object.__setattr__(self, "chunks", chunks)
        lengths = torch.tensor([len(s) for s in chunks], dtype=torch.int64)
        starts = torch.tensor([s.start for s in chunks], dtype=torch.int64)
        index = torch.repeat_interleave(torch.arange(len(chunks)), lengths)
        first = torch.cumsum(lengths, 0) - lengths  # index in pi_tokens of each chunk start
        offset = torch.arange(int(lengths.sum())) - first[index]
        object.__setattr__(self, "chunk_index", index)
        object.__setattr__(self, "chunk_offset", offset)
        object.__setattr__(self, "pi_tokens", starts[index] + offset)

    @property
    def num_pi(self) -> int:
        """Position-independent reused tokens."""
        return int(self.pi_tokens.numel())

    @property
    def reused_tokens(self) -> int:
        """Tokens that come from the cache (prefix and position-independent)."""
        return self.prefix_end + self.num_pi

    def reused_mask(self) -> torch.Tensor:
        """Bool ``[num_tokens]``: True where the token's KV comes from the cache."""
        mask = torch.zeros(self.num_tokens, dtype=torch.bool)
        mask[: self.prefix_end] = True
        mask[self.pi_tokens] = True
        return mask

    def without_last_token(self) -> ReuseLayout:
        """The layout with the prompt's last token made a miss (its logits must be computed)."""
        last = self.num_tokens - 1
        if last < 0:
            return self
        if self.prefix_end == self.num_tokens:
            return ReuseLayout(self.num_tokens, last, ())
        if self.chunks and self.chunks[-1].end == self.num_tokens:
            tail = self.chunks[-1]
            kept = (ChunkSpan(tail.start, last),) if len(tail) > 1 else ()
            return ReuseLayout(self.num_tokens, self.prefix_end, self.chunks[:-1] + kept)
        return self


@dataclass(frozen=True, slots=True)
class LayerState:
    """What a policy sees at a check layer: the running reused tokens' fresh and cached KV.

    K tensors are post-RoPE at the tokens' prompt positions (fresh and cached alike), so
    a distance between them does not depend on position. ``attention`` is present only
    for policies with ``wants_attention``.
    """

    layer: int
    layout: ReuseLayout
    running: torch.Tensor
    """Indices into ``layout.pi_tokens`` of the reused tokens computed at this layer ``[n]``."""
    fresh_k: torch.Tensor  # [n, kv_heads, head_dim]
    fresh_v: torch.Tensor  # [n, kv_heads, head_dim]
    cached_k: torch.Tensor  # [n, kv_heads, head_dim]
    cached_v: torch.Tensor  # [n, kv_heads, head_dim]
    attention: torch.Tensor | None = None
    """``[kv_heads, n]``: mean attention probability from the prompt's last tokens to each
    running token, over the query heads of each KV head group and over those tokens."""

    def __post_init__(self) -> None:
        n = int(self.running.numel())
        for name in ("fresh_k", "fresh_v", "cached_k", "cached_v"):
            t = getattr(self, name)
            if t.dim() != 3 or t.shape[0] != n:
                raise InvalidArgumentError(
                    f"LayerState.{name}", f"shape {tuple(t.shape)}, expected [{n}, heads, dim]"
                )
        if self.attention is not None and self.attention.shape != (self.fresh_k.shape[1], n):
            raise InvalidArgumentError(
                "LayerState.attention",
                f"shape {tuple(self.attention.shape)}, expected [{self.fresh_k.shape[1]}, {n}]",
            )


def head_deviation(state: LayerState, score: Score) -> torch.Tensor:
    """Squared distance fresh vs cached per KV head ``[kv_heads, n]`` (K, V or both)."""
    parts = []
    if score != "v":
        parts.append((state.fresh_k - state.cached_k).float().square().sum(-1))
    if score != "k":
        parts.append((state.fresh_v - state.cached_v).float().square().sum(-1))
    return torch.stack(parts).sum(0).T


def token_scores(state: LayerState, score: Score) -> torch.Tensor:
    """Rank of each running token under ``score`` (higher = recompute first) ``[n]``."""
    deviation = head_deviation(state, score)
    if score != "kv_attention":
        return deviation.sum(0)
    if state.attention is None:
        raise InvalidArgumentError("state.attention", "the kv_attention score needs attention")
    return (deviation * state.attention).sum(0)


def top_share(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Bool mask of the ``count`` highest scores; ties go to the lower index (stable sort)."""
    keep = torch.zeros(scores.shape, dtype=torch.bool)
    if count > 0:
        order = torch.argsort(scores, descending=True, stable=True)
        keep[order[:count]] = True
    return keep


def share_count(ratio: float, total: int) -> int:
    """Tokens a ratio of ``total`` stands for: ``ratio * total`` rounded half up."""
    return min(total, math.floor(ratio * total + 0.5))


class RecomputePolicy(abc.ABC):
    """Chooses the reused tokens a prefill recomputes, layer by layer (see the module doc)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Short label for tables, e.g. ``deviation(0.15)``."""

    @property
    def wants_attention(self) -> bool:
        """Whether :meth:`narrow` needs ``LayerState.attention``."""
        return False

    def check_layers(self) -> frozenset[int]:
        """Layers after whose KV :meth:`narrow` is called."""
        return frozenset()

    @abc.abstractmethod
    def initial(self, layout: ReuseLayout) -> torch.Tensor:
        """Bool ``[layout.num_pi]``: the reused tokens computed from layer 0."""

    def narrow(self, state: LayerState) -> torch.Tensor:
        """Bool ``[len(state.running)]``: the running tokens that go on to the next layer."""
        return torch.ones(state.running.shape, dtype=torch.bool)


@dataclass(frozen=True, slots=True)
class NoRecompute(RecomputePolicy):
    """Reuse every cached token as it is: only misses are computed."""

    @property
    def name(self) -> str:
        """``none``."""
        return "none"

    def initial(self, layout: ReuseLayout) -> torch.Tensor:
        """No reused token is computed."""
        return torch.zeros(layout.num_pi, dtype=torch.bool)


@dataclass(frozen=True, slots=True)
class FirstK(RecomputePolicy):
    """Recompute the first ``k`` tokens of every reused chunk at every layer (EPIC-style)."""

    k: int

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise InvalidArgumentError("k", f"must be an int >= 0, got {self.k!r}")

    @property
    def name(self) -> str:
        """``first_k(k)``."""
        return f"first_k({self.k})"

    def initial(self, layout: ReuseLayout) -> torch.Tensor:
        """Tokens whose offset inside their chunk is below ``k``."""
        return layout.chunk_offset < self.k


@dataclass(frozen=True, slots=True)
class Step:
    """At ``layer``, keep the ``ratio`` share (of all reused tokens) that scores highest."""

    layer: int
    ratio: float

    def __post_init__(self) -> None:
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise InvalidArgumentError("Step.layer", f"must be an int >= 0, got {self.layer!r}")
        if not isinstance(self.ratio, int | float) or not 0.0 <= self.ratio <= 1.0:
            raise InvalidArgumentError("Step.ratio", f"must be in [0, 1], got {self.ratio!r}")


@dataclass(frozen=True, slots=True)
class Selective(RecomputePolicy):
    """Every reused token runs from layer 0; each step keeps the highest-scoring share.

    ``steps`` are at increasing layers with non-increasing ratios (a share of all the
    prompt's position-independent tokens, so a budget does not depend on the step before).
    The first ``keep_first`` tokens of each chunk are kept by every step on top of the
    share. With one step this is CacheBlend's selection; with several, its gradual
    filtering.
    """

    steps: tuple[Step, ...]
    score: Score = "kv"
    keep_first: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        steps = tuple(self.steps)
        if not steps:
            raise InvalidArgumentError("steps", "needs at least one Step")
        for a, b in itertools.pairwise(steps):
            if b.layer <= a.layer:
                raise InvalidArgumentError("steps", f"layers must increase: {a.layer}, {b.layer}")
            if b.ratio > a.ratio:
                raise InvalidArgumentError(
                    "steps", f"ratios must not increase: {a.ratio} then {b.ratio}"
                )
        object.__setattr__(self, "steps", steps)
        if self.score not in SCORES:
            raise InvalidArgumentError("score", f"must be one of {SCORES}, got {self.score!r}")
        if isinstance(self.keep_first, bool) or not isinstance(self.keep_first, int):
            raise InvalidArgumentError("keep_first", f"must be an int, got {self.keep_first!r}")
        if self.keep_first < 0:
            raise InvalidArgumentError("keep_first", f"must be >= 0, got {self.keep_first}")

    @property
    def name(self) -> str:
        """The label, else ``selective(layer:ratio,...;score;+first)``."""
        if self.label:
            return self.label
        steps = ",".join(f"{s.layer}:{s.ratio:g}" for s in self.steps)
        first = f";+{self.keep_first}" if self.keep_first else ""
        return f"selective({steps};{self.score}{first})"

    @property
    def wants_attention(self) -> bool:
        """True for the attention-weighted score."""
        return self.score == "kv_attention"

    def check_layers(self) -> frozenset[int]:
        """The steps' layers."""
        return frozenset(s.layer for s in self.steps)

    def initial(self, layout: ReuseLayout) -> torch.Tensor:
        """Every reused token: the first step needs all their fresh KV."""
        return torch.ones(layout.num_pi, dtype=torch.bool)

    def narrow(self, state: LayerState) -> torch.Tensor:
        """Keep the step's share by score, plus each chunk's first ``keep_first`` tokens."""
        step = next(s for s in self.steps if s.layer == state.layer)
        pinned = state.layout.chunk_offset[state.running] < self.keep_first
        count = share_count(step.ratio, state.layout.num_pi)
        scores = token_scores(state, self.score)
        # Pinned tokens are kept anyway: rank the others for the share.
        scores = scores.masked_fill(pinned, -math.inf)
        return top_share(scores, min(count, int((~pinned).sum()))) | pinned


def none() -> NoRecompute:
    """No recompute: every cached token is used as is."""
    return NoRecompute()


def first_k(k: int) -> FirstK:
    """EPIC-style: recompute the first ``k`` tokens of every reused chunk."""
    return FirstK(k)


def deviation(ratio: float, check_layer: int = 1, score: Score = "kv") -> Selective:
    """CacheBlend-style: at ``check_layer`` keep the ``ratio`` share that deviates most."""
    extra = "".join(
        (f",layer={check_layer}" if check_layer != 1 else "", f",{score}" if score != "kv" else "")
    )
    return Selective((Step(check_layer, ratio),), score, label=f"deviation({ratio:g}{extra})")


def gradual(steps: Sequence[tuple[int, float]], score: Score = "kv") -> Selective:
    """CacheBlend's gradual filtering: a deviation selection at each ``(layer, ratio)``."""
    plan = ",".join(f"{layer}:{ratio:g}" for layer, ratio in steps)
    extra = f";{score}" if score != "kv" else ""
    return Selective(
        tuple(Step(layer, ratio) for layer, ratio in steps), score, label=f"gradual({plan}{extra})"
    )


def blend(ratio: float, keep_first: int = 8, check_layer: int = 1) -> Selective:
    """Each chunk's first ``keep_first`` tokens plus the ``ratio`` share whose V deviates most.

    The selection this adapter recommends (see bench/quality.py): V distance at the check
    layer ranks content tokens better than K distance, and the chunk's first tokens, where
    the chunk's own start acted as the attention sink, are worth recomputing anyway.
    """
    return Selective(
        (Step(check_layer, ratio),), "v", keep_first, label=f"blend({ratio:g},{keep_first})"
    )


def selective(
    steps: Sequence[tuple[int, float]],
    *,
    score: Score = "kv",
    keep_first: int = 0,
    label: str = "",
) -> Selective:
    """The general selection: steps, a score and each chunk's first tokens kept."""
    return Selective(tuple(Step(layer, ratio) for layer, ratio in steps), score, keep_first, label)


DEFAULT_POLICY: RecomputePolicy = blend(0.10, keep_first=8)
"""The policy an engine gets unless it chooses one (see :func:`blend`)."""
