"""Blend mode's claim, its settings and its fall-backs, without vLLM (tests/integrations/vllm/engine runs it in
real engines).

The scheduler and worker halves run against a real server with the inputs vLLM gives them
(requests with token ids and block hashes, a paged cache), as in test_halves.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nopecache.client.chunking import ChunkSpan
from nopecache.client.keys import BlockKey
from nopecache.client.plan import Hit, HitKind, ReusePlan
from nopecache.integrations.vllm.blend import (
    blend_claim_end,
    blend_claim_ends,
    blend_layout,
    blend_pays,
)
from nopecache.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from nopecache.integrations.vllm.metadata import StepReport
from nopecache.proto.block import StoredForm
from nopecache.recompute.policies import DEFAULT_POLICY, first_k
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import BS, _Engine, _request

URL = "nopecache://127.0.0.1:1"
SMALL_CHUNKS = "?lookup_timeout=300ms&chunk_min_tokens=2&chunk_avg_tokens=4&chunk_max_tokens=8"


def _hit(start: int, end: int, kind: HitKind) -> Hit:
    key = BlockKey(bytes(16))
    return Hit(key, ChunkSpan(start, end), ChunkSpan(0, end - start), StoredForm.ROPE, kind)


def _plan(num_tokens: int, prefix_end: int, hits: list[tuple[int, int]]) -> ReusePlan:
    prefix = tuple(_hit(i, i + BS, HitKind.PREFIX) for i in range(0, prefix_end, BS))
    pi = tuple(_hit(s, e, HitKind.POSITION_INDEPENDENT) for s, e in hits)
    misses, pos = [], prefix_end
    for s, e in hits:
        if s > pos:
            misses.append(ChunkSpan(pos, s))
        pos = e
    if pos < num_tokens:
        misses.append(ChunkSpan(pos, num_tokens))
    return ReusePlan(num_tokens, prefix, pi, tuple(misses))


def test_blend_claim_ends_at_the_last_hit_block_aligned() -> None:
    plan = _plan(40, 8, [(13, 19), (22, 31)])
    assert blend_claim_end(plan, start=0, limit=36, block_size=BS) == 28
    assert blend_claim_end(plan, start=0, limit=24, block_size=BS) == 24  # the limit cuts
    assert blend_claim_end(_plan(40, 8, []), start=0, limit=36, block_size=BS) == 8
    assert blend_claim_end(_plan(40, 0, []), start=12, limit=36, block_size=BS) == 12


def test_blend_claim_may_end_at_any_hit_block_aligned() -> None:
    plan = _plan(40, 8, [(13, 19), (22, 31)])
    assert blend_claim_ends(plan, start=0, limit=36, block_size=BS) == [8, 16, 28]
    assert blend_claim_ends(plan, start=16, limit=24, block_size=BS) == [24]
    assert blend_claim_ends(_plan(40, 0, []), start=0, limit=36, block_size=BS) == []


def test_blend_layout_marks_exact_reused_and_missing_positions() -> None:
    plan = _plan(40, 8, [(13, 19), (22, 31)])
    layout = blend_layout(plan, 4, 28)
    assert (layout.num_tokens, layout.prefix_end) == (28, 8)
    assert layout.chunks == (ChunkSpan(13, 19), ChunkSpan(22, 28))
    # vLLM's own cache covers more than the servers' exact prefix: hits below it are unused.
    assert blend_layout(plan, 16, 28).chunks == (ChunkSpan(16, 19), ChunkSpan(22, 28))
    # A hit that did not load becomes misses; an exact block that did not, the prefix's end.
    loaded = torch.ones(40, dtype=torch.bool)
    loaded[14] = False
    loaded[5] = False
    failed = blend_layout(plan, 0, 28, loaded)
    assert failed.prefix_end == 5 and failed.chunks == (ChunkSpan(22, 28),)


def test_blend_pays_when_the_loop_and_fetch_cost_less_than_vllms_prefill() -> None:
    layout = blend_layout(_plan(40, 0, [(8, 28)]), 0, 28)  # 8 misses, then 20 reused
    assert layout.num_pi == 20
    rate = 100.0  # tokens/s: vLLM prefills the 28 in 0.28 s; the loop computes 8 + 3 tokens
    assert blend_pays(layout, 0.15, prefill_tokens_per_s=rate, fetch_s=0.1)
    assert not blend_pays(layout, 0.15, prefill_tokens_per_s=rate, fetch_s=0.2)
    # A loop measured at half vLLM's rate costs 0.22 s: a 0.1 s fetch no longer pays.
    assert not blend_pays(
        layout, 0.15, prefill_tokens_per_s=rate, fetch_s=0.1, loop_tokens_per_s=rate / 2
    )
    assert blend_pays(layout, 1.0, prefill_tokens_per_s=rate, fetch_s=10.0)  # the check mode
    no_pi = blend_layout(_plan(40, 8, []), 0, 8)
    assert not blend_pays(no_pi, 0.15, prefill_tokens_per_s=rate, fetch_s=0)


def test_blend_settings_and_their_defaults() -> None:
    config = ConnectorConfig.from_extra_config({"url": URL, "pi_reuse": "blend"})
    assert config.blend and config.policy().name == DEFAULT_POLICY.name
    config = ConnectorConfig.from_extra_config(
        {"url": URL, "pi_reuse": "blend", "recompute_policy": "first_k", "recompute_budget": 1}
    )
    assert config.policy().name == first_k(1.0).name


def test_blend_check_share_and_rope_override_settings() -> None:
    config = ConnectorConfig.from_extra_config({"url": URL, "pi_reuse": "blend"})
    assert config.blend_check_share == 0.01 and config.rope_override is None
    config = ConnectorConfig.from_extra_config(
        {
            "url": URL,
            "pi_reuse": "blend",
            "blend_check_share": 0,
            "rope_override": {"rope_type": "linear", "factor": 2.0},
        }
    )
    assert config.blend_check_share == 0.0
    assert config.rope_override == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"recompute_policy": "blend"}, "['recompute_policy']: applies to pi_reuse=\"blend\""),
        (
            {"pi_reuse": "contiguous", "recompute_budget": 0.2},
            "['recompute_budget']: applies to pi_reuse=\"blend\" only",
        ),
        ({"pi_reuse": "blend", "recompute_policy": "best"}, "['recompute_policy']: must be one of"),
        ({"pi_reuse": "blend", "recompute_budget": 1.5}, "['recompute_budget']: must be a number"),
        ({"pi_reuse": "blend", "recompute_budget": True}, "['recompute_budget']: must be a number"),
        ({"blend_check_share": 0.5}, "['blend_check_share']: applies to pi_reuse=\"blend\" only"),
        ({"pi_reuse": "blend", "blend_check_share": -0.1}, "['blend_check_share']: must be a"),
        ({"pi_reuse": "blend", "blend_check_share": 2}, "['blend_check_share']: must be a number"),
        ({"pi_reuse": "blend", "blend_check_share": "1%"}, "['blend_check_share']: must be a"),
        ({"rope_override": {}}, "['rope_override']: must be a non-empty object"),
        ({"rope_override": 10000}, "['rope_override']: must be a non-empty object"),
    ],
)
def test_bad_blend_settings_name_the_key(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConnectorConfigError) as err:
        ConnectorConfig.from_extra_config({"url": URL, **extra})
    assert message in str(err.value)


SEGMENT = [1, *range(50, 62)]  # 13 tokens, a message starting with the segment token 1


@pytest.fixture
def blend_pair(cache_server: CacheServerProc) -> Any:
    a = _Engine(cache_server, 1, SMALL_CHUNKS, segment_token_ids=[1])
    b = _Engine(cache_server, 2, SMALL_CHUNKS, segment_token_ids=[1], pi_reuse="blend")
    yield a, b
    a.close()
    b.close()


def _moved_segment_claim(a: _Engine, b: _Engine) -> tuple[Any, list[int], int]:
    """A stores the segment at position 0; B's prompt has it at 8..21 and claims it: the
    request, vLLM's exact hashes of it before the claim, and the claimed tokens."""
    a.step(_request("r1", [*SEGMENT, 1, 70, 71]), [0, 1, 2, 3], 0)  # stored at position 0
    prompt = [1, *range(90, 97), *SEGMENT, 1, 80, 81, 82]  # the segment moved to 8..21
    request = _request("r2", prompt)
    exact_hashes = list(request.block_hashes)
    return request, exact_hashes, b.matched(request, 0)


