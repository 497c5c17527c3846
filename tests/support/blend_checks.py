"""What a vLLM engine's blend correctness gate logged, and its sampled blend checks.

The gate's verdict is one log line of the worker (``GateVerdict.reason``); the sampled
checks are the ``vllm:nopecache_blend_kl`` / ``_blend_top1`` histograms, which reach the
metrics only with a step's stats: :func:`wait_for_checks` runs tiny prompts until they do.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.engine_proc import EngineProc

__all__ = ["Checks", "LoggedVerdict", "gate_verdict", "wait_for_checks"]

_VERDICT = re.compile(
    r"blend correctness gate (?P<outcome>passed|refused: prefix mode only) "
    r"\((?P<policy>.+?), (?P<prompts>\d+) prompts, (?P<tokens>\d+) answer tokens\): "
    r"RoPE error (?P<rope>\S+) \(max [^)]*\), KL (?P<kl>\S+) \(max [^)]*\), "
    r"top-1 (?P<top1>\S+) \(min [^)]*\)"
)


@dataclass(frozen=True)
class LoggedVerdict:
    """The figures of the gate's log line."""

    passed: bool
    policy: str
    prompts: int
    tokens: int
    rope_error: float
    kl: float
    top1: float
    line: str


def gate_verdict(log_path: Path) -> LoggedVerdict:
    """The last verdict the engine logged (AssertionError if none)."""
    found = list(_VERDICT.finditer(log_path.read_text(errors="replace")))
    assert found, f"no correctness gate verdict in {log_path}"
    m = found[-1]
    return LoggedVerdict(
        m["outcome"] == "passed",
        m["policy"],
        int(m["prompts"]),
        int(m["tokens"]),
        float(m["rope"]),
        float(m["kl"]),
        float(m["top1"]),
        m[0],
    )


@dataclass(frozen=True)
class Checks:
    """The sampled checks' histograms: how many, and their means."""

    count: int
    kl_mean: float
    top1_mean: float
    counted: int  # vllm:nopecache_blend_checks


def _checks(metrics: dict[str, float]) -> Checks:
    count = int(metrics.get("vllm:nopecache_blend_kl:count", 0.0))
    top1_count = int(metrics.get("vllm:nopecache_blend_top1:count", 0.0))
    assert top1_count == count, (top1_count, count)
    denominator = max(count, 1)
    return Checks(
        count,
        metrics.get("vllm:nopecache_blend_kl:sum", 0.0) / denominator,
        metrics.get("vllm:nopecache_blend_top1:sum", 0.0) / denominator,
        int(metrics.get("vllm:nopecache_blend_checks", 0.0)),
    )


def wait_for_checks(engine: EngineProc, count: int, timeout_s: float = 600.0) -> Checks:
    """Wait until ``engine`` exported ``count`` sampled checks; each round runs a tiny
    prompt (a step carries the worker's stats). A check runs while the engine idles, a
    layer at a time: seconds for a 1k-token prompt on an idle core; the bound only stops a
    hang on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        checks = _checks(engine.metrics())
        if checks.count >= count:
            assert checks.counted == checks.count
            return checks
        assert time.monotonic() < deadline, f"{checks.count} of {count} blend checks exported"
        engine.generate(list(range(100, 108)), max_tokens=1)
