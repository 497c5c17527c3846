"""Chunk starts shared out by the question's relevance (recompute/relevance.py), on small
handmade inputs (no model): exact selections and the budget accounting."""

from __future__ import annotations

import pytest
import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import InvalidArgumentError
from nopecache.recompute import policies as rc
from nopecache.recompute.policies import ReuseLayout
from nopecache.recompute.relevance import Relevance, relevance, spread_by_weight

# 20 tokens: exact prefix [0, 3), chunks [5, 9) and [12, 15), the question [15, 20).
# Reused tokens (indices into pi_tokens): chunk 0 = 0..3, chunk 1 = 4..6.
LAYOUT = ReuseLayout(20, 3, (ChunkSpan(5, 9), ChunkSpan(12, 15)))
LAYERS = 10


def _picked(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def test_spread_by_weight_splits_by_weight_within_capacities() -> None:
    assert spread_by_weight(10, [1.0, 0.0, 3.0], [2, 5, 5]) == [2, 3, 5]
    assert spread_by_weight(4, [1.0, 3.0], [9, 9]) == [1, 3]
    assert spread_by_weight(3, [1.0, 1.0], [9, 9]) == [2, 1]  # a tie: the earlier entry
    assert spread_by_weight(5, [2.0, 1.0, 1.0], [1, 9, 9]) == [1, 2, 2]  # overflow re-split
    assert spread_by_weight(5, [0.0, 0.0], [2, 9]) == [2, 3]  # no weight: equally
    assert spread_by_weight(50, [1.0, 1.0], [2, 3]) == [2, 3]  # capped
    assert spread_by_weight(0, [1.0], [4]) == [0]
    assert spread_by_weight(4, [], []) == []


def test_accounting_is_first_ks_whatever_the_attention() -> None:
    # 7 reused tokens; budget 0.6 = round(4.2) = 4 tokens at every layer, 2 of them the
    # floor's first tokens (one per chunk), 2 shared out.
    for budget in (0.0, 0.15, 0.3, 0.6, 1.0):
        for within in ("first", "question"):
            policy = relevance(budget, 0.5, within)
            plan = policy.schedule(LAYOUT, LAYERS)
            want = rc.first_k(budget).schedule(LAYOUT, LAYERS)
            assert plan.token_layers == want.token_layers
            assert policy.planned_fraction(LAYOUT, LAYERS) == want.fraction
            for attention in (torch.rand(2, 7), torch.zeros(2, 7), torch.eye(7)[:2]):
                chosen = policy.initial_ranked(LAYOUT, LAYERS, attention)
                assert int(chosen.sum()) * LAYERS == plan.token_layers
    plan = relevance(0.6).schedule(LAYOUT, LAYERS)
    assert (_picked(plan.start), plan.keep, plan.token_layers) == ([0, 4], 2, 40)
    assert plan.check_layer is None and not plan.candidates.any()
    policy = relevance(0.6)
    assert policy.prescan and policy.wants_attention and policy.probe == "question"
    assert policy.check_layers() == frozenset()


def test_the_chunk_the_question_reads_gets_the_share() -> None:
    # All the attention on chunk 1: both shared tokens extend chunk 1's start.
    on_second = torch.zeros(2, 7)
    on_second[0, 6] = 0.4
    on_second[1, 5] = 0.1
    assert relevance(0.6).shares(LAYOUT, LAYERS, on_second) == [0, 2]
    assert _picked(relevance(0.6).initial_ranked(LAYOUT, LAYERS, on_second)) == [0, 4, 5, 6]
    # As much on each: one each (first_k's selection).
    even = torch.tensor([[0.1, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0]])
    assert _picked(relevance(0.6).initial_ranked(LAYOUT, LAYERS, even)) == [0, 1, 4, 5]
    first_k = rc.first_k(0.6).schedule(LAYOUT, LAYERS).start
    assert _picked(first_k) == [0, 1, 4, 5]
    # Without attention (a loop that cannot probe) the chunks share by length.
    assert _picked(relevance(0.6).initial(LAYOUT, LAYERS)) == [0, 1, 4, 5]
    # Floor 0: the whole budget follows the attention; chunk 1 holds 3, the 4th token
    # goes to chunk 0 (the budget is spent whatever the attention).
    assert _picked(relevance(0.6, 0.0).initial_ranked(LAYOUT, LAYERS, on_second)) == [0, 4, 5, 6]


def test_within_question_takes_the_chunks_most_read_tokens() -> None:
    attention = torch.zeros(2, 7)
    attention[0] = torch.tensor([0.0, 0.05, 0.0, 0.3, 0.0, 0.0, 0.2])
    attention[1] = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.0])
    policy = relevance(0.6, 0.5, "question")
    # Mass 0.45 and 0.2: 2 shared as 1.38 and 0.62, floors 1 and 0, the remainder to chunk 1.
    assert policy.shares(LAYOUT, LAYERS, attention) == [1, 1]
    # Chunk 0's best besides its pinned start: token 3 (0.3); chunk 1's: token 6 (0.2).
    assert _picked(policy.initial_ranked(LAYOUT, LAYERS, attention)) == [0, 3, 4, 6]


def test_the_window_brings_a_read_tokens_neighbours_in_its_chunk() -> None:
    # One chunk of 10 (pi 0..9): budget 0.4 = 4 tokens, floor 0.25 = 1 first token.
    layout = ReuseLayout(14, 0, (ChunkSpan(2, 12),))
    attention = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.2]])
    plain = relevance(0.4, 0.25, "question")
    # 6 (0.5) and 9 (0.2), then a tie at 0: the earliest free token, 1.
    assert _picked(plain.initial_ranked(layout, 4, attention)) == [0, 1, 6, 9]
    # Every token within 1 of token 6 scores 0.5 (5, 6, 7), ties to the earlier.
    windowed = relevance(0.4, 0.25, "question", window=1)
    assert sorted(_picked(windowed.initial_ranked(layout, 4, attention))) == [0, 5, 6, 7]
    # The window stops at a chunk's edge: token 3 (chunk 0's last) does not lift token 4.
    edge = torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0]])
    scores = relevance(0.6, 0.5, "question", window=1)._windowed(LAYOUT, edge.sum(0))
    assert scores.tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"budget": 1.5}, "budget"),
        ({"budget": 0.15, "floor": 2.0}, "floor"),
        ({"budget": 0.15, "floor": True}, "floor"),
        ({"budget": 0.15, "within": "middle"}, "within"),
        ({"budget": 0.15, "window": -1}, "window"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        Relevance(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_a_wrongly_shaped_attention_names_it() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        relevance(0.6).initial_ranked(LAYOUT, LAYERS, torch.zeros(2, 6))
    assert err.value.argument == "attention"


def test_labels_and_the_engines_factory_name() -> None:
    assert relevance(0.15).name == "relevance(0.15,0.5,first)"
    assert relevance(0.15, 0.25, "question", window=2).name == (
        "relevance(0.15,0.25,question,window=2)"
    )
    assert rc.policy_by_name("relevance", 0.2).name == "relevance(0.2,0.5,first)"
