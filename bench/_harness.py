"""Helpers the benchmarks share: a cache-server child, timing, a paged target."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.client import PagedKV

PAGE = 16  # tokens per paged-cache block (vLLM's default)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def cache_server(capacity: str, log: Path) -> Iterator[str]:
    """A server child with a CPU tier on a free loopback port, SERVING when this yields
    its address; killed on exit."""
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
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("server did not start")
                time.sleep(0.05)
        try:
            yield address
        except BaseException:
            if proc.poll() is not None:
                print(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
            raise
    finally:
        proc.kill()
        proc.wait()


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
