"""Prefill/decode hand-off through the shared cache, the connector's halves without vLLM.

A producer (``kv_role="kv_producer"``) and a consumer (``kv_consumer``) engine share one
real nopecache server on loopback (tests/support/vllm_halves). What is proven: the roles
and the keys that contradict them; the producer's params name exactly the blocks a
consumer claims and its worker reports the request in ``finished_sending`` only once the
store is acknowledged and vLLM finished it; a consumer that asks before the store landed
answers "not yet" (None) until it lands and then claims and loads exactly the producer's
KV; blocks still missing at the deadline are recomputed, counted and logged once; params
that do not match the prompt's keys are not waited on; without params a consumer loads as
kv_both. The engine suite (engine/test_pd_engine.py) runs the same through real vLLM.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import pytest
import torch

from nopecache.client.storing import StoreReport
from nopecache.integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from nopecache.integrations.vllm.pd import PARAMS_KEY, Backoff, HandOff, StoreAcks
from tests.support.server_procs import CacheServerProc
from tests.support.vllm_halves import BS, LAYERS, _Engine, _request

URL = "nopecache://127.0.0.1:1"
PROMPT = list(range(100, 114))  # 14 tokens: 3 whole blocks of 4, all before the last token
LONG_WAIT = 60_000  # ms, a hang guard: every wait here ends on an event


@pytest.fixture
def server(cache_server: CacheServerProc) -> CacheServerProc:
    return cache_server


# -- roles --------------------------------------------------------------------------------
def test_roles_set_load_and_save() -> None:
    both = ConnectorConfig.from_extra_config({"url": URL})
    producer = ConnectorConfig.from_extra_config({"url": URL}, "kv_producer")
    consumer = ConnectorConfig.from_extra_config({"url": URL, "pi_reuse": "blend"}, "kv_consumer")
    assert (both.role, both.load, both.save, both.producer) == ("kv_both", True, True, False)
    assert (producer.load, producer.save, producer.producer) == (False, True, True)
    assert (consumer.load, consumer.save, consumer.pi_reuse) == (True, False, "blend")
    assert ConnectorConfig.from_extra_config({"url": URL}, None).role == "kv_both"
    assert consumer.handoff_deadline_ms == 5000.0


@pytest.mark.parametrize(
    ("role", "extra", "key"),
    [
        ("kv_producer", {"load": True}, "load"),
        ("kv_producer", {"pi_reuse": "contiguous"}, "pi_reuse"),
        ("kv_producer", {"handoff_deadline_ms": 100}, "handoff_deadline_ms"),
        ("kv_producer", {"load_async": False}, "load_async"),
        ("kv_producer", {"lookup_wait_ms": 1}, "lookup_wait_ms"),
        ("kv_consumer", {"save": True}, "save"),
        ("kv_both", {"handoff_deadline_ms": -1}, "handoff_deadline_ms"),
        ("kv_consumer", {"handoff_deadline_ms": True}, "handoff_deadline_ms"),
        ("kv_sender", {}, "kv_role"),
    ],
)
def test_a_key_that_contradicts_the_role_is_refused_by_name(
    role: str, extra: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConnectorConfigError, match=rf"\['{key}'\]: "):
        ConnectorConfig.from_extra_config({"url": URL, **extra}, role)


def test_explicit_false_on_the_role_keys_is_accepted() -> None:
    assert not ConnectorConfig.from_extra_config({"url": URL, "load": False}, "kv_producer").load
    assert not ConnectorConfig.from_extra_config({"url": URL, "save": False}, "kv_consumer").save


# -- params -------------------------------------------------------------------------------
def test_handoff_params_round_trip_and_malformed_ones() -> None:
    handoff = HandOff(3, 4, "0123456789abcdef0123456789abcdef")
    assert HandOff.from_params({"other": 1, **handoff.to_params()}) == handoff
    assert HandOff.from_params(None) is None
    assert HandOff.from_params({"do_remote_prefill": True}) is None  # another connector's
    assert "deadline_ms" not in handoff.to_params()[PARAMS_KEY]
    short = HandOff(3, 4, handoff.digest, deadline_ms=250)
    assert HandOff.from_params(short.to_params()) == short
    assert (short.wait_ms(5000), short.wait_ms(100), handoff.wait_ms(5000)) == (250, 100, 5000)
    for body in (
        {"v": 2},
        {"v": 1, "blocks": "3"},
        {**handoff.to_params()[PARAMS_KEY], "blocks": 0},
        {**handoff.to_params()[PARAMS_KEY], "deadline_ms": 0},
        {**handoff.to_params()[PARAMS_KEY], "deadline_ms": "250"},
        {**handoff.to_params()[PARAMS_KEY], "deadline_ms": True},
    ):
        assert isinstance(HandOff.from_params({PARAMS_KEY: body}), str)


def test_store_acks_report_only_finished_and_stored_requests_once() -> None:
    acks = StoreAcks()
    first: concurrent.futures.Future[StoreReport] = concurrent.futures.Future()
    second: concurrent.futures.Future[StoreReport] = concurrent.futures.Future()
    acks.add("r1", first)
    acks.add("r1", second)  # a second head group's store
    first.set_result(StoreReport(stored=3))
    second.set_result(StoreReport(stored=3))
    assert acks.finished(set()) == set()  # stored, but vLLM has not finished it
    acks.add("r2", concurrent.futures.Future())
    assert acks.finished({"r1", "r2", "r9"}) == {"r1"}  # r2 pending, r9 never stored here
    assert acks.finished(set()) == set()  # once
    acks.ensure("r3")  # a save that could not start frees its blocks all the same
    assert acks.finished({"r3"}) == {"r3"} and acks.failed == 1
    assert acks.pending() == 1


def test_backoff_grows_to_its_cap() -> None:
    delays = Backoff(0.002, 2.0, 0.01).delays()
    assert [next(delays) for _ in range(5)] == [0.002, 0.004, 0.008, 0.01, 0.01]
    with pytest.raises(ValueError):
        Backoff(0.1, 2.0, 0.01)


# -- the hand-off, end to end over a real server --------------------------------------------
def _finish(engine: _Engine, req_id: str) -> tuple[bool, dict[str, Any] | None]:
    """What the connector's request_finished does on the scheduler side."""
    out = engine.scheduler.handoff_params(req_id)
    engine.scheduler.finished([req_id])
    return out


