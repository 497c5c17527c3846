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
    start      ####################       each chunk's first tokens (position-chosen)
    kept       ####################       candidates ranked highest at the check layer
    dropped    ##                         candidates: computed up to the check layer
    cached     .                          (cached KV at every layer)

**Budgets.** Every policy takes a ``budget``: the share of the prompt's reused
position-independent token-layers (``num_pi * num_layers``) it may recompute. All of a
policy's parts are paid out of it: the chunk-start tokens (``L`` token-layers each),
the candidates computed up to the check layer (``check_layer + 1`` each) and the tokens
kept past it (``L - 1 - check_layer`` more each). :meth:`Selective.schedule` turns the
budget into token counts for one layout; only the last count is rounded, so the realised
share is within ``1 / (2 * num_pi)`` of the budget (1.7 points for 30 reused tokens),
whatever the chunk sizes and their number. A budget too small to pay for the check
layer is spent on chunk-start tokens only. Cost is counted in token-layers: a reused
token recomputed at layer l counts once for l, the layer where it is dropped included
(its K and V were computed there).

A policy answers, on tensors (no per-token Python loops):

* :meth:`RecomputePolicy.initial`: which reused tokens start at layer 0;
* :meth:`RecomputePolicy.narrow`, called at each layer of :meth:`check_layers` after the
  layer's fresh K and V of the running tokens are known (and written: a token dropped
  at layer l still contributes its fresh layer-l KV): which of them keep running.

Both are pure functions of the layout, the layer count and (for ``narrow``) the fresh and
cached K/V of the running tokens: no engine types, so any engine's prefill loop can
drive them (see ``forward.selective_prefill``).

Policies here:

=========================  =====================================================
``none()``                 reuse every cached token as is
``first_k(budget)``        each chunk's first tokens, the budget split equally over
                           the chunks (EPIC-style)
``deviation(budget)``      every token up to layer 1, then the tokens whose K and V
                           deviate most, ranked across all chunks (CacheBlend-style)
``blend(budget, start)``   a ``start`` share of the budget on each chunk's first
                           tokens, the rest as ``deviation`` ranked by V (the
                           default, ``DEFAULT_POLICY``)
``selective(...)``         the general form: check layer, score, start share, ranking
``question(budget, ...)``  ranked by the question's attention (``question.py``)
``relevance(budget, ...)``  chunk starts shared out over the chunks by the question's
                           attention (``relevance.py``)
=========================  =====================================================
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable, Sequence
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

Probe = Literal["last", "question"]
"""Whose attention a policy reads at a check layer (see ``RecomputePolicy.probe``)."""


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
    num_layers: int
    """Layers of the model (budgets are shares of ``num_pi * num_layers``)."""
    layout: ReuseLayout
    running: torch.Tensor
    """Indices into ``layout.pi_tokens`` of the reused tokens computed at this layer ``[n]``."""
    fresh_k: torch.Tensor  # [n, kv_heads, head_dim]
    fresh_v: torch.Tensor  # [n, kv_heads, head_dim]
    cached_k: torch.Tensor  # [n, kv_heads, head_dim]
    cached_v: torch.Tensor  # [n, kv_heads, head_dim]
    attention: torch.Tensor | None = None
    """``[kv_heads, n]``: mean attention probability from the probe tokens (the prompt's
    last tokens, or the question's: ``RecomputePolicy.probe``) to each running token, over
    the query heads of each KV head group and over those tokens."""

    def __post_init__(self) -> None:
        if not 0 <= self.layer < self.num_layers:
            raise InvalidArgumentError(
                "LayerState.layer", f"{self.layer} is not a layer of {self.num_layers}"
            )
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


def round_half_up(x: float) -> int:
    """``x`` rounded to the nearest int, halves up (the same on every platform)."""
    return math.floor(x + 0.5)


def spread_equally(total: int, capacities: Sequence[int]) -> list[int]:
    """``total`` split as equally as ``capacities`` allow (water-filling; the remainder of an
    uneven split goes to the earliest entries). ``total`` above the capacities' sum is capped."""
    counts = [0] * len(capacities)
    left = min(total, sum(capacities))
    open_ = [i for i, c in enumerate(capacities) if c > 0]
    while left > 0 and open_:
        share, extra = divmod(left, len(open_))
        for rank, i in enumerate(open_):
            add = min(capacities[i] - counts[i], share + (1 if rank < extra else 0))
            counts[i] += add
            left -= add
        open_ = [i for i in open_ if counts[i] < capacities[i]]
    return counts


