"""Prefill/decode behind the proxy, for bench/vllm_pd.py and the engine test.

:func:`pd_transfer` is the ``--kv-transfer-config`` of each role; :class:`ProxyProc` runs
``python -m nopecache.integrations.vllm.pd.proxy`` (the ``nopecache-pd-proxy`` entry point)
in a process group of its own, registered in a :class:`~_vllm_procs.Started` before it
starts, ready when its port accepts connections (it raises at once, with its log, if it
exits first).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _vllm_procs import Started

from tests.support.redis_procs import free_ports

__all__ = ["ProxyProc", "pd_transfer"]

# Only a hang guard: the proxy listens within a second of its start.
_START_TIMEOUT_S = 120.0


def pd_transfer(role: str, server: str, **extra: Any) -> dict[str, Any]:
    """The kv-transfer config of a ``kv_producer``/``kv_consumer``/``kv_both`` engine."""
    return {
        "kv_connector": "NopecacheConnector",
        "kv_connector_module_path": "nopecache.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"url": f"nopecache://{server}", **extra},
    }


class ProxyProc:
    """The P/D proxy in front of ``prefill`` and ``decode`` engine URLs."""

    def __init__(self, prefill: list[str], decode: list[str], log_path: Path) -> None:
        self.prefill, self.decode, self.log_path = prefill, decode, log_path
        self.port = free_ports(1)[0]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The proxy's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, started: Started) -> ProxyProc:
        """Start it (registered in ``started``) and wait until it listens."""
        cmd = [sys.executable, "-m", "nopecache.integrations.vllm.pd.proxy"]
        cmd += ["--port", str(self.port)]
        for url in self.prefill:
            cmd += ["--prefill", url]
        for url in self.decode:
            cmd += ["--decode", url]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, process_group=0
            )
        started.group(self.proc)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"the P/D proxy exited with {self.proc.returncode}:\n{tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the P/D proxy is not listening on {self.port}") from None
                time.sleep(0.05)
