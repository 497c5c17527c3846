"""SGLang HiCache pages through nopecache: batch_set_v1 / batch_get_v1 against their ceilings.

Setup (all on 127.0.0.1): one ``python -m nopecache.cache_server`` child with a CPU tier;
in this process two real SGLang ``MHATokenToKVPoolHost`` pools (the writing engine's and
the reading engine's, bf16, page_first: SGLang's zero-copy layout) over a real device
pool, and two backends built by SGLang's ``StorageBackendFactory.create_backend("dynamic",
...)``. Each rep moves one batch of ``PAGES`` pages, each the best of ``--reps`` after a
warm-up, GB/s = 10^9 page bytes per second::

    tcp      a Python socket sending the batch's bytes from a preallocated buffer, received
             with recv_into a preallocated buffer on another thread: the loopback ceiling
    memcpy   one torch copy of the same bytes between two touched buffers
    set      writer.batch_set_v1(fresh keys, pages): Lookup, encode from the pool, Put (the
             bulk byte stream), shm=off: the network path
    get      reader.batch_get_v1(keys, pages): Get streams (bulk), verification, one copy
             of each payload into the reader's pool, shm=off
    shmget   the same get with shm=auto: a same-host reader maps the server's pages
    lf_set, lf_get   set and get with layer_first pools (a gather / scatter per batch)

Shapes: Llama-3-8B per rank (32 layers x 8 KV heads x 128, 8 MiB pages of 64 tokens);
``--quick``: SmolLM2-135M (30 x 3 x 64, 1.4 MiB pages of 64 tokens). RESULT keys:
``sglang_get_vs_tcp`` and ``sglang_set_vs_tcp`` (target >= 0.8, the data-plane issue's
network bar), ``sglang_shm_get_vs_memcpy``, then every path's GB/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from tests.support.sglang_cpu import prepare_sglang_import
from tests.support.sglang_pools import (
    cpu_device_pool,
    host_pool_over,
    tiny_model_config,
    tiny_model_folder,
)

prepare_sglang_import()

import torch  # noqa: E402
from _harness import best_of, cache_server  # noqa: E402
from dataplane import memcpy_seconds, tcp_seconds  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

# The RESULT line's keys, in order: tests/integrations/sglang/test_bench_quick.py checks
# a --quick run prints exactly these.
RESULT_KEYS = (
    "sglang_get_vs_tcp",
    "sglang_set_vs_tcp",
    "sglang_shm_get_vs_memcpy",
    "tcp_gbps",
    "memcpy_gbps",
    "sglang_get_gbps",
    "sglang_set_gbps",
    "sglang_shm_get_gbps",
    "layer_first_get_gbps",
    "layer_first_set_gbps",
)
SHAPES = {"llama3-8b": (32, 8, 128), "smollm2": (30, 3, 64)}
PAGE_SIZE = 64
PAGES = 16
_keys = itertools.count()


def host_pool(device: MHATokenToKVPool, layout: str) -> MHATokenToKVPoolHost:
    """A real host pool twice the device pool's size, touched (no page faults timed)."""
    # SGLang books host pools against free RAM minus a reserve; this names the budget.
    host = host_pool_over(device, layout, page_size=PAGE_SIZE, budget_bytes=1 << 40)
    host.kv_buffer.view(torch.uint8).fill_(7)
    return host


def backend(host: MHATokenToKVPoolHost, address: str, shm: str, model: Any) -> Any:
    """A backend built the way SGLang builds it (dynamic factory, registered pool), for
    ``model`` (SGLang's ModelConfig, which a server's backend reads from its server args)."""
    extra = {
        "backend_name": "nopecache",
        "module_path": "nopecache.integrations.sglang.backend",
        "class_name": "NopecacheStorage",
        "interface_v1": 1,
        "url": f"nopecache://{address}?shm={shm}",
    }
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first",
        model_name="bench",
        extra_config=json.loads(json.dumps(extra)),
    )
    b = StorageBackendFactory.create_backend("dynamic", config, host, model_config=model)
    b.register_mem_pool_host(host)
    return b


def slots(pages: range) -> torch.Tensor:
    """Host indices of whole pages, in the range's order."""
    return torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in pages])