def spread_proportionally(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder, ties to the earliest)."""
    weight = sum(weights)
    if weight == 0 or total <= 0:
        return [0] * len(weights)
    exact = [total * w / weight for w in weights]
    counts = [math.floor(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _check_budget(budget: object) -> float:
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise InvalidArgumentError("budget", f"must be a number in [0, 1], got {budget!r}")
    if not 0.0 <= float(budget) <= 1.0:
        raise InvalidArgumentError(
            "budget",
            f"is a share of the reused token-layers in [0, 1] (e.g. 0.15), got {budget!r}",
        )
    return float(budget)


@dataclass(frozen=True, slots=True)
class Schedule:
    """What a policy recomputes on one layout, in token counts (see the module doc).

    ``start`` tokens run every layer; ``candidates`` run up to ``check_layer`` and
    ``keep`` of them (``keep_per_chunk`` when ranked per chunk) go on to the last layer.
    """

    num_pi: int
    num_layers: int
    start: torch.Tensor
    """Bool ``[num_pi]``: each chunk's first tokens, computed at every layer."""
    candidates: torch.Tensor
    """Bool ``[num_pi]``: tokens computed up to the check layer and ranked there."""
    check_layer: int | None
    keep: int
    keep_per_chunk: tuple[int, ...] | None = None

    @property
    def token_layers(self) -> int:
        """Reused token-layers recomputed."""
        pinned = int(self.start.sum()) * self.num_layers
        if self.check_layer is None:
            return pinned
        c = self.check_layer
        return pinned + int(self.candidates.sum()) * (c + 1) + self.keep * (self.num_layers - 1 - c)

    @property
    def fraction(self) -> float:
        """Share of the reused token-layers recomputed (0 without reused tokens)."""
        total = self.num_pi * self.num_layers
        return self.token_layers / total if total else 0.0


def start_mask(layout: ReuseLayout, counts: Sequence[int]) -> torch.Tensor:
    """Bool ``[num_pi]``: the first ``counts[i]`` tokens of each chunk ``i``."""
    if not layout.num_pi:
        return torch.zeros(0, dtype=torch.bool)
    per_chunk = torch.tensor(list(counts), dtype=torch.int64)
    return layout.chunk_offset < per_chunk[layout.chunk_index]


def chunk_lengths(layout: ReuseLayout) -> list[int]:
    """Reused tokens of each chunk of ``layout``."""
    return [len(span) for span in layout.chunks]


class RecomputePolicy(abc.ABC):
    """Chooses the reused tokens a prefill recomputes, layer by layer (see the module doc)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Short label for tables, e.g. ``blend(0.15)``."""

    @property
    @abc.abstractmethod
    def budget(self) -> float:
        """Configured share of the reused token-layers to recompute."""

    @property
    def wants_attention(self) -> bool:
        """Whether :meth:`narrow` needs ``LayerState.attention``."""
        return False

    @property
    def probe(self) -> Probe:
        """Whose attention ``LayerState.attention`` holds: the prompt's ``last`` tokens, or
        the ``question`` (every token after the last reused chunk)."""
        return "last"

    @property
    def prescan(self) -> bool:
        """Whether the policy chooses its tokens before layer 0 from the probe's attention
        over layer 0's keys (exact in the cache: layer 0 sees no context), through
        :meth:`initial_ranked`, instead of :meth:`initial`."""
        return False

    def initial_ranked(
        self, layout: ReuseLayout, num_layers: int, attention: torch.Tensor
    ) -> torch.Tensor:
        """Bool ``[layout.num_pi]`` for a prescanning policy, given the probe's attention
        ``[kv_heads, num_pi]`` at layer 0; others ignore it."""
        return self.initial(layout, num_layers)

    @abc.abstractmethod
    def schedule(self, layout: ReuseLayout, num_layers: int) -> Schedule:
        """The token counts this policy recomputes on ``layout`` (what the budget buys)."""

    def check_layers(self) -> frozenset[int]:
        """Layers after whose KV :meth:`narrow` is called."""
        return frozenset()

    def initial(self, layout: ReuseLayout, num_layers: int) -> torch.Tensor:
        """Bool ``[layout.num_pi]``: the reused tokens computed from layer 0."""
        plan = self.schedule(layout, num_layers)
        return plan.start | plan.candidates

    def narrow(self, state: LayerState) -> torch.Tensor:
        """Bool ``[len(state.running)]``: the running tokens that go on to the next layer."""
        return torch.ones(state.running.shape, dtype=torch.bool)

    def planned_fraction(self, layout: ReuseLayout, num_layers: int) -> float:
        """The share of ``layout``'s reused token-layers a prefill will recompute."""
        return self.schedule(layout, num_layers).fraction


