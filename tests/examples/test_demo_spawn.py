"""A signal that lands while the demo spawns its server still stops that server.

CI once found a server of an interrupted demo alive 30 s after the demo exited: the
Ctrl-C came inside ``subprocess.Popen``, after the fork, so the demo never learnt the
child's pid. The signal here is sent from inside Popen, after the real child started and
before Popen returns: the moment that lost the pid.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.support import proc_groups
from tests.support.demo_output import alive

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _demo_server() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_demo_server", EXAMPLES / "_demo_server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_demo_server", module)
    spec.loader.exec_module(module)
    return module


def test_a_signal_inside_the_servers_spawn_still_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo_server = _demo_server()
    spawned: list[subprocess.Popen[bytes]] = []

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(*args, **kwargs)
        spawned.append(proc)
        os.kill(os.getpid(), signal.SIGINT)  # a terminal's Ctrl-C, before Popen returns
        return proc

    fake = SimpleNamespace(
        Popen=popen, DEVNULL=subprocess.DEVNULL, TimeoutExpired=subprocess.TimeoutExpired
    )
    monkeypatch.setattr(demo_server, "subprocess", fake)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    proc_groups.interrupt_on_signals()
    try:
        with pytest.raises(KeyboardInterrupt), demo_server.embedded_server(tmp_path):
            pytest.fail("the interrupted start must not yield a server")
        assert len(spawned) == 1
        # Stopped (SIGTERM, waited for and reaped) before the interrupt left the demo.
        assert spawned[0].returncode is not None
        assert not alive(spawned[0].pid)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for proc in spawned:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
