"""The connector's counters in vLLM's stats logger and in Prometheus (``vllm:nopecache_*``).

Each interval the scheduler connector reports its lookup and claim counters
(``scheduler.SCHEDULER_COUNTERS``) and each worker the numeric fields of its
``StepReport``, as :class:`NopecacheStats`; vLLM sums them (``aggregate``), logs them
(``reduce``) and hands them to :class:`NopecachePromMetrics`, which adds them to one
counter per key. The sampled blend checks (``quality.py``) travel as lists of values
(``SAMPLE_FIELDS``, concatenated) and land in one histogram each.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from nopecache.integrations.vllm.identity import SKIP_REASONS
from nopecache.integrations.vllm.metadata import StepReport
from nopecache.integrations.vllm.quality import BlendCheck
from nopecache.integrations.vllm.scheduler import SCHEDULER_COUNTERS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

__all__ = [
    "SAMPLE_BUCKETS",
    "SAMPLE_FIELDS",
    "STAT_FIELDS",
    "WORKER_COUNTERS",
    "NopecachePromMetrics",
    "NopecacheStats",
]

WORKER_COUNTERS = tuple(
    f.name for f in dataclasses.fields(StepReport) if f.name not in ("failed_requests",)
)
"""The StepReport fields a worker reports (the numeric ones)."""
STAT_FIELDS = tuple(dict.fromkeys((*SCHEDULER_COUNTERS, *WORKER_COUNTERS, "blend_checks")))
"""Every counter, scheduler's first, in the order vLLM logs them."""
SAMPLE_BUCKETS: dict[str, tuple[float, ...]] = {
    # KL(full || blend) in nats, mean over a checked request's answer tokens: the gate
    # refuses above 0.5; SmolLM2's blends measure 0.002-0.06.
    "blend_kl": (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 0.5, 1.0, 3.0, 10.0),
    # Share of the answer tokens where blend's argmax is full prefill's: in [0, 1].
    "blend_top1": (0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
}
SAMPLE_FIELDS = tuple(SAMPLE_BUCKETS)
"""Per-check values (lists): one histogram each."""


@dataclasses.dataclass
class NopecacheStats(KVConnectorStats):
    """Connector counters of an interval: StepReport's numeric fields, summed."""

    @classmethod
    def of_report(
        cls, report: StepReport, checks: list[BlendCheck] | None = None
    ) -> NopecacheStats:
        """A worker's counters: the report's numeric fields, and its blend checks."""
        data: dict[str, Any] = {k: getattr(report, k) for k in WORKER_COUNTERS}
        if checks:
            data["blend_checks"] = len(checks)
            data["blend_kl"] = [c.kl for c in checks]
            data["blend_top1"] = [c.top1 for c in checks]
        return cls(data=data)

    def reset(self) -> None:
        """Zero every counter."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters to these."""
        for key, value in other.data.items():
            if key in STAT_FIELDS:
                self.data[key] = self.data.get(key, 0) + value
            elif key in SAMPLE_FIELDS:
                self.data[key] = [*self.data.get(key, ()), *value]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, as logged (each check list as its mean)."""
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in STAT_FIELDS}
        for key in SAMPLE_FIELDS:
            values = self.data.get(key)
            if values:
                out[f"{key}_mean"] = sum(values) / len(values)
        return out

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.get(k) for k in (*STAT_FIELDS, *SAMPLE_FIELDS))


class NopecachePromMetrics(KVConnectorPromMetrics):
    """``vllm:nopecache_*`` Prometheus counters of the connector, per engine.

    The ``vllm:`` prefix puts them beside vLLM's own metrics (``LLM.get_metrics()`` and
    the server's ``/metrics`` list only those). ``/metrics`` has each counter exact;
    vLLM 0.32's ``LLM.get_metrics()`` reads every counter as an int, so the ``*_seconds``
    counters come out of it in whole seconds (sum them from ``/metrics``, or over long
    runs).
    """

    _COUNTERS: ClassVar[dict[str, str]] = {
        "loaded_exact_tokens": "Prompt tokens loaded from exact-prefix blocks (lossless)",
        "loaded_pi_tokens": "Prompt tokens loaded from position-independent blocks",
        "loaded_bytes": "Block bytes fetched from nopecache servers",
        "load_seconds": "Seconds spent in loads (blend loads: their layer loop included)",
        "fetched_bytes": "Block bytes of the loads' fetches (their rate: over fetch_seconds)",
        "fetch_seconds": "Seconds spent fetching and placing loads (layer loops excluded)",
        "load_errors": "Claimed blocks that failed to load (vLLM recomputed them)",
        "load_failures": "Loads that raised an error (their blocks were recomputed)",
        "saved_tokens": "Prompt tokens handed to the store queue",
        "save_failures": "Saves that raised an error (the request's KV was not stored)",
        "save_dropped": "Stores dropped because the client's queue was full",
        "lookups": "Prompts looked up",
        "lookup_failures": "Lookups that failed (the request ran uncached)",
        "claimed_exact_tokens": "Prompt tokens claimed from exact-prefix hits",
        "claimed_pi_tokens": "Prompt tokens claimed from position-independent hits",
        "blend_claimed_tokens": "Prompt tokens claimed in blend mode (hits and the misses between)",
        "blend_miss_tokens": "Claimed tokens the blend loop computed as misses",
        "pi_token_layers": "Reused position-independent tokens x layers of blend claims",
        "recomputed_token_layers": "Of those token-layers, the ones the blend loop recomputed",
        "blend_fallbacks": "Requests whose blend claim was refused or fell back to the prefix",
        "idle_sync_claims": (
            "Claims loaded before the step's forward because the engine held no other request"
        ),
        "blend_checks": "Blended requests re-checked against a full prefill (sampled)",
        "pd_handoffs": "Decode requests that arrived with a prefill engine's hand-off",
        "pd_deadline_misses": "Hand-offs whose blocks had not all landed by the deadline",
        "pd_missing_tokens": "Prompt tokens a hand-off named that were recomputed instead",
        "pd_bad_handoffs": "Hand-offs malformed or not matching the request's own keys",
        "layer_loaded_tokens": "Of the loaded tokens, those written layer by layer beside the forward",
        "layer_saved_tokens": "Of the saved tokens, those copied layer by layer during the forward",
        "layer_wait_seconds": "Seconds the forward waited for layer-wise loads (layerwise=true)",
        "rope_check_failed": (
            "Workers whose start-up RoPE check turned position-independent reuse off"
        ),
    }
    _HISTOGRAMS: ClassVar[dict[str, str]] = {
        "blend_kl": "KL(full prefill || blend) of a sampled blended request's answer (nats)",
        "blend_top1": "Top-1 agreement of blend with full prefill on a sampled request's answer",
    }

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """Register one counter per key of ``_COUNTERS``, one histogram per ``_HISTOGRAMS``."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in self._COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:nopecache_{key}", documentation=doc, labelnames=labelnames
            )
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self._histograms: dict[str, dict[int, Any]] = {}
        for key, doc in self._HISTOGRAMS.items():
            histogram = self._histogram_cls(
                name=f"vllm:nopecache_{key}",
                documentation=doc,
                labelnames=labelnames,
                buckets=list(SAMPLE_BUCKETS[key]),
            )
            self._histograms[key] = {
                idx: histogram.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

        # Requests neither claimed nor stored, by reason (scheduler.SKIP_COUNTERS).
        skipped = self._counter_cls(
            name="vllm:nopecache_requests_skipped",
            documentation="Requests neither claimed nor stored: their KV cannot be keyed",
            labelnames=[*labelnames, "reason"],
        )
        self._skipped = {
            reason: {
                idx: skipped.labels(*values, reason)
                for idx, values in per_engine_labelvalues.items()
            }
            for reason in SKIP_REASONS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add an interval's counters."""
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for reason, per_engine in self._skipped.items():
            value = transfer_stats_data.get(f"skipped_{reason}", 0)
            if value:
                per_engine[engine_idx].inc(value)
        for key, per_engine in self._histograms.items():
            for sample in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(sample)