def _check_layers(num_layers: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise InvalidArgumentError("num_layers", f"must be an int >= 1, got {num_layers!r}")


@dataclass(frozen=True, slots=True)
class NoRecompute(RecomputePolicy):
    """Reuse every cached token as it is: only misses are computed."""

    @property
    def name(self) -> str:
        """``none``."""
        return "none"

    @property
    def budget(self) -> float:
        """0: nothing is recomputed."""
        return 0.0

    def schedule(self, layout: ReuseLayout, num_layers: int) -> Schedule:
        """Nothing recomputed."""
        _check_layers(num_layers)
        nothing = torch.zeros(layout.num_pi, dtype=torch.bool)
        return Schedule(layout.num_pi, num_layers, nothing, nothing, None, 0)


Ranking = Literal["joint", "per_chunk"]
RANKINGS: tuple[Ranking, ...] = ("joint", "per_chunk")


@dataclass(frozen=True, slots=True)
class Selective(RecomputePolicy):
    """The general policy: chunk-start tokens, then a deviation selection, in one budget.

    ``start`` is the share of the budget spent on each chunk's first tokens (split equally
    over the chunks: the chunk start is where the cached KV saw a different attention
    sink, whatever the chunk's length). With ``check_layer`` None that is all; otherwise
    every other reused token runs up to ``check_layer`` and the budget left keeps the
    ones scoring highest there, ranked across all chunks (``joint``) or within each chunk
    in proportion to its size (``per_chunk``).
    """

    budget: float
    check_layer: int | None = 1
    score: Score = "v"
    start: float = 0.0
    ranking: Ranking = "joint"
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", _check_budget(self.budget))
        c = self.check_layer
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise InvalidArgumentError("check_layer", f"must be an int >= 0 or None, got {c!r}")
        if self.score not in SCORES:
            raise InvalidArgumentError("score", f"must be one of {SCORES}, got {self.score!r}")
        if isinstance(self.start, bool) or not isinstance(self.start, int | float):
            raise InvalidArgumentError("start", f"must be a share in [0, 1], got {self.start!r}")
        if not 0.0 <= self.start <= 1.0:
            raise InvalidArgumentError("start", f"must be a share in [0, 1], got {self.start!r}")
        if c is None and self.start != 1.0:
            raise InvalidArgumentError(
                "start", f"must be 1 without a check layer (all the budget), got {self.start}"
            )
        if self.ranking not in RANKINGS:
            raise InvalidArgumentError(
                "ranking", f"must be one of {RANKINGS}, got {self.ranking!r}"
            )

    @property
    def name(self) -> str:
        """The label, else ``selective(budget;start;layer;score;ranking)``."""
        if self.label:
            return self.label
        layer = "none" if self.check_layer is None else str(self.check_layer)
        return (
            f"selective({self.budget:g};start={self.start:g};{layer};{self.score};{self.ranking})"
        )

    @property
    def wants_attention(self) -> bool:
        """True for the attention-weighted score."""
        return self.score == "kv_attention"

    def check_layers(self) -> frozenset[int]:
        """The check layer (none for a position-only selection)."""
        return frozenset() if self.check_layer is None else frozenset({self.check_layer})

    def schedule(self, layout: ReuseLayout, num_layers: int) -> Schedule:
        """Token counts that spend the budget on ``layout`` (see the module doc)."""
        _check_layers(num_layers)
        n, lengths = layout.num_pi, chunk_lengths(layout)
        target = self.budget * n * num_layers
        # A model too shallow for the check layer gets the position-only selection.
        c = self.check_layer if (self.check_layer or 0) < num_layers - 1 else None
        none = torch.zeros(n, dtype=torch.bool)
        if c is not None and self.budget < 1.0 and n:
            first = spread_equally(round_half_up(self.start * self.budget * n), lengths)
            pinned = start_mask(layout, first)
            candidates = ~pinned
            rest = target - sum(first) * num_layers - (n - sum(first)) * (c + 1)
            if rest >= 0:
                keep = min(n - sum(first), round_half_up(rest / (num_layers - 1 - c)))
                per_chunk = None
                if self.ranking == "per_chunk":
                    free = [length - f for length, f in zip(lengths, first, strict=True)]
                    per_chunk = tuple(spread_proportionally(keep, free))
                return Schedule(n, num_layers, pinned, candidates, c, keep, per_chunk)
        # No check layer (or none the model has), a full budget, or one too small to pay
        # for the check layer: the whole budget goes to chunk-start tokens.
        first = spread_equally(round_half_up(self.budget * n), lengths)
        return Schedule(n, num_layers, start_mask(layout, first), none, None, 0)

    def narrow(self, state: LayerState) -> torch.Tensor:
        """Keep the chunk-start tokens and the candidates that score highest."""
        plan = self.schedule(state.layout, state.num_layers)
        if plan.check_layer != state.layer:
            return torch.ones(state.running.shape, dtype=torch.bool)
        pinned = plan.start[state.running]
        scores = token_scores(state, self.score).masked_fill(pinned, -math.inf)
        if plan.keep_per_chunk is None:
            return top_share(scores, plan.keep) | pinned
        keep = pinned.clone()
        chunk = state.layout.chunk_index[state.running]
        for index, count in enumerate(plan.keep_per_chunk):
            if count:
                rows = (chunk == index).nonzero().squeeze(1)
                keep[rows[top_share(scores[rows], count)]] = True
        return keep


@functools.lru_cache(maxsize=256)
def _taper_profile(budget: float, lengths: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    # Called at every layer of a prefill with the same arguments: computed once.
    total = round_half_up(budget * sum(lengths) * num_layers)
    shares = spread_equally(total, [n * num_layers for n in lengths])
    per_chunk = [taper_depths(t, n, num_layers) for t, n in zip(shares, lengths, strict=True)]
    return tuple(d for chunk in per_chunk for d in chunk)


def taper_depths(total: int, length: int, num_layers: int) -> list[int]:
    """Depths (layers from 0) of a chunk's tokens summing to ``total`` token-layers, falling
    linearly from ``num_layers`` at the chunk's first token (the ``d_i`` of :class:`Taper`)."""
    if total >= length * num_layers:
        return [num_layers] * length

    offsets = torch.arange(length, dtype=torch.float64)

    def depths(width: float) -> torch.Tensor:
        ramp = torch.floor(num_layers * (1.0 - offsets / width) + 0.5)
        return ramp.clamp(0, num_layers).to(torch.int64)

    lo, hi = 1e-9, 1e9
    for _ in range(100):  # the widest ramp whose sum stays within the total
        mid = (lo + hi) / 2
        if int(depths(mid).sum()) <= total:
            lo = mid
        else:
            hi = mid
    out = depths(lo).tolist()
    short = total - sum(out)
    for i in range(length):  # the rounding left over, one layer each, from the start
        if short <= 0:
            break
        if out[i] < num_layers:
            out[i] += 1
            short -= 1
    return out


_EVERY_LAYER = frozenset(range(4096))  # deeper than any model


@dataclass(frozen=True, slots=True)
class Taper(RecomputePolicy):
    """Each chunk's first tokens, deepest first: depth falls linearly along the chunk.

    The budget is split equally over the chunks (in token-layers); in a chunk, token ``i``
    is recomputed at layers ``0 .. d_i - 1``, ``d_i`` falling from all layers at the first
    token to none (see :func:`taper_depths`). A position-only selection like
    :func:`first_k` that trades depth for breadth.
    """

    budget: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", _check_budget(self.budget))

    @property
    def name(self) -> str:
        """``taper(budget)``."""
        return f"taper({self.budget:g})"

    def depths(self, layout: ReuseLayout, num_layers: int) -> torch.Tensor:
        """Layers each reused token is computed at ``[num_pi]`` (int64)."""
        _check_layers(num_layers)
        profile = _taper_profile(self.budget, tuple(chunk_lengths(layout)), num_layers)
        return torch.tensor(profile, dtype=torch.int64)

    def schedule(self, layout: ReuseLayout, num_layers: int) -> Schedule:
        """The tokens computed at every layer as ``start`` (the cost counts all depths)."""
        depths = self.depths(layout, num_layers)
        full = depths >= num_layers
        return _TaperSchedule(layout.num_pi, num_layers, full, depths > 0, None, 0, None, depths)

    def check_layers(self) -> frozenset[int]:
        """Every layer: tokens leave as their depth is reached."""
        return _EVERY_LAYER

    def initial(self, layout: ReuseLayout, num_layers: int) -> torch.Tensor:
        """Tokens with a depth of at least one layer."""
        return self.depths(layout, num_layers) > 0

    def narrow(self, state: LayerState) -> torch.Tensor:
        """Running tokens whose depth goes past this layer."""
        depths = self.depths(state.layout, state.num_layers)[state.running]
        return depths > state.layer + 1


@dataclass(frozen=True, slots=True)
class _TaperSchedule(Schedule):
    depths: torch.Tensor | None = None

    @property
    def token_layers(self) -> int:
        """The sum of the depths."""
        assert self.depths is not None
        return int(self.depths.sum())


def taper(budget: float) -> Taper:
    """Each chunk's first tokens with depth falling along the chunk (see :class:`Taper`)."""
    return Taper(budget)


def none() -> NoRecompute:
    """No recompute: every cached token is used as is."""
    return NoRecompute()


def first_k(budget: float) -> Selective:
    """EPIC-style: each chunk's first tokens, ``budget`` split equally over the chunks."""
    return Selective(_check_budget(budget), None, start=1.0, label=f"first_k({budget:g})")


def deviation(budget: float, check_layer: int = 1, score: Score = "kv") -> Selective:
    """CacheBlend-style: every token up to ``check_layer``, then those deviating most."""
    extra = "".join(
        (f",layer={check_layer}" if check_layer != 1 else "", f",{score}" if score != "kv" else "")
    )
    return Selective(budget, check_layer, score, label=f"deviation({budget:g}{extra})")


def blend(
    budget: float = 0.15,
    start: float = 0.5,
    *,
    check_layer: int = 1,
    ranking: Ranking = "joint",
) -> Selective:
    """A ``start`` share of ``budget`` on each chunk's first tokens, the rest ranked by V.

    The selection this adapter recommends (see bench/quality.py): the chunk's first
    tokens, where the cached chunk saw another attention sink, deviate most; among the
    others, the V distance at layer 1 ranks content tokens better than the K distance.
    """
    extra = "".join(
        (
            f",layer={check_layer}" if check_layer != 1 else "",
            ",per_chunk" if ranking != "joint" else "",
        )
    )
    return Selective(
        budget, check_layer, "v", start, ranking, label=f"blend({budget:g},{start:g}{extra})"
    )


def selective(
    budget: float,
    *,
    check_layer: int | None = 1,
    score: Score = "v",
    start: float = 0.0,
    ranking: Ranking = "joint",
    label: str = "",
) -> Selective:
    """The general selection (see :class:`Selective`)."""
    return Selective(budget, check_layer, score, start, ranking, label)


def _question(budget: float) -> RecomputePolicy:
    # question.py builds on this module; imported when first named.
    from nopecache.recompute.question import question_default

    return question_default(budget)


def _relevance(budget: float) -> RecomputePolicy:
    # relevance.py builds on this module; imported when first named.
    from nopecache.recompute.relevance import relevance

    return relevance(budget)


POLICY_FACTORIES: dict[str, Callable[[float], RecomputePolicy]] = {
    "none": lambda budget: none(),
    "first_k": first_k,
    "deviation": deviation,
    "blend": blend,
    "taper": taper,
    "selective": selective,
    "question": _question,
    "relevance": _relevance,
}
"""The policies by factory name, each built from a budget (what an engine's config names)."""

DEFAULT_POLICY_NAME = "first_k"
DEFAULT_BUDGET = 0.15


def policy_by_name(name: str, budget: float = DEFAULT_BUDGET) -> RecomputePolicy:
    """The policy ``POLICY_FACTORIES[name](budget)``; InvalidArgumentError for an unknown name."""
    factory = POLICY_FACTORIES.get(name)
    if factory is None:
        raise InvalidArgumentError(
            "policy", f"unknown policy {name!r}; the policies are {', '.join(POLICY_FACTORIES)}"
        )
    return factory(_check_budget(budget))


DEFAULT_POLICY: RecomputePolicy = policy_by_name(DEFAULT_POLICY_NAME, DEFAULT_BUDGET)
"""The policy an engine gets unless it chooses one: 15% of the reused token-layers on each
chunk's first tokens, the best at that budget on bench/quality.py's tuning half (with
chunks stored behind a chat-like sink prefix)."""