def _unstored_handoff(producer: _Engine, req_id: str, prompt: list[int]) -> dict[str, Any]:
    """A producer's hand-off of ``prompt`` whose store never ran (it failed)."""
    producer.plan_step(_request(req_id, prompt), [3, 0, 2, 1], 0)
    _, params = _finish(producer, req_id)
    producer.worker.acks.ensure(req_id)
    assert params is not None
    return params


def _until_acked(engine: _Engine, req_id: str) -> None:
    # Only a hang guard: a loopback store of three blocks takes milliseconds.
    deadline = time.monotonic() + 60
    while not (done := engine.worker.acks.finished({req_id})):
        assert time.monotonic() < deadline, "the store was never acknowledged"
        time.sleep(0.001)
    assert done == {req_id}


def test_producer_names_its_blocks_and_the_consumer_waits_for_them(
    server: CacheServerProc,
) -> None:
    producer = _Engine(server, 1, kv_role="kv_producer")
    consumer = _Engine(server, 2, kv_role="kv_consumer", handoff_deadline_ms=LONG_WAIT)
    try:
        prompt = [p + 1000 for p in PROMPT]
        planned = producer.plan_step(_request("p1", prompt), [3, 0, 2, 1], 0)
        assert planned.claimed == 0  # a producer never loads
        assert [(s.tokens, s.ack) for s in planned.plan.saves] == [(tuple(prompt), True)]
        delay, params = _finish(producer, "p1")  # prefill done, store not even started
        assert delay is True and params is not None
        handoff = HandOff.from_params(params)
        assert isinstance(handoff, HandOff) and (handoff.blocks, handoff.block_size) == (3, BS)

        request = _request("d1", prompt, params)
        assert consumer.scheduler.matched_tokens(request, 0) is None  # waiting for it
        assert consumer.scheduler.matched_tokens(request, 0) is None
        producer.worker.begin_step()
        producer.worker.save(planned.plan)  # the store starts now
        assert producer.worker.acks.finished(set()) == set()  # vLLM has not said finished
        _until_acked(producer, "p1")
        assert consumer.matched(request, 0) == 12  # every block named, claimed
        totals = consumer.scheduler.totals
        assert (totals.pd_handoffs, totals.pd_deadline_misses, totals.lookups) == (1, 0, 1)

        out = consumer.plan_step(request, [7, 8, 9, 10], 0)
        assert out.plan.saves == ()  # a consumer never stores
        consumer.load(out.plan)
        assert consumer.worker.take_errors() == set()
        for layer in range(LAYERS):
            assert torch.equal(
                consumer.cache(layer)[:, [7, 8, 9]], producer.cache(layer)[:, [3, 0, 2]]
            )
    finally:
        producer.close()
        consumer.close()


def test_missing_at_the_deadline_is_recomputed_counted_and_logged_once(
    server: CacheServerProc, caplog: pytest.LogCaptureFixture
) -> None:
    producer = _Engine(server, 1, kv_role="kv_producer")
    consumer = _Engine(server, 2, kv_role="kv_consumer", handoff_deadline_ms=50)
    try:
        logs = []
        for i in range(2):
            prompt = [p + 2000 + 100 * i for p in PROMPT]
            params = _unstored_handoff(producer, f"p{i}", prompt)
            with caplog.at_level(logging.WARNING, logger="vllm"):
                assert consumer.matched(_request(f"d{i}", prompt, params), 0) == 0
            logs = [r for r in caplog.records if "handoff_deadline_ms" in r.getMessage()]
        assert len(logs) == 1  # logged once, counted every time
        # Asked again (vLLM preempted it): a plain lookup, the deadline is not waited twice.
        consumer.scheduler._claims.clear()
        assert consumer.matched(_request("d1", [p + 2100 for p in PROMPT], params), 0) == 0
        assert consumer.scheduler.totals.pd_handoffs == 2
        totals = consumer.scheduler.totals
        assert (totals.pd_handoffs, totals.pd_deadline_misses) == (2, 2)
        assert totals.pd_missing_tokens == 24
    finally:
        producer.close()
        consumer.close()


