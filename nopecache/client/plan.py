"""The reuse plan: which parts of a new prompt come from the cache, and which to prefill.

:func:`plan_reuse` is a pure function of the prompt length, its keyed chunks and the
lookup answer (which keys exist, in which stored form). The plan it returns covers the
prompt exactly, in three parts:

    0            prefix_end                                             num_tokens
    |== prefix ==|-- miss --|== hit ==|-- miss --|== hit ==|== hit ==|-- miss --|
     exact chain             position-independent hits, each with its block's
     (lossless)              source span, rotated to its target span on fetch

* ``prefix``: the longest run of existing exact-prefix blocks from position 0.
* ``hits``: position-independent blocks after the prefix, disjoint. A block that
  overlaps the prefix or an earlier hit is trimmed at the front rather than dropped
  (its ``source`` span then starts inside the block), so the hits cover every found
  token once.
* ``misses``: the maximal ranges left to prefill.

``dropped`` holds found blocks a ``keep`` filter refused (e.g. a cost model deciding a
fetch is slower than recomputing); their tokens are misses.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.keys import BlockKey, KeyedChunk
from nopecache.proto.block import StoredForm

LookupAnswer = Mapping[BlockKey, StoredForm]
HitFilter = Callable[["Hit"], bool]


class HitKind(enum.Enum):
    """How a hit's KV relates to the new prompt."""

    PREFIX = "prefix"  # exact chain from position 0: lossless
    POSITION_INDEPENDENT = "position_independent"  # same tokens, other context: approximate


@dataclass(frozen=True, slots=True)
class Hit:
    """One stored block to fetch: where it lands and which of its tokens to use.

    A fetch checks ``block.tokens[source] == prompt[target]`` before placing any KV.
    """

    key: BlockKey
    target: ChunkSpan  # token range of the new prompt this block fills
    source: ChunkSpan  # token range inside the stored block (0 = the block's first token)
    form: StoredForm
    kind: HitKind

    def __post_init__(self) -> None:
        if len(self.source) != len(self.target):
            raise InvalidArgumentError(
                "Hit.source", f"{self.source} and target {self.target} differ in length"
            )

    @property
    def num_tokens(self) -> int:
        """Tokens this hit fills."""
        return len(self.target)


