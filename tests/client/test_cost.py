"""Cost-aware fetch: exact estimates and decisions with explicit link and prefill numbers."""

from __future__ import annotations

import pytest

from nopecache.client.chunking import ChunkSpan
from nopecache.client.cost import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    CostConfig,
    CostModel,
    FetchDecision,
    bytes_per_token,
)
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keys import BlockKey, KeyedChunk
from nopecache.client.plan import Hit, HitKind, plan_reuse
from nopecache.proto.block import StoredForm

# Floats below come from a handful of additions and divisions; rel=1e-12 only absorbs
# their binary rounding (0.002 - 0.001 is not exactly 0.001).
EXACT = 1e-12
MB = 1_000_000
FAST, SLOW = "fast:1", "slow:1"


def _fingerprint(
    layers: int, heads: int, head_dim: int, dtype: str, form: StoredForm
) -> ModelFingerprint:
    return ModelFingerprint("m", "r", layers, heads, head_dim, dtype, form, bytes(16))


def _key(n: int) -> BlockKey:
    return BlockKey(n.to_bytes(16, "little"))


def _hit(tokens: int, *, block_tokens: int | None = None) -> Hit:
    block = tokens if block_tokens is None else block_tokens
    return Hit(
        _key(tokens),
        ChunkSpan(100, 100 + tokens),
        ChunkSpan(block - tokens, block),
        StoredForm.NOPE,
        HitKind.POSITION_INDEPENDENT,
    )


def _measured(**config: float | int | bool | None) -> CostModel:
    """1 GB/s with a 1 ms round trip to FAST, 1 MB/s with 1 ms to SLOW; 1000 tok/s."""
    settings: dict[str, float | int | bool | None] = {
        "min_samples": 1,
        "safety_factor": 1.0,
        "prefill_tokens_per_s": 1000.0,
    }
    settings.update(config)
    model = CostModel(CostConfig(**settings))  # type: ignore[arg-type]
    for server, seconds in ((FAST, 0.002), (SLOW, 1.001)):
        model.observe_rtt(server, 0.001)
        model.observe_fetch(server, MB, seconds)  # 1 ms of RTT + the transfer
    return model


def test_bytes_per_token() -> None:
    llama3_8b = _fingerprint(32, 8, 128, "bfloat16", StoredForm.NOPE)
    assert bytes_per_token(llama3_8b) == 32 * 8 * (128 + 128) * 2 == 131072
    assert bytes_per_token(llama3_8b, v_head_dim=64) == 32 * 8 * (128 + 64) * 2
    fp32 = _fingerprint(2, 3, 8, "float32", StoredForm.ROPE)
    assert bytes_per_token(fp32) == 2 * 3 * 16 * 4
    fp8 = _fingerprint(2, 3, 8, "float8_e4m3fn", StoredForm.NOPE)
    assert bytes_per_token(fp8) == 2 * 3 * 16
    # MLA: one latent "head" of kv_lora_rank + rope dims, no V.
    mla = _fingerprint(61, 1, 512 + 64, "bfloat16", StoredForm.MLA)
    assert bytes_per_token(mla) == 61 * 576 * 2
    with pytest.raises(InvalidArgumentError) as err:
        bytes_per_token(llama3_8b, v_head_dim=-1)
    assert err.value.argument == "v_head_dim"
    with pytest.raises(InvalidArgumentError) as err:
        bytes_per_token("llama")  # type: ignore[arg-type]
    assert err.value.argument == "fingerprint"


def test_estimates() -> None:
    model = _measured()
    assert model.rtt_s(FAST) == 0.001
    assert model.bandwidth_bytes_per_s(FAST) == pytest.approx(1e9, rel=EXACT)
    assert model.bandwidth_bytes_per_s(SLOW) == pytest.approx(1e6, rel=EXACT)
    assert model.estimate_fetch_s(FAST, 10 * MB) == pytest.approx(0.011, rel=EXACT)
    assert model.estimate_fetch_s(FAST, 10 * MB, with_rtt=False) == pytest.approx(0.01, rel=EXACT)
    assert model.estimate_fetch_s(SLOW, MB) == pytest.approx(1.001, rel=EXACT)
    assert model.estimate_prefill_s(16) == 0.016
    assert model.estimate_prefill_s(0) == 0.0


