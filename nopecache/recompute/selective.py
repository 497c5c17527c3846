"""The selective prefill loop, one implementation for every engine that drives it.

A reuse with selective recompute runs a model layer by layer over partly cached KV: at
layer l only the *running* tokens (misses, plus the reused tokens the policy still
recomputes) are computed, their queries attend to every earlier position (cached KV
where a token is not running), and their fresh K and V replace the cached rows. This
module is that loop and nothing engine-specific: the model's arithmetic comes from a
:class:`Stack` (the engine's own modules: embedding, norms, projections with RoPE, MLP)
and the KV it reads and writes from a :class:`LayerKV` (a plain buffer for
transformers, vLLM's paged cache for the vLLM connector). The policies of
``policies.py`` decide which reused tokens run, unchanged.

Positions are prompt positions ``0..T-1``; a layer's K/V buffers ``[T, kv_heads,
head_dim]`` hold post-RoPE K at each position, so the causal mask is ``key_position <=
query_position`` whatever mix of cached and fresh rows a layer holds. When every
position runs (nothing reused) attention is called with ``is_causal`` and no mask,
exactly as transformers' sdpa path calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.nn import functional as F

from nopecache.client.errors import InvalidArgumentError
from nopecache.recompute.policies import LayerState, RecomputePolicy, ReuseLayout

__all__ = [
    "PROBE_TOKENS",
    "QUESTION_PROBE_TOKENS",
    "LayerKV",
    "LoopResult",
    "Projection",
    "Stack",
    "run_selective",
]

PROBE_TOKENS = 16
"""Last running tokens whose attention an attention-weighted policy reads."""

QUESTION_PROBE_TOKENS = 64
"""Last question tokens whose attention a question-probing policy reads."""

QUERY_BLOCK = 64
"""Running tokens per attention call, each over the keys up to its last position."""


class Projection(Protocol):
    """One layer's projections of the running tokens' normed input."""

    k: torch.Tensor  # [n, kv_heads, head_dim], post-RoPE at the tokens' positions
    v: torch.Tensor  # [n, kv_heads, head_dim]
    nope_k: torch.Tensor | None  # [n, kv_heads, head_dim] pre-RoPE K, where the stack has it

    def queries(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Post-RoPE queries ``[m, heads, head_dim]`` of ``rows`` (indices into the ``n``
        tokens; None: all of them)."""
        ...


