"""Client-side metrics: what the cache saved this engine, and what went wrong.

Every metric lives in a registry the :class:`ClientMetrics` owns (a private
``CollectorRegistry``) or one the caller passes in, never the process-global default:
several clients in one process must not collide. One registry holds one client's
metrics; an engine exporting them passes its own registry to exactly one client, or
serves each client's ``registry`` itself. :meth:`ClientMetrics.snapshot` reads the same
values back as plain numbers (:class:`ClientStats`) for tests and demos.

Exposed families (counters carry Prometheus' ``_total`` suffix)::

    nopecache_client_lookups_total                        lookups planned
    nopecache_client_lookup_tokens_total                  prompt tokens looked up
    nopecache_client_hit_tokens_total{kind}               tokens planned from the cache,
                                                          kind = prefix | position_independent
    nopecache_client_dropped_hits_total                   hits dropped as not worth fetching
    nopecache_client_dropped_hit_tokens_total             their tokens (prefilled instead)
    nopecache_client_fetched_blocks_total                 blocks fetched and verified
    nopecache_client_fetched_bytes_total                  their bytes
    nopecache_client_stored_blocks_total                  blocks the servers accepted
    nopecache_client_stored_bytes_total                   their bytes
    nopecache_client_store_dropped_blocks_total           stores dropped: queue full
    nopecache_client_verify_failures_total                fetched blocks that failed checks
    nopecache_client_missed_blocks_total                  planned blocks a fetch got no bytes
                                                          for (gone since the lookup, dropped
                                                          by the server, or a failed stream)
    nopecache_client_server_errors_total{server,code}     failed calls by gRPC status name
    nopecache_client_unreachable_keys_total{server}       keys missed: server down or slow
    nopecache_client_lookup_duration_seconds              lookup latency histogram
    nopecache_client_fetch_duration_seconds               fetch latency histogram

Concurrency: prometheus-client values carry their own locks, so any thread (the engine's,
the store queue's worker, fetch threads) may record; ``snapshot`` reads each value once
and is consistent per value, not across values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

from nopecache.client.cost import CostSnapshot
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.plan import HitKind, ReusePlan

__all__ = ["METRIC_NAMES", "ClientMetrics", "ClientStats"]

_PREFIX = "nopecache_client_"

METRIC_NAMES = tuple(
    _PREFIX + n
    for n in (
        "lookups_total",
        "lookup_tokens_total",
        "hit_tokens_total",
        "dropped_hits_total",
        "dropped_hit_tokens_total",
        "fetched_blocks_total",
        "fetched_bytes_total",
        "stored_blocks_total",
        "stored_bytes_total",
        "store_dropped_blocks_total",
        "verify_failures_total",
        "missed_blocks_total",
        "server_errors_total",
        "unreachable_keys_total",
        "lookup_duration_seconds",
        "fetch_duration_seconds",
    )
)

# A loopback lookup takes ~100 µs; a fetch of a long prompt over a network, seconds.
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
)
_TIMEOUT = grpc.StatusCode.DEADLINE_EXCEEDED.name


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A client's counters as plain numbers (see the module docstring for each)."""

    lookups: int = 0
    lookup_tokens: int = 0
    prefix_hit_tokens: int = 0
    pi_hit_tokens: int = 0
    dropped_hits: int = 0
    dropped_hit_tokens: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fetches: int = 0
    fetch_seconds: float = 0.0
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_dropped_blocks: int = 0
    verify_failures: int = 0
    missed_blocks: int = 0
    # server -> failed calls (any status), and the subset that hit their deadline.
    server_errors: Mapping[str, int] = field(default_factory=dict)
    timeouts: Mapping[str, int] = field(default_factory=dict)
    unreachable_keys: Mapping[str, int] = field(default_factory=dict)
    # The cost model's view (prefill rate, per-server estimates and last decision); set by
    # the client's ``stats()``, None in a bare metrics snapshot.
    cost: CostSnapshot | None = None

    @property
    def hit_tokens(self) -> int:
        """Tokens planned from the cache, both kinds."""
        return self.prefix_hit_tokens + self.pi_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Share of looked-up tokens planned from the cache (0 before any lookup)."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(name, f"must be an int >= 0, got {value!r}")
    return value


