"""Engines spread over the cores, and a vLLM bench stopped by a signal leaves nothing.

1. Two engines started by one process bind their OpenMP threads to different cores
   (round robin over the allowed ones): read from the kernel, each engine's process
   group has a thread whose affinity is exactly its core.
2. ``bench/vllm_e2e.py --quick`` gets SIGTERM (to itself alone, as a service manager
   sends it) or SIGINT (to its whole process group, as a terminal's Ctrl-C does) while
   its engines build: it exits within the bound and no process of its session is left
   (its cache server, every engine and vLLM's engine-core processes below them).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.demo_output import STOP_BOUND_S, interrupt_after, session_left
from tests.support.engine_proc import EngineConfig, EngineProc, stop_all
from tests.support.machine import allowed_cores

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # hang guards: engine starts

ROOT = Path(__file__).resolve().parents[4]
BENCH = ROOT / "bench" / "vllm_e2e.py"


def _group_threads_on(pgid: int, core: int) -> list[str]:
    """Threads of process group ``pgid`` whose allowed CPUs are exactly ``core``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (entry / "task").iterdir():
                status = (task / "status").read_text()
                allowed = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M)
                if allowed is not None and allowed.group(1) == str(core):
                    found.append(f"{entry.name}/{task.name}")
        except OSError:  # a process that just exited
            continue
    return found


def test_engines_bind_their_threads_round_robin(model_dir: str, tmp_path: Path) -> None:
    procs = [EngineProc(EngineConfig(model=model_dir), tmp_path / f"e{i}.log") for i in range(2)]
    try:
        for proc in procs:
            proc.launch()
        for proc in procs:
            proc.wait_ready()
        cores = [proc.cpu for proc in procs]
        assert cores[0] in allowed_cores() and cores[1] in allowed_cores()
        if len(allowed_cores()) > 1:
            assert cores[0] != cores[1]
        for proc, core in zip(procs, cores, strict=True):
            assert proc.pid is not None and core is not None
            assert _group_threads_on(proc.pid, core), f"no thread of engine {proc.pid} on {core}"
    finally:
        stop_all(procs)


@pytest.mark.parametrize(
    ("sig", "group", "code"),
    [(signal.SIGTERM, False, 128 + signal.SIGTERM), (signal.SIGINT, True, -signal.SIGINT)],
    ids=["sigterm", "ctrl-c"],
)
def test_bench_stopped_by_a_signal_stops_everything(
    model_dir: str, sig: int, group: bool, code: int
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-u", str(BENCH), "--quick", "--model", model_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    # The last engine announced (after the server): every engine and the server run.
    stop = interrupt_after(proc, "engine ref: core", wait_s=2.0, sig=sig, group=group)
    out = stop.stdout
    assert re.search(r"^engine store: core \d+, process group \d+$", out, re.M), out
    assert re.search(r"^cache server: pid \d+$", out, re.M), out
    assert proc.returncode == code, out + stop.stderr
    assert "bench stopped its processes" in stop.stderr
    assert stop.stop_s < STOP_BOUND_S
    assert session_left(proc.pid) == []
