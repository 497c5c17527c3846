"""The blend correctness gate on the real SmolLM2-135M: its own RoPE description passes, a
mis-described one (wrong base, wrong scaling) is refused and the engine reuses exact
prefixes only, counting each request it would have blended."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from nopecache.client.chunking import ChunkSpan
from nopecache.integrations.hf.adapter import HFEngine, ReusedKV
from nopecache.integrations.hf.gate import calibrate
from nopecache.kernels import RopeSpec
from nopecache.recompute import policies as rc
from nopecache.recompute.gate import CALIBRATION_PROMPTS, GateThresholds
from nopecache.recompute.policies import ReuseLayout
from tests.support.local_model import load_model, load_tokenizer

# A calibration is three prefills of ~500 tokens, a 16-token greedy answer and a blend
# each; on a shared 2-core machine under load one took 140 s: 1200 s leaves room for two.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def model() -> Iterator[PreTrainedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    yield load_model()
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


def _tokenize(tokenizer: PreTrainedTokenizerBase) -> object:
    def tokenize(text: str) -> Sequence[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    return tokenize


def _described(model: PreTrainedModel, **rope_parameters: object) -> RopeSpec:
    """The model's RoPE as a config would describe it with ``rope_parameters`` instead."""
    config = model.config.to_dict()
    config["rope_parameters"] = {**config["rope_parameters"], **rope_parameters}
    return RopeSpec.from_hf_config(config)


def test_smollm2_passes_the_gate_and_blends(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = HFEngine(model, gate=_tokenize(tokenizer))  # type: ignore[arg-type]
    verdict = engine.gate_verdict
    assert verdict is not None and verdict.passed and engine.blend_allowed
    assert (verdict.prompts, verdict.tokens) == (len(CALIBRATION_PROMPTS), 48)
    assert verdict.policy == rc.DEFAULT_POLICY.name
    # The right description reproduces the model's own K (fp32 rounding of the rotation).
    assert verdict.rope_error < 1e-5
    assert verdict.kl < verdict.thresholds.max_kl and verdict.top1 >= verdict.thresholds.min_top1
    assert "passed" in verdict.reason()


@pytest.mark.parametrize(
    "wrong",
    [{"rope_theta": 10000.0}, {"rope_type": "linear", "factor": 2.0}],
    ids=["base", "scaling"],
)
def test_a_misdescribed_rope_is_refused(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, wrong: dict[str, object]
) -> None:
    engine = HFEngine(model, rope=_described(model, **wrong))
    verdict = calibrate(
        engine,
        _tokenize(tokenizer),  # type: ignore[arg-type]
        rc.DEFAULT_POLICY,
        prompts=CALIBRATION_PROMPTS[:1],
    )
    assert not verdict.passed
    assert verdict.rope_error > 100 * verdict.thresholds.max_rope_error
    assert "refused: prefix mode only" in verdict.reason()
    assert f"RoPE error {verdict.rope_error:.2e}" in verdict.reason()


def test_a_refused_engine_reuses_exact_prefixes_only(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="nopecache.integrations.hf.adapter"):
        engine = HFEngine(
            model,
            rope=_described(model, rope_theta=10000.0),
            gate=_tokenize(tokenizer),  # type: ignore[arg-type]
        )
    verdict = engine.gate_verdict
    assert verdict is not None and not verdict.passed and not engine.blend_allowed
    assert [r.getMessage() for r in caplog.records if "gate" in r.getMessage()] == [
        f"nopecache: {engine.name}: {verdict.reason()}"
    ]
    # A prompt with an exact prefix [0, 8) and a chunk [8, 20): the chunk becomes misses.
    tokens = list(range(1000, 1024))
    full = engine.prefill(tokens)
    chunk = ReuseLayout(24, 8, (ChunkSpan(8, 20),))
    garbage = full.k.clone()
    garbage[:, 8:20] = 1e3  # KV a blend would read: never read by a refused engine
    out = engine.prefill(tokens, ReusedKV(garbage, full.v, chunk), rc.none())
    assert engine.blend_fallbacks == 1
    assert out.layout == ReuseLayout(24, 8)
    assert torch.allclose(out.logits, full.logits, atol=1e-4)
    # Prefix-only reuse is not a fallback.
    engine.prefill(tokens, ReusedKV(full.k, full.v, ReuseLayout(24, 8)))
    assert engine.blend_fallbacks == 1


def test_thresholds_name_the_bad_field() -> None:
    from nopecache.client.errors import InvalidArgumentError

    for kwargs, field in (
        ({"max_kl": -1.0}, "max_kl"),
        ({"min_top1": 1.5}, "min_top1"),
        ({"max_rope_error": "x"}, "max_rope_error"),
    ):
        with pytest.raises(InvalidArgumentError) as err:
            GateThresholds(**kwargs)
        assert err.value.argument == field