def test_a_handoffs_deadline_ms_shortens_the_engines_wait(
    server: CacheServerProc, caplog: pytest.LogCaptureFixture
) -> None:
    # The engine would wait 10 minutes (the test's timeout fails first); the request: 50 ms.
    producer = _Engine(server, 1, kv_role="kv_producer")
    consumer = _Engine(server, 2, kv_role="kv_consumer", handoff_deadline_ms=600_000)
    try:
        prompt = [p + 2500 for p in PROMPT]
        params = _unstored_handoff(producer, "p", prompt)
        params[PARAMS_KEY]["deadline_ms"] = 50
        with caplog.at_level(logging.WARNING, logger="vllm"):
            assert consumer.matched(_request("d", prompt, params), 0) == 0
        assert [r for r in caplog.records if "after 50 ms" in r.getMessage()]
        assert consumer.scheduler.totals.pd_deadline_misses == 1
    finally:
        producer.close()
        consumer.close()


def test_params_that_do_not_match_the_prompt_are_not_waited_on(server: CacheServerProc) -> None:
    producer = _Engine(server, 1, kv_role="kv_producer")
    consumer = _Engine(server, 2, kv_role="kv_consumer", handoff_deadline_ms=LONG_WAIT)
    try:
        prompt = [p + 3000 for p in PROMPT]
        producer.step(_request("p1", prompt), [3, 0, 2, 1], 0)
        _, params = _finish(producer, "p1")
        _until_acked(producer, "p1")
        other = [p + 4000 for p in PROMPT]  # never stored: a wait would last a minute
        assert consumer.matched(_request("d1", other, params), 0) == 0
        bad = {PARAMS_KEY: {"v": 1, "blocks": 9, "block_size": BS, "digest": "0" * 32}}
        assert consumer.matched(_request("d2", prompt, bad), 0) == 12  # plain lookup
        malformed = {PARAMS_KEY: {"v": 1}}
        assert consumer.matched(_request("d3", prompt, malformed), 0) == 12
        totals = consumer.scheduler.totals
        assert (totals.pd_bad_handoffs, totals.pd_handoffs) == (3, 0)
    finally:
        producer.close()
        consumer.close()


def test_without_params_a_consumer_loads_as_kv_both(server: CacheServerProc) -> None:
    both = _Engine(server, 1)
    consumer = _Engine(server, 2, kv_role="kv_consumer")
    try:
        prompt = [p + 5000 for p in PROMPT]
        both.step(_request("b1", prompt), [3, 0, 2, 1], 0)
        assert _finish(both, "b1") == (False, None)  # kv_both frees at once, names nothing
        out = consumer.step(_request("c1", prompt), [7, 8, 9, 10], 0)
        assert out.claimed == 12 and out.plan.saves == ()
        assert consumer.scheduler.totals.pd_handoffs == 0
    finally:
        both.close()
        consumer.close()


def test_a_prompt_of_one_block_stores_and_holds_but_names_nothing(server: CacheServerProc) -> None:
    producer = _Engine(server, 1, kv_role="kv_producer")
    try:
        producer.step(_request("p1", [1, 2, 3, 4]), [5], 0)  # its only block holds the last token
        assert _finish(producer, "p1") == (True, None)
        _until_acked(producer, "p1")
    finally:
        producer.close()


def test_a_claim_whose_blocks_vanish_before_the_load_counts_nothing_loaded(
    server: CacheServerProc,
) -> None:
    # Regression: the worker counted a failed load's claimed tokens as loaded, so a
    # decode engine's loaded share (bench/vllm_pd.py) counted what vLLM recomputed.
    producer = _Engine(server, 1, kv_role="kv_producer")
    consumer = _Engine(server, 2, kv_role="kv_consumer")
    try:
        prompt = [p + 6000 for p in PROMPT]
        producer.step(_request("p1", prompt), [3, 0, 2, 1], 0)
        _finish(producer, "p1")
        _until_acked(producer, "p1")
        out = consumer.plan_step(_request("d1", prompt), [7, 8, 9, 10], 0)
        assert out.claimed == 12
        server.kill()
        server.start()  # the blocks are gone between the claim and the load
        consumer.load(out.plan)
        assert consumer.worker.take_errors() == {7, 8, 9}
        report = consumer.worker.take_report()
        assert report is not None and report.load_errors == 3
        assert report.loaded_exact_tokens == 0
    finally:
        producer.close()
        consumer.close()
