"""``make demo`` end to end: a real server, two real vLLM engines, the seed's scenario.

Runs ``examples/demo_vllm.py --quick`` (a shorter report, shorter answers) and reads what
it printed; two more runs are stopped: Ctrl-C in a terminal while vLLM starts, SIGTERM to
the demo alone while engine 2 generates. Each runs in a session of its own, and
afterwards no process of that session may be left (the server, the two engine processes
and vLLM's own engine-core and worker processes below them).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.demo_output import (
    STOP_BOUND_S,
    answer_after,
    interrupt_after,
    session_left,
    summary,
)

# The per-test timeout is only a hang guard: a run starts two vLLM engines (~1 min idle,
# a few minutes at load ~6 on 2 cores); the stops themselves are timed against their bound.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[4]
DEMO = ROOT / "examples" / "demo_vllm.py"
BLOCK = 128  # vLLM's CPU block size: claims end on a block boundary
REPORT_TOKENS = 257  # --quick: the report's first three paragraphs in their message


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
        out, err = proc.communicate(timeout=840)  # a hang guard, within pytest's 900 s
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out + err
    assert session_left(proc.pid) == []
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


@pytest.mark.parametrize(
    ("marker", "sig", "group"),
    [
        # Both engines are loading: a terminal's Ctrl-C reaches the demo and the server,
        # not the engines (groups of their own): the demo must stop them.
        ("[engine 2] pid", signal.SIGINT, True),
        # Engine 2 generates: the demo alone is signalled, and stops everything.
        ("[engine 2] the server holds nothing yet", signal.SIGTERM, False),
    ],
    ids=["ctrl-c-in-vllm-start-up", "sigterm-in-generation"],
)
def test_demo_interrupted_stops_server_and_engines(
    model_dir: str, marker: str, sig: int, group: bool
) -> None:
    proc = _start(model_dir)
    # interrupt_after fails the test unless the demo is gone within STOP_BOUND_S.
    stop = interrupt_after(proc, marker, sig=sig, group=group)
    print(f"stopped {stop.stop_s:.1f} s after signal {sig}")
    assert proc.returncode == 130, stop.stdout + stop.stderr
    assert "demo interrupted; server and engines stopped" in stop.stderr
    assert re.search(r"server stopped \(pid \d+", stop.stdout), stop.stdout
    assert stop.stop_s < STOP_BOUND_S
    assert session_left(proc.pid) == []
