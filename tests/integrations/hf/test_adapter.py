"""The transformers adapter on the real SmolLM2-135M: capture, exact and re-rotated reuse.

Exactness, stated precisely:

* a full prefill through the adapter's layer loop is **bit-identical** to
  ``model(ids, logits_to_keep=1)``: same modules, same shapes, same sdpa call;
* reuse is exact **within fp32 rounding**, not bit for bit: the tokens left to compute
  go through matrix products with fewer rows and a masked attention call, whose
  kernels round differently in the last bits (transformers itself returns logits that
  differ by ~3e-5 between ``logits_to_keep=1`` and all logits), and nope K re-rotated
  by the kernel is within one ulp of transformers' rotation. ``LOGIT_ATOL`` bounds
  that noise: two orders of magnitude below the smallest KL gap a recompute policy is
  judged on, and about ten fp32 ulps of a logit of size 10-20 accumulated over 30 layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from nopecache.client import CacheClient, ClientConfig, ContentChunker, RetryPolicy
from nopecache.client.chunking import ChunkSpan
from nopecache.client.cost import CostConfig
from nopecache.client.errors import InvalidArgumentError, NopecacheError
from nopecache.client.keys import BlockKey
from nopecache.client.plan import Hit, HitKind, ReusePlan
from nopecache.integrations.hf.adapter import (
    NEWLINE_SINK,
    CacheClientSource,
    HFEngine,
    ReusedKV,
    UnsupportedModelError,
)
from nopecache.kernels.api import rotate
from nopecache.kernels.reference import rope_tolerance
from nopecache.proto.block import StoredForm
from nopecache.recompute import policies as rc
from nopecache.recompute.policies import ReuseLayout
from tests.support.hf_store import InProcessStore
from tests.support.local_model import load_model
from tests.support.server_procs import CacheServerProc

pytestmark = pytest.mark.slow

LOGIT_ATOL = 1e-4

# A prompt of three segments: [0, 24) [24, 56) [56, 70); ids are ordinary vocabulary.
GEN = torch.Generator().manual_seed(7)
SEG_A = torch.randint(300, 40000, (24,), generator=GEN).tolist()
SEG_B = torch.randint(300, 40000, (32,), generator=GEN).tolist()
SEG_C = torch.randint(300, 40000, (14,), generator=GEN).tolist()
OTHER = torch.randint(300, 40000, (19,), generator=GEN).tolist()


@pytest.fixture(scope="module")
def engine() -> Iterator[HFEngine]:
    # One thread: these prompts are tiny, and on a shared CPU several OpenMP threads spin
    # against other processes and run up to ten times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    yield HFEngine(load_model())
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)


def _no_cache_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1]


def _assert_rounding_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert float((got - want).abs().max()) <= LOGIT_ATOL
    assert int(got.argmax()) == int(want.argmax())


def test_full_prefill_is_bit_identical_to_the_model(engine: HFEngine) -> None:
    tokens = SEG_A + SEG_B + SEG_C
    out = engine.prefill(tokens)
    assert torch.equal(out.logits, _no_cache_logits(engine.model, tokens))
    assert out.computed.tolist() == [70] * 30
    assert out.recompute_fraction == 0.0


def test_captured_k_is_the_k_that_rope_rotates(engine: HFEngine) -> None:
    tokens = SEG_A + SEG_B
    out = engine.prefill(tokens, capture=True)
    hf = engine.model(torch.tensor([tokens]), use_cache=True).cache
    assert out.nope_k is not None
    for layer in (0, 13, 29):
        hf_k = hf.layers[layer].keys[0].transpose(0, 1)  # [tokens, kv_heads, dim]
        hf_v = hf.layers[layer].values[0].transpose(0, 1)
        assert torch.equal(out.k[layer], hf_k)
        assert torch.equal(out.v[layer], hf_v)
        rotated = rotate(out.nope_k[layer], None, 0, engine.rope)
        tol = rope_tolerance(hf_k, engine.rope, torch.float32)
        assert bool(((rotated - hf_k).abs() <= tol).all())


def test_exact_prefix_reuse_reproduces_no_cache_logits(engine: HFEngine) -> None:
    store = InProcessStore(engine, prefix_block_tokens=8)
    first = SEG_A + SEG_B + OTHER
    store.store(first, engine.captured(engine.prefill(first, capture=True)), [24, 56])
    prompt = SEG_A + SEG_B + SEG_C
    reused = store.reuse(prompt, [24, 56])
    assert reused is not None
    assert (reused.layout.prefix_end, reused.layout.chunks) == (56, ())
    out = engine.prefill(prompt, reused, rc.deviation(0.15))
    assert out.computed.tolist() == [14] * 30  # the misses only: the prefix is never recomputed
    _assert_rounding_close(out.logits, _no_cache_logits(engine.model, prompt))


def test_whole_prompt_cached_still_computes_the_last_token(engine: HFEngine) -> None:
    store = InProcessStore(engine, prefix_block_tokens=8)
    prompt = SEG_A + SEG_B
    store.store(prompt, engine.captured(engine.prefill(prompt, capture=True)), [24])
    reused = store.reuse(prompt, [24])
    assert reused is not None and reused.layout.prefix_end == 56
    out = engine.prefill(prompt, reused)
    assert out.computed.tolist() == [1] * 30
    _assert_rounding_close(out.logits, _no_cache_logits(engine.model, prompt))


def test_rerotated_chunk_with_all_tokens_recomputed_is_exact(engine: HFEngine) -> None:
    # SEG_B cached on its own (from position 0), reused at position 24 after other tokens.
    store = InProcessStore(engine, prefix_block_tokens=8)
    store.store(SEG_B, engine.chunk_kv(SEG_B), prefix=False)
    prompt = SEG_A + SEG_B + SEG_C
    reused = store.reuse(prompt, [24, 56])
    assert reused is not None
    assert (reused.layout.prefix_end, reused.layout.chunks) == (0, (ChunkSpan(24, 56),))
    want = _no_cache_logits(engine.model, prompt)
    every = engine.prefill(prompt, reused, rc.first_k(1.0))
    assert every.recompute_fraction == 1.0
    # Every token runs at every layer: the same computation as a full prefill.
    assert torch.equal(every.logits, want)
    through_deviation = engine.prefill(prompt, reused, rc.deviation(1.0))
    assert through_deviation.recompute_fraction == 1.0
    _assert_rounding_close(through_deviation.logits, want)
    # Reused as is, the chunk's KV is approximate: the logits move.
    approx = engine.prefill(prompt, reused, rc.none())
    assert approx.recomputed.tolist() == [0] * 30
    assert float((approx.logits - want).abs().max()) > 100 * LOGIT_ATOL


def test_prefix_plus_rerotated_chunk_fully_recomputed(engine: HFEngine) -> None:
    store = InProcessStore(engine, prefix_block_tokens=8)
    first = SEG_A + OTHER
    store.store(
        first,
        engine.captured(engine.prefill(first, capture=True)),
        [24],
        position_independent=False,
    )
    store.store(SEG_B, engine.chunk_kv(SEG_B, sink_prefix=NEWLINE_SINK), prefix=False)
    prompt = SEG_A + SEG_B + SEG_C
    reused = store.reuse(prompt, [24, 56])
    assert reused is not None
    assert (reused.layout.prefix_end, reused.layout.chunks) == (24, (ChunkSpan(24, 56),))
    out = engine.prefill(prompt, reused, rc.first_k(1.0))
    assert out.computed.tolist() == [46] * 30
    _assert_rounding_close(out.logits, _no_cache_logits(engine.model, prompt))


def test_selective_recompute_counts_token_layers(engine: HFEngine) -> None:
    store = InProcessStore(engine, prefix_block_tokens=8)
    store.store(SEG_B, engine.chunk_kv(SEG_B), prefix=False)
    prompt = SEG_A + SEG_B + SEG_C
    reused = store.reuse(prompt, [24, 56])
    assert reused is not None
    policy = rc.deviation(0.25, check_layer=1)
    out = engine.prefill(prompt, reused, policy)
    # 0.25 * 32 * 30 = 240 token-layers: all 32 chunk tokens at layers 0 and 1 (64), then
    # round(176 / 28) = 6 of them to the last layer.
    assert out.recomputed.tolist() == [32, 32] + [6] * 28
    assert out.computed.tolist() == [70, 70] + [44] * 28
    assert out.recompute_fraction == (2 * 32 + 28 * 6) / (30 * 32)
    assert out.recompute_fraction == policy.planned_fraction(reused.layout, 30)
    assert out.budget == 0.25
    assert out.budget_error_pp == pytest.approx(100 * (232 / 960 - 0.25))
    fk = engine.prefill(prompt, reused, rc.first_k(0.125))  # round(0.125 * 32) = 4 tokens
    assert fk.recomputed.tolist() == [4] * 30


def test_generate_and_teacher_forcing_match_the_model(engine: HFEngine) -> None:
    tokens = SEG_A + SEG_C
    out = engine.prefill(tokens)
    generated = engine.generate(out, 6)
    want = (
        cast(Any, engine.model)
        .generate(torch.tensor([tokens]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[
            0, len(tokens) :
        ]
        .tolist()
    )
    assert generated == want
    logits = engine.continuation_logits(out, generated[:-1])
    assert logits.shape == (6, engine.model.config.vocab_size)
    assert logits.argmax(-1).tolist() == generated
    full = engine.model(torch.tensor([tokens + generated[:-1]])).logits[0, len(tokens) - 1 :]
    assert float((logits - full).abs().max()) <= LOGIT_ATOL


def test_sink_prefix_changes_only_what_attention_sees(engine: HFEngine) -> None:
    plain = engine.chunk_kv(SEG_B)
    sunk = engine.chunk_kv(SEG_B, sink_prefix=NEWLINE_SINK)
    assert sunk.num_tokens == plain.num_tokens == 32
    # Layer 0 K and V are projections of each token's own embedding: no context yet.
    assert float((sunk.k_nope[0] - plain.k_nope[0]).abs().max()) <= 1e-6
    assert float((sunk.v[0] - plain.v[0]).abs().max()) <= 1e-6
    # Above it the first token is no longer the sequence's attention sink.
    assert float((sunk.k_nope[5, 0] - plain.k_nope[5, 0]).abs().max()) > 1.0


def test_sink_prefixed_kv_is_refused_as_an_exact_prefix(engine: HFEngine) -> None:
    kv = engine.chunk_kv(SEG_B, sink_prefix=NEWLINE_SINK)
    assert kv.sink_prefix == NEWLINE_SINK
    store = InProcessStore(engine, prefix_block_tokens=8)
    with pytest.raises(InvalidArgumentError, match=r"^prefix: .*sink prefix \[198\]"):
        store.store(SEG_B, kv)
    assert store.blocks == {}
    store.store(SEG_B, kv, prefix=False)
    assert len(store.blocks) == 1


def test_prefill_rejects_mismatched_reuse(engine: HFEngine) -> None:
    prompt = SEG_A + SEG_C
    k = torch.zeros(30, len(prompt) + 1, 3, 64)
    bad = ReusedKV(k, k.clone(), ReuseLayout(len(prompt) + 1, 4))
    with pytest.raises(InvalidArgumentError, match=r"^reused: "):
        engine.prefill(prompt, bad)
    with pytest.raises(InvalidArgumentError, match=r"^tokens: "):
        engine.prefill([])
    with pytest.raises(InvalidArgumentError, match=r"^ReusedKV.layout: "):
        ReusedKV(k, k.clone(), ReuseLayout(5, 4))


def _tiny(config_cls: type, **extra: object) -> dict[str, Any]:
    return dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        **extra,
    )


@pytest.mark.parametrize(
    ("model_cls", "config_cls", "extra"),
    [
        (LlamaForCausalLM, LlamaConfig, {}),
        (MistralForCausalLM, MistralConfig, {"sliding_window": None}),
        (Qwen2ForCausalLM, Qwen2Config, {"use_sliding_window": False}),
    ],
)
def test_supported_families_prefill_bit_identically(
    model_cls: type, config_cls: type, extra: dict[str, object]
) -> None:
    torch.manual_seed(0)
    model = model_cls(config_cls(**_tiny(config_cls, **extra))).eval()
    tokens = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        assert torch.equal(HFEngine(model).prefill(tokens).logits, _no_cache_logits(model, tokens))


def test_unsupported_models_are_refused_with_the_reason() -> None:
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64)).eval()
    with pytest.raises(UnsupportedModelError, match=r"model_type: 'gpt2' is not supported"):
        HFEngine(gpt2)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**_tiny(Qwen3Config, head_dim=16))).eval()
    with pytest.raises(UnsupportedModelError, match=r"'qwen3' is not supported"):
        HFEngine(qwen3)
    windowed = MistralForCausalLM(MistralConfig(**_tiny(MistralConfig, sliding_window=8)))
    with pytest.raises(UnsupportedModelError, match=r"sliding_window: 8"):
        HFEngine(windowed)
    eager_flex = LlamaForCausalLM(LlamaConfig(**_tiny(LlamaConfig))).eval()
    eager_flex.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedModelError, match=r"_attn_implementation: 'flex_attention'"):
        HFEngine(eager_flex)
    assert issubclass(UnsupportedModelError, NopecacheError)
    assert issubclass(UnsupportedModelError, TypeError)


def test_cache_client_source_round_trips_through_a_server(
    engine: HFEngine, cache_server: CacheServerProc
) -> None:
    config = ClientConfig(
        servers=(cache_server.address,),
        retry=RetryPolicy(max_attempts=1),
        cost=CostConfig(enabled=False),  # plans must not depend on timings
        namespace="hf-adapter",
    )
    with CacheClient(
        config,
        fingerprint=engine.fingerprint(StoredForm.NOPE),
        rope=engine.rope,
        v_head_dim=engine.stack.head_dim,
        chunker=ContentChunker(min_size=64, avg_size=256, max_size=512),
    ) as client:
        source = CacheClientSource(client, wait=True)
        source.store(SEG_B, engine.chunk_kv(SEG_B), prefix=False)
        prompt = SEG_A + SEG_B + SEG_C
        reused = source.reuse(prompt, [24, 56])
        plan = client.lookup(prompt, segments=[24, 56])
    assert reused is not None
    assert (reused.layout.prefix_end, reused.layout.chunks) == (0, (ChunkSpan(24, 56),))
    # The same KV as the in-process store: the same kernel rotated the same nope K.
    local = InProcessStore(engine, config, chunker=ContentChunker(64, 256, 512))
    local.store(SEG_B, engine.chunk_kv(SEG_B), prefix=False)
    # One keying and one planner: the same plan, key for key, as the client's.
    assert local.lookup(prompt, [24, 56]) == plan
    expected = local.reuse(prompt, [24, 56])
    assert expected is not None
    assert torch.equal(reused.k[:, 24:56], expected.k[:, 24:56])
    assert torch.equal(reused.v[:, 24:56], expected.v[:, 24:56])
    every = engine.prefill(prompt, reused, rc.first_k(1.0))
    assert torch.equal(every.logits, _no_cache_logits(engine.model, prompt))


def test_the_source_reports_every_prefill_to_the_cost_model(
    engine: HFEngine, cache_server: CacheServerProc
) -> None:
    config = ClientConfig(
        servers=(cache_server.address,), namespace="hf-prefill-rate", cost=CostConfig(min_samples=2)
    )
    seen: list[tuple[int, float]] = []
    with CacheClient(
        config,
        fingerprint=engine.fingerprint(StoredForm.NOPE),
        rope=engine.rope,
        v_head_dim=engine.stack.head_dim,
    ) as client:
        before = client.stats().cost
        CacheClientSource(client, engine)
        CacheClientSource(client, engine)  # a second source does not report twice
        engine.prefill_observers.append(lambda tokens, seconds: seen.append((tokens, seconds)))
        try:
            engine.prefill(SEG_A)
            engine.prefill(SEG_A + SEG_B)
            after = client.stats().cost
        finally:
            del engine.prefill_observers[:]
    assert before is not None and after is not None
    assert (before.prefill_source, before.prefill_samples) == ("default", 0)
    assert [tokens for tokens, _ in seen] == [len(SEG_A), len(SEG_A) + len(SEG_B)]
    assert (after.prefill_source, after.prefill_samples) == ("engine", 2)
    rate = (2 * len(SEG_A) + len(SEG_B)) / sum(seconds for _, seconds in seen)
    assert after.prefill_tokens_per_s == pytest.approx(rate, rel=1e-12)


def test_touching_hits_are_one_chunk_unless_a_segment_starts_between() -> None:
    def hit(start: int, end: int, key: int) -> Hit:
        span = ChunkSpan(start, end)
        return Hit(
            BlockKey(bytes([key]) * 16),
            span,
            ChunkSpan(0, len(span)),
            StoredForm.NOPE,
            HitKind.POSITION_INDEPENDENT,
        )

    hits = (hit(2, 5, 1), hit(5, 9, 2), hit(9, 12, 3))
    plan = ReusePlan(14, (), hits, (ChunkSpan(0, 2), ChunkSpan(12, 14)))
    kv = torch.zeros(1, 14, 1, 2)
    merged = ReusedKV.from_placed(kv, kv, plan).layout.chunks
    assert merged == (ChunkSpan(2, 12),)
    split = ReusedKV.from_placed(kv, kv, plan, segments=[2, 9]).layout.chunks
    assert split == (ChunkSpan(2, 9), ChunkSpan(9, 12))
    partial = ReusedKV.from_placed(kv, kv, plan, [ChunkSpan(2, 5), ChunkSpan(9, 12)])
    assert partial.layout.chunks == (ChunkSpan(2, 5), ChunkSpan(9, 12))
