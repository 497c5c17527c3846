"""Head groups: the fingerprint of some KV heads, each TP rank's groups, plans rekeyed."""

from __future__ import annotations

import numpy as np
import pytest

from nopecache.client import (
    ChunkSpan,
    FixedChunker,
    InputIdentity,
    InvalidArgumentError,
    KeyedChunk,
    ModelFingerprint,
    ReusePlan,
    content_chunks,
    plan_reuse,
    prefix_chunks,
)
from nopecache.client.head_groups import rank_head_groups, rekey_plan
from nopecache.client.keyplan import pi_fingerprint
from nopecache.proto.block import StoredForm

FP = ModelFingerprint("m", "r", 2, 4, 8, "float32", StoredForm.ROPE, bytes(16))


def test_a_head_group_is_keyed_apart_and_round_trips() -> None:
    g0, g1 = FP.head_group(0, 2), FP.head_group(2, 2)
    assert (g0.num_kv_heads, g0.kv_head_start, g0.kv_heads_total) == (2, 0, 4)
    assert (g1.num_kv_heads, g1.kv_head_start, g1.kv_heads_total) == (2, 2, 4)
    assert len({FP.digest(), g0.digest(), g1.digest()}) == 3
    assert g1.to_bytes()[4] == 2 and FP.to_bytes()[4] == 1  # encoding versions
    assert g1.to_bytes()[-8:] == (2).to_bytes(4, "little") + (4).to_bytes(4, "little")
    for fp in (FP, g0, g1):
        assert ModelFingerprint.from_bytes(fp.to_bytes()) == fp


def test_every_head_is_the_plain_fingerprint() -> None:
    whole = FP.head_group(0, 4)
    assert whole == FP and whole.to_bytes() == FP.to_bytes() and not whole.is_head_group


@pytest.mark.parametrize(
    ("start", "count", "field"),
    [(3, 2, "kv_head_start"), (0, 0, "count")],
)
def test_a_group_past_the_heads_is_refused(start: int, count: int, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        FP.head_group(start, count)


def test_a_truncated_group_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="truncated inside the head group"):
        ModelFingerprint.from_bytes(FP.head_group(2, 2).to_bytes()[:-1])


def test_ranks_of_every_tp_size_cut_the_heads_at_the_same_groups() -> None:
    tp1 = rank_head_groups(FP, 2, 1, 0)
    tp2 = [g for r in range(2) for g in rank_head_groups(FP, 2, 2, r)]
    assert [g.fingerprint for g in tp1] == [g.fingerprint for g in tp2]
    assert [g.local_start for g in tp1] == [0, 2]
    assert [g.local_start for g in tp2] == [0, 0]
    assert [g.fingerprint.kv_head_start for g in tp2] == [0, 2]
    assert rank_head_groups(FP, 4, 1, 0)[0].fingerprint == FP  # one group: plain keys


@pytest.mark.parametrize(
    ("group", "tp", "rank", "field"),
    [(2, 3, 0, "tp_size"), (4, 2, 0, "group_size"), (3, 1, 0, "group_size"), (2, 2, 2, "tp_rank")],
)
def test_uneven_splits_are_refused(group: int, tp: int, rank: int, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        rank_head_groups(FP, group, tp, rank)


def test_a_rekeyed_plan_is_the_plan_keyed_under_the_group() -> None:
    tokens = np.arange(100, 164, dtype=np.uint32)
    g0, g1 = FP.head_group(0, 2), FP.head_group(2, 2)
    spans = FixedChunker(16).split(tokens)

    def keyed(fp: ModelFingerprint) -> tuple[list[KeyedChunk], list[KeyedChunk]]:
        pre = prefix_chunks(fp, "ns", tokens, spans[:2])
        pi = content_chunks(pi_fingerprint(fp), "ns", tokens, [ChunkSpan(40, 56)])
        return pre, pi

    def plan(fp: ModelFingerprint) -> ReusePlan:
        pre, pi = keyed(fp)
        found = {c.key: StoredForm.ROPE for c in pre} | {c.key: StoredForm.NOPE for c in pi}
        return plan_reuse(64, pre, pi, found)

    p0 = plan(g0)
    assert p0.prefix_end == 32 and [h.target for h in p0.hits] == [ChunkSpan(40, 56)]
    assert rekey_plan(p0, tokens, g1, "ns") == plan(g1)
    assert rekey_plan(p0, tokens, g0, "ns") == p0
    with pytest.raises(InvalidArgumentError, match="tokens"):
        rekey_plan(p0, tokens[:10], g1, "ns")


def test_a_rekeyed_plan_keeps_the_identity_it_was_looked_up_with() -> None:
    """Regression: re-keying for another head group dropped the request's identity, so an
    adapter's (or an image's) plan fetched the plain-text blocks of the same tokens for every
    group but the first."""
    tokens = np.arange(100, 164, dtype=np.uint32)
    g0, g1 = FP.head_group(0, 2), FP.head_group(2, 2)
    spans = FixedChunker(16).split(tokens)[:2]
    adapter = InputIdentity(b"lora-a")

    def plan(fp: ModelFingerprint, identity: InputIdentity | None) -> ReusePlan:
        pre = prefix_chunks(fp, "ns", tokens, spans, identity)
        pi = content_chunks(pi_fingerprint(fp), "ns", tokens, [ChunkSpan(40, 56)], identity)
        found = {c.key: StoredForm.ROPE for c in pre} | {c.key: StoredForm.NOPE for c in pi}
        return plan_reuse(64, pre, pi, found)

    rekeyed = rekey_plan(plan(g0, adapter), tokens, g1, "ns", adapter)
    assert rekeyed == plan(g1, adapter)
    plain = plan(g1, None)
    assert all(a.key != b.key for a, b in zip(rekeyed.prefix, plain.prefix, strict=True))
    assert rekeyed.hits[0].key != plain.hits[0].key


def test_a_hit_trimmed_by_the_prefix_is_rekeyed_from_its_whole_chunk() -> None:
    tokens = np.arange(200, 264, dtype=np.uint32)
    g0, g1 = FP.head_group(0, 1), FP.head_group(1, 1)
    spans = FixedChunker(16).split(tokens)[:2]

    def plan(fp: ModelFingerprint) -> ReusePlan:
        pre = prefix_chunks(fp, "", tokens, spans)
        pi = content_chunks(pi_fingerprint(fp), "", tokens, [ChunkSpan(24, 48)])
        found = {c.key: StoredForm.ROPE for c in pre} | {pi[0].key: StoredForm.NOPE}
        return plan_reuse(64, pre, pi, found)

    p0 = plan(g0)
    (hit,) = p0.hits
    assert (hit.target, hit.source) == (ChunkSpan(32, 48), ChunkSpan(8, 24))
    assert rekey_plan(p0, tokens, g1, "") == plan(g1)
