"""The connector's worker half: place fetched KV into vLLM's paged cache, queue stores.

Runs in each vLLM worker process, on the model runner's thread, around every forward::

    bind metadata (StepPlan)   t0
    start_load_kv              fetch every LoadSpec's blocks (verified), write K/V into
                               the claimed slots through the layer's KVLayout
    forward                    vLLM computes the unclaimed tokens (``layerwise``:
                               each layer's loads written before its attention,
                               its saves copied out after it; layerwise.py)
    wait_for_save              copy each SaveSpec's blocks out of the cache (one gather
                               per layer), hand them to the client's store queue
                               (``wait=False``: the network runs in the background)

Loads run on a background thread by default (``load_async``) while vLLM keeps stepping
other requests; the request waits until ``finished_loads`` reports it (vLLM's
async-receive protocol). Blend loads, every load with ``load_async=false``, and a claim
the scheduler made while the engine held no other request (``sync_when_idle``) run
before the step's forward: vLLM schedules the request's forward right after, so the KV
must be in place before it. A hit that fails verification, a server that dies mid-fetch, or
any error while placing marks the blocks it covers as failed loads: vLLM recomputes
them (``get_block_ids_with_load_errors``), and nothing wrong is ever attended to.
vLLM's K is post-RoPE, so blocks are stored with ``form="rope"`` at their positions:
exact-prefix blocks stay bit-exact, position-independent ones are un-rotated once, with
the RoPE spec the start-up check found vLLM's own rotary modules to apply
(``rope_check.py``; refused, the worker stores exact-prefix keys only). A save gathers
its blocks on the cache's device and copies them once to (pinned, on CUDA) host memory
(``KVLayout.blocks_to_host``). A save or load that raises is counted
(``save_failures``, ``load_failures``) and never reaches vLLM: a failed save stores
nothing, a failed load is a recompute.

Tensor parallel: each rank holds ``num_kv_heads / tp`` heads and stores and fetches only
those, as blocks of ``kv_head_group`` heads keyed per group (``client/head_groups.py``),
one client per group. The scheduler's plan is keyed under the first group; a rank
rekeys it for each of its groups. A rank whose fetch fails reports its blocks as failed
loads; vLLM unions the ranks' failed blocks (``KVOutputAggregator``) and recomputes them
on every rank, so no request ever mixes loaded heads with recomputed ones. Per-request
token counts are reported by rank 0 only (every rank loads the same tokens); bytes,
seconds and failed blocks by every rank, and vLLM sums them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from nopecache.client.errors import NopecacheError
from nopecache.client.fetching import FetchResult
from nopecache.client.head_groups import HeadGroup, rekey_plan
from nopecache.client.placement import PagedKV
from nopecache.client.sync_client import CacheClient
from nopecache.integrations.vllm.blend import blend_layout
from nopecache.integrations.vllm.blend_loop import (
    BlendUnavailableError,
    PagedLayerKV,
    VllmStack,
    find_model,
)
from nopecache.integrations.vllm.config import ConnectorConfig, ModelIdentity
from nopecache.integrations.vllm.gate import Tokenize, calibrate
from nopecache.integrations.vllm.layerwise import LayerLoads, LayerSaves, LoadStaging
from nopecache.integrations.vllm.layout import (
    CpuAttnLayout,
    KVLayout,
    UnsupportedLayoutError,
    detect_layout,
)
from nopecache.integrations.vllm.metadata import (
    LoadSpec,
    SaveSpec,
    StepPlan,
    StepReport,
    slots_for,
)
from nopecache.integrations.vllm.pd import StoreAcks
from nopecache.integrations.vllm.quality import BlendCheck, QualityWatch
from nopecache.kernels.rope_check import EngineRotation, RopeCheck, check_positions, check_rope
from nopecache.recompute.gate import DEFAULT_THRESHOLDS, GateVerdict
from nopecache.recompute.selective import run_selective

__all__ = ["PER_REQUEST_COUNTS", "WorkerSide", "layer_index"]

log = logging.getLogger(f"vllm.{__name__}")  # shown in vLLM's log

PER_REQUEST_COUNTS = (
    "loaded_exact_tokens",
    "loaded_pi_tokens",
    "saved_tokens",
    "layer_saved_tokens",
    "layer_loaded_tokens",
    "computed_tokens",
    "blend_miss_tokens",
    "pi_token_layers",
    "recomputed_token_layers",
    "blend_fallbacks",
    "blend_token_layers",
)
"""StepReport counts that are the same on every tensor-parallel rank (tokens of the
requests): reported by rank 0 only, so vLLM's sum over ranks counts each token once."""

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
# A step computing fewer tokens is decode-dominated: its rate says nothing about prefill.
_MIN_PREFILL_TOKENS = 64


