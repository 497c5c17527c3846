"""The scheduler never waits on the network: a lookup in flight answers "not yet".

vLLM 0.32 lets ``get_num_new_matched_tokens`` return None while a lookup runs and asks
again on a later step. The server here is real, with every Lookup held 500 ms and then
until the test releases it (``tests/support/slow_lookups``), so "the lookup is still in
flight" is an event the test controls, not a race: another request's whole step runs
while it is held, and the held request is claimed on the first call after its lookup
answered. The halves run without vLLM (as test_halves.py); the engine test
(engine/test_async_lookup_engine.py) runs the same in a real vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from nopecache.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from tests.support.slow_lookups import SlowServer
from tests.support.vllm_halves import LAYERS, _Engine, _request

PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks
QUERY = "?lookup_timeout=30s"  # longer than any hold here: a held lookup never times out


@pytest.fixture
def slow() -> Iterator[SlowServer]:
    server = SlowServer()
    yield server
    server.stop()


def test_a_held_lookup_costs_its_request_steps_not_the_batch(slow: SlowServer) -> None:
    a, b = _Engine(slow, 1, QUERY), _Engine(slow, 2, QUERY)
    try:
        a.step(_request("r1", PROMPT), [3, 0, 2, 1], 0)  # stored (lookups not held yet)
        released = False

        async def release() -> bool:
            return released

        slow.lookups.delay_s = 0.5
        slow.lookups.release = release
        request = _request("r2", [*PROMPT[:12], 7, 8])
        assert b.scheduler.matched_tokens(request, 0) is None  # in flight: not yet
        # Another request's whole step (lookup-free: shorter than a block) runs now.
        short = b.step(_request("r3", [5, 6, 7]), [9], 0)
        assert short.claimed == 0 and [len(s.tokens) for s in short.plan.saves] == [3]
        assert b.scheduler.matched_tokens(request, 0) is None  # asked again: still held
        assert slow.lookups.gated == 0 and slow.lookups.answered < slow.lookups.held
        released = True
        claimed = b.matched(request, 0)  # a later step: the answer
        assert claimed == 12
        assert b.scheduler.totals.lookups == 1  # r2 looked up once, not once per call
        b.scheduler.after_alloc(request, [5, 6, 7, 8], claimed)
        output = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], new_block_ids=[], num_computed_tokens=[]
            ),
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
        )
        b.load(b.scheduler.build_step(output))
        assert b.worker.take_errors() == set()
        for layer in range(LAYERS):
            assert torch.equal(b.cache(layer)[:, [5, 6, 7]], a.cache(layer)[:, [3, 0, 2]])
    finally:
        a.close()
        b.close()


def test_a_finished_request_drops_its_lookup_in_flight(slow: SlowServer) -> None:
    b = _Engine(slow, 2, QUERY)
    try:
        released = False

        async def release() -> bool:
            return released

        slow.lookups.release = release
        request = _request("r1", PROMPT)
        assert b.scheduler.matched_tokens(request, 0) is None
        b.scheduler.finished(["r1"])  # aborted while its lookup was held
        released = True
        # Asked again (a new request with the same id): a fresh lookup, answered.
        assert b.matched(request, 0) == 0  # nothing stored
        assert b.scheduler.totals.lookups == 2
    finally:
        b.close()


@pytest.mark.parametrize("wait", [-1, "2", True, 1e5])
def test_bad_lookup_wait_names_the_key(wait: object) -> None:
    with pytest.raises(ConnectorConfigError, match="lookup_wait_ms"):
        ConnectorConfig.from_extra_config(
            {"url": "nopecache://127.0.0.1:1", "lookup_wait_ms": wait}
        )


def test_lookup_wait_default_and_value() -> None:
    url = "nopecache://127.0.0.1:1"
    assert ConnectorConfig.from_extra_config({"url": url}).lookup_wait_ms == 2.0
    assert ConnectorConfig.from_extra_config({"url": url, "lookup_wait_ms": 0}).lookup_wait_ms == 0


def test_loads_run_in_the_background_by_default() -> None:
    url = "nopecache://127.0.0.1:1"
    assert ConnectorConfig.from_extra_config({"url": url}).load_async is True
    off = ConnectorConfig.from_extra_config({"url": url, "load_async": False})
    assert off.load_async is False
    with pytest.raises(ConnectorConfigError, match="load_async"):
        ConnectorConfig.from_extra_config({"url": url, "load_async": "yes"})
