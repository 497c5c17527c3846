"""What must not kill or confuse a server process: a busy gRPC or metrics port at start
(one line on stderr naming the option to change, exit status 2, no traceback), and a
same-host client that shrinks its shared-memory segment before a Get (no SIGBUS).
Real ``python -m nopecache.cache_server`` processes on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import grpc
import pytest

from nopecache.client import shm as client_shm
from nopecache.client.shm import Segment
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.redis_procs import free_ports
from tests.support.server_harness import frames_of, key_of, make_block
from tests.support.server_procs import CacheServerProc


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def start(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "nopecache.cache_server", "--host", "127.0.0.1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_a_busy_grpc_port_is_one_line_naming_port(busy_port: int) -> None:
    done = start("--port", str(busy_port), "--no-metrics", "--tier", "cpu://?capacity=1MiB")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"nopecache-server: port: cannot listen on 127.0.0.1:{busy_port} (Address already in "
        "use); choose another port with --port (or NOPECACHE_PORT), or another address with "
        "--host"
    ]


def test_a_busy_metrics_port_is_one_line_naming_metrics_port(busy_port: int) -> None:
    (grpc_port,) = free_ports(1)
    done = start(
        "--port",
        str(grpc_port),
        "--metrics-port",
        str(busy_port),
        "--tier",
        "cpu://?capacity=1MiB",
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"nopecache-server: metrics_port: cannot listen on 127.0.0.1:{busy_port} (Address "
        "already in use); choose another port with --metrics-port (or NOPECACHE_METRICS_PORT), "
        "or another address with --metrics-host"
    ]


def test_a_client_that_shrinks_its_segment_does_not_kill_the_server(
    cache_server: CacheServerProc,
) -> None:
    key = key_of(1)
    blob = make_block(key, tokens=64, head_dim=64)
    seg = Segment.create(
        client_shm.MIN_SEGMENT_BYTES, prefix=f"nopecache-shrink-{uuid.uuid4().hex[:8]}-"
    )
    path = f"/dev/shm/{seg.name}"
    try:
        with grpc.insecure_channel(cache_server.address) as channel:
            stub = cache_pb2_grpc.KVCacheStub(channel)
            stub.Put(iter(frames_of([(key, blob)], 1 << 20)), timeout=10)
            reply = stub.AttachShm(
                pb.AttachShmRequest(name=seg.name, size=seg.size, nonce=seg.nonce), timeout=10
            )
            assert reply.refused == ""
            os.truncate(path, 4096)  # the client cuts its segment down to the header
            frames = list(
                stub.Get(
                    pb.GetRequest(
                        keys=key, shm_session=reply.session, shm_offset=8192, shm_size=len(blob)
                    ),
                    timeout=10,
                )
            )
            assert [(f.index, f.shm_offset, f.shm_length) for f in frames] == [(0, 8192, len(blob))]
            with open(path, "rb") as fh:
                assert os.pread(fh.fileno(), len(blob), 8192) == blob
            assert cache_server.running()
            assert stub.Lookup(pb.LookupRequest(keys=key), timeout=10).tiers == b"\x01"
    finally:
        os.truncate(path, seg.size)  # so that closing the client's own mapping is safe
        seg.close()