def set_get(
    device: MHATokenToKVPool, address: str, layout: str, reps: int, model: Any
) -> dict[str, float]:
    """Seconds of the best batch_set_v1 (fresh keys each time) and batch_get_v1."""
    src, dst = host_pool(device, layout), host_pool(device, layout)
    raw = src.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    writer, reader = backend(src, address, "off", model), backend(dst, address, "off", model)
    shm_reader = (
        backend(host_pool(device, layout), address, "auto", model)
        if layout == "page_first"
        else None
    )
    pages_src, pages_dst = slots(range(1, PAGES + 1)), slots(range(PAGES, 0, -1))
    last: list[str] = []

    def put() -> None:
        keys = [f"page-{next(_keys)}" for _ in range(PAGES)]
        assert all(writer.batch_set_v1(keys, pages_src)), "a page was not stored"
        last[:] = keys

    out = {"set": best_of(reps, put)}

    def get(b: Any) -> None:
        assert all(b.batch_get_v1(last, pages_dst)), "a page was not fetched"

    out["get"] = best_of(reps, lambda: get(reader))
    if shm_reader is not None:
        out["shmget"] = best_of(reps, lambda: get(shm_reader))
    for a, b in zip(range(1, PAGES + 1), range(PAGES, 0, -1), strict=True):
        same = torch.equal(
            src.get_data_page(a * PAGE_SIZE).view(torch.uint8),
            dst.get_data_page(b * PAGE_SIZE).view(torch.uint8),
        )
        assert same, f"fetched page {b} differs from stored page {a}"
    for done in (writer, reader, shm_reader):
        if done is not None:
            done.close()
    return out


def main() -> None:
    """Run every path and print the RESULT line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: smollm2, one pass")
    args = parser.parse_args()
    name = "smollm2" if args.quick else "llama3-8b"
    if args.quick:
        args.reps = 1
    layers, heads, dim = SHAPES[name]
    device = cpu_device_pool(
        tokens=(PAGES + 1) * PAGE_SIZE,
        page_size=PAGE_SIZE,
        layers=layers,
        heads=heads,
        head_dim=dim,
    )
    nbytes = PAGES * PAGE_SIZE * layers * heads * dim * 2 * 2
    # Every rep stores PAGES fresh pages: room for all of them, both layouts.
    capacity = f"{math.ceil(nbytes * (2 * args.reps + 6) / 2**20)}MiB"
    print(f"{name}: {PAGES} pages of {nbytes // PAGES / 2**20:.2f} MiB; capacity {capacity}")
    gbps = {"tcp": nbytes / tcp_seconds(nbytes, args.reps) / 1e9}
    gbps["memcpy"] = nbytes / memcpy_seconds(nbytes, args.reps) / 1e9
    with (
        tempfile.TemporaryDirectory() as tmp,
        cache_server(capacity, Path(tmp) / "server.log") as addr,
    ):
        # A config of the pools' shape (the bench moves pages; no model runs).
        folder = tiny_model_folder(Path(tmp) / name, layers=layers, heads=heads, head_dim=dim)
        model = tiny_model_config(folder)
        for layout, prefix in (("page_first", ""), ("layer_first", "lf_")):
            for path, seconds in set_get(device, addr, layout, args.reps, model).items():
                gbps[prefix + path] = nbytes / seconds / 1e9
    for path, value in gbps.items():
        print(f"{path:>10} {value:7.2f} GB/s")
    result = {
        "sglang_get_vs_tcp": gbps["get"] / gbps["tcp"],
        "sglang_set_vs_tcp": gbps["set"] / gbps["tcp"],
        "sglang_shm_get_vs_memcpy": gbps["shmget"] / gbps["memcpy"],
        "tcp_gbps": gbps["tcp"],
        "memcpy_gbps": gbps["memcpy"],
        "sglang_get_gbps": gbps["get"],
        "sglang_set_gbps": gbps["set"],
        "sglang_shm_get_gbps": gbps["shmget"],
        "layer_first_get_gbps": gbps["lf_get"],
        "layer_first_set_gbps": gbps["lf_set"],
    }
    assert tuple(result) == RESULT_KEYS
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
