"""A real cache server process with fault injection on (``--fault-injection``), for tests
and benchmarks that must prove a client survives damaged, dropped and delayed blocks
(the vLLM parity harness, ``bench/parity.py``).

    server = start_fault_server("seed=7,rate=0.2,kinds=flip,truncate,drop,delay")
    try:
        ...  # engines / clients at server.url
        assert server.faults_injected() > 0
    finally:
        server.kill()

The server serves its Prometheus metrics on a loopback port of its own; the counter
``nopecache_faults_injected_total{kind,path}`` is read from there.
"""

from __future__ import annotations

import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support.ready import ProcessExited
from tests.support.redis_procs import free_ports
from tests.support.server_procs import DEFAULT_TIER, CacheServerProc

__all__ = ["FaultServer", "fault_args", "start_fault_server"]

_FAMILY = "nopecache_faults_injected"


@dataclass
class FaultServer:
    """A running server process with fault injection on, and its metrics port."""

    proc: CacheServerProc
    metrics_port: int

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, what ClientConfig.servers takes."""
        return self.proc.address

    @property
    def url(self) -> str:
        """``nopecache://127.0.0.1:<port>``, what the engine connectors take."""
        return f"nopecache://{self.proc.address}"

    def faults_by_label(self) -> dict[tuple[str, str], int]:
        """Faults injected so far, by (kind, path), read from the metrics endpoint."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        out: dict[tuple[str, str], int] = {}
        for family in text_string_to_metric_families(text):
            if family.name != _FAMILY:
                continue
            for sample in family.samples:
                if sample.name == _FAMILY + "_total":
                    out[sample.labels["kind"], sample.labels["path"]] = int(sample.value)
        return out

    def faults_injected(self, kind: str | None = None, path: str | None = None) -> int:
        """Faults injected so far, all of them or those of one kind and/or read path."""
        return sum(
            n
            for (k, p), n in self.faults_by_label().items()
            if kind in (None, k) and path in (None, p)
        )

    def kill(self) -> None:
        """SIGKILL the server."""
        self.proc.kill()


def fault_args(spec: str, metrics_port: int) -> tuple[str, ...]:
    """The server's options to inject the faults of ``spec`` and count them on its
    metrics endpoint at ``metrics_port`` (where :class:`FaultServer` reads them)."""
    return (
        "--fault-injection",
        spec,
        "--metrics",
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(metrics_port),
    )


def start_fault_server(
    spec: str,
    workdir: Path | None = None,
    *,
    tiers: Sequence[str] = (DEFAULT_TIER,),
    extra_args: Sequence[str] = (),
) -> FaultServer:
    """Start a server process injecting the faults of ``spec`` (``--fault-injection``
    syntax, docs/operations.md) on free loopback ports; ready when it serves."""
    root = Path(tempfile.mkdtemp(prefix="nopecache-faults-")) if workdir is None else workdir
    for attempt in range(3):
        # Ports free a moment ago may be taken by now: retry on new ones.
        port, metrics_port = free_ports(2)
        proc = CacheServerProc(
            root / f"server-{attempt}",
            port,
            tiers=tiers,
            extra_args=(*fault_args(spec, metrics_port), *extra_args),
        )
        try:
            proc.start()
        except ProcessExited as exited:
            if attempt == 2 or "cannot listen on" not in exited.tail:
                raise
            continue
        return FaultServer(proc, metrics_port)
    raise AssertionError("unreachable")  # pragma: no cover
