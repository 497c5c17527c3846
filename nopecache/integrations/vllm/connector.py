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
and one in each worker (role WORKER: loads and saves, ``worker.WorkerSide``). This
class is a facade that only delegates vLLM's hooks to those halves; the package's other
modules are:

    config.py     the extra config's keys and the model identity (fingerprint, RoPE)
    metadata.py   what the halves send each other every step (StepPlan, StepReport)
    layout.py     how attention backends lay out the paged cache (KVLayout)
    blend.py      blend mode's claim arithmetic and start-up check
    blend_loop.py blend mode's layer loop over vLLM's modules and paged cache
    rope_check.py the start-up check of the RoPE spec against vLLM's rotary modules
    metrics.py    the counters in vLLM's stats logger and Prometheus
    compat.py     every reach into vLLM beyond this connector base API
    errors.py     the start-up refusals

Failures never fail a request: a lookup that fails claims nothing, a load that fails
after a claim is reported back as failed blocks and vLLM recomputes them (the connector
sets ``kv_load_failure_policy="recompute"``, since a cache miss is never fatal).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.removals import RemovalFollower
from nopecache.client.sync_client import CacheClient
from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.blend import blend_unsupported_reason
from nopecache.integrations.vllm.config import ConnectorConfig, ModelIdentity, model_identity
from nopecache.integrations.vllm.events import AnnouncedBlocks
from nopecache.integrations.vllm.layout import CpuAttnLayout
from nopecache.integrations.vllm.metadata import StepPlan, StepReport
from nopecache.integrations.vllm.metrics import NopecachePromMetrics, NopecacheStats
from nopecache.integrations.vllm.rope_check import engine_rotations
from nopecache.integrations.vllm.scheduler import SchedulerSide
from nopecache.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "NopecacheConnector",
    "NopecacheConnectorMetadata",
    "NopecacheHandshake",
    "NopecacheWorkerMetadata",
]

# Under "vllm." so the lines appear in vLLM's own log, in its format.
log = logging.getLogger(f"vllm.{__name__}")


def _tokenize(vllm_config: VllmConfig) -> Callable[[str], list[int]] | None:
    tokenizer = compat.tokenizer(vllm_config)
    if tokenizer is None:
        return None
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


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


class NopecacheHandshake(KVConnectorHandshakeMetadata):
    """A worker's start-up word to the scheduler half: why it cannot blend (None: it
    can), e.g. its correctness gate's refusal with the figures (gate.py), and why it
    takes no position-independent blocks (None: it does), its RoPE check's refusal
    (rope_check.py)."""

    def __init__(self, blend_refused: str | None, pi_refused: str | None = None) -> None:
        """Wrap the refusals."""
        self.blend_refused = blend_refused
        self.pi_refused = pi_refused


class NopecacheConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by nopecache (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        """Validate the extra config and the model, and connect the client."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorConfig.from_extra_config(
            transfer.kv_connector_extra_config, compat.kv_role(transfer)
        )
        self.model: ModelIdentity = model_identity(
            vllm_config, self.settings.kv_head_group, self.settings.rope_override
        )
        # The scheduler looks up under the first head group; a worker keys each of its
        # rank's groups under its own client (worker.py, client/head_groups.py).
        tp_rank = (
            0 if role == KVConnectorRole.SCHEDULER else compat.tensor_parallel_rank(vllm_config)
        )
        groups = self.model.head_groups(tp_rank)
        if role == KVConnectorRole.SCHEDULER:
            groups = groups[:1]
        clients = [self._make_client(group.fingerprint) for group in groups]
        self.client: CacheClient | None = clients[0]
        self._group_clients = clients
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._last_report: StepReport | None = None
        self._removals: RemovalFollower | None = None
        blend_unsupported = blend_unsupported_reason(vllm_config) if self.settings.blend else None
        if self.settings.blend and self.model.tp_size > 1:
            # The layer loop runs vLLM's sharded modules: every rank would have to run it
            # in lockstep, and one rank's failed fetch would leave the others waiting.
            blend_unsupported = f"tensor_parallel_size={self.model.tp_size}: blend runs on one rank"
        if blend_unsupported is not None:
            log.warning(
                "nopecache: pi_reuse='blend' unsupported here (%s); claiming exact prefixes only",
                blend_unsupported,
            )
        if role == KVConnectorRole.SCHEDULER:
            if compat.recompute_load_failures(transfer):
                log.info(
                    "nopecache: kv_load_failure_policy set to 'recompute' (misses are not fatal)"
                )
            announced = AnnouncedBlocks(clear_all=not compat.prefix_caching(vllm_config))
            self._scheduler = SchedulerSide(
                self.settings, self.model, self.client, blend_unsupported, announced
            )
            if compat.kv_events_enabled(vllm_config):
                # Withdraw announced blocks the servers drop, whoever made them go.
                self._removals = RemovalFollower(self.settings.client, announced.on_removal).start()
        else:
            self._worker = WorkerSide(
                self.settings,
                self.model,
                self.client,
                list(zip(groups, clients, strict=True)),
                tp_rank,
            )
            if blend_unsupported is not None:
                self._worker.refuse_blend(blend_unsupported)
        log.info(
            "nopecache connector (%s, TP rank %d/%d): %s, model %s %s, block %d, "
            "pi_reuse=%s, %s, KV heads %s in groups of %d",
            role.name,
            tp_rank,
            self.model.tp_size,
            ",".join(self.settings.client.servers),
            self.model.fingerprint.model,
            self.model.fingerprint.dtype,
            self.model.block_size,
            self.settings.pi_reuse,
            self.settings.role,
            [f"{g.fingerprint.kv_head_start}+{g.num_heads}" for g in groups],
            self.model.group_size,
        )

    def _make_client(self, fingerprint: ModelFingerprint) -> CacheClient:
        return CacheClient(
            self.settings.client,
            fingerprint=fingerprint,
            rope=self.model.rope,
            v_head_dim=self.model.v_head_dim,
            prefix_block_tokens=self.model.block_size,
        )

    # ==================================================================================
    # Worker-side methods (WorkerSide)
    # ==================================================================================
    def _worker_side(self) -> WorkerSide:
        assert self._worker is not None, "worker-side hook called on the scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Identify the cache layout; an unknown one is a start-up error."""
        worker = self._worker_side()
        layout = worker.register(kv_caches)
        if isinstance(layout, CpuAttnLayout):
            compat.verify_cpu_layout(layout, self.model.dtype)
        log.info("nopecache: KV cache layout %s for %d layers", layout.name, len(kv_caches))
        if worker.rotates:
            layers = compat.attention_layers(self._vllm_config, kv_caches)
            worker.check_rope(
                lambda: engine_rotations(layers), compat.max_model_len(self._vllm_config)
            )
        if self.settings.blend:
            worker.bind_model(compat.attention_layers(self._vllm_config, kv_caches))
            worker.run_gate(_tokenize(self._vllm_config) if worker.blend_stack else None)
            if worker.blend_stack is not None:
                log.info(
                    "nopecache: blend mode runs %s with policy %s",
                    type(worker.blend_stack).__name__,
                    self.settings.policy().name,
                )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Whether this worker blends (its gate's verdict) and takes position-independent
        blocks (its RoPE check's), for the scheduler half."""
        worker = self._worker
        if worker is None or (not self.settings.blend and worker.pi_refused is None):
            return None
        blend_refused = worker.blend_unavailable if self.settings.blend else None
        return NopecacheHandshake(blend_refused, worker.pi_refused)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's plan and start timing the step."""
        super().bind_connector_metadata(connector_metadata)
        plan = (
            connector_metadata.step
            if isinstance(connector_metadata, NopecacheConnectorMetadata)
            else None
        )
        self._worker_side().begin_step(plan)

    def _step(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NopecacheConnectorMetadata)
        return meta.step

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads: placed before the forward returns here, or with
        ``layerwise`` written layer by layer beside it (layerwise.py)."""
        self._worker_side().load(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``layerwise``: return once this layer's loads are written."""
        self._worker_side().wait_for_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """With ``layerwise``: copy this layer's blocks of the step's saves out now."""
        self._worker_side().save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Copy finished prompts' blocks out and queue their stores."""
        if self.has_connector_metadata():
            self._worker_side().save(self._step())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background loads ended (failed ones too: their blocks are in
        get_block_ids_with_load_errors in the same step)."""
        worker = self._worker_side()
        done = worker.finished_loads()
        sending = worker.acks.finished(finished_req_ids)  # a producer's acknowledged stores
        return sending or None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose claimed load failed this step (vLLM recomputes them)."""
        return self._worker_side().take_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters since the last call (for vLLM's stats logger and Prometheus)."""
        if self._scheduler is not None:
            counts = self._scheduler.take_counters()
            return NopecacheStats(data=counts) if any(counts.values()) else None
        worker = self._worker_side()
        self._last_report = worker.take_report()
        checks = worker.take_checks()
        if self._last_report is None and not checks:
            return None
        return NopecacheStats.of_report(self._last_report or StepReport(), checks)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's report for the scheduler half (prefill rate, totals)."""
        report, self._last_report = self._last_report, None
        return None if report is None else NopecacheWorkerMetadata(report)

    # ==================================================================================
    # Scheduler-side methods (SchedulerSide)
    # ==================================================================================
    def _scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side hook called on a worker connector"
        return self._scheduler

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' start-up word: one that cannot blend, or takes no
        position-independent blocks, puts the engine in prefix mode."""
        for meta in metadata.values():
            if not isinstance(meta, NopecacheHandshake):
                continue
            if meta.blend_refused is not None:
                self._scheduler_side().refuse_blend(meta.blend_refused)
            if meta.pi_refused is not None:
                self._scheduler_side().refuse_position_independent(meta.pi_refused)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after ``num_computed_tokens`` the cache can supply, and whether they load
        in the background (``load_async``); ``(None, False)`` while the lookup is in
        flight: vLLM skips the request this step and asks again on a later one."""
        side = self._scheduler_side()
        n = side.matched_tokens(request, num_computed_tokens)
        if n is None:
            return None, False
        return n, n > 0 and side.claim_is_async(compat.request_id(request))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember the request's blocks; queue a load when tokens were claimed."""
        block_ids = compat.allocated_block_ids(blocks)
        self._scheduler_side().after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves."""
        side = self._scheduler_side()
        side.finished(compat.finished_req_ids(scheduler_output))
        return NopecacheConnectorMetadata(side.build_step(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Feed the workers' reports into the totals and the cost model."""
        meta = compat.worker_metadata(connector_output)
        if isinstance(meta, NopecacheWorkerMetadata):
            self._scheduler_side().on_report(meta.report)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """kv_both and kv_consumer: stores copy their KV at once, the blocks are freed now.
        kv_producer: the blocks are held until the store is acknowledged, and the params
        name them for the decode engine (pd/handoff.py)."""
        side = self._scheduler_side()
        req_id = compat.request_id(request)
        delay, params = side.handoff_params(req_id)
        side.finished([req_id])
        return delay, params

    def take_events(self) -> Iterable[KVCacheEvent]:
        """BlockStored for blocks this engine stored, BlockRemoved for those since gone
        (AllBlocksCleared after a flush), under the configured medium (events.py)."""
        side = self._scheduler_side()
        yield from compat.kv_events(side.announced.take(), self.settings.kv_event_medium)

    def reset_cache(self) -> bool:
        """Drop this engine's announced state: every announced block is withdrawn (the
        blocks stay in the shared cache; storing them again announces them again)."""
        self._scheduler_side().announced.reset()
        return True

    # ==================================================================================
    # Metrics (metrics.py)
    # ==================================================================================
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        """Rebuild stats sent from a worker."""
        return NopecacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The connector's Prometheus counters."""
        return NopecachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Finish background loads and queued stores, then close the client."""
        if self._removals is not None:
            self._removals.close()
            self._removals = None
        if self._worker is not None:
            self._worker.close()
        for client in self._group_clients:
            client.close()
        self._group_clients = []
        self.client = None