def _check_tiling(name: str, spans: Sequence[ChunkSpan], start: int) -> int:
    for span in spans:
        if span.start != start:
            raise InvalidArgumentError(name, f"{span} does not start at position {start}")
        start = span.end
    return start


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """Exact prefix, then position-independent hits, then misses: covers the prompt."""

    num_tokens: int
    prefix: tuple[Hit, ...] = ()
    hits: tuple[Hit, ...] = ()
    misses: tuple[ChunkSpan, ...] = ()
    dropped: tuple[Hit, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int):
            raise InvalidArgumentError("num_tokens", f"must be an int, got {self.num_tokens!r}")
        if self.num_tokens < 0:
            raise InvalidArgumentError("num_tokens", f"must be >= 0, got {self.num_tokens}")
        for name in ("prefix", "hits", "misses", "dropped"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if any(h.kind is not HitKind.PREFIX for h in self.prefix):
            raise InvalidArgumentError("prefix", "holds a hit whose kind is not PREFIX")
        if any(h.kind is not HitKind.POSITION_INDEPENDENT for h in self.hits):
            raise InvalidArgumentError("hits", "holds a hit whose kind is not POSITION_INDEPENDENT")
        _check_tiling("prefix", [h.target for h in self.prefix], 0)
        # Hits and misses together tile [prefix_end, num_tokens) in order.
        rest = sorted([h.target for h in self.hits] + list(self.misses))
        end = _check_tiling("hits/misses", rest, self.prefix_end)
        if end != self.num_tokens:
            raise InvalidArgumentError(
                "hits/misses", f"cover up to {end}, not the prompt's {self.num_tokens} tokens"
            )
        if [h.target for h in self.hits] != sorted(h.target for h in self.hits):
            raise InvalidArgumentError("hits", "must be ordered by target position")

    @classmethod
    def all_miss(cls, num_tokens: int) -> ReusePlan:
        """The plan of a prompt nothing of which is cached."""
        return cls(num_tokens, misses=(ChunkSpan(0, num_tokens),) if num_tokens else ())

    @property
    def prefix_end(self) -> int:
        """Position where the exact prefix ends (0 without one)."""
        return self.prefix[-1].target.end if self.prefix else 0

    @property
    def prefix_tokens(self) -> int:
        """Tokens reused losslessly through the exact prefix."""
        return self.prefix_end

    @property
    def pi_tokens(self) -> int:
        """Tokens reused from position-independent hits."""
        return sum(len(h.target) for h in self.hits)

    @property
    def reused_tokens(self) -> int:
        """Tokens that come from the cache."""
        return self.prefix_tokens + self.pi_tokens

    @property
    def miss_tokens(self) -> int:
        """Tokens left to prefill."""
        return self.num_tokens - self.reused_tokens

    @property
    def blocks(self) -> tuple[Hit, ...]:
        """Every block to fetch, prefix first, in prompt order."""
        return self.prefix + self.hits


def _check_chunks(name: str, chunks: Sequence[KeyedChunk], num_tokens: int) -> None:
    for chunk in chunks:
        if not isinstance(chunk, KeyedChunk):
            raise InvalidArgumentError(name, f"must be KeyedChunks, got {type(chunk).__name__}")
        if chunk.span.end > num_tokens:
            raise InvalidArgumentError(
                name, f"{chunk.span} ends past the prompt's {num_tokens} tokens"
            )


def plan_reuse(
    num_tokens: int,
    prefix_chunks: Sequence[KeyedChunk],
    pi_chunks: Sequence[KeyedChunk],
    found: LookupAnswer,
    *,
    keep: HitFilter | None = None,
    min_hit_tokens: int = 1,
) -> ReusePlan:
    """The reuse plan of a prompt of ``num_tokens`` tokens (see the module docstring).

    ``prefix_chunks`` is the prefix-key chain (contiguous from 0), ``pi_chunks`` the
    content-keyed chunks (any chunkers, may overlap), ``found`` the lookup answer.
    ``keep`` may refuse a found block: the prefix stops at the first refused block,
    a refused position-independent block is skipped. A hit trimmed below
    ``min_hit_tokens`` tokens is not worth a fetch and is left out.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise InvalidArgumentError("num_tokens", f"must be an int >= 0, got {num_tokens!r}")
    if isinstance(min_hit_tokens, bool) or not isinstance(min_hit_tokens, int):
        raise InvalidArgumentError("min_hit_tokens", f"must be an int, got {min_hit_tokens!r}")
    if min_hit_tokens < 1:
        raise InvalidArgumentError("min_hit_tokens", f"must be >= 1, got {min_hit_tokens}")
    _check_chunks("prefix_chunks", prefix_chunks, num_tokens)
    _check_chunks("pi_chunks", pi_chunks, num_tokens)
    _check_tiling("prefix_chunks", [c.span for c in prefix_chunks], 0)

    dropped: list[Hit] = []
    prefix: list[Hit] = []
    for chunk in prefix_chunks:
        form = found.get(chunk.key)
        if form is None:
            break
        hit = Hit(chunk.key, chunk.span, ChunkSpan(0, len(chunk.span)), form, HitKind.PREFIX)
        if keep is not None and not keep(hit):
            dropped.append(hit)
            break
        prefix.append(hit)
    covered = prefix[-1].target.end if prefix else 0

    # Left to right, longest first at equal starts; each hit fills from where the
    # previous one stopped, so the hits cover the union of the found chunks exactly.
    candidates = sorted(
        (c for c in pi_chunks if c.key in found),
        key=lambda c: (c.span.start, -c.span.end, c.key),
    )
    hits: list[Hit] = []
    misses: list[ChunkSpan] = []
    for chunk in candidates:
        start, end = max(chunk.span.start, covered), chunk.span.end
        if end - start < min_hit_tokens:
            continue
        offset = start - chunk.span.start
        hit = Hit(
            chunk.key,
            ChunkSpan(start, end),
            ChunkSpan(offset, len(chunk.span)),
            found[chunk.key],
            HitKind.POSITION_INDEPENDENT,
        )
        if keep is not None and not keep(hit):
            dropped.append(hit)
            continue
        if start > covered:
            misses.append(ChunkSpan(covered, start))
        hits.append(hit)
        covered = end
    if covered < num_tokens:
        misses.append(ChunkSpan(covered, num_tokens))
    return ReusePlan(num_tokens, tuple(prefix), tuple(hits), tuple(misses), tuple(dropped))
