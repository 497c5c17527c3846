"""What the demos print, read back by their tests, and their Ctrl-C
(tests/examples/test_demo.py, tests/integrations/vllm/engine/test_demo_vllm.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.proc_groups import STOP_GRACE_S

__all__ = [
    "STOP_BOUND_S",
    "Interrupted",
    "alive",
    "answer_after",
    "interrupt_after",
    "session_left",
    "summary",
]

STOP_BOUND_S = 2 * STOP_GRACE_S + 30.0
"""How soon after Ctrl-C a demo must be gone: its documented bound (one grace for the
engines, then one for the server) plus 30 s for its processes' own exit on a loaded
2-core machine (an interpreter with torch loaded takes seconds to exit at load ~6)."""


def summary(stdout: str) -> dict[str, str]:
    """The demo's last line, ``DEMO key=value ...``, as a dict."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("DEMO "), stdout
    return dict(item.split("=", 1) for item in last.split()[1:])


def answer_after(stdout: str, header: str) -> str:
    """The quoted answer printed on the lines after ``header``."""
    found = re.search(re.escape(header) + r"\n((?:    .*\n)+)", stdout)
    assert found, f"no {header!r} in:\n{stdout}"
    return " ".join(line.strip() for line in found.group(1).splitlines())


@dataclass(frozen=True, slots=True)
class Interrupted:
    """What an interrupted demo printed, and how long it took to stop."""

    stdout: str
    stderr: str
    stop_s: float  # from the signal until every holder of its output pipes was gone


def interrupt_after(
    proc: subprocess.Popen[str],
    marker: str,
    wait_s: float = 0.0,
    *,
    sig: int = signal.SIGINT,
    group: bool = True,
    bound_s: float = STOP_BOUND_S,
) -> Interrupted:
    """Send ``sig`` to ``proc`` ``wait_s`` after it printed ``marker``; what it printed.

    ``group``: to the whole process group, as a terminal's Ctrl-C does (``proc`` must lead
    a group of its own: ``start_new_session=True``); else to ``proc`` alone (SIGTERM from
    a service manager). The stop is timed from the signal until the output pipes close,
    which needs every process that holds them gone; past ``bound_s`` the test fails
    (and the group is killed).
    """
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:  # the test's own timeout guards a demo that hangs here
            lines.append(line)
            if marker in line:
                break
        else:
            raise AssertionError(f"{marker!r} never printed:\n{''.join(lines)}")
        time.sleep(wait_s)
        sent = time.monotonic()
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            rest, err = proc.communicate(timeout=bound_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {bound_s:.0f} s after signal {sig}:\n{''.join(lines)}"
            ) from None
        stop_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Interrupted("".join(lines) + rest, err, stop_s)


def session_left(sid: int, timeout_s: float = 30.0) -> list[int]:
    """Live processes (zombies excluded) of session ``sid`` still there after waiting up
    to ``timeout_s`` for them to go (none is the goal).

    A demo's processes have closed its pipes when this is called, so they are exiting;
    30 s only bounds the kernel's teardown of a large process on a loaded machine.
    """
    deadline = time.monotonic() + timeout_s
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _session(sid: int) -> list[int]:
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


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
