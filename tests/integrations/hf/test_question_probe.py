"""The question-aware policy on the real SmolLM2-135M: the question the transformers prefill
reads inside the prompt and the one vLLM's blend loop reads as a lookahead (its claim ends
before the question) are the same, and so is what the policy keeps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.integrations.hf.adapter import HFEngine
from nopecache.integrations.hf.forward import _BufferKV, _HFStackRun
from nopecache.recompute.policies import (
    LayerState,
    Probe,
    RecomputePolicy,
    ReuseLayout,
    Schedule,
)
from nopecache.recompute.question import question
from nopecache.recompute.relevance import relevance
from nopecache.recompute.selective import run_selective
from tests.support.hf_store import InProcessStore
from tests.support.local_model import load_model

pytestmark = pytest.mark.slow

GEN = torch.Generator().manual_seed(11)
HEAD = torch.randint(300, 40000, (24,), generator=GEN).tolist()
CHUNK = torch.randint(300, 40000, (32,), generator=GEN).tolist()
QUESTION = torch.randint(300, 40000, (14,), generator=GEN).tolist()
END = len(HEAD) + len(CHUNK)  # where a vLLM-style claim would end


@pytest.fixture(scope="module")
def engine() -> Iterator[HFEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    yield HFEngine(load_model())
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)


@dataclass
class Recording(RecomputePolicy):
    """A policy that does what ``inner`` does and keeps what it saw at its check layer."""

    inner: RecomputePolicy
    attention: list[torch.Tensor] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def budget(self) -> float:
        return self.inner.budget

    @property
    def wants_attention(self) -> bool:
        return self.inner.wants_attention

    @property
    def probe(self) -> Probe:
        return self.inner.probe

    def schedule(self, layout: ReuseLayout, num_layers: int) -> Schedule:
        return self.inner.schedule(layout, num_layers)

    def check_layers(self) -> frozenset[int]:
        return self.inner.check_layers()

    def narrow(self, state: LayerState) -> torch.Tensor:
        keep = self.inner.narrow(state)
        assert state.attention is not None
        self.attention.append(state.attention)
        self.kept.append(state.layout.pi_tokens[state.running[keep]])
        return keep


def test_lookahead_question_equals_the_in_prompt_question(engine: HFEngine) -> None:
    store = InProcessStore(engine, prefix_block_tokens=8)
    store.store(CHUNK, engine.chunk_kv(CHUNK), prefix=False)
    prompt = HEAD + CHUNK + QUESTION
    reused = store.reuse(prompt, [len(HEAD), END])
    assert reused is not None
    assert reused.layout.chunks == (ChunkSpan(len(HEAD), END),)

    # transformers: the question is inside the prefill, its misses run at every layer.
    in_prompt = Recording(question(0.3))
    full = engine.prefill(prompt, reused, in_prompt)

    # vLLM's blend loop: positions [0, END) only, the question as a lookahead.
    layers = engine.stack.num_layers
    layout = ReuseLayout(END, 0, reused.layout.chunks)
    k = torch.empty(engine.stack.kv_shape(END))
    v = torch.empty(engine.stack.kv_shape(END))
    rows = layout.reused_mask().nonzero().squeeze(1)
    k[:, rows], v[:, rows] = reused.k[:, rows], reused.v[:, rows]
    ids = torch.tensor(prompt)
    ahead = Recording(question(0.3))
    run = run_selective(
        _HFStackRun(engine.stack, len(prompt), False),
        _BufferKV(k, v, reused.k[:, :END], reused.v[:, :END]),
        ids[:END],
        layout,
        ahead,
        output=False,
        lookahead=ids[END:],
    )
    assert len(in_prompt.attention) == len(ahead.attention) == 1
    # The same queries over the same keys; the lookahead's attention runs in smaller
    # calls (fp32 rounding only, far below the attention shares that rank tokens).
    assert torch.allclose(in_prompt.attention[0], ahead.attention[0], atol=1e-6, rtol=1e-4)
    assert torch.equal(in_prompt.kept[0], ahead.kept[0])
    assert run.recomputed.tolist() == full.recomputed.tolist()
    assert torch.allclose(k, full.k[:, :END], atol=1e-4)
    assert torch.allclose(v, full.v[:, :END], atol=1e-4)
    # 0.3 * 32 * 30 = 288 token-layers: 32 to layer 1 (64), round(224 / 28) = 8 kept.
    assert full.recomputed.tolist() == [32, 32] + [8] * (layers - 2)

    # Without the lookahead the loop has no question to read and falls back to its last
    # tokens (the chunk's own): another ranking.
    blind = Recording(question(0.3))
    run_selective(
        _HFStackRun(engine.stack, len(prompt), False),
        _BufferKV(k.clone(), v.clone(), reused.k[:, :END], reused.v[:, :END]),
        ids[:END],
        layout,
        blind,
        output=False,
    )
    assert not torch.allclose(blind.attention[0], ahead.attention[0], atol=1e-3)


def test_prescan_chooses_the_same_tokens_inside_the_prompt_and_from_a_lookahead(
    engine: HFEngine,
) -> None:
    store = InProcessStore(engine, prefix_block_tokens=8)
    store.store(CHUNK, engine.chunk_kv(CHUNK), prefix=False)
    prompt = HEAD + CHUNK + QUESTION
    reused = store.reuse(prompt, [len(HEAD), END])
    assert reused is not None
    policy = question(0.25, 0.5, prescan=True)
    full = engine.prefill(prompt, reused, policy)
    # round(0.25 * 32) = 8 tokens at every layer, 4 of them the chunk's first.
    assert full.recomputed.tolist() == [8] * engine.stack.num_layers
    assert full.recompute_fraction == 0.25

    layout = ReuseLayout(END, 0, reused.layout.chunks)
    k = torch.empty(engine.stack.kv_shape(END))
    v = torch.empty(engine.stack.kv_shape(END))
    rows = layout.reused_mask().nonzero().squeeze(1)
    k[:, rows], v[:, rows] = reused.k[:, rows], reused.v[:, rows]
    ids = torch.tensor(prompt)
    run_selective(
        _HFStackRun(engine.stack, len(prompt), False),
        _BufferKV(k, v, reused.k[:, :END], reused.v[:, :END]),
        ids[:END],
        layout,
        policy,
        output=False,
        lookahead=ids[END:],
    )
    # The same tokens recomputed: the same K/V in the range.
    assert torch.allclose(k, full.k[:, :END], atol=1e-4)
    assert torch.allclose(v, full.v[:, :END], atol=1e-4)
    chosen = (full.k[-1, len(HEAD) : END] != reused.k[-1, len(HEAD) : END]).any(-1).any(-1)
    assert int(chosen.sum()) == 8 and chosen[:4].all()


def test_relevance_shares_the_same_way_inside_the_prompt_and_from_a_lookahead(
    engine: HFEngine,
) -> None:
    # Two chunks: the per-chunk shares come from the question's attention at layer 0.
    other = torch.randint(300, 40000, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    store = InProcessStore(engine, prefix_block_tokens=8)
    for chunk in (CHUNK, other):
        store.store(chunk, engine.chunk_kv(chunk), prefix=False)
    end = len(HEAD) + len(CHUNK) + len(other)
    prompt = HEAD + CHUNK + other + QUESTION
    reused = store.reuse(prompt, [len(HEAD), END, end])
    assert reused is not None and reused.layout.num_pi == len(CHUNK) + len(other)
    assert len(reused.layout.chunks) == 2
    policy = relevance(0.25, 0.5, "question")
    full = engine.prefill(prompt, reused, policy)
    # round(0.25 * 56) = 14 tokens at every layer: 7 first tokens (4 and 3), 7 shared out.
    assert full.recomputed.tolist() == [14] * engine.stack.num_layers
    assert full.recompute_fraction == 0.25

    layout = ReuseLayout(end, 0, reused.layout.chunks)
    k = torch.empty(engine.stack.kv_shape(end))
    v = torch.empty(engine.stack.kv_shape(end))
    rows = layout.reused_mask().nonzero().squeeze(1)
    k[:, rows], v[:, rows] = reused.k[:, rows], reused.v[:, rows]
    ids = torch.tensor(prompt)
    run = run_selective(
        _HFStackRun(engine.stack, len(prompt), False),
        _BufferKV(k, v, reused.k[:, :end], reused.v[:, :end]),
        ids[:end],
        layout,
        policy,
        output=False,
        lookahead=ids[end:],
    )
    assert run.recomputed.tolist() == full.recomputed.tolist()
    assert torch.allclose(k, full.k[:, :end], atol=1e-4)
    assert torch.allclose(v, full.v[:, :end], atol=1e-4)
    at = slice(len(HEAD), end)
    chosen = (full.k[-1, at] != reused.k[-1, at]).any(-1).any(-1)
    assert int(chosen.sum()) == 14
    assert chosen[:4].all() and chosen[len(CHUNK) : len(CHUNK) + 3].all()  # the floor
