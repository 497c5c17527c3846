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
import time
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
    held = open(lock_path, "w")  # noqa: SIM115 - closed below, which releases it
    fcntl.flock(held, fcntl.LOCK_EX)
    child = subprocess.Popen(
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
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stderr is not None
        seen: list[str] = []
        # Until the child says it waits (its start-up takes seconds on a loaded machine;
        # a timer that released the lock after 3 s raced it, and the test's own timeout
        # guards a hang here). Then the other suite holds the lock 2 s more, longer than
        # this suite's 1 s test timeout.
        for line in child.stderr:
            seen.append(line)
            if "another suite holds it" in line:
                break
        time.sleep(2.0)
        held.close()
        out, err = child.communicate(timeout=600)  # a hang guard only
    finally:
        held.close()
        if child.poll() is None:
            child.kill()
            child.wait()
    stderr = "".join(seen) + err
    assert child.returncode == 0, out + stderr
    assert f"waiting for {lock_path}: another suite holds it" in stderr
    assert "1 passed" in out
