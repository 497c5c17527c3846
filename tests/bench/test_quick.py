"""Every benchmark of the main environment runs: ``bench/X.py --quick`` exits 0 and its last
line is ``RESULT`` with exactly the keys the bench declares (``RESULT_KEYS``).

The files are found by glob, so a new bench is covered as soon as it exists (and fails
here until it has ``--quick`` and ``RESULT_KEYS``). The vLLM benches run in the vLLM
environment: tests/integrations/vllm/engine/test_bench_quick.py. No speed is asserted:
the numbers of a quick run on a shared machine mean nothing; that the bench runs does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bench_runs import bench_files, declared_keys, run_quick


@pytest.mark.slow
@pytest.mark.timeout(700)  # above the run's own hang guard (QUICK_TIMEOUT_S), so that one reports
@pytest.mark.parametrize("path", bench_files(vllm=False), ids=lambda p: p.stem)
def test_quick_run_prints_its_result_line(path: Path) -> None:
    fields = run_quick(path)
    assert list(fields) == list(declared_keys(path))


def test_every_bench_is_covered() -> None:
    """The glob finds the benches (a moved folder must not make this module test nothing)."""
    names = {p.stem for p in bench_files(vllm=False)}
    assert {"client", "server", "load", "fuzz"} <= names
    assert {p.stem for p in bench_files(vllm=True)} >= {"vllm_e2e", "vllm_blend", "vllm_serve"}
    assert "sglang_pages" not in names  # runs in .venv-sglang (tests/integrations/sglang)
