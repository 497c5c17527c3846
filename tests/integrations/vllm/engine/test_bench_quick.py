"""The vLLM benchmarks run: ``bench/vllm_*.py --quick`` exits 0 and its last line is
``RESULT`` with exactly the keys the bench declares (``RESULT_KEYS``).

Run in the vLLM environment, like the rest of this folder; the files are found by glob
(a new ``bench/vllm_*.py`` is covered at once). Each run starts its own engines and
server, so the machine-wide lock this folder's conftest holds covers it. No speed is
asserted: quick runs on a shared machine measure nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.bench_runs import bench_files, declared_keys, run_quick


@pytest.mark.slow
@pytest.mark.timeout(700)  # above the run's own hang guard (QUICK_TIMEOUT_S), so that one reports
@pytest.mark.parametrize("path", bench_files(vllm=True), ids=lambda p: p.stem)
def test_quick_run_prints_its_result_line(path: Path, model_dir: str) -> None:
    fields = run_quick(path, sys.executable, {"NOPECACHE_VLLM_MODEL": model_dir})
    assert list(fields) == list(declared_keys(path))
