"""The rates the vLLM connector's blend cost model learns from the workers' step reports.

Blend claims are weighed in the scheduler process, whose client never fetches: every rate
comes from the workers' reports (``rates.MeasuredRates``). The claim tests run the two
halves against a real server (as test_blend.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from nopecache.integrations.vllm.config import ConnectorConfig
from nopecache.integrations.vllm.metadata import StepReport
from nopecache.integrations.vllm.rates import MeasuredRates
from nopecache.integrations.vllm.scheduler import SchedulerSide
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import _Engine, _identity, _request

SMALL_CHUNKS = "?lookup_timeout=300ms&chunk_min_tokens=2&chunk_avg_tokens=4&chunk_max_tokens=8"
SEGMENT = [1, *range(50, 62)]  # 13 tokens, a message starting with the segment token 1


def test_prefill_rate_sums_the_forward_times_of_successive_steps() -> None:
    config = ConnectorConfig.from_extra_config({"url": "nopecache://127.0.0.1:1"})
    side = SchedulerSide(config, _identity(), None)
    for _ in range(4):  # four steps of 100 tokens, half a second each: 200 tokens/s
        side.on_report(StepReport(computed_tokens=100, forward_seconds=0.5))
    assert side.totals.report.computed_tokens == 400
    assert side.totals.report.forward_seconds == 2.0
    assert side.rates.prefill_tokens_per_s() == 200.0


def test_the_workers_of_one_step_overlap_their_forwards() -> None:
    one = StepReport(computed_tokens=100, forward_seconds=0.5, saved_tokens=3)
    other = StepReport(computed_tokens=100, forward_seconds=0.25, saved_tokens=4)
    merged = one.add(other, same_step=True)
    assert (merged.computed_tokens, merged.forward_seconds, merged.saved_tokens) == (200, 0.5, 7)
    assert one.add(other).forward_seconds == 0.75


def test_no_prefill_rate_before_three_steps_and_256_tokens() -> None:
    rates = MeasuredRates(num_layers=2, bytes_per_token=64)
    rates.observe(StepReport(computed_tokens=13, forward_seconds=0.001))  # a chat warm-up
    assert rates.prefill_tokens_per_s() is None
    rates.observe(StepReport(saved_tokens=13))  # no forward measured: not a step of it
    rates.observe(StepReport(computed_tokens=100, forward_seconds=0.5))
    assert rates.prefill_tokens_per_s() is None  # two steps
    rates.observe(StepReport(computed_tokens=100, forward_seconds=0.5))
    assert rates.prefill_tokens_per_s() is None  # three steps, 213 tokens
    rates.observe(StepReport(computed_tokens=143, forward_seconds=0.499))
    assert rates.prefill_tokens_per_s() == 356 / 1.5


def test_fetch_time_is_the_workers_measured_rate() -> None:
    rates = MeasuredRates(num_layers=2, bytes_per_token=64)
    assert rates.fetch_s(100) == 0.0  # nothing fetched yet
    rates.observe(StepReport(fetched_bytes=6400, fetch_seconds=0.25))
    rates.observe(StepReport(fetched_bytes=6400, fetch_seconds=0.75))
    assert rates.fetch_s(100) == 0.5  # 6400 bytes at 12800 bytes per second


@pytest.fixture
def blend_pair(cache_server: CacheServerProc) -> Any:
    a = _Engine(cache_server, 1, SMALL_CHUNKS, segment_token_ids=[1])
    b = _Engine(cache_server, 2, SMALL_CHUNKS, segment_token_ids=[1], pi_reuse="blend")
    a.step(_request("stored", [*SEGMENT, 1, 70, 71]), [0, 1, 2, 3], 0)  # at position 0
    yield a, b
    a.close()
    b.close()


def _moved(req_id: str) -> Any:
    """A prompt with the stored segment moved to positions 8..21 (blend claims 20)."""
    return _request(req_id, [1, *range(90, 97), *SEGMENT, 1, 80, 81, 82])


def test_a_warm_up_step_alone_never_declines_a_blend_claim(blend_pair: Any) -> None:
    _, b = blend_pair
    # Fetches measured at 1 MB/s: 12 reused tokens (9 KiB) take 9 ms. A 13-token step in
    # a microsecond: as a rate 13M tokens/s, vLLM would prefill the range in 2 us.
    b.scheduler.on_report(StepReport(fetched_bytes=10**6, fetch_seconds=1.0))
    b.scheduler.on_report(StepReport(computed_tokens=13, forward_seconds=1e-6))
    assert b.matched(_moved("r1"), 0) == 20
    assert b.scheduler.totals.blend_claimed_tokens == 0  # counted once allocated
    # Measured over enough steps, the same speed declines it (the prefix claim: nothing).
    for _ in range(3):
        b.scheduler.on_report(StepReport(computed_tokens=100, forward_seconds=1e-5))
    assert b.matched(_moved("r2"), 0) == 0


def test_slow_fetches_reported_by_the_workers_decline_a_blend_claim(blend_pair: Any) -> None:
    _, b = blend_pair
    for _ in range(3):  # vLLM prefills 1000 tokens/s
        b.scheduler.on_report(StepReport(computed_tokens=100, forward_seconds=0.1))
    fetched = b.client.stats().fetched_bytes
    # Fetches not measured yet: the claim pays (the loop runs 20 - 12 * 0.85 tokens of 20).
    assert b.matched(_moved("r1"), 0) == 20
    # The workers report their fetches at 1 KB/s: fetching 12 tokens (9 KiB of K+V at
    # 768 bytes a token) takes seconds, vLLM prefills the range in 20 ms: declined.
    b.scheduler.on_report(StepReport(fetched_bytes=1000, fetch_seconds=1.0))
    assert b.matched(_moved("r2"), 0) == 0
    # The scheduler's own client fetched nothing: the workers' reports alone decided.
    assert b.client.stats().fetched_bytes == fetched
