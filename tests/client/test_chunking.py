"""Chunkers: exact coverage, size bounds, and equal chunks for equal content at any offset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nopecache.client import (
    ChunkSpan,
    ContentChunker,
    FixedChunker,
    InvalidArgumentError,
    SegmentChunker,
    token_array,
)

SMALL = ContentChunker(min_size=4, avg_size=16, max_size=64, window=4)
DEFAULT = ContentChunker()
# A token sequence that every machine generates the same way, for pinned vectors.
PINNED_TOKENS = [(i * 7919 + 13) % 50000 for i in range(400)]


def random_tokens(seed: int, n: int, vocab: int = 50_000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int64)


def assert_tiles(spans: list[ChunkSpan], start: int, end: int) -> None:
    """Spans are in order, disjoint, and cover [start, end) exactly."""
    pos = start
    for span in spans:
        assert span.start == pos
        pos = span.end
    assert pos == end


# ---------------------------------------------------------------- token ids and spans


def test_token_array_accepts_lists_numpy_and_torch_alike() -> None:
    ids = [0, 7, 2**32 - 1, 128_000]
    expected = np.array(ids, dtype="<u4")
    for given_ids in (ids, tuple(ids), np.array(ids, dtype=np.int64), torch.tensor(ids)):
        arr = token_array(given_ids)
        assert arr.dtype == np.dtype("<u4")
        assert arr.flags.c_contiguous
        assert arr.tolist() == expected.tolist()
    assert token_array([]).tolist() == []


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, -1], "fit in uint32"),
        ([1, 2**32], "fit in uint32"),
        ([1.0, 2.0], "integer token ids"),
        ([[1, 2], [3, 4]], "1-D"),
        ([True, False], "integer token ids"),
    ],
)
def test_token_array_rejects_what_is_not_a_token_id(tokens: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as err:
        token_array(tokens)  # type: ignore[arg-type]
    assert err.value.argument == "tokens"


def test_chunk_span_is_a_non_empty_half_open_range() -> None:
    span = ChunkSpan(3, 10)
    assert len(span) == 7
    assert span.shifted(5) == ChunkSpan(8, 15)
    assert sorted([ChunkSpan(4, 6), ChunkSpan(0, 9), ChunkSpan(0, 2)]) == [
        ChunkSpan(0, 2),
        ChunkSpan(0, 9),
        ChunkSpan(4, 6),
    ]
    for start, end in ((5, 5), (6, 5), (-1, 3)):
        with pytest.raises(InvalidArgumentError, match=r"ChunkSpan: needs 0 <= start < end"):
            ChunkSpan(start, end)
    with pytest.raises(InvalidArgumentError, match=r"ChunkSpan.end: must be an int"):
        ChunkSpan(0, np.int64(3))  # type: ignore[arg-type]


# ---------------------------------------------------------------- fixed


def test_fixed_chunker_cuts_every_n_tokens_from_zero() -> None:
    tokens = list(range(40))
    assert FixedChunker(16).split(tokens) == [ChunkSpan(0, 16), ChunkSpan(16, 32)]
    assert FixedChunker(16, keep_partial=True).split(tokens) == [
        ChunkSpan(0, 16),
        ChunkSpan(16, 32),
        ChunkSpan(32, 40),
    ]
    assert FixedChunker(8, keep_partial=True).split(tokens[:16]) == [
        ChunkSpan(0, 8),
        ChunkSpan(8, 16),
    ]
    assert FixedChunker(16).split([]) == []
    assert FixedChunker(16, keep_partial=True).split([1, 2]) == [ChunkSpan(0, 2)]


@pytest.mark.parametrize("size", [0, -16, 2.5, True])
def test_fixed_chunker_rejects_a_non_positive_size(size: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^size: must be a positive int"):
        FixedChunker(size)  # type: ignore[arg-type]


@given(n=st.integers(0, 300), size=st.integers(1, 40), keep_partial=st.booleans())
def test_fixed_chunker_tiles_the_full_blocks(n: int, size: int, keep_partial: bool) -> None:
    spans = FixedChunker(size, keep_partial=keep_partial).split(list(range(n)))
    assert_tiles(spans, 0, n if keep_partial else n - n % size)
    assert all(len(s) == size for s in spans[:-1])


# ---------------------------------------------------------------- content


def test_content_chunker_boundaries_are_pinned() -> None:
    # Same cuts on every machine and process: the gear values are plain uint64 math.
    assert DEFAULT.anchors(PINNED_TOKENS).tolist() == [
        12, 31, 47, 130, 161, 210, 230, 241, 329, 359, 378, 391,
    ]  # fmt: skip
    assert [s.end for s in DEFAULT.split(PINNED_TOKENS)] == [
        12, 31, 47, 130, 161, 210, 230, 241, 329, 359, 378, 391, 400,
    ]  # fmt: skip
    assert SMALL.anchors(PINNED_TOKENS[:120]).tolist() == [12, 19, 58, 91, 96, 101, 109]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"min_size": 0}, "min_size"),
        ({"avg_size": -1}, "avg_size"),
        ({"max_size": 2.0}, "max_size"),
        ({"window": 0}, "window"),
        ({"min_size": 40, "avg_size": 32}, "min_size"),
        ({"avg_size": 200, "max_size": 128}, "avg_size"),
        ({"min_size": 8, "avg_size": 15, "max_size": 15}, "max_size"),
        ({"min_size": 16, "avg_size": 32, "max_size": 128}, "avg_size"),
        ({"window": 65}, "window"),
    ],
)
def test_content_chunker_rejects_bad_sizes_naming_the_argument(
    kwargs: dict[str, object], argument: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"^{argument}: ") as err:
        ContentChunker(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_content_chunker_mean_size_follows_avg_size() -> None:
    tokens = random_tokens(0, 40_000)
    for chunker in (SMALL, DEFAULT, ContentChunker(16, 64, 256, 16)):
        spans = chunker.split(tokens)
        mean = len(tokens) / len(spans)
        assert 0.9 * chunker.avg_size < mean < 1.1 * chunker.avg_size, (chunker, mean)


@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 900),
    vocab=st.sampled_from([1, 2, 3, 50_000]),
    chunker=st.sampled_from([SMALL, DEFAULT, ContentChunker(2, 6, 8, 1)]),
)
def test_content_chunks_tile_the_input_within_min_and_max(
    seed: int, n: int, vocab: int, chunker: ContentChunker
) -> None:
    tokens = random_tokens(seed, n, vocab)
    spans = chunker.split(tokens)
    assert_tiles(spans, 0, n)
    if n < chunker.min_size:
        assert spans == ([ChunkSpan(0, n)] if n else [])
    else:
        assert all(chunker.min_size <= len(s) <= chunker.max_size for s in spans)
    anchors = chunker.anchors(tokens)
    assert np.all(np.diff(anchors) >= chunker.min_size)
    assert set(anchors.tolist()) <= {s.end for s in spans}


Case = tuple[np.ndarray, np.ndarray, np.ndarray, int]


def shift_cases() -> st.SearchStrategy[Case]:
    """A run of tokens (over a vocabulary), the random context before and after it."""
    return st.builds(
        lambda seed, n_run, n_before, n_after, vocab: (
            random_tokens(seed, n_before),
            random_tokens(seed + 1, n_run, vocab),
            random_tokens(seed + 2, n_after),
            vocab,
        ),
        seed=st.integers(0, 2**31),
        n_run=st.integers(300, 800),
        n_before=st.integers(0, 400),
        n_after=st.integers(0, 100),
        vocab=st.sampled_from([2, 50_000]),
    )


@given(case=shift_cases(), chunker=st.sampled_from([SMALL, DEFAULT]))
def test_anchors_depend_only_on_the_lookback_window(case: Case, chunker: ContentChunker) -> None:
    before, run, after, _ = case
    prompt = np.concatenate([before, run, after])
    lo, hi = chunker.lookback, len(run) - chunker.min_size
    alone = [a for a in chunker.anchors(run).tolist() if lo <= a <= hi]
    inside = [
        a - len(before) for a in chunker.anchors(prompt).tolist() if lo <= a - len(before) <= hi
    ]
    assert inside == alone


@given(case=shift_cases(), chunker=st.sampled_from([SMALL, DEFAULT]))
def test_a_run_keeps_its_chunks_at_any_offset(case: Case, chunker: ContentChunker) -> None:
    before, run, after, vocab = case
    prompt = np.concatenate([before, run, after])
    anchors = chunker.anchors(run).tolist()
    # The guarantee of the ContentChunker docstring.
    first = min((a for a in anchors if a >= chunker.lookback), default=len(run))
    late = len(run) - chunker.max_size - chunker.min_size
    stable = [
        s for s in chunker.split(run) if s.start >= first and (s.end in anchors or s.end <= late)
    ]
    if vocab > 2:
        # Not vacuous on varied tokens: the run is found but for about two chunks per end.
        lost = len(run) - sum(len(s) for s in stable)
        assert lost <= chunker.lookback + 3 * chunker.avg_size + chunker.max_size, lost
    spans = set(chunker.split(prompt))
    for span in stable:
        assert span.shifted(len(before)) in spans


@given(
    seed=st.integers(0, 2**31),
    n_repeat=st.integers(150, 600),
    n_tail=st.integers(0, 60),
    n_before=st.integers(0, 200),
    n_after=st.integers(1, 300),
)
def test_forced_cuts_in_a_long_anchorless_stretch_keep_their_place(
    seed: int, n_repeat: int, n_tail: int, n_before: int, n_after: int
) -> None:
    # A repeated token has no anchors after its first window, so the chunker must fall
    # back to max-size cuts; those are counted from the left anchor and so still move
    # with the run, whatever follows it in the prompt.
    chunker = SMALL
    run = np.concatenate(
        [random_tokens(seed, 120), np.full(n_repeat, 7), random_tokens(seed + 1, n_tail)]
    )
    prompt = np.concatenate(
        [random_tokens(seed + 2, n_before), run, random_tokens(seed + 3, n_after)]
    )
    anchors = chunker.anchors(run).tolist()
    first = min((a for a in anchors if a >= chunker.lookback), default=len(run))
    late = len(run) - chunker.max_size - chunker.min_size
    stable = [
        s for s in chunker.split(run) if s.start >= first and (s.end in anchors or s.end <= late)
    ]
    forced = [s for s in stable if len(s) == chunker.max_size]
    assert forced  # the case under test happens
    spans = set(chunker.split(prompt))
    for span in stable:
        assert span.shifted(n_before) in spans


def test_a_run_of_one_repeated_token_is_cut_every_max_tokens() -> None:
    tokens = [7] * 300
    spans = SMALL.split(tokens)
    assert SMALL.anchors(tokens).size <= 1
    assert all(4 <= len(s) <= 64 for s in spans)
    assert_tiles(spans, 0, 300)


# ---------------------------------------------------------------- segments


def test_segment_chunker_never_crosses_a_segment_boundary() -> None:
    tokens = random_tokens(3, 500)
    chunker = SegmentChunker([0, 3, 120, 121, 400, 500], content=SMALL)
    assert chunker.segments(500) == [
        ChunkSpan(0, 3),
        ChunkSpan(3, 120),
        ChunkSpan(120, 121),
        ChunkSpan(121, 400),
        ChunkSpan(400, 500),
    ]
    spans = chunker.split(tokens)
    assert_tiles(spans, 0, 500)
    ends = {s.end for s in spans}
    assert {3, 120, 121, 400, 500} <= ends
    assert SegmentChunker([]).split([]) == []
    assert SegmentChunker([]).split([5, 6]) == [ChunkSpan(0, 2)]


@given(
    seed=st.integers(0, 2**31),
    n_segment=st.integers(1, 700),
    n_before=st.integers(0, 300),
    n_after=st.integers(0, 50),
)
def test_a_moved_segment_keeps_all_its_chunks(
    seed: int, n_segment: int, n_before: int, n_after: int
) -> None:
    segment = random_tokens(seed, n_segment)
    prompt = np.concatenate(
        [random_tokens(seed + 1, n_before), segment, random_tokens(seed + 2, n_after)]
    )
    bounds = [n_before, n_before + n_segment]
    moved = SegmentChunker(bounds, content=SMALL).split(prompt)
    alone = SegmentChunker([], content=SMALL).split(segment)
    assert [s.shifted(n_before) for s in alone] == [
        s for s in moved if n_before <= s.start and s.end <= n_before + n_segment
    ]


@pytest.mark.parametrize(
    ("boundaries", "message"),
    [
        ([5, 3], "strictly increasing, got 5 then 3"),
        ([4, 4], "strictly increasing, got 4 then 4"),
        ([-1, 3], "must be >= 0"),
        ([1.5], "must be ints"),
        (7, "must be a sequence of ints"),
    ],
)
def test_segment_chunker_rejects_bad_boundaries(boundaries: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message) as err:
        SegmentChunker(boundaries)  # type: ignore[arg-type]
    assert err.value.argument == "boundaries"


def test_segment_chunker_rejects_a_boundary_past_the_prompt() -> None:
    chunker = SegmentChunker([2, 9])
    with pytest.raises(InvalidArgumentError, match=r"^boundaries: last boundary 9 is past"):
        chunker.split(list(range(8)))
    with pytest.raises(InvalidArgumentError, match=r"^content: must be a ContentChunker"):
        SegmentChunker([1], content=FixedChunker(4))  # type: ignore[arg-type]
