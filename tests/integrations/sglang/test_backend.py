"""The HiCache storage backend against SGLang's real classes: factory, host pools, pages.

Every backend is built by SGLang's ``StorageBackendFactory.create_backend("dynamic", ...)``
and registered with a real ``MHATokenToKVPoolHost``; pages go through a real nopecache
server on loopback. One host pool writes (the first "engine"), another reads (the second).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

from nopecache.integrations.sglang.backend import NopecacheStorage
from tests.integrations.sglang.conftest import (
    PAGE_SIZE,
    BackendFactory,
    HostFactory,
    extra_config,
    storage_config,
)
from tests.support.server_procs import CacheServerProc

LAYOUTS = ["page_first", "page_first_direct", "layer_first"]


def url_of(server: CacheServerProc) -> str:
    return f"nopecache://{server.address}"


def fill(host: object, seed: int) -> None:
    """Random bytes in every page of ``host`` (any bit pattern: bf16 NaNs too)."""
    raw = host.kv_buffer.view(torch.uint8)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def token_slots(pages: list[int]) -> torch.Tensor:
    """SGLang's host indices of whole pages: ``page_size`` token slots per page."""
    parts = [torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in pages]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def page_bytes(host: object, page: int) -> bytes:
    """A page's bytes as SGLang's own flat page (layout independent)."""
    return bytes(host.get_data_page(page * PAGE_SIZE).view(torch.uint8).numpy())  # type: ignore[attr-defined]


def test_factory_builds_backend_from_extra_config(
    cache_server: CacheServerProc, host_pool: HostFactory, tiny_model: Path, model_config: Any
) -> None:
    host = host_pool("page_first")
    config = storage_config(extra_config(url_of(cache_server), namespace="team-a"))
    backend = StorageBackendFactory.create_backend(
        "dynamic", config, host, model_config=model_config
    )
    try:
        assert type(backend) is NopecacheStorage
        backend.register_mem_pool_host(host)
        assert backend.settings.namespace == "team-a"
        assert backend.settings.interface_v1 is True
        assert backend.mem_pool_host is host
        assert backend.geometry.order == "token_major"
        assert backend.fingerprint("token_major").model == str(tiny_model)
    finally:
        backend.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_move_bit_exact_between_two_host_pools(
    cache_server: CacheServerProc,
    host_pool: HostFactory,
    backends: BackendFactory,
    layout: str,
) -> None:
    writer_host, reader_host = host_pool(layout), host_pool(layout)
    fill(writer_host, seed=1)
    writer = backends(writer_host, extra_config(url_of(cache_server)))
    reader = backends(reader_host, extra_config(url_of(cache_server)))
    keys = [f"hash-{i}" for i in range(5)]
    src_pages, dst_pages = [3, 7, 8, 20, 1], [30, 2, 11, 5, 9]

    assert writer.batch_set_v1(keys, token_slots(src_pages)) == [True] * 5
    assert reader.batch_exists(keys) == 5
    assert reader.batch_get_v1(keys, token_slots(dst_pages)) == [True] * 5

    for s, d in zip(src_pages, dst_pages, strict=True):
        assert page_bytes(reader_host, d) == page_bytes(writer_host, s)
    untouched = [p for p in range(reader_host.page_num) if p not in dst_pages]
    assert all(not any(page_bytes(reader_host, p)) for p in untouched)
    # Storing again finds the pages present and sends nothing new.
    assert writer.batch_set_v1(keys, token_slots(src_pages)) == [True] * 5


