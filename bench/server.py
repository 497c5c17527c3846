"""Cache-server data path vs its transport ceiling and vs redis-py, measured in one run.

Processes (all on 127.0.0.1)::

    this process (one client) ──gRPC──> nopecache server   (python -m nopecache.cache_server,
                              │                              CPU tier, no metrics)
                              ├─gRPC──> bare gRPC server    (this file with --raw-server:
                              │                              streams the same bytes, no cache)
                              └─RESP──> redis-server         (started here on a free port)

Per block size (1 MiB and 8 MiB blocks, same blobs everywhere):

* put:  one Put stream of every block (frames built on the fly), reply awaited.
* get:  one Get stream of every key; the client touches each frame's bytes (len) only.
* grpc_raw: the bare server streams the same blobs, in the same frame sizes, from
  preallocated ``bytes`` with identity serializers: what gRPC itself can move.
* redis: redis-py GET of every key, sync (one by one) and asyncio (8 in flight); the
  faster counts. SET likewise for put.

Lookup: 4096 keys (a third of them stored) per call, latency p50/p99 over many calls.

Throughputs are GB/s (10^9 bytes per second) of block bytes; each is the best of
``--reps`` passes. Last line::

    RESULT put_gbps= get_gbps= grpc_raw_gbps= redis_get_gbps= get_vs_grpc_raw= get_vs_redis=
           lookup4096_p99_ms= (then the same per size with _1m / _8m suffixes)

The unsuffixed throughputs are over both sizes together (total bytes / total time), the
ratios are the worse of the two sizes.

The server's limits are set as a user would for this data: ``max_request_bytes`` holds
the largest Put (every block of one size), a client's in-flight share holds that request
and the total holds the share (none below its default). ``--quick`` is a smoke run (2 MiB
per size, one pass, 20 Lookups) with the same RESULT keys.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import numpy as np
import redis
import redis.asyncio as aredis
import xxhash

from nopecache.cache_server.config import FRAME_OVERHEAD_BYTES, ServerConfig
from nopecache.cache_server.main import tune_malloc
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import StoredForm, build_block
from nopecache.proto.frames import encode_put_frame
from tests.support.ready import ProcessExited, last_lines, wait_serving

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "put_gbps",
    "get_gbps",
    "grpc_raw_gbps",
    "redis_get_gbps",
    "redis_set_gbps",
    "get_vs_grpc_raw",
    "get_vs_redis",
    "put_vs_redis",
    "get_gbps_1m",
    "put_gbps_1m",
    "grpc_raw_gbps_1m",
    "redis_get_gbps_1m",
    "get_gbps_8m",
    "put_gbps_8m",
    "grpc_raw_gbps_8m",
    "redis_get_gbps_8m",
    "lookup4096_p50_ms",
    "lookup4096_p99_ms",
)

MiB = 1024 * 1024
RAW_METHOD = "/nopecache.bench.Raw/Stream"
LOOKUP_KEYS = 4096
# Servers are ready within seconds on an idle machine; an exit is reported at once, so
# this bound only guards against a hang, generous for a loaded machine.
START_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Wire:
    """Message limit shared by every process of the bench (the server's default unless
    --max-message-bytes says otherwise); frames carry that minus the frame overhead."""

    max_message: int = ServerConfig().max_message_bytes

    @property
    def frame(self) -> int:
        """Block bytes per frame."""
        return self.max_message - FRAME_OVERHEAD_BYTES

    @property
    def options(self) -> list[tuple[str, int]]:
        """gRPC channel/server options (message size limits, as the server sets them)."""
        return replace(ServerConfig(), max_message_bytes=self.max_message).grpc_options


def make_blobs(block_bytes: int, count: int, tag: int) -> list[tuple[bytes, bytes]]:
    """``count`` valid blocks of about ``block_bytes`` each (key, blob), deterministic."""
    head_dim, layers, kv_heads = 128, 4, 8
    per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, float16
    tokens = block_bytes // per_token
    rng = np.random.default_rng(tag)
    out = []
    for i in range(count):
        key = xxhash.xxh3_128_digest(f"{tag}:{i}".encode())
        payload = rng.integers(0, 256, size=tokens * per_token, dtype=np.uint8).tobytes()
        blob = build_block(
            key=key,
            fingerprint=b"bench-model",
            form=StoredForm.NOPE,
            dtype="float16",
            shape=(layers, tokens, kv_heads, head_dim),
            v_head_dim=head_dim,
            token_ids=range(tokens),
            payload=payload,
        )
        out.append((key, blob))
    return out


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- the bare gRPC server (child process) ---------------------------------------------------
async def run_raw_server(wire: Wire, counts: dict[int, int]) -> None:
    """Serve RAW_METHOD: request b"<size>" -> the blobs of that size, framed like Get."""
    frames = {}
    for size, count in counts.items():
        blobs = [blob for _, blob in make_blobs(size, count, tag=size)]
        # Split once, up front: the ceiling should not pay for slicing.
        step = wire.frame
        frames[str(size).encode()] = [
            b[i : i + step] for b in blobs for i in range(0, len(b), step)
        ]

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for frame in frames[request]:
            yield frame

    server = grpc.aio.server(options=wire.options)
    handler = grpc.unary_stream_rpc_method_handler(stream)
    service, method = RAW_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(service, {method: handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


# -- processes -------------------------------------------------------------------------------
@dataclass
class Child:
    """A child process and the port it serves on."""

    proc: subprocess.Popen[bytes]
    port: int

    def stop(self) -> None:
        """Terminate and reap."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_limits(request_bytes: int) -> list[str]:
    """The server's memory bounds for a bench whose largest Put stream carries
    ``request_bytes`` of blocks, as a user would set them: that Put fits one request and
    one client's in-flight share, and the share fits the total (each never below the
    server's default)."""
    defaults = ServerConfig()
    request = max(defaults.max_request_bytes, request_bytes)
    per_client = max(defaults.max_inflight_bytes_per_client, request)
    total = max(defaults.max_inflight_bytes, per_client)
    return [
        *("--max-request-bytes", str(request)),
        *("--max-inflight-bytes-per-client", str(per_client)),
        *("--max-inflight-bytes", str(total)),
    ]


