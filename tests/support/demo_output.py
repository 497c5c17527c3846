"""What the demos print, read back by their tests, and their Ctrl-C (tests/test_demo.py,
tests/integrations/vllm/engine/test_demo_vllm.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

__all__ = ["answer_after", "interrupt_after", "summary"]


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


def interrupt_after(proc: subprocess.Popen[str], marker: str, wait_s: float) -> tuple[str, str]:
    """Ctrl-C ``proc`` ``wait_s`` after it printed ``marker``: what it printed, out and err.

    A terminal's Ctrl-C sends SIGINT to the whole foreground process group, so ``proc``
    must lead a group of its own (``start_new_session=True``). It is killed if it
    outlives the interrupt by a minute.
    """
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                break
        time.sleep(wait_s)
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return "".join(lines) + rest, err
