"""The reuse plan: exact prefix, disjoint position-independent hits, misses; nothing twice."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nopecache.client import (
    BlockKey,
    ChunkSpan,
    ContentChunker,
    FixedChunker,
    Hit,
    HitKind,
    InvalidArgumentError,
    KeyedChunk,
    ModelFingerprint,
    ReusePlan,
    SegmentChunker,
    content_chunks,
    plan_reuse,
    prefix_chunks,
)
from nopecache.proto.block import StoredForm

NOPE, ROPE = StoredForm.NOPE, StoredForm.ROPE
PREFIX, PI = HitKind.PREFIX, HitKind.POSITION_INDEPENDENT
FP = ModelFingerprint("m", "r", 2, 1, 8, "float32", NOPE, bytes(16))


def key(n: int) -> BlockKey:
    return BlockKey(n.to_bytes(16, "big"))


def chunk(start: int, end: int, n: int) -> KeyedChunk:
    return KeyedChunk(ChunkSpan(start, end), key(n))


# Prompt of 64 tokens: prefix grid of 16 (keys 1-4), content chunks (keys 10-14).
PREFIX_CHUNKS = [chunk(0, 16, 1), chunk(16, 32, 2), chunk(32, 48, 3), chunk(48, 64, 4)]
PI_CHUNKS = [
    chunk(0, 20, 10),
    chunk(20, 40, 11),
    chunk(40, 50, 12),
    chunk(50, 60, 13),
    chunk(60, 64, 14),
]


def test_plan_of_a_worked_example() -> None:
    found = {key(1): NOPE, key(2): ROPE, key(4): NOPE, key(10): NOPE, key(11): ROPE, key(13): NOPE}
    plan = plan_reuse(64, PREFIX_CHUNKS, PI_CHUNKS, found)
    assert plan == ReusePlan(
        num_tokens=64,
        prefix=(
            Hit(key(1), ChunkSpan(0, 16), ChunkSpan(0, 16), NOPE, PREFIX),
            Hit(key(2), ChunkSpan(16, 32), ChunkSpan(0, 16), ROPE, PREFIX),
        ),
        # key 10 lies inside the prefix; key 11 overlaps it and is trimmed at the front.
        hits=(
            Hit(key(11), ChunkSpan(32, 40), ChunkSpan(12, 20), ROPE, PI),
            Hit(key(13), ChunkSpan(50, 60), ChunkSpan(0, 10), NOPE, PI),
        ),
        misses=(ChunkSpan(40, 50), ChunkSpan(60, 64)),
    )
    assert (plan.prefix_end, plan.prefix_tokens, plan.pi_tokens) == (32, 32, 18)
    assert (plan.reused_tokens, plan.miss_tokens) == (50, 14)
    assert plan.blocks == plan.prefix + plan.hits


def test_prefix_stops_at_the_first_missing_block() -> None:
    # Key 4 exists, but without key 3 it is not an exact prefix any more.
    found = {key(1): NOPE, key(2): NOPE, key(4): NOPE}
    plan = plan_reuse(64, PREFIX_CHUNKS, PI_CHUNKS, found)
    assert [h.key for h in plan.prefix] == [key(1), key(2)]
    assert plan.hits == ()
    assert plan.misses == (ChunkSpan(32, 64),)


def test_keep_filter_drops_hits_into_misses() -> None:
    found = {key(1): NOPE, key(2): NOPE, key(11): NOPE, key(12): NOPE, key(13): NOPE}

    def keep(hit: Hit) -> bool:
        return hit.key not in (key(2), key(12))

    plan = plan_reuse(64, PREFIX_CHUNKS, PI_CHUNKS, found, keep=keep)
    assert [h.target for h in plan.prefix] == [ChunkSpan(0, 16)]
    assert [(h.key, h.target, h.source) for h in plan.hits] == [
        (key(11), ChunkSpan(20, 40), ChunkSpan(0, 20)),
        (key(13), ChunkSpan(50, 60), ChunkSpan(0, 10)),
    ]
    assert [h.key for h in plan.dropped] == [key(2), key(12)]
    assert plan.misses == (ChunkSpan(16, 20), ChunkSpan(40, 50), ChunkSpan(60, 64))


def test_hits_trimmed_below_min_hit_tokens_are_left_out() -> None:
    found = {key(1): NOPE, key(2): NOPE, key(11): NOPE}
    plan = plan_reuse(64, PREFIX_CHUNKS[:2], [chunk(20, 36, 11)], found, min_hit_tokens=5)
    assert plan.hits == ()
    plan = plan_reuse(64, PREFIX_CHUNKS[:2], [chunk(20, 36, 11)], found, min_hit_tokens=4)
    assert [(h.target, h.source) for h in plan.hits] == [(ChunkSpan(32, 36), ChunkSpan(12, 16))]


def test_overlapping_candidates_prefer_the_longest_at_equal_start() -> None:
    found = {key(20): NOPE, key(21): NOPE, key(22): NOPE}
    pi = [chunk(10, 20, 20), chunk(10, 30, 21), chunk(25, 40, 22)]
    plan = plan_reuse(50, [], pi, found)
    assert [(h.key, h.target, h.source) for h in plan.hits] == [
        (key(21), ChunkSpan(10, 30), ChunkSpan(0, 20)),
        (key(22), ChunkSpan(30, 40), ChunkSpan(5, 15)),
    ]
    assert plan.misses == (ChunkSpan(0, 10), ChunkSpan(40, 50))


def test_empty_and_all_miss_plans() -> None:
    assert plan_reuse(0, [], [], {}) == ReusePlan(0)
    assert plan_reuse(30, PREFIX_CHUNKS[:1], PI_CHUNKS[:1], {}) == ReusePlan.all_miss(30)
    assert ReusePlan.all_miss(30).misses == (ChunkSpan(0, 30),)
    assert ReusePlan.all_miss(0).reused_tokens == 0


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"prefix_chunks": [chunk(16, 32, 2)]}, "prefix_chunks"),
        ({"prefix_chunks": [chunk(0, 80, 2)]}, "prefix_chunks"),
        ({"pi_chunks": [chunk(60, 65, 2)]}, "pi_chunks"),
        ({"pi_chunks": [ChunkSpan(0, 4)]}, "pi_chunks"),
        ({"min_hit_tokens": 0}, "min_hit_tokens"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs: dict[str, object], argument: str) -> None:
    args: dict[str, object] = {
        "num_tokens": 64,
        "prefix_chunks": [],
        "pi_chunks": [],
        "found": {},
        **kwargs,
    }
    with pytest.raises(InvalidArgumentError, match=rf"^{argument}: ") as err:
        plan_reuse(**args)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_a_plan_that_does_not_cover_the_prompt_is_rejected() -> None:
    hit = Hit(key(1), ChunkSpan(0, 16), ChunkSpan(0, 16), NOPE, PREFIX)
    with pytest.raises(InvalidArgumentError, match=r"^hits/misses: cover up to 16"):
        ReusePlan(20, prefix=(hit,))
    with pytest.raises(InvalidArgumentError, match=r"^hits/misses: .* does not start at"):
        ReusePlan(20, prefix=(hit,), misses=(ChunkSpan(10, 20),))
    with pytest.raises(InvalidArgumentError, match=r"^hits: holds a hit whose kind"):
        ReusePlan(16, hits=(hit,))
    with pytest.raises(InvalidArgumentError, match=r"^Hit.source: "):
        Hit(key(1), ChunkSpan(0, 16), ChunkSpan(0, 8), NOPE, PI)
    plan = plan_reuse(20, [chunk(0, 16, 1)], [], {key(1): NOPE})
    with pytest.raises(InvalidArgumentError):
        dataclasses.replace(plan, misses=())


# ---------------------------------------------------------------- properties


@st.composite
def plan_inputs(
    draw: st.DrawFn,
) -> tuple[int, list[KeyedChunk], list[KeyedChunk], dict[BlockKey, StoredForm]]:
    n = draw(st.integers(0, 200))
    size = draw(st.integers(1, 32))
    prefix = [
        KeyedChunk(s, key(i)) for i, s in enumerate(FixedChunker(size).split(range(n)), start=1)
    ]
    pi: list[KeyedChunk] = []
    for i in range(draw(st.integers(0, 25)) if n else 0):
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, min(n, start + 40)))
        pi.append(KeyedChunk(ChunkSpan(start, end), key(1000 + i)))
    keys = [c.key for c in prefix + pi]
    exists = draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    forms = draw(
        st.lists(st.sampled_from(list(StoredForm)), min_size=len(keys), max_size=len(keys))
    )
    found = {k: f for k, e, f in zip(keys, exists, forms, strict=True) if e}
    return n, prefix, pi, found


@given(inputs=plan_inputs(), min_hit=st.integers(1, 4))
def test_plan_properties(
    inputs: tuple[int, list[KeyedChunk], list[KeyedChunk], dict[BlockKey, StoredForm]],
    min_hit: int,
) -> None:
    n, prefix, pi, found = inputs
    plan = plan_reuse(n, prefix, pi, found, min_hit_tokens=min_hit)

    # The prefix is the longest run of existing prefix blocks from position 0.
    run = 0
    while run < len(prefix) and prefix[run].key in found:
        run += 1
    assert [h.key for h in plan.prefix] == [c.key for c in prefix[:run]]
    assert plan.prefix_end == (prefix[run - 1].span.end if run else 0)

    # Prefix, hits and misses tile the prompt once, hits in order after the prefix.
    cover = np.zeros(n, dtype=np.int64)
    for part in [h.target for h in plan.blocks] + list(plan.misses):
        cover[part.start : part.end] += 1
    assert cover.tolist() == [1] * n
    assert all(h.target.start >= plan.prefix_end for h in plan.hits)
    assert list(plan.hits) == sorted(plan.hits, key=lambda h: h.target.start)
    assert all(a.end < b.start for a, b in zip(plan.misses, plan.misses[1:], strict=False))

    # Each hit is a found chunk's tail: right form, source = target inside the block.
    by_key = {c.key: c.span for c in pi}
    for hit in plan.hits:
        span = by_key[hit.key]
        assert hit.form is found[hit.key]
        assert span.start <= hit.target.start and hit.target.end == span.end
        assert hit.source == hit.target.shifted(-span.start)
        assert len(hit.target) >= min_hit
    for hit in plan.prefix:
        assert hit.form is found[hit.key]
        assert hit.source == ChunkSpan(0, len(hit.target))

    # With min_hit_tokens=1 every found token after the prefix is reused.
    if min_hit == 1:
        found_mask = np.zeros(n, dtype=bool)
        for c in pi:
            if c.key in found:
                found_mask[c.span.start : c.span.end] = True
        for miss in plan.misses:
            assert not found_mask[miss.start : miss.end].any()

    # Deterministic, whatever the order of the candidates.
    assert plan_reuse(n, prefix, pi[::-1], found, min_hit_tokens=min_hit) == plan


# ---------------------------------------------------------------- with real keys


def test_a_system_prompt_after_an_uploaded_report_is_reused_entirely() -> None:
    rng = np.random.default_rng(7)
    system, question, report = (rng.integers(0, 50_000, n) for n in (200, 30, 500))
    content = ContentChunker()

    # Engine 1 stored [system | question]; its keys are what the server holds.
    first = np.concatenate([system, question])
    seg1 = SegmentChunker([0, 200], content).split(first)
    stored = prefix_chunks(FP, "", first, FixedChunker(16).split(first))
    stored += content_chunks(FP, "", first, seg1)
    found = {c.key: NOPE for c in stored}

    # Engine 2 sees [report | system | question]: no exact prefix, the system prompt hits.
    second = np.concatenate([report, system, question])
    plan = plan_reuse(
        len(second),
        prefix_chunks(FP, "", second, FixedChunker(16).split(second)),
        content_chunks(FP, "", second, SegmentChunker([500, 700], content).split(second)),
        found,
    )
    assert plan.prefix == ()
    assert plan.pi_tokens == 230
    assert [h.target for h in plan.hits] == [s.shifted(500) for s in seg1]
    assert plan.misses == (ChunkSpan(0, 500),)

    # The same prompt again: the whole 16-token grid comes from the exact prefix.
    again = plan_reuse(
        len(first),
        prefix_chunks(FP, "", first, FixedChunker(16).split(first)),
        content_chunks(FP, "", first, seg1),
        found,
    )
    assert again.prefix_end == 224
    assert [h.target for h in again.hits] == [ChunkSpan(224, 230)]
    assert again.misses == ()