def test_keep_when_fetch_beats_recompute() -> None:
    model = _measured()
    # 10 MB from FAST: 1 ms + 10 ms = 11 ms. Recompute at 1000 tok/s: 1 ms per token.
    assert model.keep(_hit(12), 10 * MB, FAST) is True  # 11 ms < 12 ms
    assert model.keep(_hit(10), 10 * MB, FAST) is False  # 11 ms > 10 ms
    decision = model.decide(_hit(10), 10 * MB, FAST)
    assert decision == FetchDecision(
        False, FAST, 10 * MB, 10, decision.fetch_s, 0.01, "cheaper_to_recompute"
    )
    assert decision.fetch_s == pytest.approx(0.011, rel=EXACT)
    # The same 10 tokens with only 1 MB to move: 2 ms < 10 ms.
    assert model.decide(_hit(10), MB, FAST).reason == "cheaper_to_fetch"


def test_safety_factor_scales_the_fetch_estimate() -> None:
    model = _measured(safety_factor=1.2)
    # 11 ms * 1.2 = 13.2 ms against 1 ms per token.
    assert model.keep(_hit(14), 10 * MB, FAST) is True
    assert model.keep(_hit(13), 10 * MB, FAST) is False


def test_too_few_samples_keep_the_hit() -> None:
    model = CostModel(CostConfig(min_samples=3, prefill_tokens_per_s=1000.0))
    model.observe_rtt(SLOW, 0.001)
    model.observe_fetch(SLOW, MB, 1.001)
    model.observe_fetch(SLOW, MB, 1.001)
    assert model.bandwidth_bytes_per_s(SLOW) is None
    assert model.estimate_fetch_s(SLOW, MB) is None
    decision = model.decide(_hit(1), MB, SLOW)
    assert decision == FetchDecision(True, SLOW, MB, 1, None, 0.001, "unmeasured")
    assert model.keep(_hit(1), MB, "never-seen:1") is True
    model.observe_fetch(SLOW, MB, 1.001)  # the third sample: now it is measured
    assert model.keep(_hit(1), MB, SLOW) is False


def test_disabled_keeps_everything() -> None:
    model = _measured(enabled=False)
    decision = model.decide(_hit(1), 1000 * MB, SLOW)
    assert (decision.keep, decision.reason, decision.fetch_s) == (True, "disabled", None)


def test_prefill_rate_reported_learned_or_default() -> None:
    model = CostModel(CostConfig(min_samples=2, ewma_alpha=0.5))
    assert model.prefill_tokens_per_s() == DEFAULT_PREFILL_TOKENS_PER_S == 10_000.0
    model.observe_prefill(1000, 1.0)
    assert model.prefill_tokens_per_s() == 10_000.0  # one sample is not enough
    model.observe_prefill(3000, 1.0)
    # avg tokens 1000 + 0.5 * (3000 - 1000) = 2000 over avg seconds 1.0
    assert model.prefill_tokens_per_s() == 2000.0
    assert model.estimate_prefill_s(500) == 0.25
    reported = CostModel(CostConfig(prefill_tokens_per_s=400.0, min_samples=1))
    reported.observe_prefill(1000, 1.0)
    assert reported.prefill_tokens_per_s() == 400.0  # the engine's number wins
    default = CostModel(CostConfig(default_prefill_tokens_per_s=250.0))
    assert default.estimate_prefill_s(500) == 2.0


def test_bandwidth_is_a_ratio_of_averages() -> None:
    model = CostModel(CostConfig(min_samples=2, ewma_alpha=0.5))
    model.observe_rtt(FAST, 0.001)
    model.observe_fetch(FAST, 1 * MB, 0.002)  # 1 MB in 1 ms past the RTT
    model.observe_fetch(FAST, 3 * MB, 0.004)  # 3 MB in 3 ms past the RTT
    # avg bytes 2 MB, avg seconds 3 ms, minus 1 ms RTT: 2 MB / 2 ms = 1 GB/s.
    assert model.bandwidth_bytes_per_s(FAST) == pytest.approx(1e9, rel=EXACT)


