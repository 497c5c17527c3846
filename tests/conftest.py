"""Test-wide setup: Triton interpreter on CPU-only machines, GPU marker, shared fixtures."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = [
    "tests.support.redis_procs",
    "tests.support.server_harness",
    "tests.support.server_procs",
]

# The interpreter must be chosen before any module defining a Triton kernel is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Bounded, deterministic property tests: the suite runs on 2 shared cores in CI.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("NOPECACHE_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The tests that run a real vLLM need vLLM, which lives in its own environment
# (.venv-vllm); `make test` runs them there (`make test-vllm`).
collect_ignore: list[str] = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore.append("integrations/vllm/engine")
# SGLang's classes live in .venv-sglang; `make test` runs them there (`make test-sglang`).
if importlib.util.find_spec("sglang") is None:
    collect_ignore.append("integrations/sglang")
