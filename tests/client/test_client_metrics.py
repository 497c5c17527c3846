"""Client metrics: exact counts in the snapshot and in the Prometheus exposition."""

from __future__ import annotations

import threading

import grpc
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.keys import BlockKey
from nopecache.client.metrics import METRIC_NAMES, ClientMetrics, ClientStats
from nopecache.client.plan import Hit, HitKind, ReusePlan
from nopecache.proto.block import StoredForm


def _hit(n: int, start: int, end: int, kind: HitKind) -> Hit:
    span = ChunkSpan(start, end)
    return Hit(BlockKey(bytes([n]) * 16), span, ChunkSpan(0, len(span)), StoredForm.NOPE, kind)


def _plan() -> ReusePlan:
    """64 tokens: 16 exact prefix, 8 + 4 position independent, one 16-token hit dropped."""
    return ReusePlan(
        64,
        prefix=(_hit(1, 0, 16, HitKind.PREFIX),),
        hits=(
            _hit(2, 20, 28, HitKind.POSITION_INDEPENDENT),
            _hit(3, 28, 32, HitKind.POSITION_INDEPENDENT),
        ),
        misses=(ChunkSpan(16, 20), ChunkSpan(32, 64)),
        dropped=(_hit(4, 40, 56, HitKind.POSITION_INDEPENDENT),),
    )


def test_fresh_snapshot_is_zero() -> None:
    stats = ClientMetrics().snapshot()
    assert stats == ClientStats()
    assert (stats.hit_tokens, stats.hit_rate) == (0, 0.0)


def test_snapshot_counts_exactly() -> None:
    m = ClientMetrics()
    m.record_plan(_plan(), seconds=0.002)
    m.record_plan(ReusePlan.all_miss(36))
    m.record_fetch(blocks=3, nbytes=3000, seconds=0.25)
    m.record_fetch(blocks=1, nbytes=500, seconds=0.5)
    m.record_store(blocks=2, nbytes=4096)
    m.record_store_dropped()
    m.record_store_dropped(blocks=4)
    m.record_verify_failure()
    m.record_server_error("a:1", grpc.StatusCode.DEADLINE_EXCEEDED)
    m.record_server_error("a:1", "UNAVAILABLE")
    m.record_server_error("b:1", grpc.StatusCode.DEADLINE_EXCEEDED)
    m.record_unreachable("a:1", 7)
    stats = m.snapshot()
    assert stats == ClientStats(
        lookups=2,
        lookup_tokens=100,
        prefix_hit_tokens=16,
        pi_hit_tokens=12,
        dropped_hits=1,
        dropped_hit_tokens=16,
        fetched_blocks=4,
        fetched_bytes=3500,
        fetches=2,
        fetch_seconds=0.75,
        stored_blocks=2,
        stored_bytes=4096,
        store_dropped_blocks=5,
        verify_failures=1,
        server_errors={"a:1": 2, "b:1": 1},
        timeouts={"a:1": 1, "b:1": 1},
        unreachable_keys={"a:1": 7},
    )
    assert stats.hit_tokens == 28
    assert stats.hit_rate == 0.28


def test_exposition_names_and_values() -> None:
    m = ClientMetrics()
    m.record_plan(_plan(), seconds=0.002)
    m.record_fetch(blocks=1, nbytes=10, seconds=0.003)
    m.record_server_error("a:1", "UNAVAILABLE")
    m.record_unreachable("a:1", 1)
    text = generate_latest(m.registry).decode()
    types = [line.split()[2:] for line in text.splitlines() if line.startswith("# TYPE ")]
    # Every family is exposed under its documented name (the *_created gauges aside).
    assert sorted(name for name, kind in types if kind != "gauge") == sorted(METRIC_NAMES)
    assert all(name.endswith("_created") for name, kind in types if kind == "gauge")
    assert 'nopecache_client_hit_tokens_total{kind="prefix"} 16.0' in text
    assert 'nopecache_client_hit_tokens_total{kind="position_independent"} 12.0' in text
    assert 'nopecache_client_server_errors_total{code="UNAVAILABLE",server="a:1"} 1.0' in text
    assert 'nopecache_client_fetch_duration_seconds_bucket{le="0.0025"} 0.0' in text
    assert 'nopecache_client_fetch_duration_seconds_bucket{le="0.005"} 1.0' in text
    assert "nopecache_client_lookup_duration_seconds_count 1.0" in text


def test_clients_do_not_collide() -> None:
    a, b = ClientMetrics(), ClientMetrics()  # a shared registry would raise "Duplicated"
    a.record_store(blocks=1, nbytes=1)
    assert (a.snapshot().stored_blocks, b.snapshot().stored_blocks) == (1, 0)
    assert REGISTRY.get_sample_value("nopecache_client_stored_blocks_total") is None


def test_registry_passed_in() -> None:
    registry = CollectorRegistry()
    m = ClientMetrics(registry)
    m.record_verify_failure(2)
    assert m.registry is registry
    assert registry.get_sample_value("nopecache_client_verify_failures_total") == 2.0
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        ClientMetrics(registry)  # one client per registry


def test_concurrent_recording_loses_nothing() -> None:
    m = ClientMetrics()

    def work() -> None:
        for _ in range(500):
            m.record_fetch(blocks=1, nbytes=3, seconds=0.001)
            m.record_server_error("a:1", "UNAVAILABLE")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = m.snapshot()
    assert (stats.fetched_blocks, stats.fetched_bytes, stats.fetches) == (2000, 6000, 2000)
    assert stats.server_errors == {"a:1": 2000}


def test_bad_arguments_are_named() -> None:
    m = ClientMetrics()
    cases = [
        (lambda: m.record_plan("plan"), "plan"),  # type: ignore[arg-type]
        (lambda: m.record_plan(_plan(), seconds=-1.0), "seconds"),
        (lambda: m.record_fetch(-1, 0, 0.1), "blocks"),
        (lambda: m.record_fetch(1, 1.5, 0.1), "nbytes"),  # type: ignore[arg-type]
        (lambda: m.record_fetch(1, 1, float("nan")), "seconds"),
        (lambda: m.record_store(True, 1), "blocks"),
        (lambda: m.record_store_dropped(-2), "blocks"),
        (lambda: m.record_server_error("", "UNAVAILABLE"), "server"),
        (lambda: m.record_server_error("a:1", "TIMEOUT"), "code"),
        (lambda: m.record_unreachable("a:1", -1), "keys"),
        (lambda: ClientMetrics(REGISTRY.collect), "registry"),  # type: ignore[arg-type]
    ]
    for call, argument in cases:
        with pytest.raises(InvalidArgumentError) as err:
            call()
        assert err.value.argument == argument
    assert m.snapshot() == ClientStats()  # nothing was counted by a rejected call
