"""The vLLM benchmarks run: ``bench/vllm_*.py --quick`` exits 0 and its last line is
``RESULT`` with exactly the keys the bench declares (``RESULT_KEYS``).

Run in the vLLM environment, like the rest of this folder; the files are found by glob
(a new ``bench/vllm_*.py`` is covered at once). Each run starts its own engines and
server, so the machine-wide lock this folder's conftest holds covers it. No speed is
asserted: quick runs on a shared machine measure nothing.

A bench whose quick run would only start again engines another test of this folder already
runs is skipped here, naming the test that runs its quick traffic and checks its RESULT
line instead (:data:`RUN_ELSEWHERE`): each engine start costs CI ~30 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.bench_runs import bench_files, declared_keys, run_quick

# bench stem -> the test that runs its quick traffic on engines it shares, and checks the
# RESULT line the bench's own code prints against its RESULT_KEYS.
RUN_ELSEWHERE = {
    "vllm_parity": "test_parity.py::test_the_bench_quick_run_matches_the_reference",
}


def _params() -> list[object]:
    return [
        pytest.param(
            path,
            id=path.stem,
            marks=[pytest.mark.skip(reason=f"run by {RUN_ELSEWHERE[path.stem]}")]
            if path.stem in RUN_ELSEWHERE
            else [],
        )
        for path in bench_files(vllm=True)
    ]


@pytest.mark.slow
@pytest.mark.timeout(700)  # above the run's own hang guard (QUICK_TIMEOUT_S), so that one reports
@pytest.mark.parametrize("path", _params())
def test_quick_run_prints_its_result_line(path: Path, model_dir: str) -> None:
    fields = run_quick(path, sys.executable, {"NOPECACHE_VLLM_MODEL": model_dir})
    assert list(fields) == list(declared_keys(path))


def test_each_bench_run_elsewhere_exists_and_its_test_too() -> None:
    # A renamed bench or test must not leave a skip that covers nothing.
    here = Path(__file__).parent
    for stem, test in RUN_ELSEWHERE.items():
        assert stem in {p.stem for p in bench_files(vllm=True)}, stem
        module, _, name = test.partition("::")
        assert f"def {name}(" in (here / module).read_text(), test
