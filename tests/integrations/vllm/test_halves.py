"""The connector's two halves against a real server, without vLLM.

The scheduler half and the worker half are driven with the inputs vLLM gives them
(requests with token ids and block hashes, scheduler outputs, paged caches in the
FlashAttention layout built on CPU tensors), so the claim -> load -> place and save paths
are checked exactly and fast; tests/integrations/vllm/engine/ runs the same code inside real vLLM engines.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nopecache.integrations.vllm.events import Removed, StoredRun
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import LAYERS, _Engine, _request


@pytest.fixture
def pair(cache_server: CacheServerProc) -> Any:
    a, b = _Engine(cache_server, 1), _Engine(cache_server, 2)
    yield a, b
    a.close()
    b.close()


PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks


def test_second_engine_loads_the_first_ones_blocks_bit_exact(pair: Any) -> None:
    a, b = pair
    first = a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
    assert first.claimed == 0
    assert [len(s.tokens) for s in first.plan.saves] == [14]  # the partial block too
    stored = a.scheduler.announced.take()
    assert [len(s.block_hashes) for s in stored] == [3]  # vLLM hashes whole blocks only
    assert [len(s.token_ids) for s in stored if isinstance(s, StoredRun)] == [12]

    second = b.step(_request("r2", [*PROMPT[:12], 7, 8, 9, 10, 11]), [5, 6, 7, 8, 9], 0)
    assert second.claimed == 12
    assert b.worker.take_errors() == set()
    for layer in range(LAYERS):  # vLLM's post-RoPE K and V, copied without a change
        assert torch.equal(b.cache(layer)[:, [5, 6, 7]], a.cache(layer)[:, [3, 0, 2]])
    report = b.worker.take_report()
    assert report is not None and report.loaded_exact_tokens == 12


def test_the_partial_last_block_is_stored_too(pair: Any) -> None:
    # A message that ends a prompt is reusable whole only if its last, partial block is
    # stored: the report-before-the-system-prompt case reuses the system prompt's tail.
    a, b = pair
    a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
    plan = b.client.lookup(PROMPT)
    assert plan.prefix_end == 12  # exact blocks are whole; the tail is in the chunk
    assert max(hit.target.end for hit in plan.hits) == 14
    fetched = b.client.fetch(plan, PROMPT)
    assert bool(fetched.mask.all())
    for layer in range(LAYERS):  # positions 12, 13: the first two slots of A's block 1
        assert torch.equal(fetched.v[layer, 12:], a.cache(layer)[1, 1, :2])
        # K went through nope form (un-rotated, stored, re-rotated): fp32 rounding.
        assert torch.allclose(fetched.k[layer, 12:], a.cache(layer)[0, 1, :2], atol=1e-5)


def test_claims_stop_before_the_last_token_and_at_vllms_cache(pair: Any) -> None:
    a, b = pair
    a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
    # The same 12 tokens again: the last token is never claimed, so one block less.
    assert b.matched(_request("r2", PROMPT[:12]), 0) == 8
    # vLLM already holds the first block: only the rest is claimed.
    assert b.matched(_request("r3", PROMPT), 4) == 8


def test_a_claim_whose_server_died_is_a_load_error(
    pair: Any, cache_server: CacheServerProc
) -> None:
    a, b = pair
    a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
    request = _request("r2", PROMPT)
    claimed = b.matched(request, 0)
    assert claimed == 12
    b.scheduler.after_alloc(request, [5, 6, 7, 8], claimed)
    cache_server.kill()
    before = [b.cache(i).clone() for i in range(LAYERS)]
    output = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )
    b.load(b.scheduler.build_step(output))
    assert b.worker.take_errors() == {5, 6, 7}
    assert all(torch.equal(b.cache(i), before[i]) for i in range(LAYERS))
    # With the server gone, the next lookup claims nothing.
    assert b.matched(_request("r3", PROMPT), 0) == 0


def test_evicted_blocks_are_announced_removed(pair: Any, cache_server: CacheServerProc) -> None:
    a, _ = pair
    request = _request("r1", PROMPT)
    a.step(request, [3, 0, 2, 1], 0)
    (stored,) = a.scheduler.announced.take()
    cache_server.kill()
    cache_server.start()  # a restarted server holds nothing
    assert a.matched(_request("r2", PROMPT), 0) == 0
    assert a.scheduler.announced.take() == [Removed(stored.block_hashes)]
    assert a.scheduler.announced.take() == []
