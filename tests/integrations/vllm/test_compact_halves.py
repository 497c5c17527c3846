"""Compact stored forms (``kv_codec``) in the connector's two halves, against a real server
without vLLM: a claim of compact blocks is approximate from its first block on (vLLM's
block hashes salted, nothing stored after it), and a raw engine never finds them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import LAYERS, _Engine, _request

PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks of 4
FP8 = "?lookup_timeout=300ms&kv_codec=fp8"


@pytest.fixture
def engines(cache_server: CacheServerProc) -> Any:
    a, b = _Engine(cache_server, 1, FP8), _Engine(cache_server, 2, FP8)
    raw = _Engine(cache_server, 3)
    yield a, b, raw
    for engine in (a, b, raw):
        engine.close()


def test_a_compact_claim_is_loaded_approximately_salted_and_never_stored(engines: Any) -> None:
    a, b, raw = engines
    first = a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)
    assert first.claimed == 0 and [len(s.tokens) for s in first.plan.saves] == [14]

    request = _request("r2", [*PROMPT[:12], 7, 8, 9, 10, 11])
    exact_hashes = list(request.block_hashes)
    second = b.step(request, [5, 6, 7, 8, 9], 0)
    assert second.claimed == 12
    assert b.worker.take_errors() == set()
    # Every block hash from the first claimed block on is salted: vLLM's own prefix cache
    # never serves the compact KV (or what attended to it) as exact to the next request.
    assert all(new != old for new, old in zip(request.block_hashes, exact_hashes, strict=True))
    # Approximate from position 0: the request stores nothing.
    assert second.plan.saves == ()
    for layer in range(LAYERS):  # fp8 of A's K and V: close, not equal
        got, want = b.cache(layer)[:, [5, 6, 7]], a.cache(layer)[:, [3, 0, 2]]
        assert not torch.equal(got, want)
        scale = want.abs().amax() / 448
        err = (got - want).abs()
        assert bool((err <= torch.maximum(want.abs() / 16, scale / 1024) * 1.01).all())

    # An engine without the codec keys by another fingerprint: nothing to claim.
    third = raw.step(_request("r3", PROMPT), [10, 11, 4, 1], 0)
    assert third.claimed == 0
