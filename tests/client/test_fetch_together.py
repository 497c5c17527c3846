"""A fetch into a paged cache off CUDA places the blocks that wait for the worker together
(``Download._place_arrived``): each still verified on its own, a bad one a miss that does
not cost the others, and every slot holds what one-by-one placement would write."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from nopecache.client import PagedKV
from nopecache.client.fetching import BlockPlacer
from nopecache.kernels.reference import rotate_reference
from tests.support.client_harness import (
    DIM,
    HEADS,
    LAYERS,
    SPEC,
    client,
    config,
    kv,
    prompt,
    put_forged_chunk,
)
from tests.support.server_procs import CacheServerProc, start_cache_servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[CacheServerProc]]:
    """Two servers (each test has a namespace)."""
    started = start_cache_servers(2, tmp_path_factory.mktemp("together-servers"))
    yield started
    for server in started:
        server.kill()


def test_blocks_that_waited_are_placed_together_and_a_bad_one_is_a_miss(
    servers: list[CacheServerProc], monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = prompt(120, seed=21)
    k, v = kv(120, seed=21)
    new = torch.cat([prompt(30, seed=22, low=10000), chunk])
    slots = torch.randperm(160, generator=torch.Generator().manual_seed(23))[:150]
    slots[:30] = -1  # the new first part: not claimed, not written
    caches = [torch.full((20, 8, HEADS, DIM), -7.0) for _ in range(2 * LAYERS)]
    into = PagedKV(caches[:LAYERS], caches[LAYERS:], slots)
    batches: list[int] = []
    place_many = BlockPlacer.place_many

    def counted(self: BlockPlacer, items: list[object], *args: object) -> list[bool]:
        batches.append(len(items))
        return place_many(self, items, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(BlockPlacer, "place_many", counted)
    with client(config(servers, "together")) as c:
        # One block's key holds a block of other tokens: a miss. Put first: the store then
        # finds the key present and keeps it. The chunk well past where the shifted
        # chunking resynchronises.
        victim = put_forged_chunk(c, "together", chunk, (k, v), -2)
        c.store(chunk, (k, v))
        plan = c.lookup(new)
        assert victim.key in [h.key for h in plan.hits] and len(plan.hits) >= 3
        # Hold the worker until every block has arrived: they are placed in one batch.
        release = threading.Event()
        c.core._worker.submit(release.wait)
        fetched = c.submit(c.core.fetch(plan, new, into=into))
        deadline = time.monotonic() + 60
        while c.core._worker._work_queue.qsize() < len(plan.hits):  # one job per block
            assert time.monotonic() < deadline, "the blocks never arrived"
            time.sleep(0.01)
        release.set()
        result = fetched.result(timeout=60)
    assert max(batches) > 1, batches
    assert [h.key for h in result.failed] == [victim.key]
    assert len(result.placed) == len(plan.hits) - 1
    assert c.stats().verify_failures == 1
    written: set[int] = set()
    for hit in result.placed:
        for pos in range(hit.target.start, hit.target.end):
            slot = int(slots[pos])
            written.add(slot)
            want = torch.stack(
                [
                    rotate_reference(k[i, pos - 30 : pos - 29], None, pos, SPEC)
                    for i in range(LAYERS)
                ]
            )
            for layer in range(LAYERS):
                assert torch.equal(into.k_caches[layer].view(-1, HEADS, DIM)[slot], want[layer, 0])
                assert torch.equal(
                    caches[LAYERS + layer].view(-1, HEADS, DIM)[slot], v[layer, pos - 30]
                )
    others = [s for s in range(160) if s not in written]
    assert all(bool((cache.view(-1, HEADS, DIM)[others] == -7.0).all()) for cache in caches)
