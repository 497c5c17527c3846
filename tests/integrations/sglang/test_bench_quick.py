"""The SGLang benches run in this environment: ``bench/sglang_*.py --quick`` exits 0 and its
last line is ``RESULT`` with exactly the keys it declares. No speed is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.bench_runs import declared_keys, engine_bench_files, run_quick


@pytest.mark.slow
@pytest.mark.timeout(700)  # above run_quick's own hang guard, so that one reports
@pytest.mark.parametrize("path", engine_bench_files("sglang_"), ids=lambda p: p.stem)
def test_quick_run_prints_its_result_line(path: Path) -> None:
    fields = run_quick(path, python=sys.executable)
    assert list(fields) == list(declared_keys(path))


def test_the_sglang_benches_are_found() -> None:
    assert {p.stem for p in engine_bench_files("sglang_")} == {"sglang_pages"}
