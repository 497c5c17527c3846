"""Helpers the benchmarks share: a cache-server child, timing, a paged target."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from nopecache.client import PagedKV
from tests.support.ready import wait_serving

PAGE = 16  # tokens per paged-cache block (vLLM's default)
# A server is SERVING about a second after its start on an idle machine; 600 s only
# guards against a hang on a machine loaded many times over.
START_TIMEOUT_S = 600.0


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def cache_server(capacity: str, log: Path) -> Iterator[str]:
    """A server child with a CPU tier on a free loopback port, SERVING when this yields
    its address; killed on exit. Raises ``tests.support.ready.ProcessExited`` at once if
    it exits before serving."""
    port = free_port()
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
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            preexec_fn=_die_with_parent,
        )
    address = f"127.0.0.1:{port}"
    try:
        # A server that exits (a refused configuration) is reported at once with its exit
        # code and log; the bound is only a hang guard, generous for a loaded machine.
        wait_serving(proc, address, log, timeout_s=START_TIMEOUT_S)
        try:
            yield address
        except BaseException:
            if proc.poll() is not None:
                print(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
            raise
    finally:
        proc.kill()
        proc.wait()


# Resolved here, not in the forked child (a dlopen there could wait on a lock another
# thread held at the fork).
_PRCTL = ctypes.CDLL(None).prctl
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server child before exec: SIGKILL it when the thread that started it dies
    (Linux; the bench's main thread), so that a bench killed outright (the OOM killer,
    SIGKILL) leaves no server holding its pool."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def best_of(reps: int, run: Callable[[], object]) -> float:
    """The fastest of ``reps`` timed runs of ``run`` (after one untimed warm-up)."""
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def paged_target(tokens: int, layers: int, heads: int, dim: int, dtype: torch.dtype) -> PagedKV:
    """A paged cache with 25% spare pages and a shuffled block table, as an engine has."""
    blocks = -(-tokens // PAGE) * 5 // 4
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
    pages = table[: -(-tokens // PAGE)]
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1)[:tokens]
    shape = (blocks, PAGE, heads, dim)
    return PagedKV(
        [torch.zeros(shape, dtype=dtype) for _ in range(layers)],
        [torch.zeros(shape, dtype=dtype) for _ in range(layers)],
        slots.to(torch.int64),
    )
