"""Chunk starts shared out by the question's relevance (ProphetKV's idea on EPIC's tokens).

``first_k`` gives every reused chunk the same number of first tokens; a chunk the question
never reads gets as much of the budget as the one holding the answer. :class:`Relevance`
keeps a ``floor`` share of the budget split equally over the chunks as first tokens (where
the cached chunk saw another attention sink: every chunk needs a few), and shares the rest
out over the chunks in proportion to how much the question attends to each, read before
layer 0 on the cached layer-0 keys (exact in the cache: layer 0 sees no context, so
nothing is computed to be ranked; ``selective._prescan``). Inside a chunk its extra tokens
are either more first tokens (``within="first"``) or the chunk's tokens the question
attends to most (``within="question"``, each token scored by the largest attention within
``window`` tokens of it in the same chunk, so a name's neighbours come along).

Budget accounting is ``first_k``'s: ``round(budget * num_pi)`` tokens, every one computed
at every layer, so ``recompute_fraction`` is within ``1 / (2 * num_pi)`` of the budget
whatever the attention says. A pure function of the layout and the attention: the
transformers adapter and the vLLM blend loop (whose question comes as the loop's
``lookahead``) drive it alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from nopecache.client.errors import InvalidArgumentError
from nopecache.recompute.policies import (
    Probe,
    RecomputePolicy,
    ReuseLayout,
    Schedule,
    _check_budget,
    _check_layers,
    chunk_lengths,
    round_half_up,
    spread_equally,
    start_mask,
    top_share,
)

__all__ = ["WITHIN", "Relevance", "relevance", "spread_by_weight"]

Within = Literal["first", "question"]
"""What a chunk's share past the floor buys: more of its first tokens, or the tokens the
question attends to most."""

WITHIN: tuple[Within, ...] = ("first", "question")


def spread_by_weight(total: int, weights: Sequence[float], capacities: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` without exceeding ``capacities``.

    Largest remainder (ties to the earliest entry); what a full entry cannot take is split
    again over the others by their weights, and equally where none of them has weight.
    ``total`` above the capacities' sum is capped.
    """
    counts = [0] * len(capacities)
    left = min(total, sum(capacities))
    while left > 0:
        open_ = [i for i, c in enumerate(capacities) if counts[i] < c]
        weight = sum(max(0.0, weights[i]) for i in open_)
        if weight <= 0.0:
            room = [capacities[i] - counts[i] for i in open_]
            for i, even in zip(open_, spread_equally(left, room), strict=True):
                counts[i] += even
            return counts
        exact = {i: left * max(0.0, weights[i]) / weight for i in open_}
        add = {i: math.floor(e) for i, e in exact.items()}
        order = sorted(open_, key=lambda i: (add[i] - exact[i], i))
        for i in order[: left - sum(add.values())]:
            add[i] += 1
        for i in open_:
            take = min(add[i], capacities[i] - counts[i])
            counts[i] += take
            left -= take
    return counts


@dataclass(frozen=True, slots=True)
class _FlatSchedule(Schedule):
    @property
    def token_layers(self) -> int:
        """Start and ranked tokens, every layer."""
        return (int(self.start.sum()) + self.keep) * self.num_layers


