"""Pytest fixtures that run real cache servers: ``python -m nopecache.cache_server`` children.

Every server binds 127.0.0.1 on a free port chosen here (so a killed server can be
restarted on the same address), serves no metrics unless asked, logs to a file of its
own, and is ready when the gRPC health service reports ``nopecache.v1.KVCache`` SERVING.
Every process a fixture starts is killed at teardown, whatever the test did to it.

Fixtures:
    cache_server            one server with a 64 MiB CPU tier, owned by the test
    cache_servers           a factory: ``cache_servers(n, redis_url=..., ...)`` starts n
                            servers (optionally over one Redis, write-through) and
                            returns them; all are killed after the test

Plain helpers (for benchmarks, demos and other fixtures): :class:`CacheServerProc`,
:func:`start_cache_servers`, :func:`wait_stored`.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from nopecache.proto import cache_pb2, cache_pb2_grpc
from nopecache.proto.contract import SERVICE_NAME
from tests.support.ready import ProcessExited, ProcessNotReady, wait_serving
from tests.support.redis_procs import free_ports

__all__ = ["CacheServerProc", "ServerFactory", "start_cache_servers", "wait_stored"]

DEFAULT_TIER = "cpu://?capacity=64MiB&pinned=no"
# Only a hang guard: a server is SERVING ~1 s after its start on an idle machine, and the
# wait returns then; 60 s covers a 2-core machine loaded several times over, where a
# timeout here would also cost start_cache_servers a retry on another port.
_START_TIMEOUT_S = 60.0


class CacheServerProc:
    """One cache server child process on a fixed loopback port; kill and restart it freely."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        *,
        tiers: Sequence[str] = (DEFAULT_TIER,),
        write_through: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workdir = workdir
        self.port = port
        self.tiers = tuple(tiers)
        self.write_through = write_through
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``, what clients connect to."""
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """Where the server writes its log (stderr)."""
        return self.workdir / f"server-{self.port}.log"

    def command(self) -> list[str]:
        """The command line that starts this server."""
        cmd = [sys.executable, "-m", "nopecache.cache_server", "--port", str(self.port)]
        cmd += ["--host", "127.0.0.1", "--no-metrics", "--shutdown-grace-s", "1"]
        for tier in self.tiers:
            cmd += ["--tier", tier]
        cmd.append("--write-through" if self.write_through else "--no-write-through")
        return [*cmd, *self.extra_args]

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Start the server and wait until its health service says SERVING."""
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        try:
            wait_serving(
                self.proc,
                self.address,
                self.log_path,
                timeout_s=timeout_s,
                service=SERVICE_NAME,
                what="cache server",
            )
        except ProcessNotReady:
            self.kill()
            raise

    def running(self) -> bool:
        """Whether the process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (a crash: no graceful shutdown, connections reset)."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)  # also ends a paused (SIGSTOPped) server
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers (a hung server)."""
        assert self.proc is not None and self.running()
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        assert self.proc is not None and self.running()
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM the server and wait for it (SIGKILL after 10 s)."""
        if not self.running():
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, n_chars: int = 3000) -> str:
        """The end of the server's log."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "(no log)"


def start_cache_servers(
    n: int,
    workdir: Path | None = None,
    *,
    redis_url: str | None = None,
    tiers: Sequence[str] = (DEFAULT_TIER,),
    extra_args: Sequence[str] = (),
) -> list[CacheServerProc]:
    """Start ``n`` servers on free ports; with ``redis_url`` each gets it as a last tier
    with write-through, so all of them share what any one stores."""
    root = Path(tempfile.mkdtemp(prefix="nopecache-servers-")) if workdir is None else workdir
    all_tiers = (*tiers, redis_url) if redis_url is not None else tuple(tiers)
    started: list[CacheServerProc] = []
    try:
        for i in range(n):
            for attempt in range(3):
                # A port that was free a moment ago may be taken by now: retry on a new one.
                server = CacheServerProc(
                    root / f"server{i}-{attempt}",
                    free_ports(1)[0],
                    tiers=all_tiers,
                    write_through=redis_url is not None,
                    extra_args=extra_args,
                )
                try:
                    server.start()
                except ProcessExited as exited:
                    # Only a port taken meanwhile is worth another try; any other exit
                    # (a configuration the server refuses) is reported at once.
                    if attempt == 2 or "cannot listen on" not in exited.tail:
                        raise
                    continue
                started.append(server)
                break
    except BaseException:
        for server in started:
            server.kill()
        raise
    return started


def wait_stored(address: str, at_least: int = 1, timeout_s: float = 120.0) -> int:
    """Wait until a server holds ``at_least`` entries and their count stopped growing.

    Engines store in the background: this is how a caller knows a store has landed. The
    count must hold still for a second; returns it (RuntimeError after ``timeout_s``, a
    hang guard: a store lands in well under a second on an idle machine).
    """
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        deadline = time.monotonic() + timeout_s
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            try:
                reply = stub.Stats(cache_pb2.StatsRequest(), timeout=10)
            except grpc.RpcError:  # a server busy storing on a loaded machine: ask again
                continue
            n = sum(t.entries for t in reply.tiers)
            if n != last:
                last, since = n, time.monotonic()
            elif n >= at_least and time.monotonic() - since > 1.0:
                return n
            time.sleep(0.1)
    raise RuntimeError(f"the store did not settle: {last} entries on {address}")


ServerFactory = Callable[..., list[CacheServerProc]]


@pytest.fixture
def cache_servers(tmp_path: Path) -> Iterator[ServerFactory]:
    """``cache_servers(n, redis_url=None, tiers=..., extra_args=...)`` starts n servers."""
    owned: list[CacheServerProc] = []

    def factory(
        n: int = 1,
        *,
        redis_url: str | None = None,
        tiers: Sequence[str] = (DEFAULT_TIER,),
        extra_args: Sequence[str] = (),
    ) -> list[CacheServerProc]:
        workdir = tmp_path / f"servers{len(owned)}"
        servers = start_cache_servers(
            n, workdir, redis_url=redis_url, tiers=tiers, extra_args=extra_args
        )
        owned.extend(servers)
        return servers

    yield factory
    for server in owned:
        server.kill()


@pytest.fixture
def cache_server(cache_servers: ServerFactory) -> CacheServerProc:
    """One running server with a 64 MiB CPU tier, killed after the test."""
    return cache_servers(1)[0]
