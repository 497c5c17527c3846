"""The worker's loads go through the client's paged contract and the kernel API.

Each load builds a ``PagedKV`` over vLLM's own pages (``KVLayout.paged``) and fetches
``into=`` it: every block lands through ``rerope_scatter_layers`` (wrapped here to count
its calls), in both of vLLM's layouts, with nothing fetched for the positions vLLM holds
already. Real server, the connector's halves without vLLM (as test_halves.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import nopecache.client.placement as placement
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import BS, LAYERS, _Engine, _request

PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks


class _KernelCalls:
    """``rerope_scatter_layers`` wrapped: each call's written slots, then the real kernel."""

    def __init__(self) -> None:
        self.slots: list[list[int]] = []

    def wrap(self, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> None:
            slots = args[3]
            self.slots.append([int(s) for s in slots.tolist() if s >= 0])
            real(*args, **kwargs)

        return counted

    @property
    def written(self) -> list[int]:
        return sorted(s for call in self.slots for s in call)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[_KernelCalls]:
    calls = _KernelCalls()
    monkeypatch.setattr(
        placement, "rerope_scatter_layers", calls.wrap(placement.rerope_scatter_layers)
    )
    yield calls


@pytest.mark.parametrize(
    ("layout", "device"),
    [("flash", "cpu"), ("cpu", "cpu"), pytest.param("flash", "cuda", marks=pytest.mark.gpu)],
)
def test_prefix_loads_land_through_the_kernel_past_vllms_own_blocks(
    cache_server: CacheServerProc, kernel: _KernelCalls, layout: str, device: str
) -> None:
    # On CUDA (make gpu-check) the FlashAttention caches take the Triton kernel, and A's
    # save gathers from a CUDA cache into pinned host memory (layout.blocks_to_host).
    a = _Engine(cache_server, 1, layout=layout, device=device)
    b = _Engine(cache_server, 2, layout=layout, device=device)
    try:
        a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
        assert kernel.slots == []  # a stores only
        before = [tuple(t.clone() for t in b.kv(layer)) for layer in range(LAYERS)]
        fetched = b.client.stats().fetched_blocks
        fetched_bytes = b.client.stats().fetched_bytes
        # vLLM holds the first block locally (block 5): the claim is blocks 6 and 7.
        second = b.step(_request("r2", [*PROMPT[:12], 7, 8]), [5, 6, 7, 8], BS)
        assert second.claimed == 8
        assert b.worker.take_errors() == set()
        # One kernel call per block, each writing exactly its claimed slots.
        assert kernel.slots == [[6 * BS + i for i in range(BS)], [7 * BS + i for i in range(BS)]]
        # Only the two claimed blocks travelled; vLLM's own block was not fetched.
        assert b.client.stats().fetched_blocks - fetched == 2
        for layer in range(LAYERS):
            (ka, va), (kb, vb) = a.kv(layer), b.kv(layer)
            assert torch.equal(kb[[6, 7]], ka[[0, 2]]) and torch.equal(vb[[6, 7]], va[[0, 2]])
            others = [i for i in range(kb.shape[0]) if i not in (6, 7)]
            assert torch.equal(kb[others], before[layer][0][others])
            assert torch.equal(vb[others], before[layer][1][others])
        report = b.worker.take_report()
        assert report is not None and report.loaded_exact_tokens == 8
        # The fetch is reported for the scheduler's cost check (its client never fetches).
        assert report.fetched_bytes == b.client.stats().fetched_bytes - fetched_bytes > 0
        assert report.fetch_seconds > 0
    finally:
        a.close()
        b.close()


def test_a_hit_straddling_the_engines_prefix_moves_only_its_slotted_rows(
    cache_server: CacheServerProc, kernel: _KernelCalls
) -> None:
    # The prompt's tail [12, 14) is one position-independent hit (the partial last
    # block); the engine holds position 12 already (slot -1): one row lands, through the
    # kernel, and only the tail's block is fetched.
    a, b = _Engine(cache_server, 1, layout="cpu"), _Engine(cache_server, 2, layout="cpu")
    try:
        a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
        plan = b.client.lookup(PROMPT)
        assert [(h.target.start, h.target.end) for h in plan.hits] == [(12, 14)]
        slots = torch.full((len(PROMPT),), -1, dtype=torch.int64)
        slots[13] = 9 * BS + 1
        assert b.worker.layout is not None
        into = b.worker.layout.paged(b.worker.caches, slots)
        before = [tuple(t.clone() for t in b.kv(layer)) for layer in range(LAYERS)]
        fetched = b.client.stats().fetched_blocks
        result = b.client.fetch(plan, PROMPT, into=into)
        assert b.client.stats().fetched_blocks - fetched == 1
        assert kernel.slots == [[9 * BS + 1]]
        assert result.mask.tolist() == [False] * 13 + [True]
        for layer in range(LAYERS):
            (ka, va), (kb, vb) = a.kv(layer), b.kv(layer)
            # A stored position 13 in its block 1, offset 1 (post-RoPE K went through
            # nope form and back: fp32 rounding; V exact).
            assert torch.equal(vb[9, 1], va[1, 1])
            assert torch.allclose(kb[9, 1], ka[1, 1], atol=1e-5)
            kb[9, 1], vb[9, 1] = before[layer][0][9, 1], before[layer][1][9, 1]
            assert torch.equal(kb, before[layer][0]) and torch.equal(vb, before[layer][1])
    finally:
        a.close()
        b.close()


def test_a_cache_on_another_device_never_fails_the_worker(
    cache_server: CacheServerProc, caplog: pytest.LogCaptureFixture
) -> None:
    # The caches on the meta device stand in for CUDA's on this CPU-only machine: any
    # step that mixes them with host tensors fails here as it does on a GPU. Regression:
    # the save gathered with index_select(cache, out=<host tensor>), which raised out of
    # wait_for_save (on CUDA: the worker died at the first finished prefill).
    a = _Engine(cache_server, 1)
    b = _Engine(cache_server, 2, device="meta")
    try:
        a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
        with caplog.at_level(logging.ERROR, logger="vllm.nopecache.integrations.vllm.worker"):
            second = b.step(_request("r2", PROMPT), [5, 6, 7, 8], 0)
        assert second.claimed == 12
        # The load could not place into meta pages: its blocks go back to vLLM, recomputed.
        assert b.worker.take_errors() == {5, 6, 7}
        report = b.worker.take_report()
        assert report is not None
        assert (report.load_errors, report.load_failures, report.failed_requests) == (
            3,
            1,
            ["r2"],
        )
        assert (report.save_failures, report.saved_tokens) == (1, 0)
        # The gather ran on the caches' device: what failed is the one copy out of it
        # (meta holds no data), never a gather across devices.
        (saved,) = [r for r in caplog.records if "saving r2 failed" in r.getMessage()]
        assert saved.exc_info is not None
        assert str(saved.exc_info[1]) == "Cannot copy out of meta tensor; no data!"
        assert not any("cross-device" in r.getMessage() + str(r.exc_info) for r in caplog.records)
        # Nothing of r2 was stored: A's blocks are the only ones under this prompt.
        assert b.client.stats().stored_blocks == 0
    finally:
        a.close()
        b.close()
