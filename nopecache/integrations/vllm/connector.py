"""nopecache as a vLLM v1 KV connector: share KV across engines through nopecache servers.

Load it with::

    LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="NopecacheConnector",
        kv_connector_module_path="nopecache.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "nopecache://127.0.0.1:50551"},
    ))

or the same JSON on ``vllm serve --kv-transfer-config``. vLLM makes one connector in its
scheduler process (role SCHEDULER: lookups and claims, ``scheduler.SchedulerSide``)
and one in each worker (role WORKER: loads and saves, ``worker.WorkerSide``); this
class is the thin translation between vLLM's hooks and those halves. Settings and model
identity: ``config.py``; cache layouts: ``layout.py``; what the halves send
each other: ``metadata.py``.

Failures never fail a request: a lookup that fails claims nothing, a load that fails
after a claim is reported back as failed blocks and vLLM recomputes them (the connector
sets ``kv_load_failure_policy="recompute"``, since a cache miss is never fatal).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from nopecache.client.sync_client import CacheClient
from nopecache.integrations.vllm.blend import blend_unsupported_reason
from nopecache.integrations.vllm.config import (
    ConnectorConfig,
    ConnectorConfigError,
    ModelIdentity,
    UnsupportedEngineError,
    model_identity,
)
from nopecache.integrations.vllm.layout import CpuAttnLayout, KVLayout, UnsupportedLayoutError
from nopecache.integrations.vllm.metadata import StepPlan, StepReport
from nopecache.integrations.vllm.scheduler import SCHEDULER_COUNTERS, SchedulerSide
from nopecache.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "ConnectorConfigError",
    "NopecacheConnector",
    "NopecacheConnectorMetadata",
    "NopecacheStats",
    "UnsupportedEngineError",
    "UnsupportedLayoutError",
]

# Under "vllm." so the lines appear in vLLM's own log, in its format.
log = logging.getLogger(f"vllm.{__name__}")

MEDIUM = "nopecache"


class NopecacheConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves, scheduler -> workers."""

    def __init__(self, step: StepPlan) -> None:
        """Wrap a StepPlan."""
        self.step = step


class NopecacheWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's StepReport, workers -> scheduler."""

    def __init__(self, report: StepReport) -> None:
        """Wrap a StepReport."""
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """The sum of two workers' reports."""
        assert isinstance(other, NopecacheWorkerMetadata)
        return NopecacheWorkerMetadata(self.report.add(other.report, same_step=True))


_WORKER_FIELDS = tuple(
    f.name for f in dataclasses.fields(StepReport) if f.name not in ("failed_requests",)
)
_STAT_FIELDS = tuple(dict.fromkeys((*SCHEDULER_COUNTERS, *_WORKER_FIELDS)))


@dataclasses.dataclass
class NopecacheStats(KVConnectorStats):
    """Connector counters of an interval: StepReport's numeric fields, summed."""

    def reset(self) -> None:
        """Zero every counter."""
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s counters to these."""
        for key, value in other.data.items():
            if key in _STAT_FIELDS:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters, as logged."""
        return {k: self.data.get(k, 0) for k in _STAT_FIELDS}

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.get(k) for k in _STAT_FIELDS)


class NopecachePromMetrics(KVConnectorPromMetrics):
    """``vllm:nopecache_*`` Prometheus counters of the connector, per engine.

    The ``vllm:`` prefix puts them beside vLLM's own metrics (``LLM.get_metrics()`` and
    the server's ``/metrics`` list only those).
    """

    _COUNTERS: ClassVar[dict[str, str]] = {
        "loaded_exact_tokens": "Prompt tokens loaded from exact-prefix blocks (lossless)",
        "loaded_pi_tokens": "Prompt tokens loaded from position-independent blocks",
        "loaded_bytes": "Block bytes fetched from nopecache servers",
        "load_seconds": "Seconds spent fetching and placing loads",
        "load_errors": "Claimed blocks that failed to load (vLLM recomputed them)",
        "saved_tokens": "Prompt tokens handed to the store queue",
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
    }

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        """Register one counter per StepReport field."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, doc in self._COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:nopecache_{key}", documentation=doc, labelnames=labelnames
            )
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add an interval's counters."""
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)


