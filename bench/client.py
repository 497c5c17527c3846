"""End-to-end client fetch into a paged KV cache, against a plain memcpy of the same bytes.

Setup (all on 127.0.0.1): one ``python -m nopecache.cache_server`` child with a CPU tier,
and this process as the engine. The chunk set is a 4096-token prompt of a Llama-3-8B-shaped
model: 32 layers, 8 KV heads x 128, bfloat16, post-RoPE K (a ROPE fingerprint), stored
as 16 exact-prefix blocks of 256 tokens (32 MiB each; 512 MiB of K and V in all).

Measured, each the best of ``--reps`` runs after a warm-up::

    grpc     CacheClient.fetch(plan, tokens, into=PagedKV) with ``shm=off``: Get streams,
             verification (checksums, key, fingerprint, token ids), placement into a
             vLLM-layout paged cache (blocks of 16 slots, shuffled block table), pipelined
    shm      the same fetch with ``shm=auto`` and ``zero_copy=off``: the server copies
             each block into a shared-memory segment (client/shm.py, the default
             128 MiB), the client verifies and places it from there (zero copies on the
             client); the same-host default, zero copy, is bench/dataplane.py's samehost
    memcpy   one torch copy of the same number of bytes between two preallocated
             buffers: the limit any transport into this memory has
    get      the gRPC Get streams alone (blocks received, nothing verified or placed)
    shm_get  the shared-memory Get streams alone (each block dropped once received)
    place    verification and placement alone, of blocks already received

``pipeline`` = (get + place) / grpc: above 1 when placing block n overlaps receiving block
n+1. The shm fetch's warm-up run also creates and attaches the segment (not timed). GB/s
are 10^9 bytes (of K and V payload) per second. Last line::

    RESULT grpc_gbps= shm_gbps= memcpy_gbps= shm_vs_memcpy= grpc_vs_memcpy= get_gbps=
           place_gbps= pipeline= shm_get_gbps= shm_vs_grpc=
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from nopecache.client import (
    CacheClient,
    ClientConfig,
    ModelFingerprint,
    PagedKV,
    ReusePlan,
    token_array,
)
from nopecache.client.cost import CostConfig
from nopecache.client.placement import decode_for_hit, place_paged
from nopecache.client.shm import ShmFastPath
from nopecache.client.transport import BufferPool, ServerConnection
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm

sys.path.insert(0, str(Path(__file__).parent))
from _harness import best_of, cache_server

# The RESULT line's keys, in order: tests/bench/test_quick.py checks a --quick run
# prints exactly these.
RESULT_KEYS = (
    "grpc_gbps",
    "shm_gbps",
    "memcpy_gbps",
    "shm_vs_memcpy",
    "grpc_vs_memcpy",
    "get_gbps",
    "place_gbps",
    "pipeline",
    "shm_get_gbps",
    "shm_vs_grpc",
)

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
PAGE = 16  # tokens per paged-cache block (vLLM's default)
PREFIX_BLOCK = 256


def paged_target(tokens: int) -> PagedKV:
    """A paged cache with 25% spare blocks and a shuffled block table, as an engine has."""
    blocks = tokens // PAGE * 5 // 4
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[: tokens // PAGE]
    slots = (table[:, None] * PAGE + torch.arange(PAGE)[None, :]).reshape(-1)
    shape = (blocks, PAGE, KV_HEADS, HEAD_DIM)
    return PagedKV(
        [torch.zeros(shape, dtype=DTYPE) for _ in range(LAYERS)],
        [torch.zeros(shape, dtype=DTYPE) for _ in range(LAYERS)],
        slots.to(torch.int64),
    )


def get_and_place_apart(
    address: str,
    config: ClientConfig,
    client: CacheClient,
    plan: ReusePlan,
    prompt: torch.Tensor,
    into: PagedKV,
    reps: int,
) -> tuple[float, float]:
    """Seconds to receive every block (nothing else), and to verify + place them."""
    keys = b"".join(h.key.value for h in plan.blocks)
    received: list[memoryview] = []
    pool = BufferPool()  # shared by the runs, as one client's connections share theirs

    async def pull(keep: bool) -> None:
        conn = ServerConnection(address, config, pool=pool)
        async for _, blob in conn.get(keys):
            assert isinstance(blob, memoryview)  # no fast path here: network blocks
            if keep:
                received.append(blob)
            else:
                conn.pool.give(blob)  # as a fetch does once a block is placed
        await conn.close()

    get_s = best_of(reps, lambda: asyncio.run(pull(keep=False)))
    asyncio.run(pull(keep=True))
    arr = token_array(prompt)
    core = client.core

    def place_all() -> None:
        for hit, blob in zip(plan.blocks, received, strict=True):
            block = decode_for_hit(blob, hit, arr, core.fingerprint, core.v_head_dim)
            place_paged(block, hit, into, core.rope)

    return get_s, best_of(reps, place_all)


def shm_get_alone(address: str, config: ClientConfig, plan: ReusePlan, reps: int) -> float:
    """Seconds to receive every block through shared memory (one connection and segment for
    all runs, each block dropped once received, as a fetch does after placing it)."""
    keys = b"".join(h.key.value for h in plan.blocks)

    async def runs() -> float:
        fast = ShmFastPath("auto", zero_copy=False)
        conn = ServerConnection(address, config, fast_path=fast)
        times = []
        for rep in range(reps + 1):  # the first run attaches: not timed
            start = time.perf_counter()
            async for _, blob in conn.get(keys):
                assert blob is not None
                del blob
            if rep:
                times.append(time.perf_counter() - start)
        stats = fast.stats()
        assert stats.grpc_blocks == 0 and stats.shm_blocks == len(plan.blocks) * (reps + 1), stats
        await fast.close()
        await conn.close()
        return min(times)

    return asyncio.run(runs())


def main() -> None:
    """Run the benchmark and print the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens, one pass")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.reps = 256, 1
    tokens = args.tokens
    rope = RopeSpec.default(HEAD_DIM, theta=500000.0)
    fp = ModelFingerprint.from_rope_spec(
        model="llama-3-8b-shaped",
        revision="bench",
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        dtype=DTYPE,
        form=StoredForm.ROPE,
        rope=rope,
    )
    g = torch.Generator().manual_seed(0)
    shape = (LAYERS, tokens, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=g, dtype=torch.float32).to(DTYPE)
    v = torch.randn(shape, generator=g, dtype=torch.float32).to(DTYPE)
    prompt = torch.randint(0, 128000, (tokens,), generator=g)
    payload = 2 * k.numel() * k.element_size()
    print(
        f"chunk set: {tokens} tokens x {LAYERS} layers x {KV_HEADS}x{HEAD_DIM} bf16 K+V "
        f"= {payload / 2**20:.0f} MiB; torch threads {torch.get_num_threads()}"
    )

    capacity = f"{math.ceil(payload * 1.5 / 2**20)}MiB"
    with tempfile.TemporaryDirectory() as tmp, cache_server(capacity, Path(tmp) / "s.log") as addr:
        config = ClientConfig(
            servers=(addr,),
            get_timeout_s=120.0,
            put_timeout_s=120.0,
            cost=CostConfig(enabled=False),
            shm="off",
        )
        with CacheClient(
            config,
            fingerprint=fp,
            rope=rope,
            v_head_dim=HEAD_DIM,
            prefix_block_tokens=PREFIX_BLOCK,
        ) as client:
            start = time.perf_counter()
            report = client.store(prompt, (k, v), 0, form="rope", position_independent=False)
            store_s = time.perf_counter() - start
            assert report.failed == 0, report
            print(
                f"store: {report.stored} blocks in {store_s:.2f}s "
                f"({report.nbytes / store_s / 1e9:.2f} GB/s)"
            )
            plan = client.lookup(prompt)
            assert plan.prefix_end == tokens - tokens % PREFIX_BLOCK, plan
            placed_bytes = payload * plan.prefix_end // tokens
            into = paged_target(tokens)
            outcome: list[int] = []

            def fetch() -> None:
                result = client.fetch(plan, prompt, into=into)
                outcome.append(len(result.failed))

            grpc_s = best_of(args.reps, fetch)
            assert outcome == [0] * len(outcome), "blocks failed to fetch"
            # One layer's cache is checked against the source: the copy path is bit exact.
            first = into.k_caches[0].view(-1, KV_HEADS, HEAD_DIM)[into.slot_mapping[:64]]
            assert torch.equal(first, k[0, :64])
            get_s, place_s = get_and_place_apart(
                addr, config, client, plan, prompt, into, args.reps
            )
        shm_config = replace(config, shm="auto", zero_copy=False)
        with CacheClient(
            shm_config,
            fingerprint=fp,
            rope=rope,
            v_head_dim=HEAD_DIM,
            prefix_block_tokens=PREFIX_BLOCK,
        ) as shm_client:
            into = paged_target(tokens)
            outcome.clear()

            def shm_fetch() -> None:
                result = shm_client.fetch(plan, prompt, into=into)
                outcome.append(len(result.failed))

            shm_s = best_of(args.reps, shm_fetch)
            assert outcome == [0] * len(outcome), "blocks failed to fetch"
            first = into.k_caches[0].view(-1, KV_HEADS, HEAD_DIM)[into.slot_mapping[:64]]
            assert torch.equal(first, k[0, :64])
            assert shm_client.core.shm is not None
            stats = shm_client.core.shm.stats()
        print(
            f"shm fetches: {stats.shm_blocks} blocks through shared memory, "
            f"{stats.grpc_blocks} over gRPC ({stats.grpc_bytes / 2**20:.0f} MiB)"
        )
        shm_get_s = shm_get_alone(addr, shm_config, plan, args.reps)

    src = torch.empty(placed_bytes, dtype=torch.uint8)
    dst = torch.empty(placed_bytes, dtype=torch.uint8)
    src.fill_(1)
    dst.fill_(2)  # both buffers touched: no first-touch page faults in the timed copies
    memcpy_s = best_of(args.reps, lambda: dst.copy_(src))

    grpc_gbps = placed_bytes / grpc_s / 1e9
    memcpy_gbps = placed_bytes / memcpy_s / 1e9
    get_gbps = placed_bytes / get_s / 1e9
    place_gbps = placed_bytes / place_s / 1e9
    pipeline = (get_s + place_s) / grpc_s
    shm_gbps = placed_bytes / shm_s / 1e9
    shm_get_gbps = placed_bytes / shm_get_s / 1e9
    print(f"fetch (grpc, verified, placed): {grpc_s * 1e3:8.1f} ms  {grpc_gbps:6.2f} GB/s")
    print(f"  get streams alone:            {get_s * 1e3:8.1f} ms  {get_gbps:6.2f} GB/s")
    print(f"  verify + place alone:         {place_s * 1e3:8.1f} ms  {place_gbps:6.2f} GB/s")
    print(f"  pipeline (get + place) / fetch: {pipeline:.2f}")
    print(f"fetch (shm, verified, placed):  {shm_s * 1e3:8.1f} ms  {shm_gbps:6.2f} GB/s")
    print(f"  shm get streams alone:        {shm_get_s * 1e3:8.1f} ms  {shm_get_gbps:6.2f} GB/s")
    print(f"memcpy of the same bytes:       {memcpy_s * 1e3:8.1f} ms  {memcpy_gbps:6.2f} GB/s")
    print(
        f"RESULT grpc_gbps={grpc_gbps:.3f} shm_gbps={shm_gbps:.3f} memcpy_gbps={memcpy_gbps:.3f} "
        f"shm_vs_memcpy={shm_gbps / memcpy_gbps:.3f} grpc_vs_memcpy={grpc_gbps / memcpy_gbps:.3f} "
        f"get_gbps={get_gbps:.3f} place_gbps={place_gbps:.3f} pipeline={pipeline:.2f} "
        f"shm_get_gbps={shm_get_gbps:.3f} shm_vs_grpc={shm_gbps / grpc_gbps:.2f}"
    )


if __name__ == "__main__":
    main()
