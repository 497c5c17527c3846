"""Cores and memory for the vLLM engines tests and benches start (tests/support/machine.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.machine import (
    ENGINE_GIB,
    NotEnoughMemory,
    allowed_cores,
    available_gib,
    core_for,
    require_memory,
)

ROOT = Path(__file__).resolve().parents[2]


def _meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       25165824 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {available_kib} kB\nBuffers:           10000 kB\n"
    )
    return path


def test_engines_go_round_robin_over_the_allowed_cores() -> None:
    cores = allowed_cores()
    assert cores == sorted(os.sched_getaffinity(0))
    assert [core_for(i) for i in range(2 * len(cores) + 1)] == [
        *cores,
        *cores,
        cores[0],
    ]


def test_a_process_pinned_to_one_core_gives_every_engine_that_core() -> None:
    last = allowed_cores()[-1]
    code = (
        "import os; from tests.support.machine import core_for; "
        f"os.sched_setaffinity(0, {{{last}}}); print([core_for(i) for i in range(3)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == str([last, last, last])


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    assert available_gib(_meminfo(tmp_path, 3 << 20)) == 3.0
    assert available_gib() > 0  # the real /proc/meminfo has the line


def test_too_little_memory_for_the_engines_is_refused_with_the_numbers(tmp_path: Path) -> None:
    meminfo = _meminfo(tmp_path, 10 << 20)  # 10 GiB
    require_memory(2, meminfo)  # 2 x 3 + 1 = 7 GiB: fits
    with pytest.raises(NotEnoughMemory) as caught:
        require_memory(5, meminfo)  # 16 GiB needed
    need = 5 * ENGINE_GIB + 1.0
    assert str(caught.value).startswith(
        f"5 vLLM engines need about {need:.1f} GiB ({ENGINE_GIB:.1f} GiB each plus 1.0) "
        "but only 10.0 GiB is available"
    )


def test_meminfo_without_the_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 1 kB\n")
    with pytest.raises(RuntimeError, match="has no MemAvailable line"):
        available_gib(path)
