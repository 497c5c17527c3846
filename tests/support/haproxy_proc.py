"""The front proxy of deploy/haproxy/haproxy.cfg as a child process, for tests and benches.

The config takes every address from the environment (``presetenv`` defaults are the
Kubernetes sidecar's); :class:`HAProxyProc` sets them to loopback ports in front of one
server and starts ``haproxy -db`` (foreground) on the unchanged file. Ready when the
monitor frontend answers ``GET /healthz`` with 200 (the probe the sidecar uses). The
``haproxy`` binary comes from the Debian package (``make haproxy``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.redis_procs import free_ports

__all__ = ["CONFIG", "HAProxyProc", "ProxyPorts", "check_config", "haproxy_binary"]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
# Only a hang guard: haproxy listens within milliseconds of its start.
_START_TIMEOUT_S = 30.0


def haproxy_binary() -> str | None:
    """The haproxy executable on PATH (or /usr/sbin, where Debian puts it), else None."""
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")


def check_config(path: Path = CONFIG, env: dict[str, str] | None = None) -> str:
    """Run ``haproxy -c -f path``; its output (raises CalledProcessError when invalid)."""
    binary = haproxy_binary()
    assert binary is not None, "haproxy is not installed (make haproxy)"
    done = subprocess.run(
        [binary, "-c", "-f", str(path)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout + done.stderr


@dataclass(frozen=True)
class ProxyPorts:
    """Where the server listens (loopback) and where the proxy listens for it."""

    server_grpc: int
    server_bulk: int
    server_health: int
    grpc: int
    bulk: int
    health: int
    monitor: int

    @classmethod
    def free(cls) -> ProxyPorts:
        """Seven loopback ports that were free a moment ago."""
        return cls(*free_ports(7))

    def server_args(self, host: str = "127.0.0.1") -> list[str]:
        """The server's options for running behind this proxy, besides ``--host HOST
        --port server_grpc`` (it announces the proxy's bulk port: clients dial the host
        they dialled for gRPC, the proxy's, at that port)."""
        return [
            *("--bulk-listen", f"{host}:{self.server_bulk}"),
            *("--bulk-advertise-port", str(self.bulk)),
            *("--health-listen", f"{host}:{self.server_health}"),
        ]

    def env(self, host: str = "127.0.0.1") -> dict[str, str]:
        """The proxy's environment (haproxy.cfg's variables)."""
        return {
            "NOPECACHE_PROXY_GRPC_BIND": f"{host}:{self.grpc}",
            "NOPECACHE_PROXY_BULK_BIND": f"{host}:{self.bulk}",
            "NOPECACHE_PROXY_HEALTH_BIND": f"{host}:{self.health}",
            "NOPECACHE_PROXY_MONITOR_BIND": f"{host}:{self.monitor}",
            "NOPECACHE_SERVER_GRPC": f"{host}:{self.server_grpc}",
            "NOPECACHE_SERVER_BULK": f"{host}:{self.server_bulk}",
            "NOPECACHE_SERVER_HEALTH": f"{host}:{self.server_health}",
        }


class HAProxyProc:
    """``haproxy -db -f deploy/haproxy/haproxy.cfg`` in front of one server on loopback."""

    def __init__(self, ports: ProxyPorts, log_path: Path, host: str = "127.0.0.1") -> None:
        self.ports = ports
        self.host = host
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def grpc_address(self) -> str:
        """Where clients dial gRPC."""
        return f"{self.host}:{self.ports.grpc}"

    @property
    def health_address(self) -> str:
        """The proxy's health frontend."""
        return f"{self.host}:{self.ports.health}"

    def start(self) -> None:
        """Start haproxy and wait until its monitor answers."""
        binary = haproxy_binary()
        assert binary is not None, "haproxy is not installed (make haproxy)"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-db", "-f", str(CONFIG)],
                env={**os.environ, **self.ports.env(self.host)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"http://{self.host}:{self.ports.monitor}/healthz"
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"haproxy exited with {self.proc.returncode}: {self.log_path.read_text()}"
                )
            try:
                # No proxy from the environment: the monitor is on loopback.
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with opener.open(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"haproxy not ready in {_START_TIMEOUT_S} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM (haproxy stops at once), then wait; SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
