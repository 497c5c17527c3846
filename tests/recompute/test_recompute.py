"""Recompute policies select exactly the tokens they say, on small synthetic inputs (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import InvalidArgumentError
from nopecache.recompute import policies as rc
from nopecache.recompute.policies import (
    LayerState,
    ReuseLayout,
    Selective,
    head_deviation,
    spread_equally,
    spread_proportionally,
    top_share,
)

# 20 tokens: exact prefix [0, 3), chunks [5, 9) and [12, 15), misses elsewhere.
LAYOUT = ReuseLayout(20, 3, (ChunkSpan(5, 9), ChunkSpan(12, 15)))
PI = [5, 6, 7, 8, 12, 13, 14]
LAYERS = 10


def _state(
    fresh_k: torch.Tensor,
    cached_k: torch.Tensor,
    fresh_v: torch.Tensor | None = None,
    cached_v: torch.Tensor | None = None,
    *,
    running: list[int] | None = None,
    layer: int = 1,
    attention: torch.Tensor | None = None,
) -> LayerState:
    n = fresh_k.shape[0]
    zeros = torch.zeros_like(fresh_k)
    return LayerState(
        layer=layer,
        num_layers=LAYERS,
        layout=LAYOUT,
        running=torch.tensor(running if running is not None else list(range(n))),
        fresh_k=fresh_k,
        fresh_v=fresh_v if fresh_v is not None else zeros,
        cached_k=cached_k,
        cached_v=cached_v if cached_v is not None else zeros,
        attention=attention,
    )


def _k_deviating(amounts: list[float], heads: int = 2, dim: int = 4) -> LayerState:
    """Cached K zero, fresh K with squared distance ``amounts[i]`` for token i (head 0)."""
    fresh = torch.zeros(len(amounts), heads, dim)
    fresh[:, 0, 0] = torch.tensor(amounts).sqrt()
    return _state(fresh, torch.zeros_like(fresh))


def test_layout_indexes_the_position_independent_tokens() -> None:
    assert LAYOUT.pi_tokens.tolist() == PI
    assert LAYOUT.chunk_index.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert LAYOUT.chunk_offset.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert LAYOUT.num_pi == 7
    assert LAYOUT.reused_tokens == 10
    mask = LAYOUT.reused_mask()
    assert mask.nonzero().squeeze(1).tolist() == [0, 1, 2, *PI]


def test_layout_without_last_token() -> None:
    assert LAYOUT.without_last_token() is LAYOUT
    tail = ReuseLayout(10, 2, (ChunkSpan(4, 10),)).without_last_token()
    assert (tail.prefix_end, tail.chunks) == (2, (ChunkSpan(4, 9),))
    one = ReuseLayout(10, 2, (ChunkSpan(4, 6), ChunkSpan(9, 10))).without_last_token()
    assert one.chunks == (ChunkSpan(4, 6),)
    whole = ReuseLayout(10, 10).without_last_token()
    assert (whole.prefix_end, whole.chunks) == (9, ())


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_tokens": -1}, "num_tokens"),
        ({"num_tokens": 5, "prefix_end": 6}, "prefix_end"),
        ({"num_tokens": 10, "prefix_end": 4, "chunks": (ChunkSpan(3, 6),)}, "chunks"),
        ({"num_tokens": 10, "chunks": (ChunkSpan(5, 8), ChunkSpan(6, 9))}, "chunks"),
        ({"num_tokens": 10, "chunks": (ChunkSpan(5, 11),)}, "chunks"),
        ({"num_tokens": 10, "chunks": ((2, 4),)}, "chunks"),
    ],
)
def test_layout_rejects_bad_fields(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        ReuseLayout(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_none_recomputes_nothing() -> None:
    policy = rc.none()
    assert policy.initial(LAYOUT, LAYERS).tolist() == [False] * 7
    assert policy.budget == 0.0
    assert policy.check_layers() == frozenset()
    assert policy.name == "none"


def _picked(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().squeeze(1).tolist()


def test_spreads_split_exactly() -> None:
    assert spread_equally(5, [4, 3]) == [3, 2]
    assert spread_equally(6, [1, 9, 9]) == [1, 3, 2]  # the capped chunk's share moves on
    assert spread_equally(50, [2, 3]) == [2, 3]
    assert spread_proportionally(3, [4, 3]) == [2, 1]
    assert spread_proportionally(5, [1, 1, 1]) == [2, 2, 1]
    assert spread_proportionally(0, [4, 3]) == [0, 0]


def test_first_k_spends_the_budget_on_chunk_starts() -> None:
    # round(0.3 * 7) = 2 tokens, one per chunk; round(0.6 * 7) = 4, two per chunk.
    assert _picked(rc.first_k(0.3).initial(LAYOUT, LAYERS)) == [0, 4]
    assert _picked(rc.first_k(0.6).initial(LAYOUT, LAYERS)) == [0, 1, 4, 5]
    assert _picked(rc.first_k(1.0).initial(LAYOUT, LAYERS)) == list(range(7))
    assert rc.first_k(0.3).check_layers() == frozenset()
    assert rc.first_k(0.3).planned_fraction(LAYOUT, LAYERS) == 20 / 70
    assert rc.first_k(0.15).name == "first_k(0.15)"


def test_top_share_breaks_ties_towards_the_lower_index() -> None:
    scores = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert top_share(scores, 2).tolist() == [False, True, True, False, False]
    assert top_share(scores, 0).tolist() == [False] * 5


def test_deviation_pays_the_check_layer_out_of_the_budget() -> None:
    policy = rc.deviation(0.5, check_layer=1)
    assert policy.initial(LAYOUT, LAYERS).tolist() == [True] * 7
    assert policy.check_layers() == frozenset({1})
    assert policy.name == "deviation(0.5)"
    # 35 token-layers: 7 tokens x 2 layers for the check, round(21 / 8) = 3 kept after it.
    plan = policy.schedule(LAYOUT, LAYERS)
    assert (plan.keep, plan.token_layers) == (3, 38)
    state = _k_deviating([0.1, 5.0, 0.2, 3.0, 4.0, 0.3, 2.0])
    assert _picked(policy.narrow(state)) == [1, 3, 4]


def test_a_check_layer_the_model_lacks_gives_the_position_only_selection() -> None:
    plan = rc.deviation(0.3, check_layer=9).schedule(LAYOUT, LAYERS)
    assert (plan.check_layer, _picked(plan.start)) == (None, [0, 4])


def test_a_budget_below_the_check_cost_goes_to_chunk_starts() -> None:
    policy = rc.deviation(0.1)  # 7 token-layers; the check alone would cost 14
    plan = policy.schedule(LAYOUT, LAYERS)
    assert plan.check_layer is None
    assert _picked(policy.initial(LAYOUT, LAYERS)) == [0]  # round(0.7) = 1 token
    assert plan.token_layers == 10


def test_deviation_scores_k_v_or_both() -> None:
    fresh_k = torch.zeros(7, 1, 2)
    fresh_v = torch.zeros(7, 1, 2)
    fresh_k[0, 0, 0] = 3.0  # K distance 9
    fresh_v[1, 0, 1] = 2.0  # V distance 4
    fresh_k[2, 0, 0], fresh_v[2, 0, 0] = 2.0, 2.0  # 4 + 4 = 8
    state = _state(fresh_k, torch.zeros_like(fresh_k), fresh_v, torch.zeros_like(fresh_v))
    assert head_deviation(state, "kv").tolist() == [[9.0, 4.0, 8.0, 0, 0, 0, 0]]
    # Budget 0.3: 21 token-layers, 14 for the check, round(7 / 8) = 1 kept.
    pick = {s: _picked(rc.deviation(0.3, score=s).narrow(state)) for s in ("k", "v", "kv")}
    assert pick == {"k": [0], "v": [1], "kv": [0]}
    two = rc.deviation(0.4, score="kv").narrow(state)  # 28 - 14 = 14: round(1.75) = 2
    assert _picked(two) == [0, 2]


def test_attention_weighted_score_prefers_attended_tokens() -> None:
    fresh_k = torch.zeros(7, 2, 1)
    fresh_k[0, 0, 0] = 2.0  # head 0: distance 4
    fresh_k[1, 1, 0] = 1.0  # head 1: distance 1
    attention = torch.zeros(2, 7)
    attention[0, 0] = 0.1  # 4 * 0.1 = 0.4
    attention[1, 1] = 0.9  # 1 * 0.9 = 0.9
    state = _state(fresh_k, torch.zeros_like(fresh_k), attention=attention)
    policy = rc.deviation(0.3, score="kv_attention")
    assert policy.wants_attention
    assert _picked(policy.narrow(state)) == [1]
    assert _picked(rc.deviation(0.3, score="kv").narrow(state)) == [0]
    with pytest.raises(InvalidArgumentError, match="attention"):
        policy.narrow(_state(fresh_k, torch.zeros_like(fresh_k)))


def test_blend_pins_chunk_starts_and_ranks_the_rest_by_v() -> None:
    fresh_k = torch.zeros(7, 1, 1)
    fresh_v = torch.zeros(7, 1, 1)
    fresh_k[1, 0, 0] = 10.0  # large K distance only: blend ignores it
    fresh_v[:, 0, 0] = torch.tensor([0.5, 0.1, 0.2, 2.0, 0.3, 0.4, 1.0])
    state = _state(fresh_k, torch.zeros_like(fresh_k), fresh_v, torch.zeros_like(fresh_v))
    # Budget 0.6 = 42 token-layers: round(0.5 * 0.6 * 7) = 2 start tokens (0 and 4, 20),
    # 5 candidates to layer 1 (10), round(12 / 8) = 2 kept by V (3 and 6).
    policy = rc.blend(0.6, start=0.5)
    assert policy.name == "blend(0.6,0.5)"
    assert policy.check_layers() == frozenset({1})
    plan = policy.schedule(LAYOUT, LAYERS)
    assert (_picked(plan.start), plan.keep, plan.token_layers) == ([0, 4], 2, 46)
    assert _picked(policy.narrow(state)) == [0, 3, 4, 6]
    assert rc.DEFAULT_POLICY.name == "first_k(0.15)"


def test_per_chunk_ranking_keeps_each_chunks_share() -> None:
    fresh_v = torch.zeros(7, 1, 1)
    fresh_v[:, 0, 0] = torch.tensor([9.0, 8.0, 7.0, 6.0, 0.1, 0.2, 0.3])
    zeros = torch.zeros(7, 1, 1)
    state = _state(zeros, zeros, fresh_v, zeros)
    # 42 token-layers, no start tokens: 14 for the check, round(28 / 8) = 4 kept (rounded
    # half up), split 4:3 by chunk size as [2, 2]; jointly they would all go to chunk 0.
    joint = rc.selective(0.6)
    per_chunk = rc.selective(0.6, ranking="per_chunk")
    assert per_chunk.schedule(LAYOUT, LAYERS).keep_per_chunk == (2, 2)
    assert _picked(joint.narrow(state)) == [0, 1, 2, 3]
    assert _picked(per_chunk.narrow(state)) == [0, 1, 5, 6]


def _layout(lengths: list[int]) -> ReuseLayout:
    spans, start = [], 7  # a miss before every chunk
    for n in lengths:
        spans.append(ChunkSpan(start, start + n))
        start += n + 3
    return ReuseLayout(start + 1, 0, tuple(spans))


def test_realised_share_is_within_half_a_token_of_the_budget() -> None:
    # Chunks of 30-1000 tokens, 1-8 per prompt, SmolLM2's 30 layers: every policy's share
    # is the budget within 1 / (2 * reused tokens), i.e. under 2 points.
    gen = torch.Generator().manual_seed(3)
    policies = [
        rc.first_k,
        rc.taper,
        rc.deviation,
        lambda b: rc.blend(b, 0.25),
        lambda b: rc.blend(b, 0.5, ranking="per_chunk"),
        lambda b: rc.selective(b, check_layer=3, start=0.1),
    ]
    worst = 0.0
    for count in range(1, 9):
        for _ in range(3):
            lengths = torch.randint(30, 1001, (count,), generator=gen).tolist()
            layout = _layout(lengths)
            for budget in (0.05, 0.1, 0.15, 0.2, 0.35, 0.9):
                for make in policies:
                    error = abs(make(budget).planned_fraction(layout, 30) - budget)
                    assert error <= 0.5 / layout.num_pi + 1e-12, (lengths, budget)
                    worst = max(worst, error)
    assert worst < 0.02


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: rc.first_k(16), "budget"),  # a token count, not a share
        (lambda: rc.blend(-0.1), "budget"),
        (lambda: rc.blend(0.1, start=1.5), "start"),
        (lambda: Selective(0.1, check_layer=-1), "check_layer"),
        (lambda: Selective(0.1, None, start=0.5), "start"),
        (lambda: Selective(0.1, score="q"), "score"),  # type: ignore[arg-type]
        (lambda: Selective(0.1, ranking="each"), "ranking"),  # type: ignore[arg-type]
        (lambda: rc.none().schedule(LAYOUT, 0), "num_layers"),
    ],
)
def test_policies_reject_bad_parameters(build: object, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        build()  # type: ignore[operator]
    assert err.value.argument == argument


def test_labels_name_every_parameter() -> None:
    assert rc.deviation(0.15).name == "deviation(0.15)"
    assert rc.deviation(0.15, check_layer=2, score="v").name == "deviation(0.15,layer=2,v)"
    assert rc.blend(0.15, 0.25, ranking="per_chunk").name == "blend(0.15,0.25,per_chunk)"
    assert rc.selective(0.2, start=0.1).name == "selective(0.2;start=0.1;1;v;joint)"


def test_layer_state_checks_shapes() -> None:
    k = torch.zeros(3, 2, 4)
    with pytest.raises(InvalidArgumentError, match="cached_k"):
        LayerState(1, LAYERS, LAYOUT, torch.arange(3), k, k, torch.zeros(2, 2, 4), k)
    with pytest.raises(InvalidArgumentError, match="attention"):
        LayerState(1, LAYERS, LAYOUT, torch.arange(3), k, k, k, k, attention=torch.zeros(3, 2))
    with pytest.raises(InvalidArgumentError, match="layer"):
        LayerState(10, LAYERS, LAYOUT, torch.arange(3), k, k, k, k)
    state = LayerState(1, LAYERS, LAYOUT, torch.arange(3), k, k, k, k)
    assert not math.isnan(float(head_deviation(state, "k").sum()))


def test_taper_depths_fall_along_the_chunk_and_sum_to_the_budget() -> None:
    assert rc.taper_depths(20, 4, 10) == [10, 7, 3, 0]
    assert sum(rc.taper_depths(37, 9, 10)) == 37
    assert rc.taper_depths(500, 4, 10) == [10] * 4  # capped at the whole chunk
    policy = rc.taper(0.3)  # 21 token-layers: 11 to the first chunk, 10 to the second
    # The steepest ramp is a first token at every layer; the rounding left goes next.
    assert policy.depths(LAYOUT, LAYERS).tolist() == [10, 1, 0, 0, 10, 0, 0]
    assert policy.planned_fraction(LAYOUT, LAYERS) == 21 / 70
    assert _picked(policy.initial(LAYOUT, LAYERS)) == [0, 1, 4]
    # At layer 0 the token of depth 1 runs its last layer: it stops.
    zeros = torch.zeros(3, 1, 1)
    state = LayerState(0, LAYERS, LAYOUT, torch.tensor([0, 1, 4]), zeros, zeros, zeros, zeros)
    assert policy.narrow(state).tolist() == [True, False, True]