def _blend_step(b: _Engine, request: Any, claimed: int) -> Any:
    """B's step plan once vLLM allocated the claim's blocks."""
    b.scheduler.after_alloc(request, [4, 5, 6, 7, 8, 9, 10], claimed)
    assert b.scheduler.claim_is_async("r2") is False
    output = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
    )
    return b.scheduler.build_step(output)


def test_blend_claim_covers_a_moved_segment_and_salts_vllms_hashes(blend_pair: Any) -> None:
    a, b = blend_pair
    request, exact_hashes, claimed = _moved_segment_claim(a, b)
    assert claimed == 20  # to the segment's last hit (21), block aligned; misses included
    assert all(new != old for new, old in zip(request.block_hashes, exact_hashes, strict=True))
    step = _blend_step(b, request, claimed)
    (load,) = step.loads
    assert load.blend and (load.start, load.end) == (0, 20)
    totals = b.scheduler.totals
    assert totals.blend_claimed_tokens == 20 and totals.claimed_pi_tokens == 12
    # This worker has no model to run the loop: the claim falls back, never wrong KV.
    b.worker.refuse_blend("no model in this test")
    b.load(step)
    assert b.worker.take_errors() == {4, 5, 6, 7, 8}  # vLLM recomputes the whole range
    report = b.worker.take_report()
    assert report is not None and report.blend_fallbacks == 1
    assert report.loaded_pi_tokens == 0 and report.pi_token_layers == 0


