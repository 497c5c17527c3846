"""The server as its own process (`python -m nopecache.cache_server`, `nopecache-server`):
round trip over loopback, graceful SIGTERM with a Get in flight, CLI help and errors."""

from __future__ import annotations

import asyncio
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import grpc
import pytest

from nopecache.cache_server.config import ServerConfig, flag_name
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import PRESENT, STORED, get, key_of, make_block, put

_LISTENING = re.compile(r"listening on 127\.0\.0\.1:(\d+) \(metrics 127\.0\.0\.1:(\d+);")
_START_TIMEOUT_S = 60.0  # a hang guard: "listening on" comes ~1 s after the start, idle


class ServerProcess:
    """A `python -m nopecache.cache_server` child; its stderr is collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nopecache.cache_server", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.port, self.metrics_port = self._wait_listening()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _wait_listening(self) -> tuple[int, int]:
        assert self.proc.stderr is not None
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stderr, selectors.EVENT_READ)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.5):
                continue
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match:
                return int(match[1]), int(match[2])
        self.proc.kill()
        raise AssertionError(f"server did not start: {''.join(self.lines)}")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def address(self) -> str:
        """``127.0.0.1:port``."""
        return f"127.0.0.1:{self.port}"

    def wait(self, timeout: float) -> int:
        """The exit status, waiting at most ``timeout`` seconds."""
        status = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return status

    def kill(self) -> None:
        """Kill the child if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server_process() -> Iterator[ServerProcess]:
    """A server child on free ports with a 64 MiB CPU tier."""
    proc = ServerProcess(
        "--port", "0", "--metrics-port", "0", "--tier", "cpu://?capacity=64MiB&pinned=no"
    )
    yield proc
    proc.kill()


async def _round_trip(address: str) -> None:
    config = ServerConfig()
    async with grpc.aio.insecure_channel(address, options=config.grpc_options) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        keys = [key_of(i) for i in range(3)]
        blobs = [make_block(k, tokens=64 * (i + 1), head_dim=64) for i, k in enumerate(keys)]
        results = await put(stub, zip(keys, blobs, strict=True), config.max_frame_data_bytes)
        assert [r.outcome for r in results] == [STORED] * 3
        again = await put(stub, [(keys[0], blobs[0])], config.max_frame_data_bytes)
        assert [r.outcome for r in again] == [PRESENT]
        got, _ = await get(stub, [*keys, key_of(9)])
        assert got == [*blobs, None]
        lookup = await stub.Lookup(pb.LookupRequest(keys=b"".join([key_of(9), *keys])))
        assert lookup.tiers == b"\x00\x01\x01\x01"


def test_subprocess_server_round_trip(server_process: ServerProcess) -> None:
    asyncio.run(_round_trip(server_process.address))


async def _get_across_sigterm(server: ServerProcess) -> None:
    # No BDP probing: the receive window stays at 64 KiB, so the server cannot have sent
    # the whole stream before SIGTERM and the Get is really in flight.
    options = [*ServerConfig().grpc_options, ("grpc.http2.bdp_probe", 0)]
    async with grpc.aio.insecure_channel(server.address, options=options) as channel:
        stub = cache_pb2_grpc.KVCacheStub(channel)
        keys = [key_of(i) for i in range(100, 108)]
        blobs = [make_block(k, tokens=1024, head_dim=128) for k in keys]  # 512 KiB each
        results = await put(
            stub, zip(keys, blobs, strict=True), ServerConfig().max_frame_data_bytes
        )
        assert [r.outcome for r in results] == [STORED] * len(keys)

        call = stub.Get(pb.GetRequest(keys=b"".join(keys)))
        first = await call.read()
        assert isinstance(first, pb.GetFrame)
        frames = [first]
        server.proc.send_signal(signal.SIGTERM)
        # The listener closes: a new connection cannot start an RPC. When depends on how
        # soon the server runs its signal handler, so ask until one is refused.
        await _until_refused(server.address)
        while isinstance(frame := await call.read(), pb.GetFrame):  # EOF ends the loop
            frames.append(frame)
        assert await call.code() == grpc.StatusCode.OK
        assert [f.index for f in frames] == list(range(len(keys)))
        assert [f.data for f in frames] == blobs


async def _until_refused(address: str) -> None:
    """Start RPCs on fresh connections until one is refused (UNAVAILABLE).

    Takes a few ms on an idle machine; 30 s is a hang guard for a loaded one, inside the
    server's 10 s grace plus its start of the shutdown.
    """
    deadline = time.monotonic() + 30
    while True:
        async with grpc.aio.insecure_channel(address) as fresh:
            try:
                await cache_pb2_grpc.KVCacheStub(fresh).Lookup(pb.LookupRequest(), timeout=5)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    return
        assert time.monotonic() < deadline, "the listener is still open after SIGTERM"
        await asyncio.sleep(0.02)


def test_sigterm_finishes_an_in_flight_get_and_exits_0(server_process: ServerProcess) -> None:
    asyncio.run(_get_across_sigterm(server_process))
    assert server_process.wait(timeout=60) == 0  # a hang guard: ~1 s idle
    log = "".join(server_process.lines)
    assert "shutting down: finishing in-flight requests (grace 10.0s)" in log
    assert log.rstrip().endswith("stopped")


def test_sigint_on_an_idle_server_exits_0(server_process: ServerProcess) -> None:
    server_process.proc.send_signal(signal.SIGINT)
    assert server_process.wait(timeout=60) == 0  # a hang guard: ~1 s idle


def test_console_script_help_lists_every_option() -> None:
    script = Path(sys.executable).parent / "nopecache-server"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for f in fields(ServerConfig):
        assert flag_name(f.name) in result.stdout, f.name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-block-bytes", "lots"], "nopecache-server: --max-block-bytes: cannot parse 'lots'"),
        (["--tier", "cpu://?capacity=1GiB&pinned=no&colour=red", "--port", "0"], "colour"),
    ],
)
def test_bad_configuration_exits_2_naming_the_option(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nopecache.cache_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
