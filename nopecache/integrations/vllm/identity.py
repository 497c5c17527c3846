"""A vLLM request's identity: what beside its token ids shapes its KV, for the cache keys.

vLLM's own prefix cache folds per-block *extra keys* into its block hashes
(``generate_block_hash_extra_keys``): the LoRA adapter (name and path) on every block,
``("mm", identifier, offset)`` for a block that overlaps a multimodal placeholder (two
images of one size have identical placeholder ids), the request's ``cache_salt`` on the
first block (the chain carries it to every later one), and the digest of the block's
prompt embeddings. Every one of them shapes the KV, so every one goes into nopecache's
keys (``client/identity.py``):

    lora, cache_salt   request bytes: every block, prefix chain and content keys alike (a
                       salt isolates a tenant's content blocks too, not only its prefix)
    mm                 a feature over the placeholder, named by vLLM's item identifier
    prompt_embeds      a feature over each run of embedded positions, named by the
                       sha256 of that run's embeddings

The tags vLLM emits are read from vLLM's own function on the whole prompt: a tag this
module does not know (a vLLM upgrade that keys on something new) makes the request
unkeyable, and a request the connector cannot key is neither claimed nor stored
(:data:`SKIP_REASONS`), never keyed as plain text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from nopecache.client.identity import InputFeature, InputIdentity
from nopecache.integrations.vllm import compat

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["KNOWN_TAGS", "SKIP_REASONS", "request_identity"]

KNOWN_TAGS = frozenset({"lora", "cache_salt", "mm", "prompt_embeds"})
"""The extra-key tags of vLLM's block hash this module folds into keys."""

SKIP_REASONS = ("embeds_only", "unknown_extra_key")
"""Why a request is neither claimed nor stored (``vllm:nopecache_requests_skipped``):
a prompt given only as embeddings (no token ids to key), or an extra key vLLM folds into
its block hash that the connector does not know."""

_REQUEST_TAGS = ("lora", "cache_salt")


def request_identity(request: Request) -> InputIdentity | str:
    """The request's InputIdentity, or the reason (one of SKIP_REASONS) it has none."""
    prompt = compat.prompt_token_ids(request)
    embeds, mask = compat.prompt_embeds(request)
    if not prompt:
        return SKIP_REASONS[0] if embeds is not None else InputIdentity()
    if not compat.has_extra_inputs(request):
        return InputIdentity()  # plain text: vLLM folds nothing into its hashes either
    keys = compat.extra_keys(request, 0, len(prompt))
    tags = {_tag(key) for key in keys}
    if not tags <= KNOWN_TAGS:
        return SKIP_REASONS[1]
    request_keys = [list(key) for key in keys if _tag(key) in _REQUEST_TAGS]
    features = [
        InputFeature(offset, offset + length, "mm", identifier.encode())
        for offset, length, identifier in compat.mm_placeholders(request)
    ]
    if embeds is not None:
        features.extend(_embeds_features(embeds, mask, len(prompt)))
    request_bytes = msgpack.packb(request_keys) if request_keys else b""
    return InputIdentity(request_bytes, tuple(features))


def _tag(key: Any) -> str:
    return str(key[0]) if isinstance(key, tuple) and key else repr(key)


def _embeds_features(
    embeds: torch.Tensor, mask: Sequence[bool] | None, num_tokens: int
) -> list[InputFeature]:
    """One feature per run of embedded positions (``mask`` False; no mask: all of them)."""
    embedded = [True] * num_tokens if mask is None else [not is_token for is_token in mask]
    out: list[InputFeature] = []
    pos = 0
    while pos < num_tokens:
        if not embedded[pos]:
            pos += 1
            continue
        end = pos
        while end < num_tokens and embedded[end]:
            end += 1
        rows = embeds[pos:end].detach().to("cpu").contiguous()
        digest = hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).digest()
        out.append(InputFeature(pos, end, "prompt_embeds", digest))
        pos = end
    return out
