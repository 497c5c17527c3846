"""Fetch and placement on CUDA caches, end to end against a real server on loopback,
compared with the same fetch into CPU caches (the torch reference path).

What the CPU suite cannot see: the Triton path inside ``place_paged`` (NOPE blocks) and
the CUDA copies (ROPE blocks), the pinned staging ring wrapping around, the stream a
PagedKV captures and the event a fetch returns, and caches on a second device. K is
compared within one bf16 ulp of each rotated pair, V and untouched slots bit-exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

for _module in ("grpc", "msgpack", "lz4", "xxhash"):  # the client's own dependencies
    pytest.importorskip(_module)

from nopecache.client import (  # noqa: E402
    CacheClient,
    ClientConfig,
    ContentChunker,
    ModelFingerprint,
    PagedKV,
    RetryPolicy,
)
from nopecache.client.cost import CostConfig  # noqa: E402
from nopecache.client.fetching import FetchResult  # noqa: E402
from nopecache.kernels import RopeSpec  # noqa: E402
from nopecache.kernels.reference import rope_tolerance  # noqa: E402
from nopecache.proto.block import StoredForm  # noqa: E402
from tests.support.server_procs import CacheServerProc, start_cache_servers  # noqa: E402

pytestmark = pytest.mark.gpu

LAYERS, HEADS, DIM, BLOCK_SIZE, NUM_BLOCKS = 3, 8, 128, 16, 24
SPEC = RopeSpec.default(DIM, theta=500000.0)
CHUNKER = ContentChunker(min_size=8, avg_size=32, max_size=64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServerProc]:
    (started,) = start_cache_servers(1, Path(tmp_path_factory.mktemp("gpu-client")))
    yield started
    started.kill()


def _client(
    server: CacheServerProc, namespace: str, form: StoredForm, kv_codec: str = "none"
) -> CacheClient:
    config = ClientConfig(
        servers=(server.address,),
        retry=RetryPolicy(max_attempts=1),
        cost=CostConfig(enabled=False),
        namespace=namespace,
        kv_codec=kv_codec,  # type: ignore[arg-type]
    )
    fingerprint = ModelFingerprint.from_rope_spec(
        model="gpu-check",
        revision="1",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        dtype=torch.bfloat16,
        form=form,
        rope=SPEC,
    )
    return CacheClient(
        config,
        fingerprint=fingerprint,
        rope=SPEC,
        v_head_dim=DIM,
        prefix_block_tokens=16,
        chunker=CHUNKER,
    )


def _tokens(n: int, seed: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, low + 5000, (n,), generator=torch.Generator().manual_seed(seed))


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, HEADS, DIM)
    return (
        torch.randn(shape, generator=g).bfloat16(),
        torch.randn(shape, generator=g).bfloat16(),
    )


def _caches(device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)
    return [torch.randn(shape, generator=g).bfloat16().to(device) for _ in range(2 * LAYERS)]


def _slots(n: int) -> torch.Tensor:
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=torch.Generator().manual_seed(5))
    slots = slots[:n].clone()
    slots[[3, 4, n - 2]] = -1
    return slots


def _fetch_both(
    client: CacheClient, prompt: torch.Tensor, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor], FetchResult, PagedKV]:
    """The same plan fetched into CPU caches and into caches on ``device``."""
    plan = client.lookup(prompt)
    assert plan.blocks, "nothing to fetch"
    slots = _slots(prompt.numel())
    cpu = _caches(torch.device("cpu"))
    client.fetch(plan, prompt, into=PagedKV(cpu[:LAYERS], cpu[LAYERS:], slots))
    gpu = _caches(device)
    into = PagedKV(gpu[:LAYERS], gpu[LAYERS:], slots.to(device))
    result = client.fetch(plan, prompt, into=into)
    assert result.failed == () and len(result.placed) == len(plan.blocks)
    return cpu, gpu, result, into


def _assert_same(cpu: list[torch.Tensor], gpu: list[torch.Tensor], exact_k: bool) -> None:
    for layer, (want, got) in enumerate(zip(cpu, [c.cpu() for c in gpu], strict=True)):
        if layer >= LAYERS or exact_k:  # V, or K copied without rotation
            assert torch.equal(got, want)
        else:
            tol = rope_tolerance(want, SPEC, torch.bfloat16)
            assert bool(((got.double() - want.double()).abs() <= tol).all())


def test_fetch_of_position_independent_hits_into_cuda_matches_cpu(
    server: CacheServerProc,
) -> None:
    chunk = _tokens(200, seed=1)
    k, v = _kv(200, seed=1)
    prompt = torch.cat([_tokens(57, seed=2, low=10000), chunk])  # lands at 57 onwards
    with _client(server, "gpu-pi", StoredForm.NOPE) as client:
        client.store(chunk, (k, v), 0)
        cpu, gpu, result, into = _fetch_both(client, prompt, torch.device("cuda"))
    assert into.stream == torch.cuda.current_stream() and result.ready is not None
    result.ready.synchronize()
    _assert_same(cpu, gpu, exact_k=False)


def test_fetch_of_a_post_rope_prefix_into_cuda_is_bit_exact(server: CacheServerProc) -> None:
    tokens = _tokens(160, seed=3)
    k, v = _kv(160, seed=3)
    with _client(server, "gpu-rope", StoredForm.ROPE) as client:
        client.store(tokens, (k, v), 0, form="rope", position_independent=False)
        cpu, gpu, result, _ = _fetch_both(client, tokens, torch.device("cuda"))
    assert result.ready is not None
    result.ready.synchronize()
    _assert_same(cpu, gpu, exact_k=True)


@pytest.mark.parametrize("codec", ["fp8", "k16v8"])
def test_compact_blocks_decode_on_the_gpu_as_on_the_host(
    server: CacheServerProc, codec: str
) -> None:
    # A compact block bound for a CUDA cache crosses the bus compact and is decoded on
    # the GPU (fetching.py); the CPU fetch decodes on the host: the same bf16 values.
    tokens = _tokens(160, seed=4)
    k, v = _kv(160, seed=4)
    with _client(server, f"gpu-{codec}", StoredForm.ROPE, codec) as client:
        client.store(tokens, (k, v), 0, form="rope", position_independent=False)
        cpu, gpu, result, _ = _fetch_both(client, tokens, torch.device("cuda"))
    assert result.ready is not None
    result.ready.synchronize()
    _assert_same(cpu, gpu, exact_k=True)


def test_fetch_issues_on_the_builders_stream_and_its_event_orders_other_streams(
    server: CacheServerProc,
) -> None:
    chunk = _tokens(300, seed=4)
    k, v = _kv(300, seed=4)
    prompt = torch.cat([_tokens(11, seed=5, low=10000), chunk])
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    with _client(server, "gpu-stream", StoredForm.NOPE) as client:
        client.store(chunk, (k, v), 0)
        plan = client.lookup(prompt)
        slots = _slots(prompt.numel())
        cpu = _caches(torch.device("cpu"))
        client.fetch(plan, prompt, into=PagedKV(cpu[:LAYERS], cpu[LAYERS:], slots))
        gpu = _caches(torch.device("cuda"))
        with torch.cuda.stream(side):
            into = PagedKV(gpu[:LAYERS], gpu[LAYERS:], slots.cuda())
        assert into.stream == side
        result = client.fetch(plan, prompt, into=into)
    assert result.ready is not None
    with torch.cuda.stream(other):
        other.wait_event(result.ready)
        copies = [c.clone() for c in gpu]  # reads on another stream, after the event
    other.synchronize()
    _assert_same(cpu, copies, exact_k=False)


def test_fetch_into_caches_on_a_second_device(server: CacheServerProc) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    chunk = _tokens(120, seed=6)
    k, v = _kv(120, seed=6)
    prompt = torch.cat([_tokens(33, seed=7, low=10000), chunk])
    with _client(server, "gpu-dev1", StoredForm.NOPE) as client:
        client.store(chunk, (k, v), 0)
        cpu, gpu, result, into = _fetch_both(client, prompt, torch.device("cuda", 1))
    assert into.stream is not None and into.stream.device == torch.device("cuda", 1)
    assert result.ready is not None
    result.ready.synchronize()
    _assert_same(cpu, gpu, exact_k=False)