def _verify_cpu_layout(layout: KVLayout, dtype: torch.dtype) -> None:
    """Check the CPU layout against vLLM's own cache writer for this machine's ISA."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    bs, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    isa = _get_attn_isa(dtype, bs, d)
    scratch = torch.zeros(2, h, bs, 2 * d, dtype=dtype)
    key_cache, value_cache = scratch.view(2, h, 2 * bs, d).chunk(2, dim=2)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    v = torch.randn(2 * bs, h, d, generator=gen).to(dtype)
    slots = torch.arange(2 * bs, dtype=torch.int64).flip(0)
    cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    got_k, got_v = layout.read(scratch, slots)
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        raise UnsupportedLayoutError(
            f"vLLM's CPU attention ISA {isa!r} ({dtype}, block_size {bs}, head_dim {d}) "
            "does not write the layout the connector knows (K^T then V per page)"
        )


class NopecacheConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by nopecache (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        """Validate the extra config and the model, and connect the client."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        self.model: ModelIdentity = model_identity(vllm_config)
        self.client: CacheClient | None = CacheClient(
            self.settings.client,
            fingerprint=self.model.fingerprint,
            rope=self.model.rope,
            v_head_dim=self.model.v_head_dim,
            prefix_block_tokens=self.model.block_size,
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._last_report: StepReport | None = None
        blend_unsupported = blend_unsupported_reason(vllm_config) if self.settings.blend else None
        if blend_unsupported is not None:
            log.warning(
                "nopecache: pi_reuse='blend' unsupported here (%s); claiming exact prefixes only",
                blend_unsupported,
            )
        if role == KVConnectorRole.SCHEDULER:
            if transfer.kv_load_failure_policy != "recompute":
                log.info(
                    "nopecache: kv_load_failure_policy set to 'recompute' (misses are not fatal)"
                )
                transfer.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(
                self.settings, self.model, self.client, blend_unsupported
            )
        else:
            self._worker = WorkerSide(self.settings, self.model, self.client)
            if blend_unsupported is not None:
                self._worker.refuse_blend(blend_unsupported)
        log.info(
            "nopecache connector (%s): %s, model %s %s, block %d, pi_reuse=%s",
            role.name,
            ",".join(self.settings.client.servers),
            self.model.fingerprint.model,
            self.model.fingerprint.dtype,
            self.model.block_size,
            self.settings.pi_reuse,
        )

    # -- worker side ------------------------------------------------------------------
    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "worker-side hook called on the scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Identify the cache layout; an unknown one is a start-up error."""
        worker = self._worker_side()
        layout = worker.register(kv_caches)
        if isinstance(layout, CpuAttnLayout):
            _verify_cpu_layout(layout, self.model.dtype)
        log.info("nopecache: KV cache layout %s for %d layers", layout.name, len(kv_caches))
        if self.settings.blend:
            context = self._vllm_config.compilation_config.static_forward_context
            worker.bind_model({name: context[name] for name in kv_caches if name in context})
            if worker.blend_stack is not None:
                log.info(
                    "nopecache: blend mode runs %s with policy %s",
                    type(worker.blend_stack).__name__,
                    self.settings.policy().name,
                )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's plan and start timing the step."""
        super().bind_connector_metadata(connector_metadata)
        self._worker_side().begin_step()

    def _step(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NopecacheConnectorMetadata)
        return meta.step

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Fetch and place this step's loads (synchronously, before the forward)."""
        self._worker_side().load(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in start_load_kv: nothing to wait for."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Saves copy whole blocks once the forward is done (wait_for_save)."""

    def wait_for_save(self) -> None:
        """Copy finished prompts' blocks out and queue their stores."""
        if self.has_connector_metadata():
            self._worker_side().save(self._step())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background loads ended (failed ones too: their blocks are in
        get_block_ids_with_load_errors in the same step)."""
        done = self._worker_side().finished_loads()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose claimed load failed this step (vLLM recomputes them)."""
        return self._worker_side().take_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last call (for vLLM's stats logger and Prometheus)."""
        if self._scheduler is not None:
            counts = self._scheduler.take_counters()
            return NopecacheStats(data=counts) if any(counts.values()) else None
        self._last_report = self._worker_side().take_report()
        if self._last_report is None:
            return None
        data = {k: getattr(self._last_report, k) for k in _WORKER_FIELDS}
        return NopecacheStats(data=data)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's report for the scheduler half (prefill rate, totals)."""
        report, self._last_report = self._last_report, None
        return None if report is None else NopecacheWorkerMetadata(report)

    # -- scheduler side ---------------------------------------------------------------
    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side hook called on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` the cache can supply, and whether they load
        in the background (``load_async``)."""
        side = self._scheduler_side()
        n = side.matched_tokens(request, num_computed_tokens)
        return n, n > 0 and side.claim_is_async(request.request_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the request's blocks; queue a load when tokens were claimed."""
        block_ids = blocks.get_block_ids()[0] if blocks is not None else []
        self._scheduler_side().after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves."""
        side = self._scheduler_side()
        side.finished(scheduler_output.finished_req_ids)
        return NopecacheConnectorMetadata(side.build_step(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        """Feed the workers' reports into the totals and the cost model."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, NopecacheWorkerMetadata):
            self._scheduler_side().on_report(meta.report)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Stores copy their KV at once, so blocks can be freed now."""
        self._scheduler_side().finished([request.request_id])
        return False, None

    def take_events(self) -> Iterable[Any]:
        """BlockStored for blocks this engine stored, BlockRemoved for those since evicted."""
        side = self._scheduler_side()
        removed = [maybe_convert_block_hash(h) for h in side.take_removed()]
        if removed:
            yield BlockRemoved(block_hashes=removed, medium=MEDIUM)
        for stored in side.take_stored():
            hashes = [maybe_convert_block_hash(h) for h in stored.block_hashes]
            if not hashes:
                continue
            yield BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=list(stored.token_ids[: len(hashes) * stored.block_size]),
                block_size=stored.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Rebuild stats sent from a worker."""
        return NopecacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The connector's Prometheus counters."""
        return NopecachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish background loads and queued stores, then close the client."""
        if self._worker is not None:
            self._worker.close()
        if self.client is not None:
            self.client.close()
            self.client = None
