"""KV head groups: the stored form that engines of different tensor-parallel sizes share.

A tensor-parallel rank holds a slice of the model's KV heads. nopecache stores each
chunk's KV as one block per *head group*: ``group_size`` consecutive KV heads, the same
size for every engine of a fleet whatever its TP size, keyed under the fingerprint of that
group (``ModelFingerprint.head_group``: the heads it holds are part of every key)::

    model with 4 KV heads, group_size 2          blocks of one chunk
    TP=1  rank 0: heads 0 1 2 3   -> stores/fetches  [g0: heads 0-1] [g1: heads 2-3]
    TP=2  rank 0: heads 0 1       -> stores/fetches  [g0: heads 0-1]
          rank 1: heads 2 3       -> stores/fetches                  [g1: heads 2-3]

Every rank reads and writes only its own heads (no collective, no rank holding another's
bytes) and a TP=1 engine finds what a TP=2 engine stored, and the reverse, because both
cut the heads at the same boundaries. ``group_size`` must divide every rank's head count
(``num_kv_heads / tp``) of every TP size that shares; ``group_size == num_kv_heads``
(one group) is the plain fingerprint, the keys of an engine without head groups.

An engine looks a prompt up once, under one group's fingerprint (the first, which a
rank of every TP size holds). :func:`rekey_plan` turns that plan into each other group's
by recomputing the hits' keys from the prompt's tokens: same spans, same forms, the
group's keys. A group whose block is missing fails that rank's load, and the engine
recomputes the block on every rank (vLLM unions the ranks' failed blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from nopecache.client.chunking import ChunkSpan, TokenIds, token_array
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.identity import InputIdentity
from nopecache.client.keyplan import pi_fingerprint
from nopecache.client.keys import Namespace, content_chunks, prefix_chunks
from nopecache.client.plan import Hit, ReusePlan

__all__ = ["HeadGroup", "rank_head_groups", "rekey_plan"]


@dataclass(frozen=True, slots=True)
class HeadGroup:
    """One head group a rank holds: its fingerprint and where its heads sit in the rank."""

    fingerprint: ModelFingerprint  # the group's (a head group unless it is every head)
    local_start: int  # index of the group's first head among the rank's heads

    @property
    def num_heads(self) -> int:
        """KV heads in the group."""
        return self.fingerprint.num_kv_heads


def rank_head_groups(
    fingerprint: ModelFingerprint, group_size: int, tp_size: int, tp_rank: int
) -> list[HeadGroup]:
    """The head groups rank ``tp_rank`` of ``tp_size`` holds, in head order.

    ``fingerprint`` is the whole model's (every KV head); raises InvalidArgumentError
    when the heads do not split evenly into ranks or the rank's heads into groups.
    """
    total = fingerprint.num_kv_heads
    if fingerprint.is_head_group:
        raise InvalidArgumentError("fingerprint", "must cover every KV head, got a head group")
    if tp_size < 1 or total % tp_size:
        raise InvalidArgumentError(
            "tp_size", f"{tp_size} does not divide the model's {total} KV heads"
        )
    if not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError("tp_rank", f"must be in [0, {tp_size}), got {tp_rank}")
    per_rank = total // tp_size
    if group_size < 1 or per_rank % group_size:
        raise InvalidArgumentError(
            "group_size",
            f"{group_size} KV heads per group does not divide a rank's {per_rank} "
            f"({total} KV heads over TP={tp_size})",
        )
    first = tp_rank * per_rank
    return [
        HeadGroup(fingerprint.head_group(first + local, group_size), local)
        for local in range(0, per_rank, group_size)
    ]


def _chunk_span(hit: Hit) -> ChunkSpan:
    # A hit trimmed at the front starts ``source.start`` tokens into its stored chunk.
    start = hit.target.start - hit.source.start
    return ChunkSpan(start, start + hit.source.end)


def rekey_plan(
    plan: ReusePlan,
    tokens: TokenIds,
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    identity: InputIdentity | None = None,
) -> ReusePlan:
    """``plan`` with every hit's key recomputed under ``fingerprint`` (same spans, forms;
    no ``dropped`` hits).

    ``tokens`` is the prompt the plan was made for; ``fingerprint`` the exact-prefix one
    (position-independent hits are keyed under its NOPE form, as the client keys them);
    ``identity`` the one the plan was looked up with (without it an adapter's or an
    image's plan would be re-keyed to plain-text blocks of the same tokens).
    """
    arr = token_array(tokens)
    if len(arr) != plan.num_tokens:
        raise InvalidArgumentError(
            "tokens", f"{len(arr)} tokens, the plan covers {plan.num_tokens}"
        )
    chain = prefix_chunks(fingerprint, namespace, arr, [h.target for h in plan.prefix], identity)
    prefix = tuple(replace(h, key=c.key) for h, c in zip(plan.prefix, chain, strict=True))
    pi_fp = pi_fingerprint(fingerprint)

    def rekey_pi(hits: Sequence[Hit]) -> tuple[Hit, ...]:
        keyed = content_chunks(pi_fp, namespace, arr, [_chunk_span(h) for h in hits], identity)
        return tuple(replace(h, key=c.key) for h, c in zip(hits, keyed, strict=True))

    # ``dropped`` (hits a filter refused) is left out: nothing fetches those.
    return ReusePlan(plan.num_tokens, prefix, rekey_pi(plan.hits), plan.misses)
