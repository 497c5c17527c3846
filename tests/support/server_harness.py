"""The gRPC cache server in process on a loopback port, for tests: a harness (server plus a
stub on its own channel), the ``harness`` fixture, small limits and block builders.

Registered in tests/conftest.py (``pytest_plugins``), so ``harness`` is a fixture in every
test module; the rest is imported.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence

import grpc
import pytest_asyncio
import xxhash

from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.main import RunningServer, start_server
from nopecache.proto import cache_pb2 as pb
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import StoredForm, build_block

STORED = pb.PUT_OUTCOME_STORED
PRESENT = pb.PUT_OUTCOME_ALREADY_PRESENT
REJECTED = pb.PUT_OUTCOME_REJECTED

# Small limits so that framing and limit paths run with tiny blocks.
SMALL = ServerConfig(
    port=0,
    metrics=False,
    tiers=("cpu://?capacity=4MiB&page=4KiB&pinned=no",),
    max_message_bytes=64 * 1024,
    max_block_bytes=1024 * 1024,
    max_request_bytes=2 * 1024 * 1024,
    max_keys_per_request=64,
)


def key_of(i: int) -> bytes:
    """A deterministic 16-byte key."""
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def make_block(key: bytes, tokens: int = 4, head_dim: int = 8, layers: int = 1) -> bytes:
    """A valid float16 NOPE block for ``key`` whose payload depends on the key."""
    payload_len = 2 * layers * tokens * head_dim * 2
    seed = bytearray(key * (payload_len // 16 + 1))
    return build_block(
        key=key,
        fingerprint=b"test-model",
        form=StoredForm.NOPE,
        dtype="float16",
        shape=(layers, tokens, 1, head_dim),
        v_head_dim=head_dim,
        token_ids=list(range(tokens)),
        payload=bytes(seed[:payload_len]),
    )


def frames_of(blocks: Iterable[tuple[bytes, bytes]], frame_bytes: int) -> list[pb.PutFrame]:
    """The PutFrames of ``blocks`` (key, blob), each split into frames of ``frame_bytes``."""
    out = []
    for key, blob in blocks:
        out.append(pb.PutFrame(key=key, total_size=len(blob), data=blob[:frame_bytes]))
        out.extend(
            pb.PutFrame(data=blob[i : i + frame_bytes])
            for i in range(frame_bytes, len(blob), frame_bytes)
        )
    return out


async def stream(frames: Sequence[pb.PutFrame]) -> AsyncIterator[pb.PutFrame]:
    """An async request iterator over ``frames``."""
    for f in frames:
        yield f


async def put(
    stub: cache_pb2_grpc.KVCacheAsyncStub, blocks: Iterable[tuple[bytes, bytes]], frame_bytes: int
) -> list[pb.PutResult]:
    """Put ``blocks`` in frames of ``frame_bytes``; the per-block results."""
    reply = await stub.Put(stream(frames_of(blocks, frame_bytes)))
    return list(reply.results)


async def get(
    stub: cache_pb2_grpc.KVCacheAsyncStub, keys: Sequence[bytes]
) -> tuple[list[bytes | None], list[pb.GetFrame]]:
    """Get ``keys``: reassembled blobs (None for a miss) and the raw frames."""
    frames = [f async for f in stub.Get(pb.GetRequest(keys=b"".join(keys)))]
    blobs: list[bytes | None] = [None] * len(keys)
    parts: dict[int, list[bytes]] = {}
    for f in frames:
        if f.tier or f.index in parts:
            parts.setdefault(f.index, []).append(f.data)
    for index, chunks in parts.items():
        blobs[index] = b"".join(chunks)
    return blobs, frames


async def digest(stub: cache_pb2_grpc.KVCacheAsyncStub, keys: Sequence[bytes]) -> tuple[bytes, str]:
    """A checksum of every stored blob among ``keys`` plus the tiers' used bytes/entries."""
    blobs, _ = await get(stub, keys)
    h = xxhash.xxh3_128()
    for key, blob in zip(keys, blobs, strict=True):
        h.update(key + (b"\x01" + blob if blob is not None else b"\x00"))
    stats = await stub.Stats(pb.StatsRequest())
    return h.digest(), ";".join(f"{t.name}:{t.used_bytes}:{t.entries}" for t in stats.tiers)


class Harness:
    """A running in-process server with a client stub on its own channel."""

    def __init__(self, running: RunningServer, channel: grpc.aio.Channel) -> None:
        self.running = running
        self.channel = channel
        self.stub = cache_pb2_grpc.KVCacheStub(channel)
        self.config = running.config

    @property
    def frame_bytes(self) -> int:
        """The largest frame data the server accepts."""
        return self.config.max_frame_data_bytes

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One metric sample of the server (0 when absent)."""
        value = self.running.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0


@pytest_asyncio.fixture
async def harness() -> AsyncIterator[Harness]:
    """A server with the SMALL limits, stopped after the test."""
    async with serving(SMALL) as h:
        yield h


class serving:
    """Start a server for ``config`` and a channel to it; stop both on exit."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    async def __aenter__(self) -> Harness:
        self.running = await start_server(self.config, monitor_interval_s=0.2)
        self.channel = grpc.aio.insecure_channel(
            self.running.address, options=self.config.grpc_options
        )
        return Harness(self.running, self.channel)

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close(None)
        await self.running.stop(grace_s=1.0)
