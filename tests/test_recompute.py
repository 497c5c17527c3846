"""Recompute policies select exactly the tokens they say, on small synthetic inputs (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from nopecache.client.adapters import recompute as rc
from nopecache.client.adapters.recompute import (
    FirstK,
    LayerState,
    ReuseLayout,
    Selective,
    Step,
    head_deviation,
    share_count,
    top_share,
)
from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import InvalidArgumentError

# 20 tokens: exact prefix [0, 3), chunks [5, 9) and [12, 15), misses elsewhere.
LAYOUT = ReuseLayout(20, 3, (ChunkSpan(5, 9), ChunkSpan(12, 15)))
PI = [5, 6, 7, 8, 12, 13, 14]


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
    assert policy.initial(LAYOUT).tolist() == [False] * 7
    assert policy.check_layers() == frozenset()
    assert policy.name == "none"


def test_first_k_takes_the_first_tokens_of_every_chunk() -> None:
    assert rc.first_k(2).initial(LAYOUT).tolist() == [True, True, False, False, True, True, False]
    assert rc.first_k(3).initial(LAYOUT).tolist() == [True, True, True, False, True, True, True]
    assert rc.first_k(0).initial(LAYOUT).tolist() == [False] * 7
    assert rc.first_k(4).name == "first_k(4)"
    with pytest.raises(InvalidArgumentError, match=r"^k: "):
        FirstK(-1)


def test_share_count_rounds_half_up() -> None:
    assert [share_count(0.5, 7), share_count(0.15, 7), share_count(0.07, 7)] == [4, 1, 0]
    assert share_count(1.0, 7) == 7
    assert share_count(0.15, 100) == 15


def test_top_share_breaks_ties_towards_the_lower_index() -> None:
    scores = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert top_share(scores, 2).tolist() == [False, True, True, False, False]
    assert top_share(scores, 0).tolist() == [False] * 5


def test_deviation_keeps_the_share_that_deviates_most_at_its_check_layer() -> None:
    policy = rc.deviation(0.5, check_layer=1)
    assert policy.initial(LAYOUT).tolist() == [True] * 7
    assert policy.check_layers() == frozenset({1})
    assert policy.name == "deviation(0.5)"
    # round(0.5 * 7) = 4 tokens: the four largest distances.
    state = _k_deviating([0.1, 5.0, 0.2, 3.0, 4.0, 0.3, 2.0])
    assert policy.narrow(state).tolist() == [False, True, False, True, True, False, True]


def test_deviation_scores_k_v_or_both() -> None:
    fresh_k = torch.zeros(7, 1, 2)
    fresh_v = torch.zeros(7, 1, 2)
    fresh_k[0, 0, 0] = 3.0  # K distance 9
    fresh_v[1, 0, 1] = 2.0  # V distance 4
    fresh_k[2, 0, 0], fresh_v[2, 0, 0] = 2.0, 2.0  # 4 + 4 = 8
    state = _state(fresh_k, torch.zeros_like(fresh_k), fresh_v, torch.zeros_like(fresh_v))
    assert head_deviation(state, "kv").tolist() == [[9.0, 4.0, 8.0, 0, 0, 0, 0]]
    pick = {
        s: rc.deviation(0.15, score=s).narrow(state).nonzero().squeeze(1).tolist()
        for s in ("k", "v", "kv")
    }
    assert pick == {"k": [0], "v": [1], "kv": [0]}
    two = rc.deviation(0.3, score="kv").narrow(state)  # round(2.1) = 2
    assert two.nonzero().squeeze(1).tolist() == [0, 2]


def test_attention_weighted_score_prefers_attended_tokens() -> None:
    fresh_k = torch.zeros(7, 2, 1)
    fresh_k[0, 0, 0] = 2.0  # head 0: distance 4
    fresh_k[1, 1, 0] = 1.0  # head 1: distance 1
    attention = torch.zeros(2, 7)
    attention[0, 0] = 0.1  # 4 * 0.1 = 0.4
    attention[1, 1] = 0.9  # 1 * 0.9 = 0.9
    state = _state(fresh_k, torch.zeros_like(fresh_k), attention=attention)
    policy = rc.deviation(0.15, score="kv_attention")
    assert policy.wants_attention
    assert policy.narrow(state).nonzero().squeeze(1).tolist() == [1]
    assert rc.deviation(0.15, score="kv").narrow(state).nonzero().squeeze(1).tolist() == [0]
    with pytest.raises(InvalidArgumentError, match="attention"):
        policy.narrow(_state(fresh_k, torch.zeros_like(fresh_k)))


def test_keep_first_pins_chunk_starts_on_top_of_the_share() -> None:
    policy = rc.selective([(1, 0.15)], keep_first=1)
    # Chunk starts are indices 0 and 4; the share (1 token) goes to the largest of the rest.
    state = _k_deviating([9.0, 0.1, 0.2, 3.0, 8.0, 0.3, 0.4])
    assert policy.narrow(state).tolist() == [True, False, False, True, True, False, False]
    assert policy.name == "selective(1:0.15;kv;+1)"


def test_blend_ranks_by_v_and_keeps_chunk_starts() -> None:
    fresh_k = torch.zeros(7, 1, 1)
    fresh_v = torch.zeros(7, 1, 1)
    fresh_k[1, 0, 0] = 10.0  # large K distance only: blend ignores it
    fresh_v[:, 0, 0] = torch.tensor([0.5, 0.1, 0.2, 2.0, 0.3, 0.4, 1.0])
    state = _state(fresh_k, torch.zeros_like(fresh_k), fresh_v, torch.zeros_like(fresh_v))
    policy = rc.blend(0.3, keep_first=1)  # round(2.1) = 2 by V, plus indices 0 and 4
    assert policy.name == "blend(0.3,1)"
    assert policy.check_layers() == frozenset({1})
    assert policy.narrow(state).nonzero().squeeze(1).tolist() == [0, 3, 4, 6]
    assert rc.DEFAULT_POLICY.name == "blend(0.1,8)"


def test_labels_name_every_parameter() -> None:
    assert rc.deviation(0.15).name == "deviation(0.15)"
    assert rc.deviation(0.15, check_layer=2, score="v").name == "deviation(0.15,layer=2,v)"
    assert rc.gradual([(1, 0.3), (4, 0.15)]).name == "gradual(1:0.3,4:0.15)"
    assert rc.gradual([(1, 0.3)], score="k").name == "gradual(1:0.3;k)"


def test_gradual_narrows_within_the_running_tokens() -> None:
    policy = rc.gradual([(1, 0.6), (3, 0.3)])
    assert policy.check_layers() == frozenset({1, 3})
    first = policy.narrow(_k_deviating([1.0, 6.0, 2.0, 5.0, 4.0, 3.0, 0.5]))
    assert first.nonzero().squeeze(1).tolist() == [1, 3, 4, 5]  # round(4.2) = 4
    # At layer 3 only those four run; the share is of all 7 reused tokens: round(2.1) = 2.
    running = [1, 3, 4, 5]
    fresh = torch.zeros(4, 1, 1)
    fresh[:, 0, 0] = torch.tensor([1.0, 4.0, 3.0, 2.0])
    state = _state(fresh, torch.zeros_like(fresh), running=running, layer=3)
    assert policy.narrow(state).tolist() == [False, True, True, False]


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: Step(1, 1.5), "Step.ratio"),
        (lambda: Step(-1, 0.5), "Step.layer"),
        (lambda: Selective(()), "steps"),
        (lambda: Selective((Step(2, 0.5), Step(1, 0.4))), "steps"),
        (lambda: Selective((Step(1, 0.2), Step(2, 0.4))), "steps"),
        (lambda: Selective((Step(1, 0.2),), score="q"), "score"),  # type: ignore[arg-type]
        (lambda: Selective((Step(1, 0.2),), keep_first=-2), "keep_first"),
    ],
)
def test_policies_reject_bad_parameters(build: object, argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        build()  # type: ignore[operator]
    assert err.value.argument == argument


def test_layer_state_checks_shapes() -> None:
    k = torch.zeros(3, 2, 4)
    with pytest.raises(InvalidArgumentError, match="cached_k"):
        LayerState(1, LAYOUT, torch.arange(3), k, k, torch.zeros(2, 2, 4), k)
    with pytest.raises(InvalidArgumentError, match="attention"):
        LayerState(1, LAYOUT, torch.arange(3), k, k, k, k, attention=torch.zeros(3, 2))
    assert not math.isnan(
        float(head_deviation(LayerState(1, LAYOUT, torch.arange(3), k, k, k, k), "k").sum())
    )
