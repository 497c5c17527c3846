"""An honest slow client for bench/load.py's hostile phase (issue 36, "progress, not
silence"): a Put of a several-MiB block from a reader at a tenth of the rate the server
can take, which the server's minimum-rate cuts must let through under the hostile mix.

    measure_put_rate   the server's Put rate for a block of ``SLOW_PUT_BYTES``, unloaded
                       (before the load phase): the best of ``RATE_REPS`` timed Puts
    slow_put_rate      a tenth of it, never below the server's ``min_stream_rate`` default
                       (a client at that floor is still honest by the server's own rule)
    honest_slow_put    in the hostile phase: one gRPC Put of the block, its frames sent no
                       faster than that rate (one try: no retry hides a cut), then a Get
                       that must return it bit for bit (again while the server answers
                       "retry later", counted in the note); True when both hold

The client is the good tenant from 127.0.0.1 (an honest source, through the proxy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from nopecache.cache_server.inflight import DEFAULT_RULE
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc

MiB = 1024 * 1024
SLOW_PUT_BYTES = 8 * MiB
SLOW_FRAME = 128 * 1024  # the reader's chunks: the throttle is smooth at this grain
RATE_REPS = 3
SLOWDOWN = 10
# The read-back is tried again on these (the server's "retry later"), for this long: the
# hostile mix can keep the in-flight budget full for longer than a Get waits for it.
RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
READ_BACK_S = 60.0
# The Put's own deadline beyond its paced duration: a hang guard for a loaded machine.
SLACK_S = 120.0


def slow_put_rate(server_rate: float) -> float:
    """A tenth of ``server_rate`` (bytes/s), never below the server's minimum rate."""
    return max(server_rate / SLOWDOWN, float(DEFAULT_RULE.min_rate))


async def _paced(k: bytes, blob: bytes, rate: float | None) -> AsyncIterator[pb.PutFrame]:
    """The block's frames; with ``rate``, none sent before its bytes are due at it."""
    started = time.monotonic()
    for offset in range(0, len(blob), SLOW_FRAME):
        if rate is not None:
            await asyncio.sleep(max(0.0, started + offset / rate - time.monotonic()))
        data = blob[offset : offset + SLOW_FRAME]
        if offset == 0:
            yield pb.PutFrame(key=k, total_size=len(blob), data=data)
        else:
            yield pb.PutFrame(data=data)


async def _put(
    stub: cache_pb2_grpc.KVCacheAsyncStub, k: bytes, blob: bytes, rate: float | None
) -> bool:
    paced_s = len(blob) / rate if rate is not None else 0.0
    reply = await stub.Put(_paced(k, blob, rate), timeout=paced_s + SLACK_S)
    return bool(reply.results[0].outcome == pb.PUT_OUTCOME_STORED)


async def measure_put_rate(
    stub: cache_pb2_grpc.KVCacheAsyncStub, blocks: list[tuple[bytes, bytes]]
) -> float:
    """Bytes per second of the fastest unpaced Put of ``blocks`` (key, block pairs)."""
    return max([await _timed_put(stub, k, blob) for k, blob in blocks])


async def _timed_put(stub: cache_pb2_grpc.KVCacheAsyncStub, k: bytes, blob: bytes) -> float:
    started = time.perf_counter()
    if not await _put(stub, k, blob, None):
        raise RuntimeError("the unloaded Put that measures the server's rate was not stored")
    return len(blob) / (time.perf_counter() - started)


async def _read_back(stub: cache_pb2_grpc.KVCacheAsyncStub, k: bytes) -> bytes:
    """The stored block of ``k`` (empty when missing)."""
    parts: list[bytes] = []
    async for frame in stub.Get(pb.GetRequest(keys=k), timeout=SLACK_S):
        if frame.tier or parts:
            parts.append(frame.data)
    return b"".join(parts)


async def honest_slow_put(
    stub: cache_pb2_grpc.KVCacheAsyncStub, k: bytes, blob: bytes, rate: float
) -> tuple[bool, str]:
    """Put ``blob`` at ``rate`` bytes/s (one try), then read it back (again while the
    server answers "retry later": ``RETRYABLE``, up to ``READ_BACK_S``); (ok, what
    happened)."""
    started = time.monotonic()
    try:
        stored = await _put(stub, k, blob, rate)
    except grpc.aio.AioRpcError as e:
        return False, f"honest slow put: Put failed after {_since(started)}: {_why(e)}"
    if not stored:
        return False, "honest slow put: Put answered, block not stored"
    took = time.monotonic() - started
    refused: list[str] = []
    give_up = time.monotonic() + READ_BACK_S
    while True:
        try:
            got = await _read_back(stub, k)
            break
        except grpc.aio.AioRpcError as e:
            if e.code() not in RETRYABLE or time.monotonic() > give_up:
                return False, (
                    f"honest slow put: stored in {took:.1f} s; Get failed after "
                    f"{_since(started)} ({len(refused)} refused before): {_why(e)}"
                )
            refused.append(e.code().name)
            await asyncio.sleep(0.5)
    head = (
        f"honest slow put: {len(blob) // MiB} MiB at {rate / MiB:.2f} MiB/s stored in "
        f"{took:.1f} s; read back after {len(refused)} refused Gets "
        f"({', '.join(sorted(set(refused))) or 'none'})"
    )
    if got != blob:
        return False, f"{head}: {len(got)} bytes, not the block's {len(blob)} exact"
    return True, f"{head}: exact"


def _since(started: float) -> str:
    return f"{time.monotonic() - started:.1f} s"


def _why(e: grpc.aio.AioRpcError) -> str:
    return f"{e.code().name} {e.details()} ({e.debug_error_string()})"
