"""What blend mode's cost check knows: rates measured by the workers, sent in step reports.

The scheduler half weighs a blend claim (``blend.blend_pays``) in vLLM's engine-core
process, which only looks up: fetches, placement, the layer loop and the forward all run
in the worker processes. So every rate the check uses comes from the workers'
``StepReport``s, summed over the engine's life (``ConnectorTotals.report``):

    prefill   computed_tokens / forward_seconds     vLLM's forward, loads excluded
    loop      blend_token_layers / layers / blend_seconds
    fetch     fetch_seconds / fetched_bytes         client.fetch into vLLM's cache

The scheduler process's own client never fetches, so its fetch statistics stay at zero:
reading them priced every fetch at nothing.

A rate from one or two steps is a guess: the first steps after start-up pay one-time
costs (allocation, first-touch, a 13-token chat warm-up whose forward is mostly fixed
overhead) and can put vLLM's prefill anywhere. Until the prefill rate rests on
``MIN_PREFILL_STEPS`` steps and ``MIN_PREFILL_TOKENS`` tokens, :meth:`MeasuredRates.
prefill_tokens_per_s` is None and a blend claim is taken unweighed: the claims are the
measurements (as the client's cost model keeps every hit of a server it has not measured
often enough), never declined on a guess.
"""

from __future__ import annotations

from nopecache.integrations.vllm.metadata import StepReport

__all__ = ["MIN_PREFILL_STEPS", "MIN_PREFILL_TOKENS", "MeasuredRates"]

MIN_PREFILL_STEPS = 3
"""Steps with a measured prefill before the rate is trusted (the client's ``min_samples``)."""

MIN_PREFILL_TOKENS = 256
"""Tokens those steps must have computed in all (a few short prompts are not a rate)."""


class MeasuredRates:
    """The workers' measurements, summed (see the module docstring); one scheduler thread."""

    def __init__(self, num_layers: int, bytes_per_token: int) -> None:
        """Rates of a model with ``num_layers`` layers and ``bytes_per_token`` of K+V."""
        self.num_layers = num_layers
        self.bytes_per_token = bytes_per_token
        self.total = StepReport()
        self.prefill_steps = 0

    def observe(self, report: StepReport) -> None:
        """Fold in the workers' account of one step."""
        # Steps follow one another: their forward times sum (the longest of them would put
        # a lifetime of tokens over one step's time, and no blend claim would pay).
        self.total = self.total.add(report)
        if report.computed_tokens and report.forward_seconds > 0:
            self.prefill_steps += 1

    def prefill_tokens_per_s(self) -> float | None:
        """vLLM's prefill rate, once measured over enough steps and tokens (else None)."""
        t = self.total
        if (
            self.prefill_steps < MIN_PREFILL_STEPS
            or t.computed_tokens < MIN_PREFILL_TOKENS
            or t.forward_seconds <= 0
        ):
            return None
        return t.computed_tokens / t.forward_seconds

    def loop_tokens_per_s(self) -> float | None:
        """The layer loop's rate in whole tokens (all layers) per second, once measured."""
        t = self.total
        if t.blend_token_layers and t.blend_seconds > 0:
            return t.blend_token_layers / self.num_layers / t.blend_seconds
        return None

    def fetch_s(self, tokens: int) -> float:
        """Seconds the workers take to fetch and place ``tokens`` tokens of KV, at their
        measured rate (0 before any fetch: the first fetches are the measurements)."""
        t = self.total
        if not t.fetched_bytes or t.fetch_seconds <= 0:
            return 0.0
        return tokens * self.bytes_per_token * t.fetch_seconds / t.fetched_bytes
