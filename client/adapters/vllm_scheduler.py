"""The connector's scheduler half: look up prompts, claim tokens, plan loads and saves.

Runs in vLLM's engine-core process, called by the scheduler thread.

Claims. vLLM's connector API claims a prefix: tokens ``[num_computed_tokens, end)`` that
the worker half will load before the forward. ``end`` is the exact prefix the servers
hold (cut at vLLM's block size, so keys match vLLM's blocks one to one), extended with
``pi_reuse="contiguous"`` by position-independent hits that tile the prompt without a gap
right after it. It is aligned down to a block boundary and never reaches the prompt's
last token (vLLM must compute at least one token to sample from). A lookup that fails
(server down, slow, bad reply) claims 0 tokens: the request runs as if uncached.

Saves. When a request's prompt has been prefilled, its whole blocks are stored from
position 0 (the client skips blocks the servers already hold). KV that came from a
position-independent hit is approximate, and so is every later token's KV (it attended
to it): such a request stores only the blocks before its first position-independent
token, so the exact cache never holds approximate KV.

Concurrency: every method runs on vLLM's scheduler thread; the client is thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nopecache.client.adapters.vllm_config import ConnectorConfig, ModelIdentity
from nopecache.client.adapters.vllm_meta import LoadSpec, SaveSpec, StepPlan, StepReport
from nopecache.client.chunking import ChunkSpan
from nopecache.client.errors import NopecacheError
from nopecache.client.plan import ReusePlan
from nopecache.client.sync_client import CacheClient

__all__ = [
    "SCHEDULER_COUNTERS",
    "Claim",
    "ConnectorTotals",
    "SchedulerSide",
    "StoredBlocks",
    "claim_end",
    "trim_plan",
]

SCHEDULER_COUNTERS = ("lookups", "lookup_failures", "claimed_exact_tokens", "claimed_pi_tokens")

log = logging.getLogger(f"vllm.{__name__}")  # shown in vLLM's log


def claim_end(plan: ReusePlan, *, contiguous: bool, limit: int, block_size: int) -> int:
    """Where a claim ends: the exact prefix (plus contiguous PI hits), block aligned."""
    end = plan.prefix_end
    if contiguous:
        for hit in plan.hits:
            if hit.target.start != end:
                break
            end = hit.target.end
    end = min(end, limit)
    return end - end % block_size


def trim_plan(plan: ReusePlan, end: int) -> ReusePlan:
    """``plan`` without the hits that start at or after ``end`` (they become misses)."""
    hits = tuple(h for h in plan.hits if h.target.start < end)
    misses: list[ChunkSpan] = []
    pos = plan.prefix_end
    for hit in hits:
        if hit.target.start > pos:
            misses.append(ChunkSpan(pos, hit.target.start))
        pos = hit.target.end
    if pos < plan.num_tokens:
        misses.append(ChunkSpan(pos, plan.num_tokens))
    return ReusePlan(plan.num_tokens, plan.prefix, hits, tuple(misses))


@dataclass(frozen=True, slots=True)
class Claim:
    """One answer of get_num_new_matched_tokens, kept until the request is allocated."""

    tokens: tuple[int, ...]
    plan: ReusePlan
    start: int  # vLLM's locally computed tokens at the call
    end: int  # claim end (== start: nothing claimed)


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """Blocks this engine made available in the shared cache (for a KV event)."""

    block_hashes: tuple[Any, ...]  # vLLM's own block hashes
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(slots=True)
class _Tracked:
    request: Any  # vLLM's Request (for its block hashes)
    tokens: tuple[int, ...]  # the prompt
    block_ids: list[int]
    computed: int  # tokens computed before this step
    approximate_from: int | None  # first position with position-independent KV
    saved: bool = False


@dataclass(slots=True)
class ConnectorTotals:
    """What the connector did since the engine started (scheduler and worker halves)."""

    lookups: int = 0
    lookup_failures: int = 0
    claimed_exact_tokens: int = 0
    claimed_pi_tokens: int = 0
    report: StepReport = field(default_factory=StepReport)


class SchedulerSide:
    """Lookup and claim bookkeeping for one engine (see the module docstring)."""

    def __init__(
        self, config: ConnectorConfig, model: ModelIdentity, client: CacheClient | None
    ) -> None:
        """A scheduler half using ``client`` (None: the connector loads nothing)."""
        self.config = config
        self.model = model
        self.client = client
        self._claims: dict[str, Claim] = {}
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._events: list[StoredBlocks] = []
        # vLLM block hashes announced as stored and not yet seen gone (for BlockRemoved).
        self._advertised: set[Any] = set()
        self._removed: list[Any] = []
        self.totals = ConnectorTotals()
        self._reported: dict[str, int] = {}

    # -- claims -----------------------------------------------------------------------
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` that the cache can supply (0 on failure)."""
        if self.client is None or not self.config.load:
            return 0
        req_id = request.request_id
        known = self._claims.get(req_id)
        if known is not None and known.start == num_computed_tokens:
            return known.end - known.start
        prompt = tuple(request.prompt_token_ids or ())
        bs = self.model.block_size
        limit = (len(prompt) - 1) // bs * bs if prompt else 0
        if limit <= num_computed_tokens:
            return 0
        tokens = prompt[:limit]
        contiguous = self.config.pi_reuse == "contiguous"
        self.totals.lookups += 1
        try:
            plan = self.client.lookup(
                tokens,
                segments=self.config.segments(tokens),
                namespace=self.config.namespace,
                allow_position_independent=contiguous,
            )
        except NopecacheError as err:  # a client-side failure: run uncached, say why
            self.totals.lookup_failures += 1
            log.warning("nopecache lookup failed for %s: %s", req_id, err)
            return 0
        self._note_gone(request, plan.prefix_end // bs, limit // bs)
        end = claim_end(plan, contiguous=contiguous, limit=limit, block_size=bs)
        end = max(end, num_computed_tokens)
        self._claims[req_id] = Claim(tokens, trim_plan(plan, end), num_computed_tokens, end)
        return end - num_computed_tokens

    def _note_gone(self, request: Any, found_blocks: int, looked_up_blocks: int) -> None:
        """Announced blocks a lookup no longer finds were evicted: report them removed."""
        if not self._advertised:
            return
        hashes = getattr(request, "block_hashes", ())[found_blocks:looked_up_blocks]
        gone = [h for h in hashes if h in self._advertised]
        if gone:
            self._advertised.difference_update(gone)
            self._removed.extend(gone)

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """Record the blocks vLLM allocated; queue a load when tokens were claimed."""
        req_id = request.request_id
        claim = self._claims.pop(req_id, None)
        approximate_from: int | None = None
        if num_external > 0 and claim is not None:
            end = claim.start + num_external
            load = LoadSpec(
                req_id,
                claim.tokens,
                claim.plan,
                claim.start,
                end,
                tuple(block_ids),
                asynchronous=self.config.load_async,
            )
            self._loads.append(load)
            self.totals.claimed_exact_tokens += load.exact_tokens
            self.totals.claimed_pi_tokens += load.pi_tokens
            if load.pi_tokens:
                approximate_from = max(claim.start, claim.plan.prefix_end)
        prompt = tuple(request.prompt_token_ids or ())
        tracked = self._tracked.get(req_id)
        if tracked is None:
            self._tracked[req_id] = _Tracked(request, prompt, list(block_ids), 0, approximate_from)
        else:
            tracked.block_ids = list(block_ids)
            if approximate_from is not None:
                tracked.approximate_from = approximate_from

    # -- steps ------------------------------------------------------------------------
    def _update_blocks(self, scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                tracked.computed = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed and new_ids is not None:
                tracked.block_ids = list(new_ids[0])
            elif new_ids is not None:
                tracked.block_ids.extend(new_ids[0])
            tracked.computed = cached.num_computed_tokens[i]

    def _save(self, req_id: str, tracked: _Tracked, num_scheduled: int) -> SaveSpec | None:
        bs = self.model.block_size
        if tracked.saved or tracked.computed + num_scheduled < len(tracked.tokens):
            return None
        tracked.saved = True
        end = len(tracked.tokens)
        if tracked.approximate_from is not None:
            end = min(end, tracked.approximate_from)
        end -= end % bs
        if end <= 0 or not self.config.save:
            return None
        hashes = tuple(getattr(tracked.request, "block_hashes", ())[: end // bs])
        tokens = tracked.tokens[:end]
        self._events.append(StoredBlocks(hashes, tokens, bs))
        self._advertised.update(hashes)
        return SaveSpec(req_id, tokens, tuple(tracked.block_ids[: end // bs]))

    def build_step(self, scheduler_output: Any) -> StepPlan:
        """The loads and saves of this step; resets the pending loads."""
        self._update_blocks(scheduler_output)
        saves: list[SaveSpec] = []
        for req_id, num in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            spec = self._save(req_id, tracked, num)
            if spec is not None:
                saves.append(spec)
        loads, self._loads = tuple(self._loads), []
        return StepPlan(loads, tuple(saves), int(scheduler_output.total_num_scheduled_tokens))

    def on_report(self, report: StepReport | None) -> None:
        """Fold the workers' account of a step into the totals and the cost model."""
        if report is None:
            return
        self.totals.report = self.totals.report.add(report)
        if self.client is not None and report.computed_tokens and report.forward_seconds > 0:
            self.client.observe_prefill(report.computed_tokens, report.forward_seconds)

    def finished(self, req_ids: Iterable[str]) -> None:
        """Forget finished requests."""
        for req_id in req_ids:
            self._tracked.pop(req_id, None)
            self._claims.pop(req_id, None)

    def take_counters(self) -> dict[str, int]:
        """The scheduler counters (SCHEDULER_COUNTERS) gained since the last call."""
        now = {k: getattr(self.totals, k) for k in SCHEDULER_COUNTERS}
        delta = {k: now[k] - self._reported.get(k, 0) for k in SCHEDULER_COUNTERS}
        self._reported = now
        return delta

    def take_stored(self) -> list[StoredBlocks]:
        """Blocks stored since the last call (for vLLM KV events)."""
        events, self._events = self._events, []
        return events

    def take_removed(self) -> list[Any]:
        """vLLM hashes of announced blocks found evicted since the last call."""
        removed, self._removed = self._removed, []
        return removed
