"""A claim made while the engine holds no other request loads before the step's forward
(``sync_when_idle``, the default with ``load_async``), without vLLM.

A background load makes its request wait in WAITING_FOR_REMOTE_KVS for the engine steps
that poll for it; that overlap pays only while other requests run. The connector's
halves run against a real server as in test_halves.py; the answer vLLM gets
(``claim_is_async``, asked between the claim and the allocation as vLLM's scheduler
does) and the worker's load spec must agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nopecache.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import LAYERS, _Engine, _request

PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks
READ = [*PROMPT[:12], 7, 8]  # shares the 3 blocks: a claim of 12 tokens


def _claim(engine: _Engine, req_id: str, block_ids: list[int]) -> tuple[bool, Any]:
    """The claim of ``READ`` as vLLM makes it: (the async answer, the step's plan)."""
    request = _request(req_id, READ)
    claimed = engine.matched(request, 0)
    assert claimed == 12
    asynchronous = engine.scheduler.claim_is_async(req_id)
    engine.scheduler.after_alloc(request, block_ids, claimed)
    output = engine.plan_output(request, block_ids, 0, claimed)
    return asynchronous, engine.scheduler.build_step(output)


def _placed(reader: _Engine, writer: _Engine) -> bool:
    """Whether the claim's 3 blocks sit in the reader's pages 5-7 as the writer has them."""
    return all(
        torch.equal(reader.cache(layer)[:, [5, 6, 7]], writer.cache(layer)[:, [3, 0, 2]])
        for layer in range(LAYERS)
    )


@pytest.fixture
def writer(cache_server: CacheServerProc) -> Any:
    engine = _Engine(cache_server, 1)
    engine.step(_request("w", PROMPT), [3, 0, 2, 1], 0)
    yield engine
    engine.close()


@pytest.fixture
def reader(cache_server: CacheServerProc) -> Any:
    engine = _Engine(cache_server, 2)
    yield engine
    engine.close()


def test_a_claim_on_an_idle_engine_loads_before_the_forward(
    writer: _Engine, reader: _Engine
) -> None:
    asynchronous, plan = _claim(reader, "r", [5, 6, 7, 8])
    assert asynchronous is False
    assert [spec.asynchronous for spec in plan.loads] == [False]
    assert reader.scheduler.totals.idle_sync_claims == 1
    reader.worker.begin_step(plan)
    reader.worker.load(plan)  # placed when load returns: nothing to wait for
    assert reader.worker.finished_loads() == set()
    assert _placed(reader, writer)


def test_a_claim_beside_another_request_loads_in_the_background(
    writer: _Engine, reader: _Engine
) -> None:
    reader.scheduler.after_alloc(_request("other", [1, 2, 3]), [9], 0)  # running
    asynchronous, plan = _claim(reader, "r1", [5, 6, 7, 8])
    assert asynchronous is True
    assert [spec.asynchronous for spec in plan.loads] == [True]
    assert reader.scheduler.totals.idle_sync_claims == 0
    reader.load(plan)  # waits until finished_loads reports it, as vLLM does
    assert _placed(reader, writer)
    reader.scheduler.finished(["other", "r1"])  # the engine is idle again
    asynchronous, plan = _claim(reader, "r2", [4, 10, 11, 0])
    assert asynchronous is False and [s.asynchronous for s in plan.loads] == [False]
    assert reader.scheduler.totals.idle_sync_claims == 1


@pytest.mark.parametrize(
    ("extra", "asynchronous"), [({"sync_when_idle": False}, True), ({"load_async": False}, False)]
)
def test_the_keys_decide_where_the_idle_rule_does_not_apply(
    cache_server: CacheServerProc, writer: _Engine, extra: dict[str, Any], asynchronous: bool
) -> None:
    reader = _Engine(cache_server, 2, **extra)
    try:
        answer, plan = _claim(reader, "r", [5, 6, 7, 8])
        assert answer is asynchronous
        assert [spec.asynchronous for spec in plan.loads] == [asynchronous]
        assert reader.scheduler.totals.idle_sync_claims == 0
        reader.load(plan)
        assert _placed(reader, writer)
    finally:
        reader.close()


def test_sync_when_idle_is_a_bool_and_a_loading_key() -> None:
    url = "nopecache://127.0.0.1:1"
    assert ConnectorConfig.from_extra_config({"url": url}).sync_when_idle is True
    off = ConnectorConfig.from_extra_config({"url": url, "sync_when_idle": False})
    assert off.sync_when_idle is False
    with pytest.raises(ConnectorConfigError, match=r"\['sync_when_idle'\]: must be true or false"):
        ConnectorConfig.from_extra_config({"url": url, "sync_when_idle": 1})
    with pytest.raises(ConnectorConfigError, match=r"\['sync_when_idle'\]: kv_role='kv_producer'"):
        ConnectorConfig.from_extra_config({"url": url, "sync_when_idle": True}, "kv_producer")