def _ranks() -> int:
    """Ranks in the default process group (1 when there is none)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclasses.dataclass(slots=True)
class _Staged:
    """A layer-wise load fetched into its staging, waiting for its layers to be written."""

    spec: LoadSpec
    staging: LoadStaging
    result: FetchResult


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn``)."""
    match = _LAYER_INDEX.search(name)
    if match is None:
        raise UnsupportedLayoutError(f"layer {name!r}: no layer number in its name")
    return int(match.group(1))


class WorkerSide:
    """Loads and saves for one worker (see the module docstring)."""

    def __init__(
        self,
        config: ConnectorConfig,
        model: ModelIdentity,
        client: CacheClient | None,
        groups: Sequence[tuple[HeadGroup, CacheClient]] | None = None,
        tp_rank: int = 0,
    ) -> None:
        """A worker half using ``client`` (None: the connector loads and stores nothing).

        ``groups``: the rank's head groups, each with the client keyed under it (None:
        one group of every head, through ``client``).
        """
        self.config = config
        self.model = model
        self.client = client
        self.tp_rank = tp_rank
        if groups is None and client is not None:
            groups = [(model.head_groups(tp_rank)[0], client)]
        self.groups: tuple[tuple[HeadGroup, CacheClient], ...] = tuple(groups or ())
        self.layout: KVLayout | None = None
        self.caches: tuple[torch.Tensor, ...] = ()
        # Guards _errors and _report: background loads add to them.
        self._lock = threading.Lock()
        self._errors: set[int] = set()
        self._report = StepReport()
        self._pending: dict[str, concurrent.futures.Future[float]] = {}
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nopecache-load")
        self._step_start: float | None = None
        self._load_seconds = 0.0
        self.blend_stack: VllmStack | None = None
        self.blend_model: nn.Module | None = None
        self.gate: GateVerdict | None = None  # the correctness gate's verdict (gate.py)
        self.quality: QualityWatch | None = None  # sampled blend checks (quality.py)
        self.blend_unavailable: str | None = "blend mode is off" if not config.blend else None
        self.acks = StoreAcks()  # a producer's stores until acknowledged (pd/acks.py)
        # Why position-independent store and load are off (None: on); rope_check.py.
        self.pi_refused: str | None = None
        self.rope_check: RopeCheck | None = None
        # layerwise=true: the step's synchronous loads and its saves move layer by layer
        # beside the forward (layerwise.py).
        self._layer_loads: LayerLoads[_Staged] | None = (
            LayerLoads(model.num_layers) if config.layerwise else None
        )
        self._layer_saves: LayerSaves | None = None
        self._layer_index: dict[str, int] = {}

    # -- set-up -----------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> KVLayout:
        """Identify the layout of every layer's cache; refuse an unknown one."""
        if len(kv_caches) != self.model.num_layers:
            raise UnsupportedLayoutError(
                f"{len(kv_caches)} KV cache layers, the model has {self.model.num_layers}"
            )
        ordered = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        layouts = [
            detect_layout(
                name,
                cache,
                block_size=self.model.block_size,
                num_kv_heads=self.model.rank_kv_heads,
                head_dim=self.model.head_dim,
            )
            for name, cache in ordered
        ]
        kinds = {type(lay) for lay in layouts}
        if len(kinds) != 1:
            raise UnsupportedLayoutError(f"layers mix KV layouts {sorted(k.name for k in kinds)}")
        for name, cache in ordered:
            if cache.dtype != self.model.dtype:
                raise UnsupportedLayoutError(
                    f"layer {name!r}: KV cache dtype {cache.dtype}, the model's is "
                    f"{self.model.dtype}"
                )
        self.layout = layouts[0]
        self.caches = tuple(cache for _, cache in ordered)
        self._layer_index = {name: i for i, (name, _) in enumerate(ordered)}
        if self.config.layerwise:
            self._layer_saves = LayerSaves(self.layout, self.caches)
        return self.layout

    def bind_model(self, attention_layers: Mapping[str, nn.Module]) -> None:
        """Find the served model for blend mode's loop; on failure say why (prefix mode)."""
        if not self.config.blend or self.blend_unavailable is not None:
            return
        try:
            if not isinstance(self.layout, CpuAttnLayout):
                raise BlendUnavailableError(
                    f"KV layout {getattr(self.layout, 'name', None)}: blend mode runs on "
                    "the CPU attention backend only"
                )
            model = find_model(attention_layers)
            stack = VllmStack(model)
            if stack.num_layers != self.model.num_layers:
                raise BlendUnavailableError(
                    f"the model found has {stack.num_layers} layers, the caches "
                    f"{self.model.num_layers}"
                )
            self.blend_stack, self.blend_model = stack, model
        except BlendUnavailableError as err:
            self.refuse_blend(str(err))

    def run_gate(self, tokenize: Tokenize | None) -> None:
        """The blend correctness gate on the bound model (gate.py); refused, or unable to
        run, the worker runs prefix mode only (the reason, with the figures, logged)."""
        if self.blend_stack is None or self.blend_model is None:
            return
        if tokenize is None:
            self.refuse_blend("the correctness gate needs the model's tokenizer (none loaded)")
            return
        try:
            verdict = calibrate(self.blend_model, tokenize, self.config.policy(), self.model.rope)
        except Exception as err:  # an unknown model must cost blend mode, never the engine
            log.exception("nopecache: the blend correctness gate failed to run")
            self.refuse_blend(f"the correctness gate failed to run: {type(err).__name__}: {err}")
            return
        self.gate = verdict
        if not verdict.passed:
            self.refuse_blend(verdict.reason())
            return
        log.info("nopecache: %s", verdict.reason())
        if self.config.blend_check_share > 0:
            if _ranks() > 1:
                # A check runs on one rank's own schedule, and the model's sharded layers
                # reduce across ranks: the others would never join it.
                log.warning("nopecache: blend checks need a single rank; %d here", _ranks())
            else:
                self.quality = QualityWatch(self.blend_model, self.config.blend_check_share)

    @property
    def rotates(self) -> bool:
        """Whether this worker stores (``save``: content keys too) or loads
        (``pi_reuse`` not ``off``) position-independent blocks, so its RoPE is checked."""
        return self.config.save or (self.config.load and self.config.pi_reuse != "off")

    def check_rope(
        self, rotations: Callable[[], Mapping[str, EngineRotation | None]], max_len: int
    ) -> RopeCheck | None:
        """Check the connector's RoPE spec against every layer's own rotation (rope_check.py);
        a mismatch, or a check that cannot run, turns position-independent reuse off."""
        try:
            found = rotations()
            ordered = dict(sorted(found.items(), key=lambda item: layer_index(item[0])))
            if len(ordered) != self.model.num_layers:
                raise UnsupportedLayoutError(
                    f"{len(ordered)} attention layers found, the model has {self.model.num_layers}"
                )
            check = check_rope(
                ordered,
                self.model.rope,
                positions=check_positions(max_len),
                kv_heads=self.model.rank_kv_heads,
                dtype=self.model.dtype,
                bound=DEFAULT_THRESHOLDS.for_dtype(self.model.dtype).max_rope_error,
                device=self.caches[0].device if self.caches else "cpu",
            )
        except Exception as err:  # a model the check cannot reach costs PI reuse, not the engine
            log.exception("nopecache: the RoPE check failed to run")
            self.refuse_position_independent(
                f"the RoPE check failed to run: {type(err).__name__}: {err}"
            )
            return None
        self.rope_check = check
        if check.passed:
            log.info("nopecache: %s", check.summary())
            return check
        log.warning("nopecache: %s; every figure:\n%s", check.summary(), check.report())
        self.refuse_position_independent(f"{check.summary()}; first: {check.failures[0]}")
        return check

    def refuse_position_independent(self, reason: str) -> None:
        """Store and load exact prefixes only (the RoPE check refused the spec); counted."""
        self.pi_refused = reason
        with self._lock:
            self._report.rope_check_failed += 1
        log.warning(
            "nopecache: position-independent reuse off in this worker, exact prefixes only (%s)",
            reason,
        )
        if self.config.blend and self.blend_unavailable is None:
            self.refuse_blend("position-independent reuse is off (the RoPE check)")

    def refuse_blend(self, reason: str) -> None:
        """Run without the layer loop: blend claims load their exact part only."""
        self.blend_unavailable = reason
        self.blend_stack = self.blend_model = None
        log.warning("nopecache: blend mode unavailable in this worker (%s)", reason)

    # -- per step ---------------------------------------------------------------------
    def begin_step(self, plan: StepPlan | None = None) -> None:
        """Mark the start of a step (before its loads and forward); with ``layerwise``,
        make room for ``plan``'s saves to be copied layer by layer."""
        self._step_start = time.perf_counter()
        self._load_seconds = 0.0
        if self.quality is not None:
            self.quality.step_began()
        if self._layer_saves is not None and plan is not None and self.groups:
            self._layer_saves.clear()
            for spec in plan.saves:
                _, block_ids = self._save_extent(spec)
                if block_ids:
                    self._layer_saves.prepare(spec.req_id, block_ids)

    def load(self, plan: StepPlan) -> None:
        """Fetch and place every load of the step; failures become load errors.

        With ``layerwise``, the synchronous non-blend loads' fetches start on their own
        thread and this returns at once: ``wait_for_layer`` writes each layer as the
        forward reaches it (layerwise.py)."""
        layered: list[LoadSpec] = []
        for spec in plan.loads:
            if spec.asynchronous:
                self._pending[spec.req_id] = self._loader.submit(self._timed_load, spec)
            elif self._layer_loads is not None and not spec.blend:
                layered.append(spec)
            else:
                self._load_seconds += self._timed_load(spec)
        if layered:
            assert self._layer_loads is not None
            self._layer_loads.start(
                lambda: self._stage_all(layered), self._write_layer, self._count_staged
            )

    def wait_for_layer(self, layer_name: str) -> None:
        """Write ``layer_name``'s K/V of the step's layer-wise loads (once fetched)."""
        if self._layer_loads is not None and self._layer_loads.active:
            self._layer_loads.wait(self._layer_index[layer_name])

    def save_layer(self, layer_name: str) -> None:
        """Copy ``layer_name``'s blocks of the step's saves out (the forward wrote them)."""
        if self._layer_saves is not None:
            self._layer_saves.copy_layer(self._layer_index[layer_name])

    def _finish_layer_loads(self) -> None:
        """End the step's layer-wise loads (a layer no wait asked for is written now)
        and account for their time."""
        loads = self._layer_loads
        if loads is None or not loads.active:
            return
        try:
            seconds = loads.finish()
        except Exception:  # _stage_all and _write_layer catch their own: a bug
            log.exception("nopecache: layer-wise loads failed")
            seconds = loads.seconds
        self._load_seconds += loads.waited
        with self._lock:
            self._report.load_seconds += seconds
            self._report.layer_wait_seconds += loads.waited

    def _stage_all(self, specs: Sequence[LoadSpec]) -> list[_Staged]:
        """Fetch every load of the step into its staging (on the loads' thread)."""
        staged = []
        for spec in specs:
            try:
                item = self._stage_one(spec)
            except Exception:  # a bug here must cost a recompute, never the engine
                log.exception("nopecache: loading %s failed; vLLM recomputes it", spec.req_id)
                self._fail(spec, range(spec.start, spec.end))
                with self._lock:
                    self._report.load_failures += 1
                continue
            if item is not None:
                staged.append(item)
        return staged

    def _stage_one(self, spec: LoadSpec) -> _Staged | None:
        assert self.layout is not None
        slots = self._slot_mapping(spec)[spec.start : spec.end]
        staging = LoadStaging.for_claim(
            self.layout, self.model.num_layers, self.model.dtype, spec.start, slots.cpu()
        )
        result = self._fetch_checked(spec, lambda heads: staging.paged(spec.plan.num_tokens, heads))
        if result is None:
            return None
        staging.rows = self._loaded_end(spec, result) - spec.start
        return _Staged(spec, staging, result)

    def _write_layer(self, item: _Staged, layer: int) -> None:
        if item.staging.failed:
            return
        assert self.layout is not None
        try:
            item.staging.write_layer(self.layout, self.caches[layer], layer)
        except Exception:  # never a partial placement: the whole claim is recomputed
            log.exception(
                "nopecache: writing layer %d of %s failed; vLLM recomputes it",
                layer,
                item.spec.req_id,
            )
            item.staging.failed = True
            self._fail(item.spec, range(item.spec.start, item.spec.end))
            with self._lock:
                self._report.load_failures += 1

    def _count_staged(self, item: _Staged) -> None:
        if not item.staging.failed:
            self._count_loaded(item.spec, item.result, item.spec.start + item.staging.rows)
            with self._lock:
                self._report.layer_loaded_tokens += item.staging.rows

    def _timed_load(self, spec: LoadSpec) -> float:
        start = time.perf_counter()
        try:
            self._load_one(spec)
        except Exception:  # a bug here must cost a recompute, never the engine
            log.exception("nopecache: loading %s failed; vLLM recomputes it", spec.req_id)
            self._fail(spec, range(spec.start, spec.end))
            with self._lock:
                self._report.load_failures += 1
        seconds = time.perf_counter() - start
        with self._lock:
            self._report.load_seconds += seconds
        return seconds

    def finished_loads(self) -> set[str]:
        """Requests whose background load ended since the last call."""
        done = {req_id for req_id, future in self._pending.items() if future.done()}
        for req_id in done:
            del self._pending[req_id]
        return done

    def _fail(self, spec: LoadSpec, positions: range) -> None:
        bs = self.model.block_size
        blocks = {spec.block_ids[p // bs] for p in positions}
        with self._lock:
            self._errors.update(blocks)
            self._report.load_errors += len(blocks)
            self._report.failed_requests.append(spec.req_id)

    def _slot_mapping(self, spec: LoadSpec) -> torch.Tensor:
        """Slots of the claimed positions ``[start, end)``, -1 everywhere else (vLLM's own
        prefix before, the unclaimed rest after: neither is fetched nor written)."""
        slots = torch.full((spec.plan.num_tokens,), -1, dtype=torch.int64)
        bs = self.model.block_size
        slots[spec.start : spec.end] = torch.tensor(
            slots_for(list(spec.block_ids), bs, spec.start, spec.end), dtype=torch.int64
        )
        return slots.to(self.caches[0].device)

    def _load_one(self, spec: LoadSpec) -> None:
        if self.layout is None:
            self._fail(spec, range(spec.start, spec.end))
            return
        layout, caches, slots = self.layout, self.caches, self._slot_mapping(spec)
        result = self._fetch_checked(spec, lambda heads: layout.paged(caches, slots, heads))
        if result is None:
            return
        if spec.blend:
            self._blend_one(spec, result)
            return
        self._count_loaded(spec, result, self._loaded_end(spec, result))

    def _fetch_checked(
        self, spec: LoadSpec, into: Callable[[slice | None], PagedKV]
    ) -> FetchResult | None:
        """Fetch ``spec`` into the paged targets ``into(heads)`` makes; None (its claim
        failed) when there is no client or the fetch raised."""
        claimed = range(spec.start, spec.end)
        if not self.groups:
            self._fail(spec, claimed)
            return None
        started = time.perf_counter()
        try:
            result = self._fetch_groups(spec, into)
        except NopecacheError as err:
            log.warning("nopecache fetch for %s failed: %s", spec.req_id, err)
            self._fail(spec, claimed)
            return None
        if result.nbytes:  # the scheduler's cost check prices fetches with these
            with self._lock:
                self._report.fetched_bytes += result.nbytes
                self._report.fetch_seconds += time.perf_counter() - started
        return result

    def _loaded_end(self, spec: LoadSpec, result: FetchResult) -> int:
        """Where what the fetch placed of the claim ends (a block boundary when some
        position failed: those from its block on are failed loads, vLLM recomputes)."""
        claimed = range(spec.start, spec.end)
        mask = result.mask[spec.start : spec.end]
        placed = int(mask.sum())
        loaded_end = spec.end
        if placed != len(claimed):
            missing = [spec.start + int(i) for i in torch.nonzero(~mask).flatten()]
            log.warning(
                "nopecache: %d of %d claimed tokens of %s failed to load",
                len(missing),
                len(claimed),
                spec.req_id,
            )
            self._fail(spec, range(min(missing), spec.end))
            # vLLM recomputes from the failed position's block on: only before it loaded.
            loaded_end = min(missing) - min(missing) % self.model.block_size
        return loaded_end

    def _count_loaded(self, spec: LoadSpec, result: FetchResult, loaded_end: int) -> None:
        with self._lock:
            exact_end = min(spec.plan.prefix_end, loaded_end)
            self._report.loaded_exact_tokens += max(0, exact_end - spec.start)
            self._report.loaded_pi_tokens += spec.pi_tokens if loaded_end == spec.end else 0
            self._report.loaded_bytes += result.nbytes

    def _fetch_groups(self, spec: LoadSpec, into: Callable[[slice | None], PagedKV]) -> FetchResult:
        """Fetch every head group of the rank into its heads of the claimed slots
        (``into(heads)``: vLLM's pages, or a layer-wise load's staging).

        Every block lands in vLLM's pages through the client's paged contract and the
        fused re-RoPE scatter: no whole-plan tensor, no second copy. A position counts
        as loaded when every group's block for it loaded (the masks' AND).
        """
        lookup = self.model.lookup_fingerprint
        result: FetchResult | None = None
        for group, client in self.groups:
            plan = spec.plan
            if group.fingerprint != lookup:
                plan = rekey_plan(
                    plan, spec.tokens, group.fingerprint, self.config.namespace, spec.identity
                )
            heads = None
            if group.num_heads != self.model.rank_kv_heads:
                heads = slice(group.local_start, group.local_start + group.num_heads)
            got = client.fetch(plan, spec.tokens, into=into(heads))
            if got.ready is not None:
                got.ready.synchronize()  # placed before vLLM's forward reads the pages
            result = (
                got
                if result is None
                else dataclasses.replace(
                    got, mask=result.mask & got.mask, nbytes=result.nbytes + got.nbytes
                )
            )
        assert result is not None
        return result

    def _blend_one(self, spec: LoadSpec, result: FetchResult) -> None:
        """Run the layer loop over ``[start, end)``, whose loaded hits the fetch placed.

        The fetch wrote every hit of the range into its slots; a hit that did not load
        whole is a miss in the layout, so the loop computes its rows and overwrites them.
        """
        assert self.layout is not None
        layout = blend_layout(spec.plan, spec.start, spec.end, result.mask)
        bs = self.model.block_size
        slots = torch.tensor(slots_for(list(spec.block_ids), bs, 0, spec.end), dtype=torch.int64)
        computed_from = layout.prefix_end  # what vLLM recomputes if the loop cannot run
        if self.blend_stack is None:
            self._blend_failed(spec, computed_from, self.blend_unavailable or "no model")
            return
        ids = torch.tensor(spec.tokens[: spec.end], dtype=torch.int64)
        kv = PagedLayerKV(self.layout, self.caches, slots)
        started = time.perf_counter()
        try:
            # The prompt past the claim (the question) for a policy that reads it.
            question = torch.tensor(spec.tokens[spec.end :], dtype=torch.int64)
            run = run_selective(
                self.blend_stack,
                kv,
                ids,
                layout,
                self.config.policy(),
                output=False,
                lookahead=question,
            )
        except Exception as err:  # never wrong KV: vLLM recomputes past the exact part
            log.exception("nopecache: blend loop for %s failed", spec.req_id)
            self._blend_failed(spec, computed_from, f"{type(err).__name__}: {err}")
            return
        with self._lock:
            report = self._report
            report.loaded_exact_tokens += layout.prefix_end - spec.start
            report.loaded_pi_tokens += layout.num_pi
            report.loaded_bytes += result.nbytes
            report.blend_miss_tokens += spec.end - layout.prefix_end - layout.num_pi
            report.pi_token_layers += layout.num_pi * self.model.num_layers
            report.recomputed_token_layers += int(run.recomputed.sum())
            report.blend_seconds += time.perf_counter() - started
            report.blend_token_layers += int(run.computed.sum())
        if self.quality is not None:
            self.quality.offer(spec.req_id, list(spec.tokens), lambda: self._read_kv(kv.slots))

    def _read_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies ``[layers, len(slots), kv_heads, head_dim]`` of K and V at ``slots``."""
        assert self.layout is not None
        pairs = [self.layout.read(cache, slots) for cache in self.caches]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    def _blend_failed(self, spec: LoadSpec, start: int, reason: str) -> None:
        log.warning(
            "nopecache: blend of %s fell back to the exact prefix (%s)", spec.req_id, reason
        )
        if start < spec.end:
            self._fail(spec, range(start, spec.end))
        with self._lock:
            self._report.loaded_exact_tokens += start - spec.start
            self._report.blend_fallbacks += 1

    def save(self, plan: StepPlan) -> None:
        """Copy every save's blocks out of the cache and queue their store (with
        ``layerwise``, the copies ``save_layer`` made during the forward)."""
        self._finish_layer_loads()
        if self.quality is not None:
            self.quality.step_ended()
        if self.groups and self.layout is not None:
            for spec in plan.saves:
                try:
                    self._save_one(spec)
                except Exception:  # a failed save is a skipped store, never a dead worker
                    log.exception("nopecache: saving %s failed; not stored", spec.req_id)
                    with self._lock:
                        self._report.save_failures += 1
        for spec in plan.saves:
            if spec.ack:  # vLLM holds its blocks until reported: report even if not stored
                self.acks.ensure(spec.req_id)
        self._end_step(plan)

    def _save_extent(self, spec: SaveSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The tokens of ``spec`` this worker stores and the blocks holding them."""
        tokens, block_ids = spec.tokens, spec.block_ids
        if spec.exact_end is not None and self.pi_refused is not None:
            # Nothing past the exact part to key.
            bs = self.model.block_size
            tokens, block_ids = tokens[: spec.exact_end], block_ids[: spec.exact_end // bs]
        return tokens, block_ids[: -(-len(tokens) // self.model.block_size)]

    def _save_one(self, spec: SaveSpec) -> None:
        assert self.layout is not None
        pi = self.pi_refused is None
        tokens, block_ids = self._save_extent(spec)
        n = len(tokens)
        if n == 0:
            return
        # Whole blocks (the last one partial): as the layers copied them during the
        # forward (layerwise), or gathered now on the caches' device.
        copied = None if self._layer_saves is None else self._layer_saves.take(spec.req_id)
        k, v = copied if copied is not None else self.layout.blocks_to_host(self.caches, block_ids)
        k, v = k[:, :n], v[:, :n]
        stored = True
        layered = copied is not None
        for group, client in self.groups:
            if group.num_heads == self.model.rank_kv_heads:
                gk, gv = k, v
            else:  # one group of the rank's heads, as its own block
                heads = slice(group.local_start, group.local_start + group.num_heads)
                gk, gv = k[:, :, heads].contiguous(), v[:, :, heads].contiguous()
            segments = self.config.segments(tokens)
            try:
                if spec.ack:  # a producer's: the blocks are held until it is acknowledged
                    future = client.submit_store(
                        tokens,
                        (gk, gv),
                        0,
                        form="rope",
                        segments=segments,
                        namespace=self.config.namespace,
                        position_independent=pi,
                        identity=spec.identity,
                        prefix_end=spec.exact_end,
                    )
                    self.acks.add(spec.req_id, future)
                    continue
                report = client.store(
                    tokens,
                    (gk, gv),
                    0,
                    form="rope",
                    segments=segments,
                    namespace=self.config.namespace,
                    position_independent=pi,
                    wait=False,
                    identity=spec.identity,
                    prefix_end=spec.exact_end,
                )
            except NopecacheError as err:
                log.warning("nopecache store for %s refused: %s", spec.req_id, err)
                report = None
            stored = stored and report is not None and not report.dropped
        with self._lock:
            if stored:
                self._report.saved_tokens += n
                self._report.layer_saved_tokens += n if layered else 0
            else:
                self._report.save_dropped += 1

    def _end_step(self, plan: StepPlan) -> None:
        if self._step_start is None:
            return
        forward = time.perf_counter() - self._step_start - self._load_seconds
        computed = plan.scheduled_tokens
        if computed >= _MIN_PREFILL_TOKENS and forward > 0:
            with self._lock:
                self._report.computed_tokens += computed
                self._report.forward_seconds += forward
        self._step_start = None

    def take_errors(self) -> set[int]:
        """Block ids whose load failed since the last call."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> StepReport | None:
        """What this worker did since the last call (None if nothing); on ranks other
        than 0 without the per-request token counts, which rank 0 reports for all."""
        with self._lock:
            report, self._report = self._report, StepReport()
        if self.tp_rank != 0:
            for name in PER_REQUEST_COUNTS:
                setattr(report, name, 0)
        return None if report == StepReport() else report

    def take_checks(self) -> list[BlendCheck]:
        """Sampled blend checks finished since the last call (quality.py)."""
        return [] if self.quality is None else self.quality.take()

    def close(self) -> None:
        """Wait for background loads, then stop their thread (and the blend checks')."""
        self._loader.shutdown(wait=True)
        if self._layer_loads is not None:
            self._layer_loads.close()
        if self.quality is not None:
            self.quality.close()
