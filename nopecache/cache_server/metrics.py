"""Prometheus metrics of one server: store events, tier gauges, request latency, rejections.

Every metric lives in a registry owned by the :class:`ServerMetrics` instance (not the
process-global one), so several servers can run in one process (tests) without clashing.
``METRIC_NAMES`` lists the exposed family names; dashboards and manifests are checked
against it.

Exposed families (counters carry Prometheus' ``_total`` suffix)::

    nopecache_hits_total{tier}                      blocks served, by the tier that had them
    nopecache_misses_total                          keys found in no tier
    nopecache_evictions_total{tier}                 blocks dropped from a tier (last tier: lost)
    nopecache_demotions_total{from_tier,to_tier}    blocks moved down on eviction
    nopecache_promotions_total{from_tier,to_tier}   blocks moved up on a hit
    nopecache_tier_used_bytes{tier}                 bytes stored per tier
    nopecache_tier_capacity_bytes{tier}             configured capacity (absent when unbounded)
    nopecache_tier_entries{tier}                    blocks stored per tier
    nopecache_tier_healthy{tier}                    1 when the tier answers, 0 otherwise
    nopecache_request_duration_seconds{method}      RPC latency histogram
    nopecache_requests_rejected_total{method,reason}  refused requests and blocks
    nopecache_put_blocks_total{outcome}             Put results: stored / already_present / rejected
    nopecache_put_bytes_total                       block bytes received by Put
    nopecache_get_bytes_total                       block bytes sent by Get
    nopecache_server_info{version}                  constant 1, labelled with the version
    nopecache_corrupt_blocks_total{tier}            damaged values found (deleted, never served)
    nopecache_auth_failures_total{reason}           calls refused UNAUTHENTICATED: missing /
                                                    malformed / invalid token
    nopecache_faults_injected_total{kind,path}      faults injected on a read path (testing and
                                                    staging only: faults.py)
    nopecache_tenant_requests_total{tenant,method}  admitted RPCs per tenant
    nopecache_tenant_rejected_total{tenant,reason}  refused requests and blocks per tenant
    nopecache_tenant_put_bytes_total{tenant}        block bytes received by Put per tenant
    nopecache_tenant_get_bytes_total{tenant}        block bytes served per tenant
    nopecache_tenant_used_bytes{tenant}             bytes charged against the quota (tenants
                                                    with a quota; an upper bound, see tenants.py)
    nopecache_tenant_quota_bytes{tenant}            the tenant's byte quota

Tenant labels take only configured tenant names (or ``anonymous``), so their number is
bounded by the token file, never by what clients send. The metrics port has no
authentication, so the ``nopecache_tenant_*`` families (they name tenants and show each
one's traffic) are left out of what it serves unless ``--metrics-tenant-labels`` is on
(for a metrics port only the operator can reach); they are always in ``registry``.

Concurrency: the store calls the observer methods from the event loop thread; the HTTP
exporter reads from its own thread. prometheus-client values are lock-protected, and the
per-label children are cached in plain dicts that only the event loop thread writes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import Metric

__all__ = ["METHODS", "METRIC_NAMES", "MetricsEndpoint", "ServerMetrics", "TierSnapshot"]

METHODS = ("Lookup", "Put", "Get", "Delete", "Stats")
# Families that name tenants: served on the metrics port only with --metrics-tenant-labels.
TENANT_PREFIX = "nopecache_tenant_"

METRIC_NAMES = (
    "nopecache_hits_total",
    "nopecache_misses_total",
    "nopecache_evictions_total",
    "nopecache_demotions_total",
    "nopecache_promotions_total",
    "nopecache_tier_used_bytes",
    "nopecache_tier_capacity_bytes",
    "nopecache_tier_entries",
    "nopecache_tier_healthy",
    "nopecache_request_duration_seconds",
    "nopecache_requests_rejected_total",
    "nopecache_put_blocks_total",
    "nopecache_put_bytes_total",
    "nopecache_get_bytes_total",
    "nopecache_server_info",
    "nopecache_corrupt_blocks_total",
    "nopecache_auth_failures_total",
    "nopecache_faults_injected_total",
    "nopecache_tenant_requests_total",
    "nopecache_tenant_rejected_total",
    "nopecache_tenant_put_bytes_total",
    "nopecache_tenant_get_bytes_total",
    "nopecache_tenant_used_bytes",
    "nopecache_tenant_quota_bytes",
)

# Loopback RPCs take ~100 µs; a Get of many 8 MiB blocks takes seconds.
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class TierSnapshot(Protocol):
    """What the metrics need from a tier's statistics (TierStats has these fields)."""

    @property
    def name(self) -> str: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def capacity_bytes(self) -> int | None: ...
    @property
    def entries(self) -> int: ...
    @property
    def healthy(self) -> bool: ...


