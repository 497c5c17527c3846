"""``make demo`` end to end: a real server subprocess, two engine processes on SmolLM2.

Runs ``examples/demo.py --quick`` (a shorter report, fewer new tokens) and reads what it
printed; a second run is interrupted like Ctrl-C in a terminal. Both check that no process
the demo started outlives it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.demo_output import answer_after, interrupt_after, summary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.py"
# The system prompt (294 tokens) and the assistant header (4) are engine 1's messages
# that come back in engine 2's prompt; the report before them is new.
SYSTEM_AND_HEADER_TOKENS = 294 + 4


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def _pid(pattern: str, stdout: str) -> int:
    found = re.search(pattern, stdout)
    assert found, f"no {pattern!r} in:\n{stdout}"
    return int(found.group(1))


def test_demo_quick_runs_end_to_end_and_stops_everything() -> None:
    out = subprocess.run(
        [sys.executable, str(DEMO), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = summary(out.stdout)
    assert found["reused_exact"] == "0"  # the report comes first: no prefix hit
    assert found["reused_pi"] == str(SYSTEM_AND_HEADER_TOKENS)
    # The default policy recomputes some of the moved tokens, not all of them.
    assert 0 < int(found["recomputed_last_layer"]) < SYSTEM_AND_HEADER_TOKENS
    assert 0.0 < float(found["recompute_fraction"]) < 1.0
    assert int(found["prefill_cached_ms"]) > 0
    assert int(found["prefill_nocache_ms"]) > 0
    assert found["same_answer"] in ("yes", "no")
    # Engine 1 read its system prompt: the persona's name comes from there.
    assert "Pip" in answer_after(out.stdout, "  answer:")
    for header in ("  answer with the cache:", "  answer without the cache:"):
        assert len(answer_after(out.stdout, header)) > 2  # more than the quotes
    assert "[engine 1] loading the model from" in out.stdout  # load progress shown
    assert "[engine 2] lookup + fetch: 0 exact-prefix and 298" in out.stdout
    server_pid = int(found["server_pid"])
    assert f"server stopped (pid {server_pid}, exit status 0)" in out.stdout
    pids = [server_pid, *(int(p) for p in found["engine_pids"].split(","))]
    assert [pid for pid in pids if _alive(pid)] == []


def test_demo_interrupted_stops_the_server() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-u", str(DEMO), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    stdout, err = interrupt_after(proc, "[engine 1] pid", 1.0)  # inside the model load
    assert proc.returncode == 130, stdout + err
    assert "demo interrupted; server and engines stopped" in err
    server_pid = _pid(r"server pid (\d+) listening", stdout)
    engine_pid = _pid(r"\[engine 1\] pid (\d+)", stdout)
    assert f"server stopped (pid {server_pid}" in stdout
    assert not _alive(server_pid)
    assert not _alive(engine_pid)


DEMO_VLLM = ROOT / "examples" / "demo_vllm.py"


def _vllm_demo(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO_VLLM), *args],
        capture_output=True,
        text=True,
        timeout=60,
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
