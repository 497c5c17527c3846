"""What the connector's two halves tell each other every engine step (plain, picklable).

::

    scheduler process                                  worker process
    -----------------                                  --------------
    get_num_new_matched_tokens: lookup, claim
    build_connector_meta  -- StepPlan (loads, saves) -->  start_load_kv: fetch + place
                                                          wait_for_save: copy + queue store
    update_connector_output <-- StepReport ----------  build_connector_worker_meta

vLLM pickles these between its processes, so they hold only numbers, token lists and the
client's own frozen plan objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from nopecache.client.identity import InputIdentity
from nopecache.client.plan import ReusePlan

__all__ = ["LoadSpec", "SaveSpec", "StepPlan", "StepReport", "slots_for"]


def slots_for(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The cache slot of every token position in ``[start, end)``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load the plan's blocks into positions ``[start, end)`` of one request.

    ``plan`` covers ``tokens`` (the prompt up to the claim's lookup limit); positions
    below ``start`` are already in vLLM's cache and are not written.
    """

    req_id: str
    tokens: tuple[int, ...]
    plan: ReusePlan
    start: int
    end: int
    block_ids: tuple[int, ...]  # the request's blocks, from position 0
    asynchronous: bool = False  # fetched in the background; vLLM waits for get_finished
    blend: bool = False  # blend mode: the worker runs the layer loop over [start, end)
    identity: InputIdentity = field(default_factory=InputIdentity)  # the plan's lookup identity

    @property
    def exact_tokens(self) -> int:
        """Claimed tokens that come from the exact prefix (lossless)."""
        return max(0, min(self.plan.prefix_end, self.end) - self.start)

    @property
    def pi_tokens(self) -> int:
        """Claimed tokens that come from position-independent hits."""
        return self.end - self.start - self.exact_tokens


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store the KV of ``tokens`` (from position 0; the last block may be partial) from
    ``block_ids``.

    ``exact_end``: where the exact-prefix keys end (a block boundary); the tokens after it
    attended to reused position-independent KV, so they are stored under content keys
    only. None: the whole prompt is exact.
    """

    req_id: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    identity: InputIdentity = field(default_factory=InputIdentity)  # what else shapes the KV
    ack: bool = False  # a producer's: report the request in get_finished once stored
    exact_end: int | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The scheduler half's instructions for one engine step."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    scheduled_tokens: int = 0  # tokens the step's forward computes (for the prefill rate)


_OVERLAPPING = ("forward_seconds", "fetch_seconds", "layer_wait_seconds")
"""StepReport times that run side by side on the workers of one step."""


@dataclass(slots=True)
class StepReport:
    """The worker half's account of one engine step (summed over workers)."""

    loaded_exact_tokens: int = 0
    loaded_pi_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    fetched_bytes: int = 0  # block bytes the client's fetches received
    fetch_seconds: float = 0.0  # those fetches, placement into vLLM's cache included
    load_errors: int = 0  # blocks reported to vLLM as failed loads
    load_failures: int = 0  # loads that raised (their blocks are load errors: recomputed)
    saved_tokens: int = 0
    save_dropped: int = 0  # stores the client's queue refused
    save_failures: int = 0  # saves that raised (nothing stored for the request)
    computed_tokens: int = 0  # tokens the forward computed
    forward_seconds: float = 0.0  # the step's forward, loads excluded
    blend_miss_tokens: int = 0  # claimed tokens the blend loop computed as misses
    pi_token_layers: int = 0  # reused position-independent tokens x layers (blend loads)
    recomputed_token_layers: int = 0  # of those, recomputed by the blend loop
    blend_fallbacks: int = 0  # blend loads that failed: vLLM recomputed from the first hit
    blend_seconds: float = 0.0  # time in the layer loop (fetches excluded)
    blend_token_layers: int = 0  # token-layers the loop computed (misses included)
    rope_check_failed: int = 0  # workers whose start-up RoPE check refused PI reuse
    layer_loaded_tokens: int = 0  # of the loaded tokens, written layer by layer (layerwise)
    layer_saved_tokens: int = 0  # of saved_tokens, copied layer by layer in the forward
    layer_wait_seconds: float = 0.0  # the forward's waits for layer-wise loads
    failed_requests: list[str] = field(default_factory=list)

    def add(self, other: StepReport, *, same_step: bool = False) -> StepReport:
        """This report plus ``other`` (a new object): sums and both lists.

        ``same_step``: the two are workers of one step (tensor-parallel ranks), whose
        forwards and fetches overlap, so the longest of each counts (the fetch rate is
        every rank's bytes over that time); successive steps' times sum.
        """
        out = StepReport()
        for f in fields(StepReport):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if same_step and f.name in _OVERLAPPING:
                setattr(out, f.name, max(mine, theirs))
            else:
                setattr(out, f.name, mine + theirs)
        return out