@dataclass(frozen=True, slots=True)
class Relevance(RecomputePolicy):
    """A ``floor`` share of the budget on every chunk's first tokens, the rest per chunk by
    the question's attention (see the module doc)."""

    budget: float
    floor: float = 0.5
    within: Within = "first"
    window: int = 0
    label: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", _check_budget(self.budget))
        f = self.floor
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0.0 <= f <= 1.0:
            raise InvalidArgumentError("floor", f"must be a share in [0, 1], got {f!r}")
        if self.within not in WITHIN:
            raise InvalidArgumentError("within", f"must be one of {WITHIN}, got {self.within!r}")
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise InvalidArgumentError("window", f"must be an int >= 0, got {w!r}")

    @property
    def name(self) -> str:
        """The label, else ``relevance(budget,floor,within[,window=])``."""
        if self.label:
            return self.label
        extra = f",window={self.window}" if self.window else ""
        return f"relevance({self.budget:g},{self.floor:g},{self.within}{extra})"

    @property
    def wants_attention(self) -> bool:
        """True: the shares follow the question's attention."""
        return True

    @property
    def probe(self) -> Probe:
        """The question's tokens."""
        return "question"

    @property
    def prescan(self) -> bool:
        """True: chosen before layer 0 (see the module doc)."""
        return True

    def schedule(self, layout: ReuseLayout, num_layers: int) -> Schedule:
        """``round(budget * num_pi)`` tokens at every layer: the floor's first tokens as
        ``start``, the rest as ``keep`` (which ones, the attention decides)."""
        _check_layers(num_layers)
        n = layout.num_pi
        total = round_half_up(self.budget * n)
        first = spread_equally(round_half_up(self.floor * total), chunk_lengths(layout))
        nothing = torch.zeros(n, dtype=torch.bool)
        return _FlatSchedule(
            n, num_layers, start_mask(layout, first), nothing, None, total - sum(first)
        )

    def initial(self, layout: ReuseLayout, num_layers: int) -> torch.Tensor:
        """Without the question's attention (a loop that cannot probe): every chunk alike."""
        return self.initial_ranked(layout, num_layers, torch.ones(1, layout.num_pi))

    def shares(self, layout: ReuseLayout, num_layers: int, attention: torch.Tensor) -> list[int]:
        """Tokens past the floor each chunk gets, in proportion to the attention mass the
        question pays to the chunk (``attention`` ``[kv_heads, num_pi]``)."""
        plan = self.schedule(layout, num_layers)
        per_token = attention.float().sum(0)
        mass = torch.zeros(len(layout.chunks), dtype=torch.float64)
        mass.index_add_(0, layout.chunk_index, per_token.double())
        pinned = torch.zeros(len(layout.chunks), dtype=torch.int64)
        pinned.index_add_(0, layout.chunk_index, plan.start.long())
        free = [length - int(p) for length, p in zip(chunk_lengths(layout), pinned, strict=True)]
        return spread_by_weight(plan.keep, mass.tolist(), free)

    def initial_ranked(
        self, layout: ReuseLayout, num_layers: int, attention: torch.Tensor
    ) -> torch.Tensor:
        """Bool ``[num_pi]``: the floor's first tokens and each chunk's share."""
        _check_layers(num_layers)
        if attention.dim() != 2 or attention.shape[1] != layout.num_pi:
            raise InvalidArgumentError(
                "attention", f"shape {tuple(attention.shape)}, expected [heads, {layout.num_pi}]"
            )
        plan = self.schedule(layout, num_layers)
        extra = self.shares(layout, num_layers, attention)
        chosen = plan.start.clone()
        if not any(extra):
            return chosen
        if self.within == "first":
            first = torch.zeros(len(layout.chunks), dtype=torch.int64)
            first.index_add_(0, layout.chunk_index, plan.start.long())
            more = first + torch.tensor(extra, dtype=torch.int64)
            return layout.chunk_offset < more[layout.chunk_index]
        scores = self._windowed(layout, attention.float().sum(0))
        scores = scores.masked_fill(plan.start, -math.inf)
        for index, count in enumerate(extra):
            if count:
                rows = (layout.chunk_index == index).nonzero().squeeze(1)
                chosen[rows[top_share(scores[rows], count)]] = True
        return chosen

    def _windowed(self, layout: ReuseLayout, scores: torch.Tensor) -> torch.Tensor:
        """Each token's largest score within ``window`` tokens of it in its chunk."""
        out = scores.clone()
        n = int(scores.numel())
        for shift in range(1, self.window + 1):
            if shift >= n:
                break
            same = layout.chunk_index[shift:] == layout.chunk_index[:-shift]
            ahead = torch.where(same, scores[shift:], -math.inf)  # the token `shift` later
            behind = torch.where(same, scores[:-shift], -math.inf)  # `shift` earlier
            out[:-shift] = torch.maximum(out[:-shift], ahead)
            out[shift:] = torch.maximum(out[shift:], behind)
        return out


def relevance(
    budget: float, floor: float = 0.5, within: Within = "first", *, window: int = 0
) -> Relevance:
    """Chunk starts shared out by the question's relevance (see :class:`Relevance`)."""
    return Relevance(budget, floor, within, window)
