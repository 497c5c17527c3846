"""The parity harness's traffic: requests that share tokens but not their identity.

Shared by tests/integrations/vllm/engine/test_parity.py and bench/vllm_parity.py. A
request is a prompt (token ids, or text for the multimodal model, whose processor expands
the image placeholder) and an :class:`~tests.support.engine_proc.Identity`. Engine 1
stores one round, engine 2 serves another round of the same prompts with the identities
moved one place on: a request may share its tokens with a stored one of another identity
(wrong KV if served) and its identity with a stored one of other tokens (a legitimate
shared prefix, which must still be claimed).

A round runs as two ``generate`` calls, each with all of its requests in flight together:
the requests with an adapter, then those without. vLLM 0.32's CPU build does not keep
them apart in one batch: a no-adapter request batched with adapter requests answers
differently than alone (measured: in a batch [none, A, B] the no-adapter request answered
exactly as adapter A), in a no-cache engine too, so no reference could be computed for it.
Adapters A and B, and salts none, s1 and s2, still share every batch.

Identities stored: none, adapter A, adapter B, salt s1, adapter A + salt s1.
Served beside them: salt s2, which nothing stored, so its claim must be zero (a salt
changes no output, only what may be shared, so the claim is the only thing to check).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tests.support.connector_prompts import BLOCK
from tests.support.engine_proc import EngineProc, Identity, common_prefix

__all__ = ["Request", "expected_claim", "identities", "run_round", "serve_round", "store_round"]

UNSTORED_SALT = "s2"


@dataclass(frozen=True)
class Request:
    """One request of a round: its prompt and identity."""

    prompt: list[int]
    identity: Identity

    def label(self) -> str:
        """A short name for messages."""
        return f"{self.identity.label()} tokens={len(self.prompt)}"


def identities(lora_a: str, lora_b: str) -> list[Identity]:
    """The identities engine 1 stores under: none, A, B, s1, A+s1."""
    return [
        Identity(),
        Identity(lora=lora_a),
        Identity(lora=lora_b),
        Identity(cache_salt="s1"),
        Identity(lora=lora_a, cache_salt="s1"),
    ]


def store_round(prompts: list[list[int]], stored: list[Identity]) -> list[Request]:
    """Prompt i under identity i mod n (engine 1 stores these)."""
    return [Request(p, stored[i % len(stored)]) for i, p in enumerate(prompts)]


def serve_round(prompts: list[list[int]], stored: list[Identity], shift: int = 1) -> list[Request]:
    """Prompt i under identity i + shift, and the last prompt once more under the salt
    nothing stored (engine 2 serves these)."""
    out = [Request(p, stored[(i + shift) % len(stored)]) for i, p in enumerate(prompts)]
    return [*out, Request(prompts[-1], replace(Identity(), cache_salt=UNSTORED_SALT))]


def expected_claim(request: Request, stored: list[Request]) -> int:
    """Tokens a correct connector claims for ``request``: the longest whole-block prefix it
    shares with a stored request of the same identity (vLLM computes at least the last
    prompt token, so a claim stops a block short of a whole prompt)."""
    best = 0
    for s in stored:
        if s.identity != request.identity:
            continue
        common = common_prefix(s.prompt, request.prompt)
        limit = min(
            common, len(s.prompt) // BLOCK * BLOCK, (len(request.prompt) - 1) // BLOCK * BLOCK
        )
        best = max(best, limit - limit % BLOCK)
    return best


def run_round(engine: EngineProc, requests: list[Request], max_tokens: int) -> list[dict[str, Any]]:
    """Generate every request (adapter requests together, then the others, see the module's
    docstring); the outputs in the order of ``requests``."""
    outs: list[dict[str, Any] | None] = [None] * len(requests)
    for with_adapter in (True, False):
        idx = [i for i, r in enumerate(requests) if (r.identity.lora is not None) == with_adapter]
        if not idx:
            continue
        batch = engine.generate_many(
            [requests[i].prompt for i in idx],
            max_tokens=max_tokens,
            identities=[requests[i].identity for i in idx],
        )
        for i, out in zip(idx, batch, strict=True):
            outs[i] = out
    return [o for o in outs if o is not None]