def test_rtt_bound_and_rtt_free_estimates() -> None:
    bound = CostModel(CostConfig(min_samples=1))
    bound.observe_rtt(FAST, 0.002)
    bound.observe_fetch(FAST, 1000, 0.0015)  # done within one round trip
    # Regression: this used to be an infinite rate, pricing a 1 TB fetch at one RTT.
    # The whole call time counts as transfer instead (a lower bound on bandwidth).
    assert bound.bandwidth_bytes_per_s(FAST) == pytest.approx(1000 / 0.0015, rel=EXACT)
    assert bound.estimate_fetch_s(FAST, 10**12) == pytest.approx(
        0.002 + 10**12 * 0.0015 / 1000, rel=EXACT
    )
    no_rtt = CostModel(CostConfig(min_samples=1))
    no_rtt.observe_fetch(FAST, 4 * MB, 0.002)  # no RTT samples: all time is transfer
    assert no_rtt.rtt_s(FAST) is None
    assert no_rtt.bandwidth_bytes_per_s(FAST) == 2e9
    assert no_rtt.estimate_fetch_s(FAST, 2 * MB) == 0.001


def test_hit_filter_in_plan_reuse() -> None:
    model = _measured()
    owners = {_key(1): FAST, _key(2): FAST, _key(3): FAST, _key(4): SLOW}
    keep = model.hit_filter(1000, lambda key: owners[BlockKey(key)])  # 16 kB per block
    prefix = [KeyedChunk(ChunkSpan(0, 16), _key(1))]
    pi = [
        KeyedChunk(ChunkSpan(16, 32), _key(2)),
        KeyedChunk(ChunkSpan(24, 40), _key(3)),  # overlaps: trimmed to [32, 40)
        KeyedChunk(ChunkSpan(40, 56), _key(4)),
    ]
    found = dict.fromkeys(owners, StoredForm.NOPE)
    plan = plan_reuse(64, prefix, pi, found, keep=keep)
    assert [h.key for h in plan.prefix] == [_key(1)]
    assert [(h.key, h.target, h.source) for h in plan.hits] == [
        (_key(2), ChunkSpan(16, 32), ChunkSpan(0, 16)),
        (_key(3), ChunkSpan(32, 40), ChunkSpan(8, 16)),
    ]
    assert plan.misses == (ChunkSpan(40, 64),)
    assert [h.key for h in plan.dropped] == [_key(4)]

    d = keep.decisions
    # Only the first block from FAST pays the round trip: 1 ms + 16 kB / 1 GB/s.
    assert d[_key(1)].fetch_s == pytest.approx(0.001016, rel=EXACT)
    assert d[_key(2)].fetch_s == pytest.approx(0.000016, rel=EXACT)
    # The trimmed hit still moves its whole 16-token block, and saves 8 tokens.
    assert (d[_key(3)].nbytes, d[_key(3)].tokens, d[_key(3)].prefill_s) == (16000, 8, 0.008)
    # SLOW: 1 ms + 16 kB / 1 MB/s = 17 ms, more than the 16 ms to recompute.
    assert d[_key(4)].fetch_s == pytest.approx(0.017, rel=EXACT)
    assert (d[_key(4)].keep, d[_key(4)].reason) == (False, "cheaper_to_recompute")
    assert keep.dropped() == [d[_key(4)]]