def start_cache_server(wire: Wire, capacity: str, request_bytes: int, workdir: Path) -> Child:
    """The nopecache server on a free port, once it serves (ProcessExited at once if it
    exits first, with its exit code and last log lines)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "nopecache.cache_server",
        *("--host", "127.0.0.1", "--port", str(port)),
        "--no-metrics",
        "--tier",
        f"cpu://?capacity={capacity}&pinned=no",
        "--max-message-bytes",
        str(wire.max_message),
        *server_limits(request_bytes),
        "--log-level",
        "WARNING",
    ]
    log = workdir / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    child = Child(proc, port)
    try:
        wait_serving(proc, f"127.0.0.1:{port}", log, timeout_s=START_TIMEOUT_S)
    except BaseException:
        child.stop()
        raise
    return child


def start_raw_server(wire: Wire, counts: dict[int, int]) -> Child:
    """This file in --raw-server mode; it prints its port when ready (an exit before that
    is reported at once: its stdout closes)."""
    cmd = [sys.executable, __file__, "--raw-server", f"--max-message-bytes={wire.max_message}"]
    cmd += [f"--blocks={size}:{count}" for size, count in counts.items()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip():
        raise ProcessExited("the bare gRPC server", proc.wait(), "(its stderr is above)")
    return Child(proc, int(line))


def start_redis(workdir: Path) -> Child:
    """A redis-server with no persistence on a free port, once it answers PING."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server not found: run `make redis-server`")
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "no", "--dir", str(workdir), "--proto-max-bulk-len", "64mb"]
    log = workdir / "redis.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise ProcessExited(f"redis-server on port {port}", proc.returncode, last_lines(log))
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server on port {port} did not answer PING") from None
            time.sleep(0.02)
    client.close()
    return Child(proc, port)


async def wait_ready(channel: grpc.aio.Channel) -> None:
    """Wait until the channel connects (the server process finished starting)."""
    await asyncio.wait_for(channel.channel_ready(), timeout=60)


# -- measurements ----------------------------------------------------------------------------
def best_gbps(nbytes: int, seconds: list[float]) -> float:
    """GB/s of the fastest pass."""
    return nbytes / min(seconds) / 1e9


