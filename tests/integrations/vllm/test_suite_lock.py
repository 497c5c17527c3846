"""The vLLM suite's machine-wide lock: a suite queued behind another waits outside its tests.

Two checkouts' ``make test`` side by side: the second vLLM suite waits ~10 minutes for the
first. Waiting in a fixture counted against the first test's 300 s timeout and failed the
whole suite; the hooks of tests/support/suite_lock.py wait before any test starts.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_suite_queued_behind_another_waits_longer_than_its_test_timeout(tmp_path: Path) -> None:
    lock_path = tmp_path / "suite.lock"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        textwrap.dedent(
            f"""
            from tests.support import suite_lock
            suite_lock.VLLM_LOCK = {str(lock_path)!r}
            pytest_collection_finish = suite_lock.hold
            pytest_sessionfinish = suite_lock.release
            """
        )
    )
    (suite / "test_one.py").write_text("def test_runs():\n    pass\n")
    held = open(lock_path, "w")  # noqa: SIM115 - released by the timer below
    fcntl.flock(held, fcntl.LOCK_EX)
    # The other suite holds the lock 3 s, longer than this suite's 1 s test timeout.
    release = threading.Timer(3.0, held.close)
    release.start()
    try:
        child = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-o",
                "timeout=1",
                "--rootdir",
                str(suite),
                str(suite),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=600,  # a hang guard only: the child waits ~3 s
            check=False,
        )
    finally:
        release.cancel()
        held.close()
    assert child.returncode == 0, child.stdout + child.stderr
    assert f"waiting for {lock_path}: another suite holds it" in child.stderr
    assert "1 passed" in child.stdout