class Stack(Protocol):
    """A Llama-family decoder's submodules, as the loop uses them.

    ``Stream`` values (the residual stream of the running tokens) are the stack's own
    business; the loop only hands them back and narrows them with :meth:`select`.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype
    device: torch.device

    def embed(self, ids: torch.Tensor) -> Any:
        """The stream of tokens ``ids`` ``[n]`` before layer 0."""
        ...

    def attention_input(self, layer: int, stream: Any) -> tuple[Any, torch.Tensor]:
        """The stream updated for ``layer`` and the normed attention input ``[n, hidden]``."""
        ...

    def project(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> Projection:
        """Q/K/V of normed inputs ``x`` ``[n, hidden]`` at ``positions`` ``[n]``."""
        ...

    def finish_layer(self, layer: int, stream: Any, attn: torch.Tensor) -> Any:
        """The stream after ``layer``: output projection of ``attn`` ``[n, heads * head_dim]``,
        residual, post-attention norm and MLP."""
        ...

    def select(self, stream: Any, keep: torch.Tensor) -> Any:
        """The stream of the tokens where bool ``keep`` ``[n]`` is True."""
        ...


class LayerKV(Protocol):
    """Where the loop reads and writes each layer's K/V of positions ``0..T-1``."""

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[T, kv_heads, head_dim]`` of the layer (the loop writes fresh rows in)."""
        ...

    def cached(self, index: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached K and V of positions ``rows`` at the layer (before fresh rows replace them)."""
        ...

    def commit(self, index: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fresh K/V ``[n, kv_heads, head_dim]`` of positions ``rows`` were computed at the
        layer (already written into :meth:`layer`'s tensors)."""
        ...


@dataclass(frozen=True, slots=True)
class LoopResult:
    """What one run of the loop left: the final stream and what it computed."""

    stream: Any
    """The stream of the tokens still running after the last layer (None without output)."""
    positions: torch.Tensor
    """Positions of those tokens ``[n]``."""
    computed: torch.Tensor
    """``[layers]`` int64: tokens whose KV was computed at each layer (misses included)."""
    recomputed: torch.Tensor
    """``[layers]`` int64: reused position-independent tokens recomputed at each layer."""


def _probe_attention(
    stack: Stack,
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    pi_rows: torch.Tensor,
) -> torch.Tensor:
    """Mean attention ``[kv_heads, n]`` that ``queries`` ``[m, heads, dim]`` (post-RoPE, at
    ``query_positions`` ``[m]``) pay to the ``pi_rows`` of ``keys`` ``[T', kv_heads, dim]``
    (positions ``0..T'-1``), causally masked."""
    probe_q = queries.transpose(0, 1)  # [heads, m, dim]
    group = stack.num_heads // stack.num_kv_heads
    k_all = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, T', dim]
    logits = torch.matmul(probe_q, k_all.transpose(1, 2).to(probe_q.dtype)) * stack.scaling
    future = torch.arange(keys.shape[0])[None, :] > query_positions[:, None]
    probs = logits.float().masked_fill(future, -torch.inf).softmax(-1)  # [heads, m, T']
    per_head = probs[:, :, pi_rows].mean(1)  # [heads, n]
    return per_head.view(stack.num_kv_heads, group, -1).mean(1)


def question_start(layout: ReuseLayout) -> int:
    """Where a prompt's question starts: the end of its last reused chunk (of the exact
    prefix without chunks)."""
    return layout.chunks[-1].end if layout.chunks else layout.prefix_end


def _probe_rows(
    policy: RecomputePolicy, layout: ReuseLayout, running: torch.Tensor
) -> torch.Tensor:
    """Indices into ``running`` whose queries a policy's attention reads: the question's
    last ``QUESTION_PROBE_TOKENS`` for a question probe (none when the question lies past
    the loop's range), else the last ``PROBE_TOKENS`` running tokens."""
    n = int(running.numel())
    if policy.probe == "question":
        rows = (running >= question_start(layout)).nonzero().squeeze(1)
        return rows[-QUESTION_PROBE_TOKENS:]
    return torch.arange(n - min(PROBE_TOKENS, n), n)


class _Lookahead:
    """Tokens after the loop's range (a question the engine computes itself later), run up
    to the last check layer so that a question probe can read their queries; their K and V
    are the loop's own and never reach the cache."""

    def __init__(self, stack: Stack, ids: torch.Tensor, start: int, last_layer: int) -> None:
        self.stack, self.last_layer = stack, last_layer
        self.positions = torch.arange(start, start + int(ids.numel()))
        self.stream = stack.embed(ids.to(stack.device))
        self.proj: Projection | None = None

    def project(self, layer: int) -> Projection:
        self.stream, x = self.stack.attention_input(layer, self.stream)
        self.proj = self.stack.project(layer, x, self.positions)
        return self.proj

    def finish(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Attention over ``keys``/``values`` (the range's, then the lookahead's own)."""
        assert self.proj is not None
        q = self.proj.queries(None).transpose(0, 1)[None]
        attn = _attend_up_to(
            q,
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            self.positions,
            self.stack.scaling,
        )
        attn = attn[0].transpose(0, 1).reshape(int(self.positions.numel()), -1)
        self.stream = self.stack.finish_layer(layer, self.stream, attn)


def _prescan(
    stack: Stack,
    kv: LayerKV,
    input_ids: torch.Tensor,
    layout: ReuseLayout,
    policy: RecomputePolicy,
    lookahead: torch.Tensor | None,
) -> torch.Tensor:
    """The probe's attention ``[kv_heads, num_pi]`` at layer 0 to every reused token, before
    any layer runs: layer 0's queries and keys need no attention (only the embedding, the
    norm and the projections), and the cached layer-0 K of a reused token is exact. The
    misses' layer-0 keys are projected here (the loop computes them again), the reused
    tokens' are read from the cache: no reused token is computed to be ranked."""
    miss = (~layout.reused_mask()).nonzero().squeeze(1)
    cached, _ = kv.layer(0)
    keys = cached.clone()
    queries: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    if miss.numel():
        _, x = stack.attention_input(0, stack.embed(input_ids.to(stack.device)[miss]))
        proj = stack.project(0, x, miss)
        keys[miss] = proj.k.to(keys.dtype)
        rows = _probe_rows(policy, layout, miss)
        if not rows.numel() and (lookahead is None or not lookahead.numel()):
            # No question in the range nor past it: the last misses probe.
            rows = torch.arange(max(0, int(miss.numel()) - PROBE_TOKENS), int(miss.numel()))
        queries.append(proj.queries(rows))
        positions.append(miss[rows])
    if lookahead is not None and lookahead.numel() and policy.probe == "question":
        at = torch.arange(layout.num_tokens, layout.num_tokens + int(lookahead.numel()))
        _, x = stack.attention_input(0, stack.embed(lookahead.to(stack.device)))
        ahead = stack.project(0, x, at)
        keys = torch.cat([keys, ahead.k.to(keys.dtype)])
        queries.append(ahead.queries(None))
        positions.append(at)
    if not queries:
        raise InvalidArgumentError("layout", "a prescan needs a computed token to probe with")
    q, pos = torch.cat(queries), torch.cat(positions)
    return _probe_attention(
        stack, q[-QUESTION_PROBE_TOKENS:], pos[-QUESTION_PROBE_TOKENS:], keys, layout.pi_tokens
    )


def _attention_of_probe(
    stack: Stack,
    policy: RecomputePolicy,
    layout: ReuseLayout,
    proj: Projection,
    running: torch.Tensor,
    keys: torch.Tensor,
    pi_rows: torch.Tensor,
    ahead: Projection | None,
) -> torch.Tensor:
    """The attention a policy reads at a check layer: its probe rows' (and the lookahead's,
    when present) to the running reused tokens; the last running tokens' when a question
    probe finds no question."""
    rows = _probe_rows(policy, layout, running)
    queries, positions = proj.queries(rows), running[rows]
    if ahead is not None:
        n_ahead = int(ahead.k.shape[0])
        ahead_positions = torch.arange(keys.shape[0] - n_ahead, keys.shape[0])
        queries = torch.cat([queries, ahead.queries(None).to(queries.dtype)])
        positions = torch.cat([positions, ahead_positions])
        queries = queries[-QUESTION_PROBE_TOKENS:]
        positions = positions[-QUESTION_PROBE_TOKENS:]
    if positions.numel() == 0:
        n = int(running.numel())
        rows = torch.arange(n - min(PROBE_TOKENS, n), n)
        queries, positions = proj.queries(rows), running[rows]
    return _probe_attention(stack, queries, positions, keys, pi_rows)


def _attend_up_to(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention ``[1, heads, n, dim]`` of queries ``q`` at ascending ``positions``
    over ``keys`` / ``values`` ``[1, kv_heads, T, dim]`` of positions ``0..T-1``.

    One masked call over all ``T`` keys computes every query against every key and masks
    most of it away when the running tokens sit early in the prompt (a report before a
    cached system prompt: the misses at 0..600 of 1400). Blocks of ``QUERY_BLOCK``
    queries each attend to the keys up to their last position only, the masked-off
    remainder skipped; the result differs from the one call by float rounding only."""
    n = int(positions.numel())
    if n == 0:
        return torch.empty_like(q)
    out = []
    for lo in range(0, n, QUERY_BLOCK):
        block = positions[lo : lo + QUERY_BLOCK]
        end = int(block[-1]) + 1
        mask = torch.arange(end, device=block.device)[None, :] <= block[:, None]
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, lo : lo + QUERY_BLOCK],
                keys[:, :, :end],
                values[:, :, :end],
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
        )
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def running_at_start(layout: ReuseLayout, policy: RecomputePolicy, num_layers: int) -> torch.Tensor:
    """Positions computed from layer 0: every miss and the reused tokens the policy starts."""
    reused = layout.reused_mask()
    is_pi = torch.zeros(layout.num_tokens, dtype=torch.bool)
    is_pi[layout.pi_tokens[policy.initial(layout, num_layers)]] = True
    return (~reused | is_pi).nonzero().squeeze(1)


@torch.no_grad()
def run_selective(
    stack: Stack,
    kv: LayerKV,
    input_ids: torch.Tensor,
    layout: ReuseLayout,
    policy: RecomputePolicy,
    *,
    output: bool = True,
    capture: torch.Tensor | None = None,
    lookahead: torch.Tensor | None = None,
) -> LoopResult:
    """Run the layers over ``layout`` (``input_ids`` ``[T]``), recomputing what ``policy``
    selects; fresh K/V land in ``kv``.

    ``output`` False skips the last layer's queries, attention and MLP (only its K/V are
    needed when no logits are read). ``capture`` ``[layers, T, kv_heads, head_dim]``
    receives the pre-RoPE K of every computed row. ``lookahead`` ``[m]``: ids of the
    prompt's tokens after position ``T - 1`` (the question, where the engine computes it
    itself); a policy probing the question reads their queries at its check layers (they
    run up to the last one and are not counted as recompute, nor stored).
    """
    tokens = layout.num_tokens
    if policy.prescan and layout.num_pi:
        attention = _prescan(stack, kv, input_ids, layout, policy, lookahead)
        chosen = policy.initial_ranked(layout, stack.num_layers, attention)
        is_pi = torch.zeros(tokens, dtype=torch.bool)
        is_pi[layout.pi_tokens[chosen]] = True
        running = (~layout.reused_mask() | is_pi).nonzero().squeeze(1)
    else:
        running = running_at_start(layout, policy, stack.num_layers)
    pi_of_token = torch.full((tokens,), -1, dtype=torch.int64)
    pi_of_token[layout.pi_tokens] = torch.arange(layout.num_pi)
    checks = policy.check_layers()
    computed = torch.zeros(stack.num_layers, dtype=torch.int64)
    recomputed = torch.zeros(stack.num_layers, dtype=torch.int64)
    if running.numel() == 0:  # nothing to compute: every position is reused as is
        return LoopResult(None, running, computed, recomputed)
    stream = stack.embed(input_ids.to(stack.device)[running])
    last = stack.num_layers - 1
    ahead: _Lookahead | None = None
    if lookahead is not None and lookahead.numel() and policy.probe == "question" and checks:
        last_check = min(max(checks), last)
        ahead = _Lookahead(stack, lookahead, tokens, last_check)

    for index in range(stack.num_layers):
        n = int(running.numel())
        full = n == tokens
        is_running_pi = pi_of_token[running] >= 0
        running_pi = running[is_running_pi]
        computed[index] = n
        recomputed[index] = running_pi.numel()
        stream, x = stack.attention_input(index, stream)
        proj = stack.project(index, x, running)
        if capture is not None and proj.nope_k is not None:
            capture[index, running] = proj.nope_k
        keys, values = kv.layer(index)
        keep: torch.Tensor | None = None
        state_cached: tuple[torch.Tensor, torch.Tensor] | None = None
        if index in checks and running_pi.numel():
            state_cached = kv.cached(index, running_pi)
        keys[running] = proj.k.to(keys.dtype)
        values[running] = proj.v.to(values.dtype)
        kv.commit(index, running, proj.k, proj.v)
        probe_keys, probe_values = keys, values
        ahead_proj: Projection | None = None
        if ahead is not None and index <= ahead.last_layer:
            ahead_proj = ahead.project(index)
            probe_keys = torch.cat([keys, ahead_proj.k.to(keys.dtype)])
            probe_values = torch.cat([values, ahead_proj.v.to(values.dtype)])
        if state_cached is not None:
            at = is_running_pi.nonzero().squeeze(1)
            state = LayerState(
                layer=index,
                num_layers=stack.num_layers,
                layout=layout,
                running=pi_of_token[running_pi],
                fresh_k=proj.k[at],
                fresh_v=proj.v[at],
                cached_k=state_cached[0],
                cached_v=state_cached[1],
                attention=(
                    _attention_of_probe(
                        stack, policy, layout, proj, running, probe_keys, running_pi, ahead_proj
                    )
                    if policy.wants_attention
                    else None
                ),
            )
            keep = torch.ones(n, dtype=torch.bool)
            keep[at] = policy.narrow(state)
        if ahead is not None and index < ahead.last_layer:
            ahead.finish(index, probe_keys, probe_values)
        if index == last and not output:
            break

        rows: torch.Tensor | None = None
        if keep is not None:
            # Queries, attention and MLP only for the tokens that go on.
            rows = keep.nonzero().squeeze(1)
            stream = stack.select(stream, keep)
            running = running[keep]
        q = proj.queries(rows).transpose(0, 1)[None]  # [1, heads, m, dim]
        k_all = keys.transpose(0, 1)[None]  # [1, kv_heads, T, dim]
        v_all = values.transpose(0, 1)[None]
        if full and keep is None:
            # transformers' sdpa call for a maskless causal prefill: bit-identical output.
            attn = F.scaled_dot_product_attention(
                q, k_all, v_all, is_causal=True, scale=stack.scaling, enable_gqa=True
            )
        else:
            attn = _attend_up_to(q, k_all, v_all, running, stack.scaling)
        attn = attn[0].transpose(0, 1).reshape(int(running.numel()), -1)
        stream = stack.finish_layer(index, stream, attn)

    return LoopResult(stream if output else None, running, computed, recomputed)