class _Child(Protocol):
    """A labelled counter/gauge child."""

    def inc(self, amount: float = 1) -> None: ...


class ServerMetrics:
    """The metrics of one server; implements the store's StoreObserver protocol."""

    def __init__(self, *, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._hits = Counter(
            "nopecache_hits", "Blocks served, by the tier that held them", ["tier"], registry=r
        )
        self._misses = Counter("nopecache_misses", "Keys found in no tier", registry=r)
        self._evictions = Counter(
            "nopecache_evictions",
            "Blocks evicted from a tier (from the last tier they are gone)",
            ["tier"],
            registry=r,
        )
        self._demotions = Counter(
            "nopecache_demotions",
            "Blocks moved to the next tier on eviction",
            ["from_tier", "to_tier"],
            registry=r,
        )
        self._promotions = Counter(
            "nopecache_promotions",
            "Blocks moved to a faster tier on a hit",
            ["from_tier", "to_tier"],
            registry=r,
        )
        self._used = Gauge(
            "nopecache_tier_used_bytes", "Bytes stored in a tier", ["tier"], registry=r
        )
        self._capacity = Gauge(
            "nopecache_tier_capacity_bytes",
            "Configured byte capacity of a tier",
            ["tier"],
            registry=r,
        )
        self._entries = Gauge(
            "nopecache_tier_entries", "Blocks stored in a tier", ["tier"], registry=r
        )
        self._healthy = Gauge(
            "nopecache_tier_healthy",
            "1 when the tier answers, 0 when it does not",
            ["tier"],
            registry=r,
        )
        self._latency = Histogram(
            "nopecache_request_duration_seconds",
            "Time to serve an RPC, by method",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._rejected = Counter(
            "nopecache_requests_rejected",
            "Requests (or single Put blocks) refused, by method and reason",
            ["method", "reason"],
            registry=r,
        )
        self._put_blocks = Counter(
            "nopecache_put_blocks", "Put results per block, by outcome", ["outcome"], registry=r
        )
        self._put_bytes = Counter("nopecache_put_bytes", "Block bytes received by Put", registry=r)
        self._get_bytes = Counter("nopecache_get_bytes", "Block bytes sent by Get", registry=r)
        Gauge(
            "nopecache_server_info",
            "Constant 1, labelled with the server version",
            ["version"],
            registry=r,
        ).labels(version).set(1)
        self._corrupt = Counter(
            "nopecache_corrupt_blocks",
            "Stored values found damaged (checksum), deleted and never served, by tier",
            ["tier"],
            registry=r,
        )
        self._auth_failures = Counter(
            "nopecache_auth_failures",
            "Calls refused UNAUTHENTICATED, by reason (missing, malformed, invalid)",
            ["reason"],
            registry=r,
        )
        self._faults = Counter(
            "nopecache_faults_injected",
            "Faults injected on purpose (--fault-injection), by kind and read path",
            ["kind", "path"],
            registry=r,
        )
        self._tenant_requests = Counter(
            "nopecache_tenant_requests",
            "RPCs admitted, by tenant and method",
            ["tenant", "method"],
            registry=r,
        )
        self._tenant_rejected = Counter(
            "nopecache_tenant_rejected",
            "Requests (or single Put blocks) refused, by tenant and reason",
            ["tenant", "reason"],
            registry=r,
        )
        self._tenant_put_bytes = Counter(
            "nopecache_tenant_put_bytes",
            "Block bytes received by Put, by tenant",
            ["tenant"],
            registry=r,
        )
        self._tenant_get_bytes = Counter(
            "nopecache_tenant_get_bytes", "Block bytes served, by tenant", ["tenant"], registry=r
        )
        self._tenant_used = Gauge(
            "nopecache_tenant_used_bytes",
            "Bytes charged against the tenant's quota (an upper bound of what it holds)",
            ["tenant"],
            registry=r,
        )
        self._tenant_quota = Gauge(
            "nopecache_tenant_quota_bytes", "The tenant's byte quota", ["tenant"], registry=r
        )
        self._corrupt_seen: dict[str, int] = {}
        self._tenant_children: dict[tuple[str, str, str], _Child] = {}
        # Resolving a labelled child costs a lock and a tuple hash; hits are counted per
        # block on the data path, so the children are looked up once and kept here.
        self._hit_children: dict[str, _Child] = {}
        self._eviction_children: dict[str, _Child] = {}
        self._move_children: dict[tuple[str, str, str], _Child] = {}
        self.latency = {m: self._latency.labels(m) for m in METHODS}

    # -- StoreObserver -------------------------------------------------------------------
    def on_hit(self, tier: str) -> None:
        """A block was served from ``tier``."""
        child = self._hit_children.get(tier)
        if child is None:
            child = self._hit_children[tier] = self._hits.labels(tier)
        child.inc()

    def on_miss(self) -> None:
        """A key was found in no tier."""
        self._misses.inc()

    def on_eviction(self, tier: str) -> None:
        """A block left ``tier`` to make room."""
        child = self._eviction_children.get(tier)
        if child is None:
            child = self._eviction_children[tier] = self._evictions.labels(tier)
        child.inc()

    def on_demotion(self, src: str, dst: str) -> None:
        """A block evicted from ``src`` was moved to ``dst``."""
        self._move("demotion", src, dst).inc()

    def on_promotion(self, src: str, dst: str) -> None:
        """A block hit in ``src`` was copied up to ``dst``."""
        self._move("promotion", src, dst).inc()

    def on_tier_health(self, tier: str, healthy: bool) -> None:
        """``tier`` became healthy or unhealthy."""
        self._healthy.labels(tier).set(1 if healthy else 0)

    def _move(self, kind: str, src: str, dst: str) -> _Child:
        child = self._move_children.get((kind, src, dst))
        if child is None:
            family = self._demotions if kind == "demotion" else self._promotions
            child = self._move_children[(kind, src, dst)] = family.labels(src, dst)
        return child

    # -- server events -------------------------------------------------------------------
    def rejected(self, method: str, reason: str) -> None:
        """A request (or one Put block) was refused for ``reason`` (a short snake_case tag)."""
        self._rejected.labels(method, reason).inc()

    def put_outcome(self, outcome: str, count: int = 1) -> None:
        """``count`` Put blocks ended as ``outcome`` (stored / already_present / rejected)."""
        self._put_blocks.labels(outcome).inc(count)

    def put_bytes(self, n: int) -> None:
        """Put received ``n`` block bytes."""
        self._put_bytes.inc(n)

    def get_bytes(self, n: int) -> None:
        """Get sent ``n`` block bytes."""
        self._get_bytes.inc(n)

    def set_tier_stats(self, stats: Sequence[TierSnapshot]) -> None:
        """Refresh the per-tier gauges from a stats snapshot."""
        for s in stats:
            self._used.labels(s.name).set(s.used_bytes)
            if s.capacity_bytes is not None:
                self._capacity.labels(s.name).set(s.capacity_bytes)
            self._entries.labels(s.name).set(s.entries)
            self._healthy.labels(s.name).set(1 if s.healthy else 0)

    def on_corrupt(self, tier: str, count: int) -> None:
        """``count`` blobs read from ``tier`` failed verification (deleted, never served)."""
        self._corrupt.labels(tier).inc(count)

    def corrupt_total(self, tier: str, total: int) -> None:
        """``tier`` has found ``total`` damaged values since start (a running count)."""
        seen = self._corrupt_seen.get(tier, 0)
        if total > seen:
            self._corrupt.labels(tier).inc(total - seen)
            self._corrupt_seen[tier] = total

    # -- security and tenancy ------------------------------------------------------------
    def auth_failure(self, reason: str) -> None:
        """A call was refused UNAUTHENTICATED for ``reason`` (missing/malformed/invalid)."""
        self._auth_failures.labels(reason).inc()

    def fault_injected(self, kind: str, path: str) -> None:
        """Count one fault injected on a read path (faults.py)."""
        self._faults.labels(kind, path).inc()

    def tenant_request(self, tenant: str, method: str) -> None:
        """``tenant`` made an admitted ``method`` call."""
        self._tenant_child("requests", tenant, method).inc()

    def tenant_rejected(self, tenant: str, reason: str, count: int = 1) -> None:
        """``count`` requests or blocks of ``tenant`` were refused for ``reason``."""
        self._tenant_child("rejected", tenant, reason).inc(count)

    def tenant_put_bytes(self, tenant: str, n: int) -> None:
        """``tenant`` stored ``n`` block bytes."""
        self._tenant_child("put", tenant, "").inc(n)

    def tenant_get_bytes(self, tenant: str, n: int) -> None:
        """``tenant`` was served ``n`` block bytes."""
        self._tenant_child("get", tenant, "").inc(n)

    def tenant_used(self, tenant: str, used_bytes: int) -> None:
        """The bytes charged to ``tenant`` changed (its blocks were dropped)."""
        self._tenant_used.labels(tenant).set(used_bytes)

    def tenant_usage(self, tenant: str, used_bytes: int, quota_bytes: int) -> None:
        """The bytes charged to ``tenant`` and its quota."""
        self._tenant_used.labels(tenant).set(used_bytes)
        self._tenant_quota.labels(tenant).set(quota_bytes)

    def _tenant_child(self, kind: str, tenant: str, extra: str) -> _Child:
        child = self._tenant_children.get((kind, tenant, extra))
        if child is None:
            if kind == "requests":
                child = self._tenant_requests.labels(tenant, extra)
            elif kind == "rejected":
                child = self._tenant_rejected.labels(tenant, extra)
            elif kind == "put":
                child = self._tenant_put_bytes.labels(tenant)
            else:
                child = self._tenant_get_bytes.labels(tenant)
            self._tenant_children[(kind, tenant, extra)] = child
        return child

    def exposition(self) -> bytes:
        """The current metrics in the Prometheus text format."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int, *, tenant_labels: bool = False) -> MetricsEndpoint:
        """Start the HTTP exporter on ``host:port`` (0: a free port) in a daemon thread;
        the per-tenant families only with ``tenant_labels``."""
        served: CollectorRegistry | _WithoutTenants = self.registry
        if not tenant_labels:
            served = _WithoutTenants(self.registry)
        server, thread = start_http_server(port, addr=host, registry=served)
        return MetricsEndpoint(
            host=host, port=int(server.server_port), _server=server, _thread=thread
        )


class _WithoutTenants:
    """A registry as the unauthenticated metrics port serves it: no tenant families."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        """Every family of the registry except ``nopecache_tenant_*``."""
        for family in self._registry.collect():
            if not family.name.startswith(TENANT_PREFIX):
                yield family

    def restricted_registry(self, names: Iterable[str]) -> _WithoutTenants:
        """The view over the registry restricted to ``names`` (the ``name[]`` query)."""
        return _WithoutTenants(self._registry.restricted_registry(names))  # type: ignore[arg-type]


@dataclass(slots=True)
class MetricsEndpoint:
    """A running metrics HTTP exporter."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        """Stop the exporter and release its port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
