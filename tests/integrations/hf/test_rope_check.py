"""The transformers adapter checks its RoPE description against the model's own rotation.

A tiny random Llama (2 layers, head dim 16, theta 10000, 256 positions): its own
description passes at fp32 rounding; a description it does not rotate by (another
theta, the GPT-J pair layout, a scaling the model does not use) turns the engine's
position-independent path off: a reused chunk is computed as misses, and the
``CacheClientSource`` over a real server stores and looks up exact prefixes only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nopecache.client import CacheClient, ClientConfig, RetryPolicy
from nopecache.client.chunking import ChunkSpan
from nopecache.client.cost import CostConfig
from nopecache.integrations.hf.adapter import CacheClientSource, HFEngine, ReusedKV
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from nopecache.recompute import policies as rc
from nopecache.recompute.policies import ReuseLayout
from tests.support.server_procs import CacheServerProc

ADAPTER_LOG = "nopecache.integrations.hf.adapter"
_TINY: dict[str, object] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "attn_implementation": "sdpa",
}
CONFIG = LlamaConfig(**_TINY)  # type: ignore[arg-type]  # RoPE theta 10000, the default
TOKENS = [int(t) for t in torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(3))]


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaForCausalLM]:
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    yield LlamaForCausalLM(CONFIG).eval()
    torch.set_grad_enabled(True)


def _described(**rope_parameters: object) -> RopeSpec:
    config = CONFIG.to_dict()
    config["rope_parameters"] = {**config["rope_parameters"], **rope_parameters}
    return RopeSpec.from_hf_config(config)


def test_the_models_own_description_passes(model: LlamaForCausalLM) -> None:
    assert CONFIG.rope_parameters is not None
    assert CONFIG.rope_parameters["rope_theta"] == 10000.0
    engine = HFEngine(model)
    check = engine.rope_check
    assert check.passed and engine.position_independent and engine.blend_allowed
    assert [(f.layer, f.position) for f in check.figures] == [
        (f"model.layers.{i}.self_attn", p) for i in range(2) for p in (0, 1, 128, 255)
    ]
    assert check.max_error < 1e-6  # two fp32 rotations of the same K: rounding only
    assert all(f.bound == 1e-3 for f in check.figures)  # GateThresholds' fp32 bound


WRONG = {
    "theta": lambda: _described(rope_theta=500000.0),
    "gptj": lambda: dataclasses.replace(RopeSpec.from_hf_config(CONFIG), layout="gptj"),
    "scaling": lambda: _described(rope_type="linear", factor=2.0),
}


@pytest.mark.parametrize("kind", sorted(WRONG))
def test_a_description_the_model_does_not_rotate_by_turns_reuse_off(
    model: LlamaForCausalLM, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    with caplog.at_level(logging.WARNING, logger=ADAPTER_LOG):
        engine = HFEngine(model, rope=WRONG[kind]())
    check = engine.rope_check
    assert not check.passed and not engine.position_independent and not engine.blend_allowed
    # Every figure logged: layer, position, error and bound.
    (logged,) = [r.getMessage() for r in caplog.records if "every figure" in r.getMessage()]
    assert "position-independent reuse off, exact prefixes only" in logged
    assert logged.splitlines()[1:] == [str(f) for f in check.figures]
    assert len(check.figures) == 8 and check.max_error > 0.01
    # A reused chunk [8, 20) is computed as misses; the exact prefix [0, 8) is kept.
    full = engine.prefill(TOKENS)
    garbage = full.k.clone()
    garbage[:, 8:20] = 1e3  # what a blend would read: never read here
    out = engine.prefill(
        TOKENS, ReusedKV(garbage, full.v, ReuseLayout(40, 8, (ChunkSpan(8, 20),))), rc.none()
    )
    assert engine.blend_fallbacks == 1 and out.layout == ReuseLayout(40, 8)
    assert torch.allclose(out.logits, full.logits, atol=1e-4)


def test_a_refused_source_stores_and_looks_up_exact_prefixes_only(
    model: LlamaForCausalLM, cache_server: CacheServerProc
) -> None:
    right = HFEngine(model)
    wrong = HFEngine(model, rope=_described(rope_theta=500000.0))
    config = ClientConfig(
        servers=(cache_server.address,),
        retry=RetryPolicy(max_attempts=1),
        cost=CostConfig(enabled=False),  # plans must not depend on timings
    )
    clients = [
        CacheClient(
            config,
            fingerprint=engine.fingerprint(StoredForm.NOPE),
            rope=engine.rope,
            v_head_dim=engine.stack.head_dim,
            prefix_block_tokens=16,
        )
        for engine in (right, wrong)
    ]
    try:
        good, bad = (
            CacheClientSource(c, e, wait=True) for c, e in zip(clients, (right, wrong), strict=True)
        )
        captured = wrong.captured(wrong.prefill(TOKENS, capture=True))
        bad.store(TOKENS, captured, [0, 20])
        bad.store(TOKENS[20:], wrong.chunk_kv(TOKENS[20:]), prefix=False)  # PI only: skipped
        plan = clients[1].lookup(TOKENS, segments=[0, 20])
        assert plan.prefix_end == 32 and plan.hits == ()  # two whole 16-token blocks only
        # Content hits exist under the passing engine's keys; an engine whose check
        # failed, on the same client, does not ask for them.
        good.store(TOKENS, right.captured(right.prefill(TOKENS, capture=True)), [0, 20])
        shifted = TOKENS[20:] + TOKENS[:20]
        assert clients[0].lookup(shifted, segments=[0, 20]).hits != ()
        gated = CacheClientSource(clients[0], wrong, wait=True)
        before = clients[0].stats().pi_hit_tokens
        assert gated.reuse(shifted, [0, 20]) is None
        assert clients[0].stats().pi_hit_tokens == before
        assert good.reuse(shifted, [0, 20]) is not None
    finally:
        for client in clients:
            client.close()