def _check_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise InvalidArgumentError("seconds", f"must be a number >= 0, got {value!r}")
    return float(value)


def _check_server(server: object) -> str:
    if not isinstance(server, str) or not server:
        raise InvalidArgumentError("server", f"must be a non-empty str, got {server!r}")
    return server


class ClientMetrics:
    """The Prometheus metrics of one client, and a plain-number :meth:`snapshot`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """Metrics in ``registry``, or in a new private registry when None."""
        if registry is not None and not isinstance(registry, CollectorRegistry):
            raise InvalidArgumentError(
                "registry", f"must be a CollectorRegistry, got {type(registry).__name__}"
            )
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        r = self.registry
        self._lookups = Counter(_PREFIX + "lookups", "Lookups planned", registry=r)
        self._lookup_tokens = Counter(
            _PREFIX + "lookup_tokens", "Prompt tokens looked up", registry=r
        )
        self._hit_tokens = Counter(
            _PREFIX + "hit_tokens", "Tokens planned from the cache", ["kind"], registry=r
        )
        self._dropped_hits = Counter(
            _PREFIX + "dropped_hits",
            "Hits dropped as slower to fetch than to recompute",
            registry=r,
        )
        self._dropped_tokens = Counter(
            _PREFIX + "dropped_hit_tokens", "Tokens of dropped hits", registry=r
        )
        self._fetched_blocks = Counter(
            _PREFIX + "fetched_blocks", "Blocks fetched and verified", registry=r
        )
        self._fetched_bytes = Counter(
            _PREFIX + "fetched_bytes", "Bytes of fetched blocks", registry=r
        )
        self._stored_blocks = Counter(
            _PREFIX + "stored_blocks", "Blocks the servers accepted", registry=r
        )
        self._stored_bytes = Counter(_PREFIX + "stored_bytes", "Bytes of stored blocks", registry=r)
        self._store_dropped = Counter(
            _PREFIX + "store_dropped_blocks", "Blocks not stored: store queue full", registry=r
        )
        self._verify_failures = Counter(
            _PREFIX + "verify_failures", "Fetched blocks that failed verification", registry=r
        )
        self._missed_blocks = Counter(
            _PREFIX + "missed_blocks",
            "Planned blocks a fetch got no bytes for (a miss at fetch time)",
            registry=r,
        )
        self._server_errors = Counter(
            _PREFIX + "server_errors", "Failed calls by gRPC status", ["server", "code"], registry=r
        )
        self._unreachable = Counter(
            _PREFIX + "unreachable_keys",
            "Keys treated as misses because their server was down or slow",
            ["server"],
            registry=r,
        )
        self._lookup_seconds = Histogram(
            _PREFIX + "lookup_duration_seconds",
            "Lookup latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._fetch_seconds = Histogram(
            _PREFIX + "fetch_duration_seconds",
            "Fetch latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    # -- recording ------------------------------------------------------------------

    def record_plan(self, plan: ReusePlan, seconds: float | None = None) -> None:
        """Count one lookup: its tokens, hit tokens by kind, and hits dropped by the plan."""
        if not isinstance(plan, ReusePlan):
            raise InvalidArgumentError("plan", f"must be a ReusePlan, got {type(plan).__name__}")
        # Validate everything before counting anything: a rejected call counts nothing.
        duration = None if seconds is None else _check_seconds(seconds)
        self._lookups.inc()
        self._lookup_tokens.inc(plan.num_tokens)
        self._hit_tokens.labels(HitKind.PREFIX.value).inc(plan.prefix_tokens)
        self._hit_tokens.labels(HitKind.POSITION_INDEPENDENT.value).inc(plan.pi_tokens)
        self._dropped_hits.inc(len(plan.dropped))
        self._dropped_tokens.inc(sum(h.num_tokens for h in plan.dropped))
        if duration is not None:
            self._lookup_seconds.observe(duration)

    def record_fetch(self, blocks: int, nbytes: int, seconds: float) -> None:
        """Count one fetch call: ``blocks`` verified blocks of ``nbytes`` in ``seconds``."""
        blocks, nbytes = _check_count("blocks", blocks), _check_count("nbytes", nbytes)
        duration = _check_seconds(seconds)
        self._fetched_blocks.inc(blocks)
        self._fetched_bytes.inc(nbytes)
        self._fetch_seconds.observe(duration)

    def record_store(self, blocks: int, nbytes: int) -> None:
        """Count ``blocks`` blocks (``nbytes`` in all) the servers accepted."""
        blocks, nbytes = _check_count("blocks", blocks), _check_count("nbytes", nbytes)
        self._stored_blocks.inc(blocks)
        self._stored_bytes.inc(nbytes)

    def record_store_dropped(self, blocks: int = 1) -> None:
        """Count blocks not stored because the store queue was full."""
        self._store_dropped.inc(_check_count("blocks", blocks))

    def record_verify_failure(self, blocks: int = 1) -> None:
        """Count fetched blocks that failed verification (turned into misses)."""
        self._verify_failures.inc(_check_count("blocks", blocks))

    def record_missed(self, blocks: int = 1) -> None:
        """Count planned blocks a fetch got no bytes for (turned into misses)."""
        self._missed_blocks.inc(_check_count("blocks", blocks))

    def record_server_error(self, server: str, code: grpc.StatusCode | str) -> None:
        """Count one failed call to ``server`` by its gRPC status (DEADLINE_EXCEEDED: timeout)."""
        name = code.name if isinstance(code, grpc.StatusCode) else code
        if not isinstance(name, str) or name not in grpc.StatusCode.__members__:
            raise InvalidArgumentError("code", f"must be a gRPC status code, got {code!r}")
        self._server_errors.labels(_check_server(server), name).inc()

    def record_unreachable(self, server: str, keys: int) -> None:
        """Count ``keys`` keys treated as misses because ``server`` was down or slow."""
        keys = _check_count("keys", keys)
        self._unreachable.labels(_check_server(server)).inc(keys)

    # -- reading back ---------------------------------------------------------------

    def snapshot(self) -> ClientStats:
        """The current values as plain numbers."""
        hit_tokens = _labelled(self._hit_tokens, "kind")
        errors: dict[str, int] = {}
        timeouts: dict[str, int] = {}
        for labels, value in _samples(self._server_errors, "_total"):
            server = labels["server"]
            errors[server] = errors.get(server, 0) + int(value)
            if labels["code"] == _TIMEOUT:
                timeouts[server] = timeouts.get(server, 0) + int(value)
        return ClientStats(
            lookups=_total(self._lookups),
            lookup_tokens=_total(self._lookup_tokens),
            prefix_hit_tokens=hit_tokens.get(HitKind.PREFIX.value, 0),
            pi_hit_tokens=hit_tokens.get(HitKind.POSITION_INDEPENDENT.value, 0),
            dropped_hits=_total(self._dropped_hits),
            dropped_hit_tokens=_total(self._dropped_tokens),
            fetched_blocks=_total(self._fetched_blocks),
            fetched_bytes=_total(self._fetched_bytes),
            fetches=int(_sample(self._fetch_seconds, "_count")),
            fetch_seconds=_sample(self._fetch_seconds, "_sum"),
            stored_blocks=_total(self._stored_blocks),
            stored_bytes=_total(self._stored_bytes),
            store_dropped_blocks=_total(self._store_dropped),
            verify_failures=_total(self._verify_failures),
            missed_blocks=_total(self._missed_blocks),
            server_errors=errors,
            timeouts=timeouts,
            unreachable_keys=_labelled(self._unreachable, "server"),
        )


def _samples(metric: MetricWrapperBase, suffix: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of ``metric`` whose name ends in ``suffix``."""
    return [
        (s.labels, s.value)
        for family in metric.collect()
        for s in family.samples
        if s.name.endswith(suffix)
    ]


def _sample(metric: MetricWrapperBase, suffix: str) -> float:
    return sum(value for _, value in _samples(metric, suffix))


def _total(counter: Counter) -> int:
    return int(_sample(counter, "_total"))


def _labelled(counter: Counter, label: str) -> dict[str, int]:
    return {labels[label]: int(value) for labels, value in _samples(counter, "_total")}
