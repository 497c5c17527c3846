"""Two engine processes, two server replicas, one Redis: KV one engine stores through one
replica is fetched by the other engine through the other replica, at another offset."""

from __future__ import annotations

import multiprocessing
import queue
from typing import Any

import numpy as np
import torch

from nopecache.client import CacheClient, ClientConfig, ContentChunker, ModelFingerprint
from nopecache.client.cost import CostConfig
from nopecache.kernels import RopeSpec
from nopecache.kernels.reference import rotate_reference
from nopecache.proto.block import StoredForm
from tests.support.redis_procs import RedisProc
from tests.support.server_procs import ServerFactory

LAYERS, HEADS, DIM = 2, 2, 8
SPEC = RopeSpec.default(DIM)
OFFSET = 333
_TIMEOUT_S = 120


def _doc() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared document: 96 token ids and their post-RoPE K (positions 0..95) and V."""
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, 5000, (96,), generator=g)
    shape = (LAYERS, 96, HEADS, DIM)
    return tokens, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _client(address: str) -> CacheClient:
    fp = ModelFingerprint.from_rope_spec(
        model="tiny",
        revision="1",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=torch.float32,
        form=StoredForm.ROPE,
        rope=SPEC,
    )
    config = ClientConfig(servers=(address,), namespace="mp", cost=CostConfig(enabled=False))
    return CacheClient(
        config,
        fingerprint=fp,
        rope=SPEC,
        v_head_dim=DIM,
        prefix_block_tokens=16,
        chunker=ContentChunker(min_size=4, avg_size=16, max_size=32),
    )


def _engine_storing(address: str, stored: Any, results: Any) -> None:
    """Child process: store the document at positions 0.. through one replica."""
    tokens, k, v = _doc()
    with _client(address) as client:
        report = client.store(tokens, (k, v), 0, form="rope")
    results.put(("stored", report.stored, report.failed))
    stored.set()


def _engine_fetching(address: str, stored: Any, results: Any) -> None:
    """Child process: once stored, fetch the document behind OFFSET other tokens."""
    tokens, _, _ = _doc()
    prompt = torch.cat([torch.arange(10000, 10000 + OFFSET), tokens])
    with _client(address) as client:
        assert stored.wait(_TIMEOUT_S)
        plan = client.lookup(prompt)
        result = client.fetch(plan, prompt)
    assert result.k is not None and result.v is not None
    spans = [(h.target.start, h.target.end) for h in result.placed]
    results.put(("fetched", spans, len(result.failed), result.k.numpy(), result.v.numpy()))


def test_one_engine_stores_the_other_fetches_at_another_offset_via_another_replica(
    cache_servers: ServerFactory, redis_clean: RedisProc
) -> None:
    first, second = cache_servers(2, redis_url=redis_clean.url)
    ctx = multiprocessing.get_context("spawn")
    stored = ctx.Event()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_engine_storing, args=(first.address, stored, results)),
        ctx.Process(target=_engine_fetching, args=(second.address, stored, results)),
    ]
    for p in procs:
        p.start()
    try:
        got: dict[str, tuple[Any, ...]] = {}
        while len(got) < 2:
            try:
                item = results.get(timeout=_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"children exited {[p.exitcode for p in procs]}") from None
            got[item[0]] = item[1:]
        for p in procs:
            p.join(timeout=_TIMEOUT_S)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    n_stored, n_failed = got["stored"]
    assert n_stored > 0 and n_failed == 0
    spans, n_missed, k_np, v_np = got["fetched"]
    assert n_missed == 0 and len(spans) >= 3
    _, k, v = _doc()
    nope = torch.stack([rotate_reference(k[i], 0, None, SPEC) for i in range(LAYERS)])
    k_got, v_got = torch.from_numpy(k_np), torch.from_numpy(v_np)
    for start, end in spans:
        assert start >= OFFSET
        src = slice(start - OFFSET, end - OFFSET)
        for layer in range(LAYERS):
            want = rotate_reference(nope[layer, src], None, start, SPEC)
            assert torch.equal(k_got[layer, start:end], want)
        assert torch.equal(v_got[:, start:end], v[:, src])
    covered = np.zeros(OFFSET + 96, dtype=bool)
    for start, end in spans:
        covered[start:end] = True
    # Content chunking loses at most the first chunk(s) of the document to the new context.
    assert covered[OFFSET + 48 :].all()