def test_consecutive_hits_stop_at_the_first_gap(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    host = host_pool("page_first")
    fill(host, seed=2)
    backend = backends(host, extra_config(url_of(cache_server)))
    keys = ["a", "b", "c", "d", "e"]
    stored = [0, 1, 3]
    assert backend.batch_set_v1([keys[i] for i in stored], token_slots([4, 5, 6])) == [True] * 3

    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists(keys[3:4]) == 1
    assert backend.exists("d") is True and backend.exists("c") is False
    assert backend.batch_get_v1(keys, token_slots([10, 11, 12, 13, 14])) == [
        True,
        True,
        False,
        True,
        False,
    ]


def test_legacy_flat_pages_round_trip_and_meet_v1_layer_major_pages(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    """SGLang's generic path moves flat pages ([2, layers, page, heads, dim]): the same bytes
    as a layer-major pool's v1 pages, so the two meet; a page_first pool's do not."""
    src = host_pool("page_first")
    fill(src, seed=3)
    legacy = backends(src, extra_config(url_of(cache_server), interface_v1=0))
    flat = [src.get_data_page(p * PAGE_SIZE) for p in (2, 9)]
    assert legacy.batch_set(["x", "y"], flat) is True
    assert legacy.set("z", src.get_data_page(4 * PAGE_SIZE)) is True
    assert legacy.batch_exists(["x", "y", "z"]) == 3

    dummy = [src.get_dummy_flat_data_page() for _ in range(3)]
    got = legacy.batch_get(["x", "y", "missing"], dummy)
    assert got[2] is None
    assert got[0] is not None and torch.equal(got[0].view(torch.uint8), flat[0].view(torch.uint8))
    one = legacy.get("z")
    assert one is not None
    assert bytes(one.view(torch.uint8).numpy()) == page_bytes(src, 4)

    lf = host_pool("layer_first")
    v1 = backends(lf, extra_config(url_of(cache_server)))
    assert v1.batch_get_v1(["x", "y"], token_slots([0, 1])) == [True, True]
    assert page_bytes(lf, 0) == page_bytes(src, 2)
    assert page_bytes(lf, 1) == page_bytes(src, 9)

    pf = host_pool("page_first")
    token_major = backends(pf, extra_config(url_of(cache_server)))
    assert token_major.batch_exists(["x"]) == 0


def test_page_first_and_layer_first_pages_never_meet(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    pf, lf = host_pool("page_first"), host_pool("layer_first")
    fill(pf, seed=4)
    a = backends(pf, extra_config(url_of(cache_server)))
    b = backends(lf, extra_config(url_of(cache_server)))
    assert a.batch_set_v1(["k"], token_slots([1])) == [True]
    assert a.fingerprint("token_major") != b.fingerprint(b.geometry.order)
    assert b.batch_exists(["k"]) == 0
    assert b.batch_get_v1(["k"], token_slots([1])) == [False]
    assert not any(page_bytes(lf, 1))


def test_namespaces_and_tp_ranks_do_not_share(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    host = host_pool("page_first")
    fill(host, seed=5)
    a = backends(host, extra_config(url_of(cache_server), namespace="a"))
    assert a.batch_set_v1(["k"], token_slots([1])) == [True]
    assert (
        backends(
            host_pool("page_first"), extra_config(url_of(cache_server), namespace="b")
        ).batch_exists(["k"])
        == 0
    )
    other_rank = backends(
        host_pool("page_first"),
        extra_config(url_of(cache_server), namespace="a"),
        tp_rank=1,
        tp_size=2,
    )
    assert other_rank.batch_exists(["k"]) == 0
    assert (
        backends(
            host_pool("page_first"), extra_config(url_of(cache_server), namespace="a")
        ).batch_exists(["k"])
        == 1
    )


def test_mla_only_rank_zero_writes(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    rank1_host, rank0_host = host_pool("page_first"), host_pool("page_first")
    fill(rank1_host, seed=6)
    fill(rank0_host, seed=7)
    rank1 = backends(
        rank1_host, extra_config(url_of(cache_server)), is_mla_model=True, tp_rank=1, tp_size=2
    )
    rank0 = backends(
        rank0_host, extra_config(url_of(cache_server)), is_mla_model=True, tp_rank=0, tp_size=2
    )
    # SGLang skips non-writers' backups itself; asked anyway, rank 1 stores nothing.
    assert rank1.batch_set_v1(["m"], token_slots([2])) == [True]
    assert rank1.batch_exists(["m"]) == 0
    assert rank0.batch_set_v1(["m"], token_slots([3])) == [True]
    # The latent is replicated: every rank reads what rank 0 wrote.
    assert rank1.batch_get_v1(["m"], token_slots([5])) == [True]
    assert page_bytes(rank1_host, 5) == page_bytes(rank0_host, 3)


def test_bad_host_indices_are_misses_not_errors(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    host = host_pool("page_first")
    backend = backends(host, extra_config(url_of(cache_server)))
    assert backend.batch_set_v1(["a", "b"], token_slots([1])) == [False, False]  # too few
    assert backend.batch_get_v1(["a"], torch.arange(1, 1 + PAGE_SIZE)) == [False]  # unaligned
    assert backend.batch_get_v1(["a"], token_slots([10_000])) == [False]  # past the pool
    assert backend.batch_set_v1([], token_slots([])) == []
    assert backend.batch_exists([]) == 0


def test_clear_removes_this_process_pages_and_stats_count_them(
    cache_server: CacheServerProc, host_pool: HostFactory, backends: BackendFactory
) -> None:
    host = host_pool("page_first")
    fill(host, seed=8)
    backend = backends(host, extra_config(url_of(cache_server)), enable_storage_metrics=True)
    assert backend.batch_set_v1(["p", "q"], token_slots([1, 2])) == [True, True]
    assert backend.batch_get_v1(["p", "q"], token_slots([3, 4])) == [True, True]
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [2] and stats.prefetch_pgs == [2]
    assert len(stats.backup_bandwidth) == 1 and stats.backup_bandwidth[0] > 0
    assert backend.get_stats().prefetch_pgs == []  # drained
    backend.clear()
    assert backend.batch_exists(["p", "q"]) == 0