def test_a_measured_blend_claim_ends_where_it_saves_the_most(blend_pair: Any) -> None:
    """Regression: the claim always ran to the last hit, so a small stored chunk near the
    prompt's end (a chat's generation prompt) put every miss before it in the slower
    layer loop; the whole claim then did not pay and the reusable message was lost."""
    a, b = blend_pair
    a.step(_request("r1", [*SEGMENT, 1, 70, 71]), [0, 1, 2, 3, 4], 0)  # [1, 70, 71] a chunk
    misses = [1, *range(200, 220)]  # 21 new tokens between the message and the chunk
    prompt = [1, 90, 91, 92, *SEGMENT, *misses, 1, 70, 71, 1, 5, 5]  # message at 4..17
    rates = b.scheduler.rates
    for _ in range(3):  # vLLM prefills 100 tokens/s, the loop runs at half that
        rates.observe(StepReport(computed_tokens=1000, forward_seconds=10.0))
    rates.observe(StepReport(blend_token_layers=2 * 500, blend_seconds=10.0))
    # To the chunk's end (40): 26 misses in the loop cost more than the 40 tokens save.
    # To the message's end (16): 4 misses, 12 reused: it pays.
    request = _request("r2", prompt)
    assert b.matched(request, 0) == 16
    assert b.scheduler.totals.blend_fallbacks == 0


