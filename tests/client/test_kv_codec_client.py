"""Compact stored forms through the real client and real server processes on loopback:
the codec keys blocks apart, the server stores and serves the compact bytes as they are,
and the fetch path hands the engine its own dtype back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
import torch

from nopecache.client import ClientConfig, ModelFingerprint, content_chunks
from nopecache.client.chunking import FixedChunker
from nopecache.client.cuda_arena import DeviceBlob, decode_device_block
from nopecache.client.keys import prefix_chunks
from nopecache.proto import cache_pb2_grpc
from nopecache.proto.block import StoredForm, decode_block, encode_block, validate
from nopecache.proto.kv_codec import E4M3_MAX
from tests.support.client_harness import (
    CHUNKER,
    PREFIX_BLOCK,
    client,
    config,
    fingerprint,
    kv,
    prompt,
)
from tests.support.server_harness import get
from tests.support.server_procs import CacheServerProc, start_cache_servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[CacheServerProc]]:
    """One server shared by the tests (each test has its own namespace)."""
    started = start_cache_servers(1, tmp_path_factory.mktemp("codec-servers"))
    yield started
    for server in started:
        server.kill()


def test_every_codec_has_its_own_fingerprint_and_keys() -> None:
    base = fingerprint(StoredForm.ROPE, torch.bfloat16)
    fps = [base, replace(base, codec="fp8"), replace(base, codec="k16v8")]
    assert len({fp.to_bytes() for fp in fps}) == 3
    assert [ModelFingerprint.from_bytes(fp.to_bytes()) for fp in fps] == fps
    assert base.to_bytes() == replace(base, codec="none").to_bytes()  # raw bytes unchanged
    tokens = prompt(40, seed=1).numpy()
    spans = FixedChunker(8).split(tokens)
    prefix = [{c.key for c in prefix_chunks(fp, "ns", tokens, spans)} for fp in fps]
    content = [
        {c.key for c in content_chunks(fp, "ns", tokens, CHUNKER.split(tokens))} for fp in fps
    ]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not prefix[a] & prefix[b] and not content[a] & content[b]


def test_the_url_names_the_codec_and_the_client_keys_under_it() -> None:
    cfg = ClientConfig.from_url("nopecache://h:1?kv_codec=k16v8")
    assert cfg.kv_codec == "k16v8"
    with client(cfg, StoredForm.ROPE, dtype=torch.bfloat16) as c:
        assert c.core.fingerprint.codec == "k16v8" and c.core.pi_fingerprint.codec == "k16v8"


def _bound(x: torch.Tensor) -> torch.Tensor:
    """fp8 rounding of ``x`` with per-(layer, head) scales, plus bf16's of the result."""
    scale = x.float().abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX
    return torch.maximum(x.float().abs() * 2**-4, scale * 2**-10) * 1.01 + x.float().abs() * 2**-7


@pytest.mark.parametrize("codec", ["fp8", "k16v8"])
def test_compact_blocks_round_trip_through_a_server_and_stay_apart_from_raw_ones(
    servers: list[CacheServerProc], codec: str
) -> None:
    tokens = prompt(100, seed=2)
    k, v = kv(100, seed=2, dtype=torch.bfloat16)
    compact_cfg = config(servers, f"codec-{codec}", kv_codec=codec)
    with client(compact_cfg, StoredForm.ROPE, dtype=torch.bfloat16) as c:
        report = c.store(tokens, (k, v), 0, form="rope", position_independent=False)
        assert report.failed == 0 and report.stored == 6  # 96 tokens in blocks of 16
        plan = c.lookup(tokens, allow_position_independent=False)
        assert plan.prefix_end == 96
        result = c.fetch(plan, tokens)
    assert result.failed == () and result.prefix_tokens == 96
    assert result.k is not None and result.v is not None
    assert result.k.dtype == torch.bfloat16  # the engine's dtype, decoded on placement
    got_k, got_v = result.k[:, :96].float(), result.v[:, :96].float()
    assert bool(((got_v - v[:, :96].float()).abs() <= _bound(v[:, :96])).all())
    assert not torch.equal(result.v[:, :96], v[:, :96])  # approximate, not exact
    if codec == "k16v8":
        assert torch.equal(result.k[:, :96], k[:, :96])
    else:
        assert bool(((got_k - k[:, :96].float()).abs() <= _bound(k[:, :96])).all())
    # The same namespace without the codec finds none of them: other fingerprint, other keys.
    with client(config(servers, f"codec-{codec}"), StoredForm.ROPE, dtype=torch.bfloat16) as raw:
        assert raw.lookup(tokens).reused_tokens == 0


def test_the_server_holds_and_serves_the_compact_bytes_as_the_client_made_them(
    servers: list[CacheServerProc],
) -> None:
    tokens = prompt(16, seed=3)
    k, v = kv(16, seed=3, dtype=torch.bfloat16)
    with client(config(servers, "codec-bytes", kv_codec="fp8"), StoredForm.ROPE) as c:
        c.store(tokens, (k.float(), v.float()), 0, form="rope", position_independent=False)
        plan = c.lookup(tokens, allow_position_independent=False)
        fp = c.core.fingerprint
    assert plan.prefix_end == 16
    keys = [
        c_.key.value
        for c_ in prefix_chunks(
            fp, "codec-bytes", tokens.numpy(), FixedChunker(PREFIX_BLOCK).split(tokens.numpy())
        )
    ]

    async def fetch_raw() -> list[bytes | None]:
        async with grpc.aio.insecure_channel(servers[0].address) as channel:
            blobs, _ = await get(cache_pb2_grpc.KVCacheStub(channel), keys)
            return blobs

    blobs = asyncio.run(fetch_raw())
    assert all(b is not None for b in blobs)
    for blob in blobs:
        assert blob is not None
        header = validate(blob)  # what the server checked on Put: the compact bytes
        assert header.codec == "fp8" and header.dtype == "float32" and header.version == 2
        # 16 tokens x 2 layers x 2 heads x (8 + 8) fp8 bytes + 2 x 2 x 2 fp32 scales
        assert header.payload_nbytes == 16 * 2 * 2 * 16 + 2 * 2 * 2 * 4
        assert decode_block(blob).k.dtype == torch.float32


@pytest.mark.parametrize("codec", ["fp8", "k16v8"])
def test_the_device_decode_path_gives_what_decode_block_gives(codec: str) -> None:
    # decode_device_block reads the header on the host and decodes the payload where it
    # lies (a GPU pool in production; CPU tensors here, in two runs, as a pool lends them).
    k, v = kv(16, seed=4, dtype=torch.bfloat16)
    b = encode_block(
        key=b"k" * 16,
        fingerprint=b"fp",
        form=StoredForm.NOPE,
        k=k,
        v=v,
        token_ids=range(16),
        codec=codec,
    )
    raw = torch.frombuffer(bytearray(b), dtype=torch.uint8)
    got = decode_device_block(DeviceBlob([raw[:100], raw[100:]]), expect_key=b"k" * 16)
    want = decode_block(b)
    assert got.header == want.header and got.header.codec == codec
    assert torch.equal(got.k, want.k) and got.v is not None and want.v is not None
    assert torch.equal(got.v, want.v)
