"""Waiting for a child cache server to serve, and saying at once when it died instead.

Every helper that starts ``python -m nopecache.cache_server`` (tests/support/server_procs.py,
bench/_harness.py, the benchmarks with servers of their own) waits through
:func:`wait_serving`: it returns when the gRPC health service reports SERVING and raises
:class:`ProcessExited` the moment the process has exited, with its exit code and the last
lines of its log, so a server refusing its configuration fails a run in about a second
instead of after the readiness timeout.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["ProcessExited", "ProcessNotReady", "last_lines", "wait_serving"]

# A child that is starting refuses connections; gRPC's reconnect backoff (1 s, growing to
# 120 s) would then delay the first SERVING answer long after the server listens. Short
# retries keep the wait on the event (the server listening), not on a backoff timer.
_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]
_POLL_S = 0.05


class ProcessExited(RuntimeError):
    """A child process exited before it was ready; the message carries its exit code and
    the last lines of its log."""

    def __init__(self, what: str, returncode: int, tail: str) -> None:
        super().__init__(
            f"{what} exited with code {returncode} before it was ready; last lines of its "
            f"log:\n{tail}"
        )
        self.returncode = returncode
        self.tail = tail


class ProcessNotReady(RuntimeError):
    """A child process still ran, but was not ready within the wait's bound."""


def last_lines(path: Path, n: int = 20) -> str:
    """The last ``n`` non-empty lines of a log file ("(no log)" if it cannot be read)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join([line for line in lines if line.strip()][-n:]) or "(empty log)"


def wait_serving(
    proc: subprocess.Popen[bytes],
    address: str,
    log_path: Path,
    *,
    timeout_s: float,
    service: str = "",
    what: str = "cache server",
) -> None:
    """Wait until the server ``proc`` at ``address`` reports ``service`` SERVING.

    Raises :class:`ProcessExited` as soon as ``proc`` has exited (checked every 50 ms),
    and :class:`ProcessNotReady` after ``timeout_s`` (a hang guard only: callers pick it
    generous; the process is left running for the caller to stop).
    """
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    with grpc.insecure_channel(address, options=_PROBE_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                raise ProcessExited(f"{what} at {address}", proc.returncode, last_lines(log_path))
            with contextlib.suppress(grpc.RpcError):
                reply = stub.Check(request, timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if time.monotonic() > deadline:
                raise ProcessNotReady(
                    f"{what} at {address} still not SERVING after {timeout_s:.0f} s; last "
                    f"lines of its log:\n{last_lines(log_path)}"
                )
            time.sleep(_POLL_S)
