"""Chunkers: where a prompt is cut into blocks, so that equal content gets equal blocks.

Three ways to cut, all returning ``list[ChunkSpan]`` that cover the tokens exactly,
in order, without overlap:

    FixedChunker(16)         |0 .. 16|16 .. 32|32 .. 48|..   prefix mode, aligned to 0
    ContentChunker(8,32,128) |0 ..  29|29 ..    71|71 .. 90|  cuts chosen by the tokens
    SegmentChunker([b1, b2]) |seg 0 chunks|seg 1 chunks|..   caller's segments, each
                                                             content-chunked from its start

Token ids travel as little-endian uint32 arrays (:func:`token_array`), the form the
keys hash, so a prompt is converted once and never walked token by token in Python.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from nopecache.client.errors import InvalidArgumentError

TokenIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor
TokenArray: TypeAlias = npt.NDArray[np.uint32]

_TOKEN_DTYPE = np.dtype("<u4")


def token_array(tokens: TokenIds, argument: str = "tokens") -> TokenArray:
    """Token ids as a contiguous little-endian uint32 array; anything else is rejected."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == _TOKEN_DTYPE:
        arr = tokens
    elif isinstance(tokens, torch.Tensor):
        arr = tokens.detach().cpu().numpy()
    else:
        arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(argument, f"must be 1-D token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if arr.dtype != _TOKEN_DTYPE:
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentError(argument, f"must be integer token ids, got {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 0xFFFFFFFF:
            raise InvalidArgumentError(
                argument, f"token ids must fit in uint32, got range [{lo}, {hi}]"
            )
        arr = arr.astype(_TOKEN_DTYPE)
    return np.ascontiguousarray(arr)


@dataclass(frozen=True, slots=True, order=True)
class ChunkSpan:
    """Half-open token range ``[start, end)`` of a prompt; never empty."""

    start: int
    end: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(
                    f"ChunkSpan.{name}", f"must be an int, got {type(value).__name__}"
                )
        if not 0 <= self.start < self.end:
            raise InvalidArgumentError(
                "ChunkSpan", f"needs 0 <= start < end, got [{self.start}, {self.end})"
            )

    def __len__(self) -> int:
        return self.end - self.start

    def shifted(self, offset: int) -> ChunkSpan:
        """The same span moved by ``offset`` tokens."""
        return ChunkSpan(self.start + offset, self.end + offset)


class Chunker(Protocol):
    """Anything that cuts a token sequence into covering, ordered, disjoint spans."""

    def split(self, tokens: TokenIds) -> list[ChunkSpan]:
        """Spans covering ``tokens`` exactly, in order."""
        ...


def _spans(bounds: Sequence[int]) -> list[ChunkSpan]:
    return [ChunkSpan(a, b) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True, slots=True)
class FixedChunker:
    """Every ``size`` tokens from position 0: the block grid of exact-prefix caching.

    With ``keep_partial=False`` (the default, as vLLM) a last chunk shorter than
    ``size`` is left out, so the spans may stop before the end of the prompt.
    """

    size: int = 16
    keep_partial: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
            raise InvalidArgumentError("size", f"must be a positive int, got {self.size!r}")

    def split(self, tokens: TokenIds) -> list[ChunkSpan]:
        """Spans ``[k*size, (k+1)*size)``, plus the partial tail if ``keep_partial``."""
        n = len(tokens)
        full = n - n % self.size
        bounds = list(range(0, full + 1, self.size))
        if self.keep_partial and full < n:
            bounds.append(n)
        return _spans(bounds)


# Gear values are a fixed mix of the token id: no table, no vocabulary limit, the same
# on every machine (only uint64 wrap-around arithmetic, which numpy does exactly).
_GEAR_SEED = np.uint64(0x6E6F70656361636B)  # b"nopecack"
_MIX_ADD = np.uint64(0x9E3779B97F4A7C15)
_MIX_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_MUL2 = np.uint64(0x94D049BB133111EB)


def gear_values(tokens: TokenArray) -> npt.NDArray[np.uint64]:
    """Per-token 64-bit pseudo-random values: a splitmix64 finaliser of (seed ^ id)."""
    z = (tokens.astype(np.uint64) ^ _GEAR_SEED) + _MIX_ADD
    z = (z ^ (z >> np.uint64(30))) * _MIX_MUL1
    z = (z ^ (z >> np.uint64(27))) * _MIX_MUL2
    return z ^ (z >> np.uint64(31))


def _isolated_density(q: float, min_size: int) -> float:
    # A position is an anchor when its window hits (prob. q) and the min_size - 1
    # positions before it do not.
    return q * (1.0 - q) ** (min_size - 1)


@dataclass(frozen=True, slots=True)
class ContentChunker:
    """Content-defined chunking over token ids, stable under any shift of the content.

    Rule. A windowed gear hash ``h(c) = sum_j gear(t[c-1-j]) << j`` (j < ``window``,
    mod 2**64) is computed at every cut position ``c``; ``c`` *hits* when ``h(c)`` falls
    below a threshold. An *anchor* is a hit with no other hit in the ``min_size - 1``
    positions before it (and at least ``min_size`` tokens from both ends of the input).
    Anchors are at least ``min_size`` apart, and whether ``c`` is one depends only on the
    ``lookback = min_size + window - 1`` tokens before it: unlike the usual "first hit
    after previous cut + min" rule, no decision depends on where the previous cut fell,
    so a shifted start cannot desynchronise later cuts. Gaps between anchors longer
    than ``max_size`` are cut every ``max_size`` tokens from the left anchor; a last
    remainder shorter than ``max_size + min_size`` is halved. The hit threshold is set
    so that anchors are ``avg_size`` apart on average.

    Sizes. Every chunk has ``min_size <= len <= max_size``, except the single chunk of
    an input shorter than ``min_size``.

    Guarantee. Let a token run R be chunked alone and inside any prompt P. Let ``a*``
    be R's first anchor at or after ``lookback``. Every chunk of R that starts at or
    after ``a*`` and ends at an anchor of R (or at least ``max_size + min_size`` tokens
    before R's end) is also a chunk of P, shifted by R's offset: same tokens, same key.
    So at most ``lookback`` tokens plus the distance to the next anchor (about
    ``avg_size``) are lost at R's start, and one to two chunks at its end.
    """

    min_size: int = 8
    avg_size: int = 32
    max_size: int = 128
    window: int = 8
    # Hit threshold on the 64-bit window hash, derived from the sizes once.
    _threshold: np.uint64 = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("min_size", "avg_size", "max_size", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(name, f"must be a positive int, got {value!r}")
        if self.avg_size < 2:
            # One token per chunk on average is a cut after every token: no chunking.
            raise InvalidArgumentError("avg_size", f"must be at least 2, got {self.avg_size}")
        if self.min_size > self.avg_size:
            raise InvalidArgumentError(
                "min_size", f"{self.min_size} exceeds avg_size {self.avg_size}"
            )
        if self.avg_size > self.max_size:
            raise InvalidArgumentError(
                "avg_size", f"{self.avg_size} exceeds max_size {self.max_size}"
            )
        if self.max_size < 2 * self.min_size:
            raise InvalidArgumentError(
                "max_size",
                f"must be at least 2 * min_size = {2 * self.min_size} (oversized gaps are "
                f"split into pieces of at least max_size / 2), got {self.max_size}",
            )
        densest = _isolated_density(1.0 / self.min_size, self.min_size)
        if self.avg_size * densest < 1.0:
            raise InvalidArgumentError(
                "avg_size",
                f"{self.avg_size} is below {math.ceil(1.0 / densest)}, the smallest mean "
                f"anchor spacing reachable with min_size {self.min_size} (about e * min_size)",
            )
        if self.window > 64:
            raise InvalidArgumentError("window", f"must be at most 64, got {self.window}")
        object.__setattr__(self, "_threshold", self._solve_threshold())

    @property
    def lookback(self) -> int:
        """Tokens before a cut that decide whether it is an anchor."""
        return self.min_size + self.window - 1

    def _solve_threshold(self) -> np.uint64:
        # Largest q = k / 2**32 on (0, 1/min_size] with q * (1 - q)**(min_size - 1) at
        # most 1 / avg_size: the branch with sparse hits (fewer clustered hits wasted by
        # the isolation rule). Exact integer arithmetic, so every machine gets the same
        # threshold and hence the same cuts.
        m, one = self.min_size, 1 << 32
        lo, hi = 0, one // m
        while lo < hi:
            k = (lo + hi + 1) // 2
            if k * (one - k) ** (m - 1) * self.avg_size <= one**m:
                lo = k
            else:
                hi = k - 1
        return np.uint64(lo << 32)

    def anchors(self, tokens: TokenIds) -> npt.NDArray[np.int64]:
        """Positions of the content anchors of ``tokens`` (sorted cut positions)."""
        arr = token_array(tokens)
        n, w, m = len(arr), self.window, self.min_size
        if n < max(2 * m, w):
            return np.empty(0, dtype=np.int64)
        gear = gear_values(arr)
        # h[k] is the hash of the window t[k : k + w], i.e. of cut position c = k + w.
        h = np.zeros(n - w + 1, dtype=np.uint64)
        for j in range(w):
            h += gear[w - 1 - j : n - j] << np.uint64(j)
        hits = np.flatnonzero(h < self._threshold).astype(np.int64) + w
        if hits.size == 0:
            return hits
        isolated = np.empty(hits.size, dtype=bool)
        isolated[0] = True
        np.greater_equal(np.diff(hits), m, out=isolated[1:])
        cuts = hits[isolated]
        return cuts[(cuts >= m) & (cuts <= n - m)]

    def _cut_gap(self, start: int, end: int, out: list[int]) -> None:
        # Append the cuts inside an anchor gap [start, end) that is longer than max_size;
        # each depends only on `start` while the gap goes on, so they stay shift-stable.
        cur = start
        while end - cur > self.max_size:
            if end - cur >= self.max_size + self.min_size:
                cur += self.max_size
            else:
                cur += (end - cur) // 2
            out.append(cur)

    def split(self, tokens: TokenIds) -> list[ChunkSpan]:
        """Content-defined spans covering ``tokens`` (see the class docstring)."""
        arr = token_array(tokens)
        n = len(arr)
        if n == 0:
            return []
        bounds = [0]
        for anchor in [*self.anchors(arr).tolist(), n]:
            if anchor - bounds[-1] > self.max_size:
                self._cut_gap(bounds[-1], anchor, bounds)
            bounds.append(anchor)
        return _spans(bounds)


@dataclass(frozen=True, slots=True)
class SegmentChunker:
    """Caller-given segments (messages, documents, tool results), each content-chunked.

    ``boundaries`` are the positions where a new segment starts, strictly increasing;
    0 and the prompt length are implied (and allowed). Each segment is chunked by
    ``content`` from its own start, so a segment that moves to another offset, or into
    another prompt, keeps exactly the same chunks and keys.
    """

    boundaries: Sequence[int]
    content: ContentChunker = ContentChunker()

    def __post_init__(self) -> None:
        try:
            bounds = tuple(self.boundaries)
        except TypeError:
            raise InvalidArgumentError(
                "boundaries", f"must be a sequence of ints, got {type(self.boundaries).__name__}"
            ) from None
        for b in bounds:
            if isinstance(b, bool) or not isinstance(b, int | np.integer):
                raise InvalidArgumentError("boundaries", f"must be ints, got {b!r}")
        bounds = tuple(int(b) for b in bounds)
        if bounds and bounds[0] < 0:
            raise InvalidArgumentError("boundaries", f"must be >= 0, got {bounds[0]}")
        for a, b in itertools.pairwise(bounds):
            if b <= a:
                raise InvalidArgumentError(
                    "boundaries", f"must be strictly increasing, got {a} then {b}"
                )
        if not isinstance(self.content, ContentChunker):
            raise InvalidArgumentError(
                "content", f"must be a ContentChunker, got {type(self.content).__name__}"
            )
        object.__setattr__(self, "boundaries", bounds)

    def segments(self, num_tokens: int) -> list[ChunkSpan]:
        """The segments of a prompt of ``num_tokens`` tokens."""
        if self.boundaries and self.boundaries[-1] > num_tokens:
            raise InvalidArgumentError(
                "boundaries",
                f"last boundary {self.boundaries[-1]} is past the prompt end {num_tokens}",
            )
        cuts = [b for b in self.boundaries if 0 < b < num_tokens]
        return _spans([0, *cuts, num_tokens]) if num_tokens else []

    def split(self, tokens: TokenIds) -> list[ChunkSpan]:
        """Content chunks of every segment, in prompt order."""
        arr = token_array(tokens)
        out: list[ChunkSpan] = []
        for seg in self.segments(len(arr)):
            out.extend(
                span.shifted(seg.start) for span in self.content.split(arr[seg.start : seg.end])
            )
        return out
