"""A real cache server for bench/quality.py: ``python -m nopecache.cache_server`` on loopback."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def cache_server(capacity: str, log: Path) -> Iterator[str]:
    """A CPU-tier server child on a free 127.0.0.1 port; yields its address once SERVING."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "nopecache.cache_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-metrics",
        "--tier",
        f"cpu://?capacity={capacity}&pinned=no",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"cache server exited: {log.read_text()[-2000:]}")
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("cache server did not start")
                time.sleep(0.05)
        yield address
    finally:
        proc.kill()
        proc.wait()
