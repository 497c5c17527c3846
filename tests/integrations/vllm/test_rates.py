"""The rates the vLLM connector's blend cost model learns from the workers' step reports."""

from __future__ import annotations

from nopecache.integrations.vllm.config import ConnectorConfig
from nopecache.integrations.vllm.metadata import StepReport
from nopecache.integrations.vllm.scheduler import SchedulerSide
from tests.support.vllm_halves import _identity


def test_prefill_rate_sums_the_forward_times_of_successive_steps() -> None:
    config = ConnectorConfig.from_extra_config({"url": "nopecache://127.0.0.1:1"})
    side = SchedulerSide(config, _identity(), None)
    for _ in range(4):  # four steps of 100 tokens, half a second each: 200 tokens/s
        side.on_report(StepReport(computed_tokens=100, forward_seconds=0.5))
    assert side.totals.report.computed_tokens == 400
    assert side.totals.report.forward_seconds == 2.0
    assert side._prefill_rate() == 200.0


def test_the_workers_of_one_step_overlap_their_forwards() -> None:
    one = StepReport(computed_tokens=100, forward_seconds=0.5, saved_tokens=3)
    other = StepReport(computed_tokens=100, forward_seconds=0.25, saved_tokens=4)
    merged = one.add(other, same_step=True)
    assert (merged.computed_tokens, merged.forward_seconds, merged.saved_tokens) == (200, 0.5, 7)
    assert one.add(other).forward_seconds == 0.75
