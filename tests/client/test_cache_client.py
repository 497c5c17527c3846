"""CacheClient end to end against real server processes on loopback (and a real Redis):
store, lookup, fetch and place; exactness of every placement against the torch reference;
failures (killed servers, corrupted blocks) as misses; sharding; the store queue; cost."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import lz4.frame
import pytest
import torch

from nopecache.client import (
    AsyncCacheClient,
    CacheClient,
    ClientConfig,
    FingerprintMismatchError,
    InvalidArgumentError,
    ModelFingerprint,
    PagedKV,
    storing,
)
from nopecache.client.bulk import BulkSource
from nopecache.client.cost import CostConfig
from nopecache.client.sharding import Rendezvous
from nopecache.client.transport import BlockSource, FastPathFactory, ServerConnection, ServerInfo
from nopecache.kernels import RopeSpec
from nopecache.kernels.reference import rotate_reference
from nopecache.proto.block import StoredForm
from tests.support.client_harness import (
    CHUNKER,
    DIM,
    HEADS,
    LAYERS,
    PREFIX_BLOCK,
    SPEC,
    client,
    config,
    fingerprint,
    kv,
    prompt,
    put_forged_chunk,
)
from tests.support.redis_procs import RedisProc
from tests.support.server_procs import CacheServerProc, ServerFactory, start_cache_servers


def rotated(k: torch.Tensor, src: object, dst: object) -> torch.Tensor:
    """The reference rotation of every layer of K."""
    return torch.stack([rotate_reference(k[i], src, dst, SPEC) for i in range(k.shape[0])])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[CacheServerProc]]:
    """Two servers shared by the tests that do not kill them (each test has a namespace)."""
    started = start_cache_servers(2, tmp_path_factory.mktemp("client-servers"))
    yield started
    for server in started:
        server.kill()


# -- exact prefix ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_prefix_of_post_rope_k_comes_back_bit_exact(
    servers: list[CacheServerProc], dtype: torch.dtype
) -> None:
    tokens = prompt(100, seed=1)
    k, v = kv(100, seed=1, dtype=dtype)
    with client(config(servers, f"prefix-{dtype}"), StoredForm.ROPE, dtype=dtype) as c:
        report = c.store(tokens, (k, v), 0, form="rope")
        assert report.failed == 0 and report.stored > 0
        plan = c.lookup(tokens)
        assert plan.prefix_end == 96 and plan.num_tokens == 100
        result = c.fetch(plan, tokens)
    assert result.failed == () and result.prefix_tokens == 96 and plan.reused_tokens == 100
    assert result.k is not None and result.v is not None
    assert torch.equal(result.k[:, :96], k[:, :96])  # a copy, no rotation at all
    assert torch.equal(result.v[:, :96], v[:, :96])
    # The tail comes from position-independent blocks: stored un-rotated, rotated back once.
    nope = rotated(k, 0, None)
    tail = [h for h in plan.hits if h.target.end > 96]
    for hit in tail:
        t = slice(hit.target.start, hit.target.end)
        assert torch.equal(result.k[:, t], rotated(nope[:, t], None, hit.target.start))
        assert torch.equal(result.v[:, t], v[:, t])


def test_exact_prefix_of_nope_k_is_rotated_once_to_its_positions(
    servers: list[CacheServerProc],
) -> None:
    tokens = prompt(64, seed=2)
    k, v = kv(64, seed=2)
    with client(config(servers, "prefix-nope")) as c:
        c.store(tokens, (k, v), form="nope", position_independent=False)
        plan = c.lookup(tokens)
        result = c.fetch(plan, tokens)
    assert plan.prefix_end == 64 and plan.hits == ()
    assert result.k is not None and result.v is not None
    assert torch.equal(result.k, rotated(k, None, 0))
    assert torch.equal(result.v, v)
    assert bool(result.mask.all())


def test_a_store_of_several_batches_stores_every_block_once(
    servers: list[CacheServerProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(100, seed=3)
    k, v = kv(100, seed=3)
    # One block a batch: six Puts, each with the next batch encoding beside it (storing.py).
    monkeypatch.setattr(storing, "_STORE_BATCH_BYTES", 1)
    encoded: list[int] = []
    encode = storing.StorePipeline._encode

    def counting(self: storing.StorePipeline, chunks: list[object], *args: object) -> object:
        encoded.append(len(chunks))
        return encode(self, chunks, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(storing.StorePipeline, "_encode", counting)
    with client(config(servers[:1], "batches")) as c:
        report = c.store(tokens, (k, v), form="nope", position_independent=False)
        plan = c.lookup(tokens)
        result = c.fetch(plan, tokens)
    assert report.stored == len(encoded) == 6 and encoded == [1] * 6 and report.failed == 0
    assert plan.prefix_end == 96 and result.failed == ()
    assert result.k is not None and result.v is not None
    assert torch.equal(result.k[:, :96], rotated(k, None, 0)[:, :96])
    assert torch.equal(result.v[:, :96], v[:, :96])


# -- position independent ----------------------------------------------------------------------
@pytest.mark.parametrize("form", ["nope", "rope"])
def test_chunk_stored_at_0_fetched_at_501_equals_the_reference_rotation(
    servers: list[CacheServerProc], form: str
) -> None:
    chunk = prompt(120, seed=3)
    k, v = kv(120, seed=3)
    new = torch.cat([prompt(501, seed=4, low=10000), chunk])
    with client(config(servers, f"offset-{form}")) as c:
        c.store(chunk, (k, v), 0, form=form)  # type: ignore[arg-type]
        plan = c.lookup(new)
        result = c.fetch(plan, new)
    assert plan.prefix == () and len(plan.hits) >= 3
    assert all(h.target.start >= 501 for h in plan.hits)
    assert result.placed == plan.hits and result.failed == ()
    nope = k if form == "nope" else rotated(k, 0, None)  # what the client stored
    assert result.k is not None and result.v is not None
    for hit in plan.hits:
        src = slice(hit.target.start - 501, hit.target.end - 501)
        want = rotated(nope[:, src], None, hit.target.start)
        assert torch.equal(result.k[:, hit.target.start : hit.target.end], want)
        assert torch.equal(result.v[:, hit.target.start : hit.target.end], v[:, src])
    expected_mask = torch.zeros(621, dtype=torch.bool)
    for hit in plan.hits:
        expected_mask[hit.target.start : hit.target.end] = True
    assert torch.equal(result.mask, expected_mask)
    assert not result.k[:, ~expected_mask].any() and not result.v[:, ~expected_mask].any()


def test_paged_placement_writes_exactly_the_mapped_slots(servers: list[CacheServerProc]) -> None:
    chunk = prompt(80, seed=5)
    k, v = kv(80, seed=5)
    new = torch.cat([prompt(30, seed=6, low=10000), chunk])
    num_blocks, block_size = 16, 8  # 128 slots for 110 tokens
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(7))[:110]
    slots[[40, 41, 77]] = -1  # positions the engine does not want written
    caches = [torch.full((num_blocks, block_size, HEADS, DIM), -7.0) for _ in range(2 * LAYERS)]
    into = PagedKV(caches[:LAYERS], caches[LAYERS:], slots)
    with client(config(servers, "paged")) as c:
        c.store(chunk, (k, v))
        plan = c.lookup(new)
        result = c.fetch(plan, new, into=into)
    assert result.k is None and len(result.placed) == len(plan.hits) >= 2
    written: set[int] = set()
    for hit in plan.hits:
        for pos in range(hit.target.start, hit.target.end):
            slot = int(slots[pos])
            if slot < 0:
                continue
            written.add(slot)
            want = rotated(k[:, pos - 30 : pos - 29], None, pos)
            for layer in range(LAYERS):
                assert torch.equal(into.k_caches[layer].view(-1, HEADS, DIM)[slot], want[layer, 0])
                v_cache = caches[LAYERS + layer]
                assert torch.equal(v_cache.view(-1, HEADS, DIM)[slot], v[layer, pos - 30])
    others = [s for s in range(128) if s not in written]
    assert all(bool((c.view(-1, HEADS, DIM)[others] == -7.0).all()) for c in caches)


# -- store -----------------------------------------------------------------------------------
def test_store_sends_only_missing_blocks_and_queues_without_blocking(
    servers: list[CacheServerProc],
) -> None:
    tokens = prompt(64, seed=8)
    k, v = kv(64, seed=8)
    with client(config(servers, "store", store_queue_blocks=8)) as c:
        first = c.store(tokens, (k, v))
        blocks = first.stored
        assert blocks == 4 + len(CHUNKER.split(tokens)) and first.already_present == 0
        again = c.store(tokens, (k, v))
        assert (again.stored, again.already_present, again.nbytes) == (0, blocks, 0)
        other = prompt(48, seed=9)
        ko, vo = kv(48, seed=9)
        queued = c.store(other, (ko, vo), prefix=False, wait=False)
        assert queued.queued and not queued.dropped
        c.drain()
        assert c.lookup(other).pi_tokens == 48
        big = prompt(200, seed=10)
        kb, vb = kv(200, seed=10)
        dropped = c.store(big, (kb, vb), wait=False)
        assert dropped.dropped and not dropped.queued
        expected_drop = 200 // PREFIX_BLOCK + len(CHUNKER.split(big))
        stats = c.stats()
        assert stats.store_dropped_blocks == expected_drop
        assert stats.stored_blocks == blocks + len(CHUNKER.split(other))


def test_prefix_end_keys_the_approximate_rest_by_content_only(
    servers: list[CacheServerProc],
) -> None:
    """``prefix_end``: exact-prefix keys stop at it, content keys cover every token."""
    tokens = prompt(100, seed=12)
    k, v = kv(100, seed=12)
    with client(config(servers, "prefix-end"), StoredForm.ROPE) as c:
        for bad in (-1, 101, 1.5, True):
            with pytest.raises(InvalidArgumentError, match="prefix_end"):
                c.store(tokens, (k, v), form="rope", prefix_end=bad)  # type: ignore[arg-type]
        assert c.stats().stored_blocks == 0  # refused before anything was sent
        report = c.store(tokens, (k, v), 0, form="rope", prefix_end=2 * PREFIX_BLOCK)
        assert report.failed == 0
        assert c.stats().stored_blocks == 2 + len(CHUNKER.split(tokens))
        plan = c.lookup(tokens)
    assert plan.prefix_end == 2 * PREFIX_BLOCK
    assert plan.prefix_end + plan.pi_tokens == 100  # the rest found by content


# -- failures --------------------------------------------------------------------------------
def test_a_killed_server_turns_its_blocks_into_misses(cache_servers: ServerFactory) -> None:
    pair = cache_servers(2)
    tokens = prompt(160, seed=11)
    k, v = kv(160, seed=11)
    with client(config(pair, "killed")) as c:
        c.store(tokens, (k, v), prefix=False)
        plan = c.lookup(tokens)
        assert plan.pi_tokens == 160
        ring = Rendezvous(s.address for s in pair)
        on_dead = [h for h in plan.hits if ring.owner(h.key) == pair[0].address]
        assert on_dead and len(on_dead) < len(plan.hits)
        pair[0].kill()
        result = c.fetch(plan, tokens)
        assert set(result.failed) == set(on_dead)
        assert set(result.placed) == set(plan.hits) - set(on_dead)
        assert c.stats().unreachable_keys == {pair[0].address: len(on_dead)}
        assert c.lookup(tokens).pi_tokens == 160 - sum(h.num_tokens for h in on_dead)
    assert result.k is not None
    for hit in result.failed:
        assert not result.k[:, hit.target.start : hit.target.end].any()


def _kill_after_first_block(server: CacheServerProc) -> FastPathFactory:
    """A block source that is the real gRPC stream, with the server SIGKILLed the moment
    the first block has arrived: a crash mid-fetch at a known point."""

    def factory(conn: ServerConnection, info: ServerInfo) -> BlockSource:
        async def source(
            keys: bytes, timeout: float
        ) -> AsyncIterator[tuple[int, memoryview | None]]:
            async for item in conn.grpc_blocks(keys, timeout):
                yield item
                server.kill()

        return source

    return factory


def test_a_server_killed_mid_fetch_turns_the_rest_into_misses(
    cache_servers: ServerFactory,
) -> None:
    (server,) = cache_servers(1, tiers=("cpu://?capacity=128MiB&pinned=no",))
    # A bigger model than elsewhere: 16 KiB per token, 8 blocks of 4 MiB, more than gRPC
    # and the sockets buffer, so the kill lands with blocks still unsent.
    spec = RopeSpec.default(128)
    fp = ModelFingerprint.from_rope_spec(
        model="small",
        revision="1",
        num_layers=4,
        num_kv_heads=8,
        dtype=torch.bfloat16,
        form=StoredForm.ROPE,
        rope=spec,
    )
    tokens = prompt(2048, seed=20)
    g = torch.Generator().manual_seed(20)
    k, v = (torch.randn(4, 2048, 8, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    cfg = config([server], "mid-fetch")
    with CacheClient(cfg, fingerprint=fp, rope=spec, v_head_dim=128) as c:
        assert c.store(tokens, (k, v), form="rope", position_independent=False).failed == 0
    with CacheClient(
        cfg, fingerprint=fp, rope=spec, v_head_dim=128, fast_path=_kill_after_first_block(server)
    ) as c:
        plan = c.lookup(tokens)
        assert len(plan.prefix) == 8
        result = c.fetch(plan, tokens)
        assert not server.running()
        stats = c.stats()
    placed = len(result.placed)
    assert 1 <= placed < 8
    assert result.placed == plan.prefix[:placed] and result.failed == plan.prefix[placed:]
    assert result.prefix_tokens == 256 * placed
    assert result.k is not None
    assert torch.equal(result.k[:, : 256 * placed], k[:, : 256 * placed])
    assert not result.k[:, 256 * placed :].any()
    assert stats.unreachable_keys == {server.address: 8 - placed}


def test_a_block_with_other_tokens_under_a_prompt_key_is_a_miss(
    servers: list[CacheServerProc],
) -> None:
    tokens = prompt(40, seed=12)
    k, v = kv(40, seed=12)
    with client(config(servers, "forged")) as c:
        victim = put_forged_chunk(c, "forged", tokens, (k, v), 0)
        plan = c.lookup(tokens)
        assert [h.key for h in plan.hits] == [victim.key]
        result = c.fetch(plan, tokens)
        assert result.failed == plan.hits and result.placed == ()
        assert c.stats().verify_failures == 1


def test_a_block_corrupted_in_redis_is_a_miss(
    cache_servers: ServerFactory, redis_clean: RedisProc
) -> None:
    (server,) = cache_servers(1, tiers=(redis_clean.url,))
    tokens = prompt(30, seed=13)
    k, v = kv(30, seed=13)
    with client(config([server], "redis-corrupt")) as c:
        c.store(tokens, (k, v), prefix=False)
        plan = c.lookup(tokens)
        assert len(plan.hits) >= 2
        victim = plan.hits[0].key.value
        with redis_clean.client() as r:
            blob = bytearray(lz4.frame.decompress(r.get(b"nc:" + victim)))
            blob[-3] ^= 0x40  # one payload bit: the block checksum no longer matches
            r.set(b"nc:" + victim, lz4.frame.compress(bytes(blob), content_checksum=True))
        result = c.fetch(plan, tokens)
        assert [h.key.value for h in result.failed] == [victim]
        assert set(result.placed) == set(plan.hits[1:])
        # The server verifies what it reads from Redis: the damaged block never reaches the
        # client (a miss there), and it is deleted from Redis.
        assert c.stats().verify_failures == 0
        with redis_clean.client() as r:
            assert r.exists(b"nc:" + victim) == 0


# -- sharding --------------------------------------------------------------------------------
def test_adding_a_server_moves_only_the_keys_it_now_owns(cache_servers: ServerFactory) -> None:
    first = cache_servers(2)
    tokens = prompt(600, seed=14)
    k, v = kv(600, seed=14)
    with client(config(first, "shard")) as c:
        assert c.store(tokens, (k, v), prefix=False).failed == 0
        keys = [h.key for h in c.lookup(tokens).hits]
        added = cache_servers(1)[0]
        c.set_servers([s.address for s in (*first, added)])
        assert added.address in c.servers
        new_ring = c.core.ring
        moved = {key for key in keys if new_ring.owner(key) == added.address}
        assert 0 < len(moved) < len(keys)
        plan = c.lookup(tokens)
        assert {h.key for h in plan.hits} == set(keys) - moved
        old_ring = Rendezvous(s.address for s in first)
        assert all(old_ring.owner(h.key) == new_ring.owner(h.key) for h in plan.hits)
        c.set_servers([s.address for s in first])  # removed again: every key is back home
        assert {h.key for h in c.lookup(tokens).hits} == set(keys)


# -- prefetch, cost, async ---------------------------------------------------------------------
def test_prefetch_gives_the_plan_and_the_same_kv_as_fetch(servers: list[CacheServerProc]) -> None:
    tokens = torch.cat([prompt(7, seed=15, low=20000), prompt(90, seed=16)])
    k, v = kv(90, seed=16)
    with client(config(servers, "prefetch")) as c:
        c.store(tokens[7:], (k, v))
        handle = c.prefetch(tokens)
        plan = handle.plan()
        prefetched = handle.fetch()
        fetched = c.fetch(c.lookup(tokens), tokens)
        assert handle.done()
        with pytest.raises(InvalidArgumentError, match="fetched already"):
            handle.fetch()
    assert plan == fetched.plan and plan.pi_tokens > 0
    assert prefetched.k is not None and fetched.k is not None
    assert torch.equal(prefetched.k, fetched.k) and torch.equal(prefetched.mask, fetched.mask)


def test_cost_model_drops_hits_slower_to_fetch_than_to_recompute(
    servers: list[CacheServerProc],
) -> None:
    tokens = prompt(64, seed=17)
    k, v = kv(64, seed=17)
    # Measured after one fetch; an engine "prefilling" 1e12 tokens/s makes every fetch lose.
    cost = CostConfig(min_samples=1, prefill_tokens_per_s=1e12)
    # One server: the first fetch (the exact prefix) then measures every owner of the
    # second plan's hits. With two, which server owns which block follows the ports the
    # servers got, and when all prefix blocks landed on one of them the other stayed
    # unmeasured and its position-independent hits were kept ("unmeasured").
    with client(config(servers[:1], "cost", cost=cost)) as c:
        c.store(tokens, (k, v))
        first = c.lookup(tokens)
        assert first.dropped == () and first.reused_tokens == 64  # servers not measured yet
        c.fetch(first, tokens)
        second = c.lookup(tokens)
        stats = c.stats()
    assert second.reused_tokens == 0 and second.prefix == () and second.hits == ()
    assert len(second.dropped) >= 1
    assert stats.dropped_hits == len(second.dropped)


def test_a_server_slow_then_fast_gets_its_hits_back(servers: list[CacheServerProc]) -> None:
    tokens = prompt(64, seed=21)
    k, v = kv(64, seed=21)
    # Recomputing a 16-token block costs 160 ms; a loopback fetch of its 4 KiB takes
    # milliseconds. But the model starts out believing the server moves 100 bytes/s.
    window, share = 4, 0.25
    cost = CostConfig(min_samples=2, window=window, probe_share=share, prefill_tokens_per_s=100.0)
    with client(config(servers[:1], "cost-relearn", cost=cost)) as c:
        c.store(tokens, (k, v), position_independent=False)
        server = servers[0].address
        for _ in range(window):
            c.core.cost.observe_fetch(server, 1000, 10.0)
        lookups = 0
        while True:
            lookups += 1
            plan = c.lookup(tokens, allow_position_independent=False)
            if not plan.dropped:
                break
            assert lookups < window / share, "the server never got its hits back"
            c.fetch(plan, tokens)  # the probe's fetch is the model's new sample
        stats = c.stats()
    assert plan.prefix_end == 64
    # Each probe is the 4th drop; the 4 probes' samples replaced the 4 slow ones.
    assert lookups == 14
    assert stats.cost is not None
    seen = stats.cost.servers[server]
    assert seen.probes == window and seen.samples == window
    assert seen.last_decision is not None and seen.last_decision.reason == "cheaper_to_fetch"
    assert seen.bandwidth_bytes_per_s is not None and seen.bandwidth_bytes_per_s > 1e5
    assert (stats.cost.prefill_source, stats.cost.prefill_tokens_per_s) == ("config", 100.0)


async def _async_round_trip(cfg: ClientConfig) -> None:
    tokens = prompt(50, seed=18)
    k, v = kv(50, seed=18)
    async with AsyncCacheClient(
        cfg,
        fingerprint=fingerprint(StoredForm.NOPE),
        rope=SPEC,
        v_head_dim=DIM,
        prefix_block_tokens=PREFIX_BLOCK,
        chunker=CHUNKER,
    ) as c:
        queued = await c.store(tokens, (k, v), wait=False)
        assert queued.queued
        await c.drain()
        handle = c.prefetch(tokens)
        result = await handle.fetch()
        assert (await handle.plan()).prefix_end == 48
        assert result.k is not None and torch.equal(result.k[:, :48], rotated(k[:, :48], None, 0))


def test_async_client_stores_in_the_background_and_prefetches(
    servers: list[CacheServerProc],
) -> None:
    asyncio.run(_async_round_trip(config(servers, "async")))


def test_one_client_serves_several_engine_threads_at_once(servers: list[CacheServerProc]) -> None:
    inputs = [(prompt(70, seed=30 + i), *kv(70, seed=30 + i)) for i in range(4)]
    results: dict[int, torch.Tensor] = {}
    with client(config(servers, "threads")) as c:

        def engine(i: int) -> None:
            tokens, k, v = inputs[i]
            c.store(tokens, (k, v))
            fetched = c.fetch(c.lookup(tokens), tokens)
            assert fetched.k is not None and bool(fetched.mask.all())
            results[i] = fetched.k

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert sorted(results) == [0, 1, 2, 3]
    for i, (_, k, _) in enumerate(inputs):
        assert torch.equal(results[i][:, :64], rotated(k[:, :64], None, 0))


def test_mla_latents_round_trip_without_v(servers: list[CacheServerProc]) -> None:
    spec = RopeSpec.mla(kv_lora_rank=8, qk_rope_head_dim=4)
    fp = ModelFingerprint.from_rope_spec(
        model="mla",
        revision="1",
        num_layers=LAYERS,
        num_kv_heads=1,
        dtype=torch.float32,
        form=StoredForm.MLA,
        rope=spec,
    )
    chunk = prompt(60, seed=40)
    latent = torch.randn(LAYERS, 60, 1, 12, generator=torch.Generator().manual_seed(40))
    new = torch.cat([prompt(9, seed=41, low=10000), chunk])
    cfg = config(servers, "mla")
    with CacheClient(cfg, fingerprint=fp, rope=spec, v_head_dim=0, chunker=CHUNKER) as c:
        c.store(chunk, (latent, None), 0, form="rope")  # rope part rotated: un-rotated once
        plan = c.lookup(new)
        result = c.fetch(plan, new)
    assert result.v is None and result.k is not None and len(plan.hits) >= 2
    nope = torch.stack([rotate_reference(latent[i], 0, None, spec) for i in range(LAYERS)])
    for hit in plan.hits:
        t, src = hit.target, slice(hit.target.start - 9, hit.target.end - 9)
        for layer in range(LAYERS):
            want = rotate_reference(nope[layer, src], None, t.start, spec)
            assert torch.equal(result.k[layer, t.start : t.end], want)


# -- programming errors ------------------------------------------------------------------------
def test_bad_arguments_raise_typed_errors_naming_them() -> None:
    cfg = ClientConfig(servers=("127.0.0.1:1",))
    with pytest.raises(FingerprintMismatchError, match="rope: this RopeSpec"):
        CacheClient(
            cfg,
            fingerprint=fingerprint(StoredForm.NOPE),
            rope=RopeSpec.default(DIM, 500.0),
            v_head_dim=DIM,
        )
    with pytest.raises(InvalidArgumentError, match="v_head_dim: must be 0 exactly for MLA"):
        CacheClient(cfg, fingerprint=fingerprint(StoredForm.NOPE), rope=SPEC, v_head_dim=0)
    tokens = prompt(20, seed=19)
    k, v = kv(20, seed=19)
    with client(cfg) as c:
        with pytest.raises(FingerprintMismatchError, match=r"kv.k: torch.float16 \[2, 20, 2, 8\]"):
            c.store(tokens, (k.half(), v))
        with pytest.raises(InvalidArgumentError, match=r"kv\.v: 19 tokens, but 20 token ids"):
            c.store(tokens, (k, v[:, :19]))
        with pytest.raises(InvalidArgumentError, match="form: must be 'nope' or 'rope'"):
            c.store(tokens, (k, v), form="post")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match=r"positions: must be int32/int64 of shape"):
            c.store(tokens, (k, v), torch.arange(19))
        with pytest.raises(InvalidArgumentError, match="segments: give segments or chunking"):
            c.lookup(tokens, segments=[5], chunking=CHUNKER)
        plan = c.lookup(tokens)  # the server is unreachable: a plan of misses, no exception
        assert plan.reused_tokens == 0
        with pytest.raises(InvalidArgumentError, match="tokens: 19 tokens, the plan is for 20"):
            c.fetch(plan, tokens[:19])
        wrong = PagedKV(
            [torch.zeros(4, 8, 1, DIM)] * LAYERS,
            [torch.zeros(4, 8, 1, DIM)] * LAYERS,
            torch.zeros(20, dtype=torch.int64),
        )
        with pytest.raises(FingerprintMismatchError, match="into: caches of"):
            c.fetch(plan, tokens, into=wrong)


def test_construction_warms_channels_buffers_and_the_bulk_socket(
    servers: list[CacheServerProc],
) -> None:
    with client(config(servers[:1], "warm", shm="off")) as c:
        conn = c.core.connection(servers[0].address)
        source = conn.data_blocks
        info = conn.info
        pooled = c.core._pool.pooled_bytes
        idle = len(source._idle) if isinstance(source, BulkSource) else -1
        stats = c.stats()
    assert info is not None  # Stats answered before the first call
    assert idle == 1  # one bulk socket connected ahead of the first Get
    # Two touched receive buffers of one prefix block (16 tokens, rounded to 1 MiB).
    assert pooled == 2 * 1024 * 1024
    assert stats.server_errors == {} and stats.fetches == 0


def test_a_warm_up_against_a_dead_server_is_its_first_failure(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    (dead,) = start_cache_servers(1, tmp_path_factory.mktemp("dead"))
    dead.kill()
    tokens = prompt(20, seed=33)
    with client(config([dead], "warm-dead", down_backoff_s=30.0)) as c:
        conn = c.core.connection(dead.address)
        assert conn.is_down()  # backed off, as after any failed call
        assert c.lookup(tokens).reused_tokens == 0  # a miss at once, no second attempt
        assert c.stats().server_errors == {dead.address: 1}
