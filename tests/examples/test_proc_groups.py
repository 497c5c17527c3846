"""How the demos stop their children (tests/support/proc_groups.py), with real processes
and real signals: a group whose member ignores SIGTERM, a group that quits at once, and a
signal that lands while a stop runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.proc_groups import Group, interrupt_on_signals, stop_groups, stopping

# A group leader that forks a member ignoring SIGTERM, prints both pids once the member
# ignores it (a pipe says so: printed earlier, SIGTERM could end the member first), waits.
STUBBORN = """
import os, signal, sys, time
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.write(ready_w, b"1")
    while True:
        time.sleep(1)
os.read(ready_r, 1)
print(os.getpid(), pid, flush=True)
while True:
    time.sleep(1)
"""


def _group(proc: subprocess.Popen[str]) -> Group:
    def reap(timeout_s: float | None) -> bool:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    return Group(proc.pid, reap)


def _exists(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _start(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, process_group=0
    )


def test_a_member_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc = _start(STUBBORN)
    assert proc.stdout is not None
    leader, member = (int(p) for p in proc.stdout.readline().split())
    start = time.monotonic()
    stop_groups([_group(proc)], grace_s=1.0)
    took = time.monotonic() - start
    assert proc.returncode == -signal.SIGTERM  # the leader unwound on SIGTERM
    # The member outlived the leader and the grace, then SIGKILL ended it.
    deadline = time.monotonic() + 30  # init reaps it; a hang guard for a loaded machine
    while _exists(member):
        assert time.monotonic() < deadline, f"member {member} of group {leader} survived"
        time.sleep(0.05)
    assert took >= 1.0


def test_a_group_that_quits_on_sigterm_is_not_waited_for_the_whole_grace() -> None:
    proc = _start("import time; print(flush=True); time.sleep(600)")
    assert proc.stdout is not None
    proc.stdout.readline()
    start = time.monotonic()
    stop_groups([_group(proc)], grace_s=300.0)
    assert proc.returncode == -signal.SIGTERM
    # Gone at SIGTERM: the stop returns then, not at the grace (300 s, far above
    # anything a loaded machine takes to end a sleeping process).
    assert time.monotonic() - start < 60


def test_a_group_left_with_only_zombies_is_empty() -> None:
    # The leader sleeps; a second member of its group is a zombie of ours that nobody
    # reaps while the stop runs (as an orphan waits on a PID 1 that reaps late).
    proc = _start("import time; print(flush=True); time.sleep(600)")
    assert proc.stdout is not None
    proc.stdout.readline()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"], process_group=proc.pid)
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.05)  # until it has exited (unreaped: a zombie in the group)
    start = time.monotonic()
    try:
        stop_groups([_group(proc)], grace_s=300.0)
        # The old check counted the zombie as a live member and waited out the grace
        # (300 s, far above anything a loaded machine takes to end a sleeping process).
        assert time.monotonic() - start < 60
        assert proc.returncode == -signal.SIGTERM
    finally:
        zombie.wait()


@pytest.fixture
def demo_signals() -> Iterator[None]:
    """The demos' SIGINT/SIGTERM handling in this process; pytest's own restored after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    interrupt_on_signals()
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.usefixtures("demo_signals")
def test_a_signal_during_a_stop_is_raised_after_it_and_later_ones_are_ignored() -> None:
    finished = False
    with pytest.raises(KeyboardInterrupt), stopping():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode: the stop goes on
        finished = True
    assert finished
    # Once raised, further signals are ignored: the cleanup after runs uncut.
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)


@pytest.mark.usefixtures("demo_signals")
def test_the_first_signal_outside_a_stop_raises_at_once() -> None:
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # interrupted: the handler raises inside the sleep
