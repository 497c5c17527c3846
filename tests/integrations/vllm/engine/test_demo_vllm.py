"""``make demo`` end to end: a real server, two real vLLM engines, the seed's scenario.

Runs ``examples/demo_vllm.py --quick`` (a shorter report, shorter answers) and reads what
it printed; a second run is interrupted like Ctrl-C in a terminal. Each runs in a session
of its own, and afterwards no process of that session may be left (the server, the two
engine processes and vLLM's own engine-core and worker processes below them).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.demo_output import answer_after, interrupt_after, summary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[4]
DEMO = ROOT / "examples" / "demo_vllm.py"
BLOCK = 128  # vLLM's CPU block size: claims end on a block boundary
REPORT_TOKENS = 257  # --quick: the report's first three paragraphs in their message


def _session(sid: int) -> list[int]:
    """Live processes (zombies excluded) whose session id is ``sid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, sid
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return pids


def _gone(sid: int, timeout_s: float = 20.0) -> list[int]:
    """The session's processes still alive after ``timeout_s`` (none is the goal)."""
    deadline = time.monotonic() + timeout_s
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _start(model_dir: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-u", str(DEMO), "--quick", "--model", model_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )


def test_demo_reuses_the_system_prompt_behind_the_report(model_dir: str) -> None:
    proc = _start(model_dir)
    try:
        out, err = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out + err
    assert _gone(proc.pid) == []
    found = summary(out)
    assert found["reused_exact"] == "0"  # the report comes first: no prefix hit
    # The claim runs from 0 to a block boundary inside the system prompt: the report's
    # tokens are the loop's misses, the rest of the claim the reused system prompt.
    pi, misses = int(found["reused_pi"]), int(found["blend_misses"])
    assert misses == REPORT_TOKENS
    assert (pi + misses) % BLOCK == 0
    assert pi >= 4 * BLOCK
    # first_k(0.15): the share recomputed is the budget, rounded once (see policies.py).
    assert abs(float(found["recompute_fraction"]) - 0.15) <= 1 / (2 * pi) + 5e-4
    assert int(found["ttft_cached_ms"]) > 0
    assert int(found["ttft_nocache_ms"]) > 0
    assert found["same_answer"] in ("yes", "no")
    # Engine 1 read its system prompt: the persona's name comes from there.
    assert "Pip" in answer_after(out, "  answer:")
    for header in ("  answer with the cache:", "  answer without the cache:"):
        assert len(answer_after(out, header)) > 2  # more than the quotes
    assert f"server stopped (pid {found['server_pid']}, exit status 0)" in out


def test_demo_interrupted_stops_server_and_engines(model_dir: str) -> None:
    proc = _start(model_dir)
    stdout, err = interrupt_after(proc, "[engine 2] pid", 3.0)  # inside vLLM's start-up
    assert proc.returncode == 130, stdout + err
    assert "demo interrupted; server and engines stopped" in err
    assert re.search(r"server stopped \(pid \d+", stdout), stdout
    assert _gone(proc.pid) == []
