"""Every process a vLLM bench starts, stopped together whatever ends the bench.

``with bench_processes(engines=3) as started:`` checks that the machine has memory for
that many engines (:func:`tests.support.machine.require_memory`: a clear error instead
of an engine OOM-killed halfway), makes SIGTERM unwind like Ctrl-C, and on the way out,
normal end, exception, SIGINT or SIGTERM alike, stops what the bench registered:

    engines        :func:`tests.support.engine_proc.stop_all` (each process group;
                   a short grace on a failure: engines still building read no stdin)
    cache servers  ``CacheServerProc.stop`` (SIGTERM, SIGKILL after 10 s)
    other children a peer's server, started in a process group of its own: SIGTERM
                   to the group, SIGKILL after a grace

While it stops, further SIGINT/SIGTERM are ignored: every stop is bounded, and a second
Ctrl-C must not cut one short and leave processes behind. :meth:`Started.announce` prints
each engine's core and process group, so a reader (and the signal test) sees where every
engine ran and can check it is gone after the bench.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

from tests.support.engine_proc import EngineProc, stop_all
from tests.support.machine import require_memory
from tests.support.proc_groups import STOP_GRACE_S, Group, stop_groups
from tests.support.server_procs import CacheServerProc

__all__ = ["Started", "bench_processes"]


@dataclass
class Started:
    """What a bench started, by kind; register each before it starts."""

    engines: dict[str, EngineProc] = field(default_factory=dict)
    servers: list[CacheServerProc] = field(default_factory=list)
    groups: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def engine(self, name: str, proc: EngineProc) -> EngineProc:
        """Register an engine (launched or not) under ``name``."""
        self.engines[name] = proc
        return proc

    def server(self, server: CacheServerProc) -> CacheServerProc:
        """Register a cache server."""
        self.servers.append(server)
        return server

    def group(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Register a child that leads a process group of its own (a peer's server)."""
        self.groups.append(proc)
        return proc

    def stop_now(self, procs: list[subprocess.Popen[bytes]]) -> None:
        """Stop registered groups now, together (SIGTERM, SIGKILL after a grace), and forget
        them: a bench that runs its engines one configuration at a time frees the memory
        before the next starts."""
        stop_groups([_popen_group(child) for child in procs], grace_s=STOP_GRACE_S * 3)
        for child in procs:
            self.groups.remove(child)

    def announce(self) -> None:
        """Print one line per server, then per launched engine: name, core, process group."""
        for server in self.servers:
            if server.proc is not None:
                print(f"cache server: pid {server.proc.pid}", flush=True)
        for child in self.groups:
            print(f"peer server: process group {child.pid}", flush=True)
        for name, proc in self.engines.items():
            if proc.pid is not None:
                print(f"engine {name}: core {proc.cpu}, process group {proc.pid}", flush=True)

    def stop(self, finished: bool) -> None:
        """Stop everything registered (engines first: they hold connections to servers)."""
        if not finished:
            # Engines still building read no stdin: every group gets SIGTERM at once, so
            # the stop takes one grace, not one per engine.
            stop_groups([p.group() for p in self.engines.values() if p.proc is not None])
        stop_all(list(self.engines.values()), timeout_s=30.0 if finished else 5.0)
        for server in self.servers:
            server.stop()
        stop_groups([_popen_group(child) for child in self.groups], grace_s=STOP_GRACE_S * 3)


def _popen_group(proc: subprocess.Popen[bytes]) -> Group:
    def reap(timeout_s: float | None) -> bool:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
        return proc.returncode is not None

    return Group(proc.pid, reap)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)


@contextlib.contextmanager
def bench_processes(engines: int) -> Iterator[Started]:
    """Check memory for ``engines`` engines; yield a :class:`Started`; stop it all after."""
    require_memory(engines)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = Started()
    finished = False
    try:
        yield started
        finished = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            started.stop(finished)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
            if not finished:
                print(f"bench stopped its processes (pid {os.getpid()})", file=sys.stderr)
