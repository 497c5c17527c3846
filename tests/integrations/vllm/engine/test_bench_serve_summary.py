"""bench/vllm_serve.py's RESULT values from the counters it reads: the connector's load rate
per configuration (``blend_load_mb_s``, ``prefix_load_mb_s``). No engine is started; in
the vLLM environment because the bench's HTTP client (httpx) lives there."""

from __future__ import annotations

import sys

from tests.support.bench_runs import BENCH, ROOT

for folder in (BENCH, ROOT / "examples"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from vllm_serve import ConfigResult, summary  # noqa: E402


def _result(name: str, fetched: float, seconds: float) -> ConfigResult:
    counters = {
        "vllm:nopecache_fetched_bytes": fetched,
        "vllm:nopecache_fetch_seconds": seconds,
        "vllm:nopecache_loaded_bytes": 7e9,  # loads' bytes over load_seconds: not this rate
        "vllm:nopecache_load_seconds": 1e3,
    }
    return ConfigResult(name, [], 1.0, counters if fetched or seconds else {})


def test_load_rates_are_fetched_bytes_over_fetch_seconds_per_configuration() -> None:
    results = {
        "blend": _result("blend", 300e6, 2.0),
        "prefix": _result("prefix", 500e6, 2.5),
    }
    fields = summary(results, bound=0.5, facts={})
    assert fields["blend_load_mb_s"] == "150.0"
    assert fields["prefix_load_mb_s"] == "200.0"


def test_a_configuration_that_did_not_run_is_skipped_and_one_that_loaded_nothing_is_nan() -> None:
    fields = summary({"blend": _result("blend", 0, 0)}, bound=0.5, facts={})
    assert fields["prefix_load_mb_s"] == "skipped"
    assert fields["blend_load_mb_s"] == "nan"