@pytest.mark.parametrize(
    ("changes", "argument"),
    [
        ({"enabled": 1}, "cost.enabled"),
        ({"prefill_tokens_per_s": 0.0}, "cost.prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": "fast"}, "cost.prefill_tokens_per_s"),
        ({"default_prefill_tokens_per_s": float("inf")}, "cost.default_prefill_tokens_per_s"),
        ({"safety_factor": -1.0}, "cost.safety_factor"),
        ({"min_samples": 0}, "cost.min_samples"),
        ({"min_samples": 2.0}, "cost.min_samples"),
        ({"ewma_alpha": 0.0}, "cost.ewma_alpha"),
        ({"ewma_alpha": 1.01}, "cost.ewma_alpha"),
        ({"window": 0}, "cost.window"),
        ({"window": 2, "min_samples": 3}, "cost.window"),
        ({"max_age_s": 0.0}, "cost.max_age_s"),
        ({"probe_share": 0.0}, "cost.probe_share"),
        ({"probe_share": 1.5}, "cost.probe_share"),
    ],
)
def test_bad_cost_config_is_named(changes: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        CostConfig(**changes)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_bad_observations_are_named() -> None:
    model = CostModel()
    cases = [
        (lambda: model.observe_fetch("", 1, 1.0), "server"),
        (lambda: model.observe_fetch(FAST, -1, 1.0), "nbytes"),
        (lambda: model.observe_fetch(FAST, 1, float("nan")), "seconds"),
        (lambda: model.observe_rtt(FAST, -0.1), "seconds"),
        (lambda: model.observe_prefill(0, 1.0), "tokens"),
        (lambda: model.observe_prefill(10, 0.0), "seconds"),
        (lambda: model.estimate_prefill_s(-1), "tokens"),
        (lambda: model.decide("hit", 1, FAST), "hit"),  # type: ignore[arg-type]
        (lambda: model.hit_filter(0, str), "bytes_per_token"),
        (lambda: CostModel({"enabled": True}), "config"),  # type: ignore[arg-type]
    ]
    for call, argument in cases:
        with pytest.raises(InvalidArgumentError) as err:
            call()
        assert err.value.argument == argument


class Clock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_cold_first_sample_weighs_as_one_of_the_window() -> None:
    model = CostModel(CostConfig(min_samples=2, window=4))
    model.observe_fetch(FAST, MB, 0.1)  # cold: 100x slower than the rest
    model.observe_fetch(FAST, MB, 0.001)
    # A plain ratio of sums: 2 MB in 101 ms (an EWMA from the first sample: ~81 ms per MB).
    assert model.bandwidth_bytes_per_s(FAST) == pytest.approx(2 * MB / 0.101, rel=EXACT)
    for _ in range(4):
        model.observe_fetch(FAST, MB, 0.001)
    assert model.bandwidth_bytes_per_s(FAST) == pytest.approx(1e9, rel=EXACT)  # aged out


def test_samples_expire_so_a_dropped_server_is_measured_again() -> None:
    clock = Clock()
    model = CostModel(
        CostConfig(min_samples=1, max_age_s=60.0, prefill_tokens_per_s=1000.0), clock=clock
    )
    model.observe_fetch(SLOW, MB, 10.0)
    assert model.keep(_hit(10), MB, SLOW) is False
    clock.now += 60.0
    assert model.keep(_hit(10), MB, SLOW) is False  # 60 s old: still live
    clock.now += 0.5
    decision = model.decide(_hit(10), MB, SLOW)
    assert (decision.keep, decision.reason) == (True, "unmeasured")
    assert model.snapshot().servers[SLOW].samples == 0


def test_every_nth_drop_is_a_probe_and_shows_in_the_snapshot() -> None:
    model = _measured(probe_share=0.25)
    keep = model.hit_filter(MB, lambda key: SLOW)  # 1 MB per token: far too slow to fetch
    reasons = [keep(_hit(1)) for _ in range(8)]
    assert reasons == [False, False, False, True] * 2
    assert [d.reason for d in keep.decisions.values()] == ["probe"]  # one key, last decision
    snap = model.snapshot()
    assert (snap.enabled, snap.prefill_tokens_per_s, snap.prefill_source) == (
        True,
        1000.0,
        "config",
    )
    slow = snap.servers[SLOW]
    assert (slow.probes, slow.samples, slow.rtt_s) == (2, 1, 0.001)
    assert slow.bandwidth_bytes_per_s == pytest.approx(1e6, rel=EXACT)
    assert slow.last_decision is not None and slow.last_decision.reason == "probe"
    # A query never probes: decide() alone keeps saying no.
    assert [model.decide(_hit(1), MB, SLOW).keep for _ in range(8)] == [False] * 8


def test_a_slow_server_turned_fast_is_kept_again_within_the_bound() -> None:
    config = CostConfig(min_samples=2, window=4, probe_share=0.25, prefill_tokens_per_s=1000.0)
    model = CostModel(config)
    for _ in range(4):
        model.observe_fetch(SLOW, MB, 10.0)
    dropped = 0
    while True:
        keep = model.hit_filter(MB // 10, lambda key: SLOW)
        if keep(_hit(10)) and keep.decisions[_key(10)].reason == "cheaper_to_fetch":
            break
        dropped += 1
        if keep.decisions[_key(10)].reason == "probe":
            model.observe_fetch(SLOW, MB, 0.001)  # the probe's fetch: the server is fast now
        assert dropped <= config.window / config.probe_share
    assert dropped == 16  # 4 probes, each after 3 drops
