"""The demos' cache server: ``python -m nopecache.cache_server`` on a free loopback port.

Shared by ``examples/demo.py`` (transformers) and ``examples/demo_vllm.py`` (vLLM); it
imports nothing heavy, so it runs in either virtual environment.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.proc_groups import STOP_GRACE_S, stopping

SERVER_TIER = "cpu://?capacity=512MiB&pinned=no"
# Only a hang guard: the demo waits for the server's "listening on" line (polled), which
# comes in ~1 s on an idle machine; 60 s covers a machine loaded several times over.
_START_TIMEOUT_S = 60.0
_LISTENING = re.compile(r"listening on \S+:(\d+) ")


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


@contextmanager
def embedded_server(workdir: Path, tier: str = SERVER_TIER) -> Iterator[tuple[str, int]]:
    """Run a CPU-tier nopecache server on a free loopback port; yield (address, pid).

    The server picks the port (``--port 0``) and logs it; the log goes to a file so a
    failure can show its end. It is stopped (SIGTERM, then SIGKILL after STOP_GRACE_S)
    whatever happens. It stays in the demo's process group: a terminal's Ctrl-C reaches
    it at once and it shuts down (1 s grace for in-flight calls) while the demo stops
    its engines.
    """
    log_path = workdir / "server.log"
    cmd = [sys.executable, "-m", "nopecache.cache_server", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--tier", tier, "--no-write-through", "--no-metrics"]
    cmd += ["--shutdown-grace-s", "1", "--log-level", "INFO"]
    proc: subprocess.Popen[bytes] | None = None
    try:
        # A signal inside Popen, after the fork, would lose the child's pid and leave the
        # server running: it is held until proc is set, then raised here.
        with log_path.open("wb") as log, stopping():
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        port = _wait_listening(proc, log_path)
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        if proc is not None:
            with stopping():
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                print(f"server stopped (pid {proc.pid}, exit status {proc.returncode})", flush=True)


def _wait_listening(proc: subprocess.Popen[bytes], log_path: Path) -> int:
    """The port the server logged once it serves; DemoError if it exits or stays silent."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        found = _LISTENING.search(text)
        if found:
            return int(found.group(1))
        if proc.poll() is not None:
            raise DemoError(f"the server exited with {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace")[-2000:]
    raise DemoError(
        f"the server did not log 'listening on' within {_START_TIMEOUT_S:.0f} s:\n{tail}"
    )