def frame_data_len(raw: bytes) -> int:
    """Length of a GetFrame's data field, parsing the head of the wire bytes only."""
    pos = 0
    while pos < len(raw):
        tag = raw[pos]
        pos += 1
        if tag == 0x22:  # data: length-delimited
            length = shift = 0
            while True:
                byte = raw[pos]
                pos += 1
                length |= (byte & 0x7F) << shift
                if byte < 0x80:
                    return length
                shift += 7
        # index / tier / total_size: a varint; skip it.
        while raw[pos] & 0x80:
            pos += 1
        pos += 1
        if tag not in (0x08, 0x10, 0x18):
            break
    return 0


async def measure_cache(
    wire: Wire, channel: grpc.aio.Channel, blocks: list[tuple[bytes, bytes]], reps: int
) -> tuple[list[float], list[float], list[float]]:
    """Seconds per pass for Put (into an empty server), Get of all blocks with the frame
    codec, and Get of all blocks through the generated protobuf classes."""
    stub = cache_pb2_grpc.KVCacheStub(channel)
    put_call = channel.stream_unary(
        "/nopecache.v1.KVCache/Put",
        request_serializer=None,
        response_deserializer=pb.PutReply.FromString,
    )
    get_call = channel.unary_stream(
        "/nopecache.v1.KVCache/Get",
        request_serializer=pb.GetRequest.SerializeToString,
        response_deserializer=None,
    )
    keys = b"".join(k for k, _ in blocks)
    total = sum(len(b) for _, b in blocks)

    async def frames() -> AsyncIterator[bytes]:
        for key, blob in blocks:
            view = memoryview(blob)
            yield encode_put_frame(key, len(blob), view[: wire.frame])
            for i in range(wire.frame, len(blob), wire.frame):
                yield encode_put_frame(b"", 0, view[i : i + wire.frame])

    put_s, get_s, get_pb_s = [], [], []
    for _ in range(reps):
        await stub.Delete(pb.DeleteRequest(keys=keys))
        start = time.perf_counter()
        reply = await put_call(frames())
        put_s.append(time.perf_counter() - start)
        assert all(r.outcome == pb.PUT_OUTCOME_STORED for r in reply.results), reply.results[:1]
        start = time.perf_counter()
        received = 0
        async for raw in get_call(pb.GetRequest(keys=keys)):
            received += frame_data_len(raw)
        get_s.append(time.perf_counter() - start)
        assert received == total, (received, total)
        start = time.perf_counter()
        received = 0
        async for frame in stub.Get(pb.GetRequest(keys=keys)):
            received += len(frame.data)
        get_pb_s.append(time.perf_counter() - start)
        assert received == total, (received, total)
    # Bit-exact once, untimed.
    got: dict[int, list[bytes]] = {}
    async for frame in stub.Get(pb.GetRequest(keys=keys)):
        got.setdefault(frame.index, []).append(frame.data)
    assert [b"".join(got[i]) for i in range(len(blocks))] == [b for _, b in blocks]
    return put_s, get_s, get_pb_s


async def measure_raw(channel: grpc.aio.Channel, size: int, total: int, reps: int) -> list[float]:
    """Seconds per pass for the bare server to stream the blobs of ``size``."""
    call = channel.unary_stream(RAW_METHOD, request_serializer=None, response_deserializer=None)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        received = 0
        async for frame in call(str(size).encode()):
            received += len(frame)
        seconds.append(time.perf_counter() - start)
        assert received == total, (received, total)
    return seconds


def measure_redis_sync(
    port: int, blocks: list[tuple[bytes, bytes]], reps: int
) -> tuple[list[float], list[float]]:
    """Seconds per pass for sync SET of every block, and GET of every key."""
    client = redis.Redis(port=port)
    set_s, get_s = [], []
    for _ in range(reps):
        client.flushall()
        start = time.perf_counter()
        for key, blob in blocks:
            client.set(key, blob)
        set_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for key, blob in blocks:
            assert len(client.get(key)) == len(blob)  # type: ignore[arg-type]
        get_s.append(time.perf_counter() - start)
    client.close()
    return set_s, get_s


