"""The connector's scheduler half: look up prompts, claim tokens, plan loads and saves.

Runs in vLLM's engine-core process, called by the scheduler thread.

Claims. vLLM's connector API claims a prefix: tokens ``[num_computed_tokens, end)`` that
the worker half will load before the forward. ``end`` is the exact prefix the servers
hold (cut at vLLM's block size, so keys match vLLM's blocks one to one), extended with
``pi_reuse="contiguous"`` by position-independent hits that tile the prompt without a gap
right after it. It is aligned down to a block boundary and never reaches the prompt's
last token (vLLM must compute at least one token to sample from). A lookup that fails
(server down, slow, bad reply) claims 0 tokens: the request runs as if uncached.

Lookups never hold up the batch. ``matched_tokens`` starts the request's lookup on the
client's loop (``CacheClient.submit_lookup``) and waits at most ``lookup_wait_ms``
for it; still in flight, it answers None, vLLM skips the request for this step (the
other requests' steps run) and asks again on the next, when the finished lookup is
claimed. A slow or far server costs the requests it serves a step or a few, never the
engine a stall.
With ``pi_reuse="blend"`` the whole prompt is looked up and the claim reaches the end of
the last hit anywhere in it, misses included (``blend.py``), when the cost model
says it pays; the worker then runs the layer loop over the range.

Saves. When a request's prompt has been prefilled, its KV is stored from position 0,
the partial last block included (the client skips blocks the servers already hold; a
message that ends the prompt is then reusable whole, at any position). KV events name
the whole blocks only, the ones vLLM hashes. KV that came from a
position-independent hit is approximate, and so is every later token's KV (it attended
to it): such a request stores exact-prefix keys only for the blocks before its first
position-independent token (blend: before the first position the layer loop computes),
so the exact cache never holds approximate KV; the rest of its prompt (the misses and
recomputed tokens of a blend claim, the turn a chat added after a contiguous claim) is
stored under content keys only (``SaveSpec.exact_end``), so the next turn reuses it at
any position. A blend claim also salts vLLM's block hashes from there on
(``_salt_block_hashes``), so vLLM's own prefix cache never serves those blocks either.

Identity. Every key folds in what beside the token ids shapes the request's KV (its LoRA
adapter, cache salt, images, prompt embeddings: ``identity.py``), for lookups, stores and
the blocks KV events announce. A request the connector cannot key is neither claimed nor
stored, counted as ``skipped_<reason>`` and logged once per reason.

Approximate never becomes exact. A contiguous claim's position-independent blocks, like a
blend claim's range, salt vLLM's block hashes from the first approximate block on, so the
engine's own prefix cache never serves them (or anything computed after them) as exact to
the next request, and the request stores no exact-prefix key from there (a multi-turn
chat's next turn would otherwise find them as local hits, claim nothing, and store them
as exact).
With a compact stored form (the client URL's ``kv_codec``, fp8 or K16/V8) every block the
client finds is approximate, exact prefixes included: a claim is approximate from its
first block (``_compact``).

Prefill/decode (``pd/``). A ``kv_producer`` marks its saves to be acknowledged and, when
the request finishes, answers ``kv_transfer_params`` naming the whole blocks a decode engine
claims (``HandOff``: count and keys digest) with ``delay_free_blocks`` (the worker frees
them once the servers acknowledged the store). A request that arrives with such params
is looked up by ``wait_for_prefix`` until those blocks landed or ``handoff_deadline_ms``
passed, answering "not yet" meanwhile like any lookup in flight; what is still missing
then is recomputed (``pd_deadline_misses``, ``pd_missing_tokens``, logged once). Params
that do not match the request's own keys (another model, namespace, adapter or prompt)
are not waited on (``pd_bad_handoffs``, logged once): the request is looked up as a
plain one, as is every request without params.

vLLM's ``Request`` and ``SchedulerOutput`` are read through ``compat`` only (the unit
tests hand in stand-ins with the same attributes).

Concurrency: every method runs on vLLM's scheduler thread; the client is thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from nopecache.client.chunking import ChunkSpan, token_array
from nopecache.client.errors import NopecacheError
from nopecache.client.identity import InputIdentity
from nopecache.client.plan import ReusePlan
from nopecache.client.sync_client import CacheClient
from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.blend import (
    blend_claim_end,
    blend_claim_ends,
    blend_layout,
    blend_pays,
    blend_saving,
)
from nopecache.integrations.vllm.config import ConnectorConfig, ModelIdentity
from nopecache.integrations.vllm.events import AnnouncedBlocks
from nopecache.integrations.vllm.identity import SKIP_REASONS, request_identity
from nopecache.integrations.vllm.metadata import LoadSpec, SaveSpec, StepPlan, StepReport
from nopecache.integrations.vllm.pd import HandOff, keys_digest, wait_for_prefix
from nopecache.integrations.vllm.rates import MeasuredRates
from nopecache.recompute.policies import ReuseLayout

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHash
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = [
    "SCHEDULER_COUNTERS",
    "SKIP_COUNTERS",
    "Claim",
    "ConnectorTotals",
    "SchedulerSide",
    "claim_end",
    "trim_plan",
]

SKIP_COUNTERS = tuple(f"skipped_{reason}" for reason in SKIP_REASONS)
"""Requests neither claimed nor stored, one counter per reason (identity.SKIP_REASONS)."""
SCHEDULER_COUNTERS = (
    "lookups",
    "lookup_failures",
    "claimed_exact_tokens",
    "claimed_pi_tokens",
    "blend_claimed_tokens",
    "blend_fallbacks",
    "idle_sync_claims",
    "pd_handoffs",
    "pd_deadline_misses",
    "pd_missing_tokens",
    "pd_bad_handoffs",
    *SKIP_COUNTERS,
)

log = logging.getLogger(f"vllm.{__name__}")  # shown in vLLM's log

_SALT = b"nopecache-approximate-kv:"


def _salt_block_hashes(request: Request, first_block: int, end_block: int | None = None) -> None:
    """Give the request's blocks from ``first_block`` on hashes no other request has.

    vLLM's prefix cache indexes a computed block by the chained hash of the tokens up to
    it, so blocks holding approximate KV (a contiguous claim's position-independent
    blocks, the blend range from its first position-independent token, and every later
    block, which attended to it) would be
    served as exact to the next request with the same tokens. vLLM hashes a request's
    blocks when the request is made and chains each new block's hash from the last one
    in ``request.block_hashes``; replacing the hashes from the first approximate block on
    with ones salted by the request id (before the blocks are allocated and cached) files
    those blocks, and all that follow, under keys no other request computes. Blocks
    before it keep their hashes and stay shared. ``end_block``: salt only up to there
    (the rest already is).
    """
    hashes = compat.block_hashes(request)
    if hashes is None:
        return
    salt = _SALT + str(compat.request_id(request)).encode()
    for i in range(first_block, len(hashes) if end_block is None else end_block):
        hashes[i] = cast("BlockHash", hashlib.sha256(salt + bytes(hashes[i])).digest())


def _identity_or_plain(identity: InputIdentity | str) -> InputIdentity:
    """The identity a claim was looked up with (a skipped request claims nothing)."""
    assert isinstance(identity, InputIdentity), "a skipped request has no claim"
    return identity


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
    blend: bool = False  # the worker runs the layer loop over [start, end)
    pi_tokens: int = -1  # blend: position-independent tokens in the range (-1: not blend)
    approximate_from: int | None = None  # blend: first position the layer loop computes
    asynchronous: bool = False  # loads in the background (the answer given to vLLM)


@dataclass(slots=True)
class _Tracked:
    request: Request  # for its block hashes
    tokens: tuple[int, ...]  # the prompt
    block_ids: list[int]
    computed: int  # tokens computed before this step
    approximate_from: int | None  # first position with position-independent KV
    identity: InputIdentity | str  # its keys' identity, or why it has none (not stored)
    saved: bool = False


@dataclass(slots=True)
class ConnectorTotals:
    """What the connector did since the engine started (scheduler and worker halves)."""

    lookups: int = 0
    lookup_failures: int = 0
    claimed_exact_tokens: int = 0
    claimed_pi_tokens: int = 0
    blend_claimed_tokens: int = 0
    blend_fallbacks: int = 0
    idle_sync_claims: int = 0  # claims loaded before the forward (sync_when_idle)
    pd_handoffs: int = 0  # requests that arrived with a producer's hand-off and waited
    pd_deadline_misses: int = 0  # of those, still short of the named blocks at the deadline
    pd_missing_tokens: int = 0  # the tokens they lacked (recomputed)
    pd_bad_handoffs: int = 0  # hand-offs malformed or not matching the request's keys
    skipped: dict[str, int] = field(default_factory=dict)  # SKIP_REASONS -> requests
    report: StepReport = field(default_factory=StepReport)


class SchedulerSide:
    """Lookup and claim bookkeeping for one engine (see the module docstring)."""

    def __init__(
        self,
        config: ConnectorConfig,
        model: ModelIdentity,
        client: CacheClient | None,
        blend_unsupported: str | None = None,
        announced: AnnouncedBlocks | None = None,
    ) -> None:
        """A scheduler half using ``client`` (None: the connector loads nothing).

        ``announced``: where stored blocks are announced for KV events (events.py).

        ``blend_unsupported``: why the engine cannot run blend mode (then it claims
        prefixes only and counts the requests that lost a blend claim).
        """
        self.config = config
        self.model = model
        self.client = client
        self.blend = config.blend and blend_unsupported is None
        # False once a worker's RoPE check refused the spec: exact prefixes only.
        self.position_independent = config.pi_reuse != "off"
        self.policy = config.policy() if self.blend else None
        self._claims: dict[str, Claim] = {}
        # Lookups in flight, by request (answered on a later call of matched_tokens).
        self._lookups: dict[str, concurrent.futures.Future[ReusePlan]] = {}
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        # Blocks announced in KV events, and their withdrawals (events.py).
        self.announced = AnnouncedBlocks(clear_all=False) if announced is None else announced
        self._salted: dict[str, int] = {}  # request -> first block salted
        self._identities: dict[str, InputIdentity | str] = {}  # request -> identity or reason
        self._logged_reasons: set[str] = set()
        self._failed_loads: set[str] = set()  # requests whose load failed: never reclaimed
        # request -> (tokens its hand-off named, ms it waits for them), while in flight
        self._waiting: dict[str, tuple[int, float]] = {}
        self._handed: set[str] = set()  # requests whose hand-off was waited on: once only
        self._handing: dict[str, HandOff | None] = {}  # producer: saved requests' hand-offs
        self.totals = ConnectorTotals()
        self._reported: dict[str, int] = {}
        per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim
        self.rates = MeasuredRates(model.num_layers, per_token * model.dtype.itemsize)

    def refuse_blend(self, reason: str) -> None:
        """Claim exact prefixes only from now on (a worker refused blend mode at start-up:
        its correctness gate, or no layer loop); requests that lose a blend claim are
        counted as ``blend_fallbacks``."""
        if self.blend:
            log.warning("nopecache: blend mode refused by a worker, prefix mode only (%s)", reason)
        self.blend = False
        self.policy = None

    def refuse_position_independent(self, reason: str) -> None:
        """Look up exact prefixes only from now on (a worker's start-up RoPE check refused
        the spec: rope_check.py); blend mode goes with it."""
        if self.position_independent:
            log.warning(
                "nopecache: position-independent reuse refused by a worker, exact prefixes "
                "only (%s)",
                reason,
            )
        self.position_independent = False
        self.refuse_blend(reason)

    # -- identity ---------------------------------------------------------------------
    def identity(self, request: Request) -> InputIdentity | str:
        """The request's key identity, or why it has none (counted once per request)."""
        req_id = compat.request_id(request)
        known = self._identities.get(req_id)
        if known is not None:
            return known
        found = request_identity(request)
        self._identities[req_id] = found
        if isinstance(found, str):
            self.totals.skipped[found] = self.totals.skipped.get(found, 0) + 1
            if found not in self._logged_reasons:
                self._logged_reasons.add(found)
                log.warning(
                    "nopecache: requests with %s are neither claimed nor stored (their KV "
                    "cannot be keyed correctly); counted as vllm:nopecache_requests_skipped",
                    found.replace("_", " "),
                )
        return found

    # -- claims -----------------------------------------------------------------------
    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that the cache can supply (0 on failure);
        None while the request's lookup is still in flight (vLLM asks again next step)."""
        if self.client is None or not self.config.load:
            return 0
        req_id = compat.request_id(request)
        if req_id in self._failed_loads:
            return 0  # its load failed: vLLM recomputes it; claiming again would loop
        known = self._claims.get(req_id)
        if known is not None and known.start == num_computed_tokens:
            return known.end - known.start
        identity = self.identity(request)
        if isinstance(identity, str):
            return 0
        prompt = compat.prompt_token_ids(request)
        bs = self.model.block_size
        limit = (len(prompt) - 1) // bs * bs if prompt else 0
        if limit <= num_computed_tokens:
            return 0
        # Blend mode looks up the whole prompt: a hit that crosses the claim's limit (a
        # moved message ending near the prompt's end) is then found, and used up to it.
        tokens = prompt if self.config.blend else prompt[:limit]
        pending = self._lookups.get(req_id)
        if pending is None:
            self.totals.lookups += 1
            pending = self._lookups[req_id] = self._submit(request, tokens, identity, limit)
        try:
            plan = pending.result(timeout=self.config.lookup_wait_ms / 1000)
        except TimeoutError:
            return None  # in flight: this request waits a step, the batch does not
        except NopecacheError as err:  # a client-side failure: run uncached, say why
            del self._lookups[req_id]
            self.totals.lookup_failures += 1
            log.warning("nopecache lookup failed for %s: %s", req_id, err)
            return 0
        del self._lookups[req_id]
        self._waited(req_id, plan)
        return self._claim(request, tokens, plan, num_computed_tokens, limit)

    def _submit(
        self, request: Request, tokens: Sequence[int], identity: InputIdentity, limit: int
    ) -> concurrent.futures.Future[ReusePlan]:
        """Start the request's lookup: one, or repeated until its hand-off's blocks land."""
        assert self.client is not None
        client = self.client

        def lookup() -> Coroutine[Any, Any, ReusePlan]:
            return client.core.lookup(
                tokens,
                segments=self.config.segments(tokens),
                namespace=self.config.namespace,
                allow_position_independent=self.position_independent,
                identity=identity,
            )

        req_id = compat.request_id(request)
        # Looked up again (preempted, or its load failed): the blocks had their deadline.
        handoff = (
            None if req_id in self._handed else self._handoff(request, tokens, identity, limit)
        )
        if handoff is None:
            return client.submit(lookup())
        self.totals.pd_handoffs += 1
        self._handed.add(req_id)
        wait_ms = handoff.wait_ms(self.config.handoff_deadline_ms)
        self._waiting[req_id] = handoff.tokens, wait_ms
        deadline = time.monotonic() + wait_ms / 1000
        return client.submit(wait_for_prefix(lookup, handoff.tokens, deadline))

    def _handoff(
        self, request: Request, tokens: Sequence[int], identity: InputIdentity, limit: int
    ) -> HandOff | None:
        """The producer's hand-off the request carries, checked against its own keys."""
        found = HandOff.from_params(compat.kv_transfer_params(request))
        if found is None:
            return None
        reason = found if isinstance(found, str) else None
        if isinstance(found, HandOff):
            bs = self.model.block_size
            if found.block_size != bs:
                reason = f"block_size {found.block_size}, this engine's is {bs}"
            elif found.tokens > limit:
                reason = f"{found.tokens} tokens named, the prompt claims at most {limit}"
            elif keys_digest(self.block_keys(tokens[: found.tokens], identity)) != found.digest:
                reason = "the keys differ (another model, namespace, adapter or prompt)"
        if reason is None:
            return cast(HandOff, found)
        self.totals.pd_bad_handoffs += 1
        self._log_once(
            "bad_handoff",
            "nopecache: a prefill hand-off was not used (%s); such requests are looked up "
            "as plain ones, counted as vllm:nopecache_pd_bad_handoffs",
            reason,
        )
        return None

    def _waited(self, req_id: str, plan: ReusePlan) -> None:
        """Count a hand-off whose blocks were still missing at its deadline."""
        waited = self._waiting.pop(req_id, None)
        if waited is None or plan.prefix_end >= waited[0]:
            return
        need, wait_ms = waited
        self.totals.pd_deadline_misses += 1
        self.totals.pd_missing_tokens += need - plan.prefix_end
        self._log_once(
            "deadline",
            "nopecache: %s: %d of the %d tokens its prefill stored had not landed after "
            "%.0f ms (handoff_deadline_ms=%.0f, or the hand-off's shorter deadline_ms); "
            "recomputing them (counted as vllm:nopecache_pd_deadline_misses)",
            req_id,
            need - plan.prefix_end,
            need,
            wait_ms,
            self.config.handoff_deadline_ms,
        )

    def _log_once(self, what: str, message: str, *args: object) -> None:
        if what not in self._logged_reasons:
            self._logged_reasons.add(what)
            log.warning(message, *args)

    def _claim(
        self,
        request: Request,
        tokens: Sequence[int],
        plan: ReusePlan,
        num_computed_tokens: int,
        limit: int,
    ) -> int:
        """Claim what ``plan`` (the lookup of ``tokens``) supplies past vLLM's own tokens."""
        req_id = compat.request_id(request)
        bs = self.model.block_size
        contiguous = self.config.pi_reuse == "contiguous"
        tokens = tuple(tokens)
        self._note_gone(request, plan.prefix_end // bs, limit // bs)
        end = claim_end(plan, contiguous=contiguous, limit=limit, block_size=bs)
        end = max(end, num_computed_tokens)
        claim = Claim(tokens, trim_plan(plan, end), num_computed_tokens, end)
        if self.config.blend:
            claim = self._blend_claim(request, plan, claim, limit)
        if self._compact and not claim.blend and claim.end > num_computed_tokens:
            self._salt_from(request, num_computed_tokens // bs)  # compact: every block
        elif not self.config.blend and end > max(plan.prefix_end, num_computed_tokens):
            # Position-independent blocks claimed: approximate from the first of them on.
            self._salt_from(request, max(plan.prefix_end, num_computed_tokens) // bs)
        if self.config.load_async and not claim.blend:
            inline = self.config.sync_when_idle and self._idle(req_id)
            claim = replace(claim, asynchronous=not inline)
            if inline and claim.end > claim.start:
                self.totals.idle_sync_claims += 1
        self._claims[req_id] = claim
        return claim.end - claim.start

    def _idle(self, req_id: str) -> bool:
        """Whether the engine holds no request but ``req_id``: nothing would run beside
        its background load, so the load runs before the step's forward instead (a
        background load costs its request the engine steps that poll for it). Decided
        when the claim is made and kept with it, so vLLM and the load agree."""
        return all(other == req_id for other in self._tracked)

    def _blend_claim(self, request: Request, plan: ReusePlan, prefix: Claim, limit: int) -> Claim:
        """The blend claim of ``plan`` when it pays, else the prefix claim ``prefix``."""
        req_id = compat.request_id(request)
        bs = self.model.block_size
        start = prefix.start
        end = blend_claim_end(plan, start=start, limit=limit, block_size=bs)
        if end <= prefix.end:
            return prefix
        if not self.blend or self.policy is None:
            self.totals.blend_fallbacks += 1  # blend refused at start-up (reason logged)
            return prefix
        layout = blend_layout(plan, start, end)
        fraction = self.policy.planned_fraction(layout, self.model.num_layers)
        prefill_rate = self.rates.prefill_tokens_per_s()  # None: not measured enough yet
        if prefill_rate is not None and fraction < 1.0:
            # Measured: end where the claim saves the most (blend.py).
            end, layout, fraction = self._best_blend_end(plan, start, limit, prefill_rate)
        if prefill_rate is not None and not blend_pays(
            layout,
            fraction,
            prefill_tokens_per_s=prefill_rate,
            fetch_s=self.rates.fetch_s(layout.num_pi),
            loop_tokens_per_s=self.rates.loop_tokens_per_s(),
        ):
            log.info(
                "nopecache: %s: blend claim [%d, %d) does not pay (%d reused of %d, "
                "%.0f%% recomputed); claiming the prefix",
                req_id,
                start,
                end,
                layout.num_pi,
                end - start,
                100 * fraction,
            )
            return prefix
        # The loop's rows match vLLM's own to rounding, not bit for bit: from its first
        # position on, nothing is stored under exact keys (content keys only) and vLLM's
        # prefix cache files nothing as exact.
        approximate_from = start if self._compact else layout.prefix_end
        self._salt_from(request, approximate_from // bs)
        return Claim(
            prefix.tokens,
            trim_plan(plan, end),
            start,
            end,
            blend=True,
            pi_tokens=layout.num_pi,
            approximate_from=approximate_from,
        )

    def _best_blend_end(
        self, plan: ReusePlan, start: int, limit: int, prefill_rate: float
    ) -> tuple[int, ReuseLayout, float]:
        """The blend claim's end that saves the most, with its layout and recompute
        fraction (the farthest end when none saves anything: it is then refused)."""
        assert self.policy is not None
        bs = self.model.block_size
        best: tuple[float, int, ReuseLayout, float] | None = None
        for end in blend_claim_ends(plan, start=start, limit=limit, block_size=bs):
            layout = blend_layout(plan, start, end)
            fraction = self.policy.planned_fraction(layout, self.model.num_layers)
            saving = blend_saving(
                layout,
                fraction,
                prefill_tokens_per_s=prefill_rate,
                fetch_s=self.rates.fetch_s(layout.num_pi),
                loop_tokens_per_s=self.rates.loop_tokens_per_s(),
            )
            if layout.num_pi and (best is None or saving >= best[0]):
                best = (saving, end, layout, fraction)
        if best is None or best[0] <= 0:
            end = blend_claim_end(plan, start=start, limit=limit, block_size=bs)
            layout = blend_layout(plan, start, end)
            return end, layout, self.policy.planned_fraction(layout, self.model.num_layers)
        return best[1], best[2], best[3]

    @property
    def _compact(self) -> bool:
        """Whether the client stores and loads a compact form: approximate, prefixes too."""
        return self.config.client.kv_codec != "none"

    def _salt_from(self, request: Request, first: int) -> None:
        """Salt the request's block hashes from block ``first`` on (a retried claim keeps
        its salt; one that starts earlier salts the blocks before the old start too)."""
        req_id = compat.request_id(request)
        salted = self._salted.get(req_id)
        if salted is None or first < salted:
            _salt_block_hashes(request, first, salted)
            self._salted[req_id] = first

    def claim_is_async(self, req_id: str) -> bool:
        """Whether the pending claim of ``req_id`` loads in the background (blend: never,
        its layer loop must run right before the step's forward; nor, with
        ``sync_when_idle``, one made while the engine held no other request)."""
        claim = self._claims.get(req_id)
        return claim is not None and claim.asynchronous

    def _note_gone(self, request: Request, found_blocks: int, looked_up_blocks: int) -> None:
        """Announced blocks a lookup no longer finds were evicted: report them removed."""
        if not len(self.announced):
            return
        hashes = (compat.block_hashes(request) or [])[found_blocks:looked_up_blocks]
        self.announced.gone_hashes(hashes)

    def after_alloc(self, request: Request, block_ids: Sequence[int], num_external: int) -> None:
        """Record the blocks vLLM allocated; queue a load when tokens were claimed."""
        req_id = compat.request_id(request)
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
                asynchronous=claim.asynchronous,
                blend=claim.blend,
                identity=_identity_or_plain(self.identity(request)),
            )
            self._loads.append(load)
            self.totals.claimed_exact_tokens += load.exact_tokens
            if claim.blend:
                self.totals.claimed_pi_tokens += claim.pi_tokens
                self.totals.blend_claimed_tokens += end - claim.start
                approximate_from = claim.approximate_from
            else:
                self.totals.claimed_pi_tokens += load.pi_tokens
                if self._compact:
                    approximate_from = claim.start
                elif load.pi_tokens:
                    approximate_from = max(claim.start, claim.plan.prefix_end)
        prompt = compat.prompt_token_ids(request)
        tracked = self._tracked.get(req_id)
        if tracked is None:
            self._tracked[req_id] = _Tracked(
                request, prompt, list(block_ids), 0, approximate_from, self.identity(request)
            )
        else:
            tracked.block_ids = list(block_ids)
            if approximate_from is not None:
                tracked.approximate_from = approximate_from

    # -- steps ------------------------------------------------------------------------
    def _update_blocks(self, scheduler_output: SchedulerOutput) -> None:
        for scheduled in compat.scheduled_requests(scheduler_output):
            tracked = self._tracked.get(scheduled.req_id)
            if tracked is None:
                continue
            if scheduled.block_ids is not None:
                if scheduled.replaces_blocks:
                    tracked.block_ids = list(scheduled.block_ids)
                else:
                    tracked.block_ids.extend(scheduled.block_ids)
            tracked.computed = scheduled.num_computed_tokens

    def _save(self, req_id: str, tracked: _Tracked, num_scheduled: int) -> SaveSpec | None:
        bs = self.model.block_size
        if tracked.saved or tracked.computed + num_scheduled < len(tracked.tokens):
            return None
        tracked.saved = True
        end = len(tracked.tokens)  # the partial last block too: its KV is the prompt's
        exact_end: int | None = None
        if tracked.approximate_from is not None:
            end = min(end, tracked.approximate_from)
            end -= end % bs
            exact_end = end
        identity = tracked.identity
        if not self.config.save or isinstance(identity, str):
            return None
        # What attended to approximate KV is kept under content keys only (a chat's next
        # turn reuses the turn computed inside this claim at any position).
        stored = len(tracked.tokens) if self.position_independent else end
        if stored <= 0:
            return None
        if self.config.producer:
            self._handing[req_id] = self._handoff_of(tracked, end, identity)
        # vLLM hashes whole blocks only: the KV event announces those.
        whole = end // bs
        hashes = tuple((compat.block_hashes(tracked.request) or [])[:whole])
        tokens = tracked.tokens[:end]
        if hashes and self.client is not None:
            self.announced.stored(
                hashes,
                self.block_keys(tokens[: len(hashes) * bs], identity),
                tokens,
                bs,
                lora=compat.lora_label(tracked.request),
                extra_keys=compat.event_extra_keys(tracked.request, len(hashes), bs),
            )
        blocks = tuple(tracked.block_ids[: -(-stored // bs)])
        return SaveSpec(
            req_id,
            tracked.tokens[:stored],
            blocks,
            identity,
            ack=self.config.producer,
            exact_end=exact_end,
        )

    def _handoff_of(self, tracked: _Tracked, end: int, identity: InputIdentity) -> HandOff | None:
        """What a decode engine will claim of the saved ``[0, end)``: every whole block
        before the prompt's last token (None: not one)."""
        bs = self.model.block_size
        blocks = min(end, len(tracked.tokens) - 1) // bs
        if blocks < 1:
            return None
        keys = self.block_keys(tracked.tokens[: blocks * bs], identity)
        return HandOff(blocks, bs, keys_digest(keys))

    def handoff_params(self, req_id: str) -> tuple[bool, dict[str, Any] | None]:
        """A finishing request's ``(delay_free_blocks, kv_transfer_params)``: a producer
        holds the blocks of every request it stored until the store is acknowledged
        (the worker reports it, ``pd.StoreAcks``) and names them for the decode engine."""
        if req_id not in self._handing:
            return False, None
        handoff = self._handing.pop(req_id)
        return True, None if handoff is None else handoff.to_params()

    def build_step(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """The loads and saves of this step; resets the pending loads."""
        self._update_blocks(scheduler_output)
        saves: list[SaveSpec] = []
        for req_id, num in compat.num_scheduled_tokens(scheduler_output).items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            spec = self._save(req_id, tracked, num)
            if spec is not None:
                saves.append(spec)
        loads, self._loads = tuple(self._loads), []
        total = compat.total_scheduled_tokens(scheduler_output)
        return StepPlan(loads, tuple(saves), total)

    def on_report(self, report: StepReport | None) -> None:
        """Fold the workers' account of a step into the totals and the cost model."""
        if report is None:
            return
        self.totals.report = self.totals.report.add(report)
        self.rates.observe(report)
        # A request whose load failed (on any rank) is asked again after vLLM reschedules
        # it; the same claim would fail the same way (a block another rank lacks), so it
        # runs uncached from then on.
        self._failed_loads.update(report.failed_requests)
        if self.client is not None and report.computed_tokens and report.forward_seconds > 0:
            self.client.observe_prefill(report.computed_tokens, report.forward_seconds)

    def finished(self, req_ids: Iterable[str]) -> None:
        """Forget finished requests."""
        for req_id in req_ids:
            pending = self._lookups.pop(req_id, None)
            if pending is not None:
                pending.cancel()
            self._tracked.pop(req_id, None)
            self._claims.pop(req_id, None)
            self._salted.pop(req_id, None)
            self._identities.pop(req_id, None)
            self._failed_loads.discard(req_id)
            self._waiting.pop(req_id, None)
            self._handed.discard(req_id)
            self._handing.pop(req_id, None)

    def take_counters(self) -> dict[str, int]:
        """The scheduler counters (SCHEDULER_COUNTERS) gained since the last call."""
        skipped = {f"skipped_{r}": self.totals.skipped.get(r, 0) for r in SKIP_REASONS}
        now = {
            k: skipped[k] if k in skipped else getattr(self.totals, k) for k in SCHEDULER_COUNTERS
        }
        delta = {k: now[k] - self._reported.get(k, 0) for k in SCHEDULER_COUNTERS}
        self._reported = now
        return delta

    def block_keys(
        self, tokens: Sequence[int], identity: InputIdentity | None = None
    ) -> list[bytes]:
        """The cache keys of the whole blocks of ``tokens`` (prefix mode, vLLM's blocks)."""
        if self.client is None:
            return []
        keying = self.client.core.keying
        chain, _ = keying.keys(
            token_array(tokens),
            self.config.namespace,
            keying.chunker,
            prefix=True,
            pi=False,
            identity=identity,
        )
        return [bytes(chunk.key) for chunk in chain]