def test_a_blend_loads_fetch_time_is_its_fetch_and_placement_not_the_layer_loop(
    blend_pair: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fetch_seconds / fetched_bytes compare blend loads with prefix loads (bench/vllm_serve's
    blend_load_mb_s): the layer loop after the fetch counts in load_seconds only."""
    a, b = blend_pair
    request, _, claimed = _moved_segment_claim(a, b)
    step = _blend_step(b, request, claimed)
    loop_seconds = 0.2

    def slow_loop(spec: Any, result: Any) -> None:  # stands in for the layer loop
        time.sleep(loop_seconds)

    monkeypatch.setattr(b.worker, "_blend_one", slow_loop)
    b.load(step)
    report = b.worker.take_report()
    assert report is not None and report.fetched_bytes > 0
    # The loop's time is in load_seconds and not in fetch_seconds, however long the fetch
    # took on this machine.
    assert report.fetch_seconds > 0
    assert report.load_seconds - report.fetch_seconds >= loop_seconds


def test_an_engine_without_blend_support_claims_prefixes_only(
    cache_server: CacheServerProc,
) -> None:
    a = _Engine(cache_server, 1, SMALL_CHUNKS, segment_token_ids=[1])
    b = _Engine(
        cache_server,
        2,
        SMALL_CHUNKS,
        blend_unsupported="model architecture ['GPT2LMHeadModel']",
        segment_token_ids=[1],
        pi_reuse="blend",
    )
    try:
        a.step(_request("r1", [*SEGMENT, 1, 70, 71]), [0, 1, 2, 3], 0)
        request = _request("r2", [1, *range(90, 97), *SEGMENT, 1, 80, 81, 82])
        hashes = list(request.block_hashes)
        assert b.matched(request, 0) == 0
        assert request.block_hashes == hashes
        assert b.scheduler.totals.blend_fallbacks == 1
    finally:
        a.close()
        b.close()


def test_a_contiguous_claim_keeps_what_it_computed_under_content_keys_only(
    cache_server: CacheServerProc,
) -> None:
    """Issue 33: tokens computed after a position-independent claim (a chat's new turn)
    attended to approximate KV: stored under content keys, so the next turn reuses them at
    any position, and never under exact-prefix keys."""
    writer = _Engine(cache_server, 1, SMALL_CHUNKS, segment_token_ids=[1])
    reader = _Engine(cache_server, 2, SMALL_CHUNKS, segment_token_ids=[1], pi_reuse="contiguous")
    exact_only = _Engine(cache_server, 3, SMALL_CHUNKS, segment_token_ids=[1])
    try:
        head = [1, *range(90, 97)]  # two blocks, stored as an exact prefix
        segment = [1, *range(50, 62)]  # a message, stored at position 0
        writer.step(_request("w1", [*segment, 1, 70, 71]), [0, 1, 2, 3], 0)
        writer.step(_request("w2", [*head, 5, 5, 5, 5]), [4, 5, 6], 0)
        new_turn = [1, *range(80, 87)]  # computed by the reader after its claim
        prompt = [*head, *segment, *new_turn]  # 29 tokens, the message moved to 8..21
        out = reader.step(_request("r1", prompt), list(range(8)), 0)
        assert out.claimed == 20  # 8 exact tokens, then the message's hits, block aligned
        (save,) = out.plan.saves
        assert save.tokens == tuple(prompt) and save.exact_end == 8
        assert save.block_ids == tuple(range(8))

        # The new turn's tokens are content blocks now: found at another position, with
        # the KV the reader computed for them (a chat's next turn reuses them).
        moved = [*new_turn, 1, 7, 7, 7]
        plan = reader.client.lookup(moved, segments=reader.config.segments(moved))
        covered = sorted(p for hit in plan.hits for p in range(hit.target.start, hit.target.end))
        assert covered == list(range(len(new_turn)))
        fetched = reader.client.fetch(plan, moved)
        k_stored, v_stored = fetched.k, fetched.v
        assert k_stored is not None and v_stored is not None
        for layer in range(2):
            _, v_reader = reader.kv(layer)
            rows = v_reader.reshape(-1, *v_reader.shape[2:])[21:29]  # slots 21..28
            assert torch.equal(v_stored[layer, : len(new_turn)], rows)

        # An exact-only engine finds the exact prefix only: nothing after the claim's
        # first position-independent block passes as exact.
        assert exact_only.matched(_request("e1", prompt), 0) == 8
    finally:
        writer.close()
        reader.close()
        exact_only.close()