async def measure_redis_async(
    port: int, blocks: list[tuple[bytes, bytes]], reps: int, window: int = 8
) -> tuple[list[float], list[float]]:
    """Seconds per pass for asyncio SET/GET with ``window`` commands in flight."""
    client = aredis.Redis(port=port, max_connections=window)
    set_s, get_s = [], []
    for _ in range(reps):
        await client.flushall()
        start = time.perf_counter()
        for i in range(0, len(blocks), window):
            await asyncio.gather(*(client.set(k, b) for k, b in blocks[i : i + window]))
        set_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(0, len(blocks), window):
            values = await asyncio.gather(*(client.get(k) for k, _ in blocks[i : i + window]))
            assert all(v is not None for v in values)
        get_s.append(time.perf_counter() - start)
    await client.aclose()
    return set_s, get_s


async def measure_lookup(
    stub: cache_pb2_grpc.KVCacheAsyncStub, stored: list[bytes], calls: int
) -> list[float]:
    """Milliseconds per Lookup of LOOKUP_KEYS keys (a third stored, the rest absent)."""
    rng = np.random.default_rng(7)
    present = [stored[i] for i in rng.integers(0, len(stored), LOOKUP_KEYS // 3)]
    absent = [rng.bytes(16) for _ in range(LOOKUP_KEYS - len(present))]
    keys = present + absent
    packed = b"".join(keys[i] for i in rng.permutation(len(keys)))
    request = pb.LookupRequest(keys=packed)
    reply = await stub.Lookup(request)
    assert len(reply.tiers) == LOOKUP_KEYS and reply.tiers.count(0) == len(absent)
    for _ in range(20):
        await stub.Lookup(request)
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        await stub.Lookup(request)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class SizeResult:
    """Best seconds per pass of each contender for one block size."""

    label: str
    total: int
    put_s: float
    get_s: float
    raw_s: float
    redis_set_s: float
    redis_get_s: float


@dataclass
class Servers:
    """The three servers of the bench."""

    cache: Child
    raw: Child
    redis: Child


async def measure_size(
    wire: Wire, servers: Servers, size: int, blocks: list[tuple[bytes, bytes]], reps: int
) -> SizeResult:
    """Every contender on the blocks of one size, passes interleaved (so that load from
    other processes hits each alike); prints a line and returns the best of each."""
    total = sum(len(b) for _, b in blocks)
    t: dict[str, list[float]] = {}

    def add(name: str, seconds: list[float]) -> None:
        t.setdefault(name, []).extend(seconds)

    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{servers.cache.port}", options=wire.options) as ch,
        grpc.aio.insecure_channel(f"127.0.0.1:{servers.raw.port}", options=wire.options) as rch,
    ):
        await wait_ready(ch)
        await wait_ready(rch)
        for _ in range(reps):
            add("raw", await measure_raw(rch, size, total, 1))
            put_s, get_s, get_pb_s = await measure_cache(wire, ch, blocks, 1)
            add("put", put_s)
            add("get", get_s)
            add("get_pb", get_pb_s)
            sync_set, sync_get = measure_redis_sync(servers.redis.port, blocks, 1)
            add("sync_set", sync_set)
            add("sync_get", sync_get)
            async_set, async_get = await measure_redis_async(servers.redis.port, blocks, 1)
            add("async_set", async_set)
            add("async_get", async_get)
    label = f"{size // MiB}m"
    g = {name: best_gbps(total, seconds) for name, seconds in t.items()}
    print(
        f"{label}: {len(blocks)} blocks of {len(blocks[0][1]) / MiB:.2f} MiB | put {g['put']:.3f}"
        f" get {g['get']:.3f} grpc_raw {g['raw']:.3f} get_via_protobuf_client "
        f"{g['get_pb']:.3f} | redis sync set/get {g['sync_set']:.3f}/{g['sync_get']:.3f} "
        f"asyncio set/get {g['async_set']:.3f}/{g['async_get']:.3f} GB/s",
        flush=True,
    )
    return SizeResult(
        label=label,
        total=total,
        put_s=min(t["put"]),
        get_s=min(t["get"]),
        raw_s=min(t["raw"]),
        redis_set_s=min(t["sync_set"] + t["async_set"]),
        redis_get_s=min(t["sync_get"] + t["async_get"]),
    )


async def run_bench(wire: Wire, args: argparse.Namespace) -> None:
    """Start the three servers, measure each size and Lookup, print the RESULT line."""
    sizes = [MiB, 8 * MiB]
    counts = {s: max(2, args.mib_per_size * MiB // s) for s in sizes}
    print(
        f"building blocks: {args.mib_per_size} MiB per size, frames of {wire.frame} bytes",
        flush=True,
    )
    data = {s: make_blobs(s, counts[s], tag=s) for s in sizes}
    # The largest Put stream of the bench: every block of one size.
    request_bytes = max(sum(len(blob) for _, blob in data[s]) for s in sizes)
    workdir = Path(tempfile.mkdtemp(prefix="nopecache-bench-"))
    children: list[Child] = []
    try:
        # Room for every block four times over, and for the largest block whatever the size.
        capacity = f"{max(4 * args.mib_per_size, 64)}MiB"
        children.append(start_cache_server(wire, capacity, request_bytes, workdir))
        children.append(start_raw_server(wire, counts))
        children.append(start_redis(workdir))
        servers = Servers(*children)
        results = [await measure_size(wire, servers, s, data[s], args.reps) for s in sizes]
        address = f"127.0.0.1:{servers.cache.port}"
        async with grpc.aio.insecure_channel(address, options=wire.options) as ch:
            stored = [k for s in sizes for k, _ in data[s]]
            lookup_ms = await measure_lookup(cache_pb2_grpc.KVCacheStub(ch), stored, args.lookups)
    finally:
        for child in children:
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    p50, p99 = percentile(lookup_ms, 0.5), percentile(lookup_ms, 0.99)
    mean = statistics.mean(lookup_ms)
    print(f"lookup {LOOKUP_KEYS} keys: p50 {p50:.3f} ms p99 {p99:.3f} ms (mean {mean:.3f})")
    fields = summarize(results)
    fields["lookup4096_p50_ms"] = p50
    fields["lookup4096_p99_ms"] = p99
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in fields.items()))


def summarize(results: list[SizeResult]) -> dict[str, float]:
    """The RESULT fields: totals over sizes, worst-size ratios, then per-size values."""
    total = sum(r.total for r in results)

    def gbps(pick: Callable[[SizeResult], float]) -> float:
        return total / sum(pick(r) for r in results) / 1e9

    out = {
        "put_gbps": gbps(lambda r: r.put_s),
        "get_gbps": gbps(lambda r: r.get_s),
        "grpc_raw_gbps": gbps(lambda r: r.raw_s),
        "redis_get_gbps": gbps(lambda r: r.redis_get_s),
        "redis_set_gbps": gbps(lambda r: r.redis_set_s),
        "get_vs_grpc_raw": min(r.raw_s / r.get_s for r in results),
        "get_vs_redis": min(r.redis_get_s / r.get_s for r in results),
        "put_vs_redis": min(r.redis_set_s / r.put_s for r in results),
    }
    for r in results:
        out[f"get_gbps_{r.label}"] = r.total / r.get_s / 1e9
        out[f"put_gbps_{r.label}"] = r.total / r.put_s / 1e9
        out[f"grpc_raw_gbps_{r.label}"] = r.total / r.raw_s / 1e9
        out[f"redis_get_gbps_{r.label}"] = r.total / r.redis_get_s / 1e9
    return out


def main() -> None:
    """Command line: the bench, or (internally) the bare gRPC server."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--mib-per-size", type=int, default=128, help="MiB of blocks per block size"
    )
    parser.add_argument("--reps", type=int, default=7, help="passes per measurement (best counts)")
    parser.add_argument("--lookups", type=int, default=300, help="Lookup calls timed")
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=Wire().max_message,
        help="gRPC message limit for every process (frames are this minus the frame overhead)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (what make test runs): 2 MiB per size, one pass, 20 lookups",
    )
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.mib_per_size, args.reps, args.lookups = 2, 1, 20
    wire = Wire(args.max_message_bytes)
    # The same allocator setting the server runs with, in every process of the bench, so
    # that the baselines are not slowed by page faults the server avoids.
    tune_malloc()
    if args.raw_server:
        pairs = (b.split(":") for b in args.blocks)
        asyncio.run(run_raw_server(wire, {int(size): int(count) for size, count in pairs}))
        return
    asyncio.run(run_bench(wire, args))


if __name__ == "__main__":
    main()
