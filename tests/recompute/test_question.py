"""The question-aware policy (recompute/question.py) on small synthetic inputs (no model)."""

from __future__ import annotations

import pytest
import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import InvalidArgumentError
from nopecache.recompute import policies as rc
from nopecache.recompute import selective
from nopecache.recompute.policies import LayerState, ReuseLayout
from nopecache.recompute.question import QuestionAware, question, question_scores

# 20 tokens: exact prefix [0, 3), chunks [5, 9) and [12, 15), the question [15, 20).
LAYOUT = ReuseLayout(20, 3, (ChunkSpan(5, 9), ChunkSpan(12, 15)))
LAYERS = 10


def _state(attention: torch.Tensor, fresh_v: torch.Tensor | None = None) -> LayerState:
    heads, n = attention.shape
    zeros = torch.zeros(n, heads, 2)
    return LayerState(
        layer=1,
        num_layers=LAYERS,
        layout=LAYOUT,
        running=torch.arange(n),
        fresh_k=zeros,
        fresh_v=fresh_v if fresh_v is not None else zeros,
        cached_k=zeros,
        cached_v=zeros,
        attention=attention,
    )


def _picked(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def test_same_schedule_and_accounting_as_the_selective_policy() -> None:
    for budget, start in ((0.15, 0.0), (0.3, 0.5), (0.6, 0.5), (0.05, 0.0), (1.0, 0.0)):
        q = question(budget, start)
        s = rc.selective(budget, check_layer=1, score="v", start=start)
        got, want = q.schedule(LAYOUT, LAYERS), s.schedule(LAYOUT, LAYERS)
        assert torch.equal(got.start, want.start)
        assert torch.equal(got.candidates, want.candidates)
        assert (got.check_layer, got.keep, got.token_layers) == (
            want.check_layer,
            want.keep,
            want.token_layers,
        )
        assert q.planned_fraction(LAYOUT, LAYERS) == s.planned_fraction(LAYOUT, LAYERS)
    assert question(0.3).check_layers() == frozenset({1})
    assert question(0.3, check_layer=2).check_layers() == frozenset({2})


def test_ranks_by_the_questions_attention() -> None:
    # Budget 0.3 = 21 token-layers: 7 candidates to layer 1 (14), round(7 / 8) = 1 kept.
    attention = torch.zeros(2, 7)
    attention[0] = torch.tensor([0.1, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0])
    attention[1] = torch.tensor([0.25, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0])
    policy = question(0.3)
    assert policy.wants_attention and policy.probe == "question"
    assert policy.schedule(LAYOUT, LAYERS).keep == 1
    assert _picked(policy.narrow(_state(attention))) == [0]  # 0.35 summed over heads
    assert _picked(question(0.3, heads="max").narrow(_state(attention))) == [2]  # 0.3 in one
    assert question_scores(_state(attention), "attention", "mean").tolist() == pytest.approx(
        [0.35, 0.0, 0.3, 0.0, 0.0, 0.2, 0.0]
    )


def test_attention_v_weights_the_attention_by_the_v_drift() -> None:
    attention = torch.zeros(1, 7)
    attention[0] = torch.tensor([0.5, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])
    fresh_v = torch.zeros(7, 1, 2)
    fresh_v[0, 0, 0] = 0.1  # attended, barely drifted: 0.5 * 0.1 = 0.05
    fresh_v[1, 0, 0] = 3.0  # less attended, drifted: 0.1 * 3 = 0.3
    state = _state(attention, fresh_v)
    assert _picked(question(0.3).narrow(state)) == [0]
    assert _picked(question(0.3, score="attention_v").narrow(state)) == [1]
    scores = question_scores(state, "attention_v", "mean")
    assert scores[:2].tolist() == pytest.approx([0.05, 0.3])


def test_chunk_starts_are_pinned_and_never_ranked() -> None:
    # Budget 0.6 = 42 token-layers: round(0.5 * 0.6 * 7) = 2 start tokens (0 and 4, 20),
    # 5 candidates to layer 1 (10), round(12 / 8) = 2 kept by attention.
    attention = torch.tensor([[0.9, 0.1, 0.2, 0.05, 0.9, 0.3, 0.0]])
    keep = question(0.6, 0.5).narrow(_state(attention))
    assert _picked(keep) == [0, 2, 4, 5]


def test_other_layers_keep_everything_and_the_attention_is_required() -> None:
    attention = torch.ones(1, 7)
    state = _state(attention)
    at_two = question(0.3, check_layer=2)
    assert _picked(at_two.narrow(state)) == list(range(7))
    missing = LayerState(1, LAYERS, LAYOUT, torch.arange(7), *(torch.zeros(7, 1, 2),) * 4)
    with pytest.raises(InvalidArgumentError, match="attention"):
        question(0.3).narrow(missing)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"budget": 1.5}, "budget"),
        ({"budget": 0.2, "start": 2.0}, "start"),
        ({"budget": 0.2, "check_layer": -1}, "check_layer"),
        ({"budget": 0.2, "score": "kv"}, "score"),
        ({"budget": 0.2, "heads": "min"}, "heads"),
    ],
)
def test_bad_parameters_name_the_field(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        QuestionAware(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_labels_and_the_engines_factory_name() -> None:
    assert question(0.15).name == "question(0.15,0)"
    assert question(0.15, 0.5, check_layer=2, score="attention_v", heads="max").name == (
        "question(0.15,0.5,layer=2,attention_v,max)"
    )
    by_name = rc.policy_by_name("question", 0.2)
    assert isinstance(by_name, QuestionAware) and by_name.budget == 0.2
    assert by_name.name == "question(0.2,0.5,prescan)"
    assert "question" in rc.POLICY_FACTORIES


def test_the_probe_reads_the_question_not_the_last_tokens() -> None:
    running = torch.tensor([0, 1, 2, 5, 6, 15, 16, 17, 18, 19])
    rows = selective._probe_rows(question(0.3), LAYOUT, running)
    assert running[rows].tolist() == [15, 16, 17, 18, 19]
    long_question = ReuseLayout(200, 0, (ChunkSpan(2, 10),))
    many = torch.arange(200)
    rows = selective._probe_rows(question(0.3), long_question, many)
    assert many[rows].tolist() == list(range(200 - selective.QUESTION_PROBE_TOKENS, 200))
    last = selective._probe_rows(rc.deviation(0.3, score="kv_attention"), long_question, many)
    assert many[last].tolist() == list(range(200 - selective.PROBE_TOKENS, 200))
    # The question past the loop's range (vLLM's claim ends before it): no rows here.
    cut = ReuseLayout(10, 0, (ChunkSpan(2, 10),))
    assert selective._probe_rows(question(0.3), cut, torch.arange(10)).numel() == 0


def test_prescan_pays_the_whole_budget_for_ranked_tokens() -> None:
    # 7 reused tokens, budget 0.6: round(4.2) = 4 tokens at every layer, no candidates;
    # start 0.5: round(2.1) = 2 of them chunk starts (0 and 4), 2 ranked by attention.
    policy = question(0.6, 0.5, prescan=True)
    assert policy.prescan and policy.check_layers() == frozenset()
    plan = policy.schedule(LAYOUT, LAYERS)
    assert (plan.keep, plan.token_layers, int(plan.candidates.sum())) == (2, 40, 0)
    assert policy.planned_fraction(LAYOUT, LAYERS) == 40 / 70
    attention = torch.tensor([[0.9, 0.1, 0.2, 0.05, 0.9, 0.3, 0.0]])
    assert _picked(policy.initial_ranked(LAYOUT, LAYERS, attention)) == [0, 2, 4, 5]
    assert not question(0.6).prescan
    with pytest.raises(InvalidArgumentError) as err:
        question(0.3, prescan=True, score="attention_v")
    assert err.value.argument == "score"
