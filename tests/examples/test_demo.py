"""``make demo`` end to end: a real server subprocess, two engine processes on SmolLM2.

Runs ``examples/demo.py --quick`` (a shorter report, fewer new tokens) and reads what it
printed; other runs are interrupted in each phase, like Ctrl-C in a terminal (and once by
SIGTERM to the demo alone). Each run is a session of its own, and afterwards no process
of that session may be left.
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
    alive,
    answer_after,
    interrupt_after,
    session_left,
    summary,
)

# The per-test timeout is only a hang guard: a run takes ~30 s on an idle machine and a
# few minutes at load ~6 on 2 cores; the stops themselves are timed against their bound.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.py"
# The system prompt (294 tokens) and the assistant header (4) are engine 1's messages
# that come back in engine 2's prompt; the report before them is new.
SYSTEM_AND_HEADER_TOKENS = 294 + 4


def test_demo_quick_runs_end_to_end_and_stops_everything() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(DEMO), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        # Only a hang guard: ~30 s idle, a few minutes at load ~6 on 2 cores.
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out + err
    found = summary(out)
    assert found["reused_exact"] == "0"  # the report comes first: no prefix hit
    assert found["reused_pi"] == str(SYSTEM_AND_HEADER_TOKENS)
    # The default policy recomputes some of the moved tokens, not all of them.
    assert 0 < int(found["recomputed_last_layer"]) < SYSTEM_AND_HEADER_TOKENS
    assert 0.0 < float(found["recompute_fraction"]) < 1.0
    assert int(found["prefill_cached_ms"]) > 0
    assert int(found["prefill_nocache_ms"]) > 0
    assert found["same_answer"] in ("yes", "no")
    # Engine 1 read its system prompt: the persona's name comes from there.
    assert "Pip" in answer_after(out, "  answer:")
    for header in ("  answer with the cache:", "  answer without the cache:"):
        assert len(answer_after(out, header)) > 2  # more than the quotes
    assert "[engine 1] loading the model from" in out  # load progress shown
    assert "[engine 2] lookup + fetch: 0 exact-prefix and 298" in out
    server_pid = int(found["server_pid"])
    assert f"server stopped (pid {server_pid}, exit status 0)" in out
    pids = [server_pid, *(int(p) for p in found["engine_pids"].split(","))]
    assert [pid for pid in pids if alive(pid)] == []
    assert session_left(proc.pid) == []


# The line after which the signal goes, one per phase of the demo. The demo prints each
# line as it enters the phase, so the signal lands inside it (or, where the phase is
# short, in the next one: still a phase the stop must handle).
PHASES = {
    "server start-up": "starting the nopecache server",
    "engine start": "engine 1: a chat whose system prompt",
    "model load": "[engine 1] pid",
    "prefill": "[engine 1] prompt:",
    "storing": "[engine 1] prefill (empty cache",
    "engine 2 prefills": "[engine 2] lookup + fetch",
}


@pytest.mark.parametrize("marker", PHASES.values(), ids=PHASES.keys())
def test_demo_interrupted_stops_everything_in_bounded_time(marker: str) -> None:
    _interrupted_run(marker, signal.SIGINT, group=True)


def test_demo_stops_on_sigterm_to_the_demo_alone() -> None:
    # No process but the demo gets the signal: it must stop the engine and the server.
    _interrupted_run(PHASES["prefill"], signal.SIGTERM, group=False)


def _interrupted_run(marker: str, sig: int, group: bool) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-u", str(DEMO), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    # interrupt_after fails the test unless the demo is gone within STOP_BOUND_S.
    stop = interrupt_after(proc, marker, sig=sig, group=group)
    print(f"stopped {stop.stop_s:.1f} s after signal {sig}")
    assert proc.returncode == 130, stop.stdout + stop.stderr
    assert "demo interrupted; server and engines stopped" in stop.stderr
    assert stop.stop_s < STOP_BOUND_S
    servers = [int(p) for p in re.findall(r"server pid (\d+) listening", stop.stdout)]
    for pid in servers:
        assert f"server stopped (pid {pid}" in stop.stdout
    engines = [int(p) for p in re.findall(r"\[engine \d\] pid (\d+)", stop.stdout)]
    assert [pid for pid in servers + engines if alive(pid)] == []
    assert session_left(proc.pid) == []


DEMO_VLLM = ROOT / "examples" / "demo_vllm.py"


def _vllm_demo(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO_VLLM), *args],
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard: argument checks only, ~2 s (importing transformers)
        cwd=ROOT,
        env=env,
    )


def test_vllm_demo_without_a_model_says_how_to_get_one(tmp_path: Path) -> None:
    # The vLLM demo itself runs in tests/integrations/vllm/engine (it needs vLLM); its argument checks come
    # before anything starts, so they run here.
    env = {k: v for k, v in os.environ.items() if k != "NOPECACHE_VLLM_MODEL"}
    out = _vllm_demo([], env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "must name the converted SmolLM2 folder; `make demo` sets it up" in out.stderr
    out = _vllm_demo(["--model", str(tmp_path)], env)  # a folder without config.json
    assert out.returncode == 2
    assert "--model (or $NOPECACHE_VLLM_MODEL)" in out.stderr
    assert "starting the nopecache server" not in out.stdout


def test_vllm_demo_rejects_a_bad_answer_length(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    out = _vllm_demo(["--model", str(tmp_path), "--max-new-tokens", "0"], dict(os.environ))
    assert out.returncode == 2
    assert "--max-new-tokens: must be >= 1, got 0" in out.stderr
