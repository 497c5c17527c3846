"""Hugging Face transformers adapter: nopecache reuse for Llama-family models on transformers.

:class:`HFEngine` wraps a loaded ``*ForCausalLM`` model (see ``forward`` for the
supported families and versions) and does what an engine integration does around a
prefill:

* **capture**: a prefill returns the pre-RoPE ("nope") K and V of every layer, i.e. the
  ``k_proj``/``v_proj`` outputs that RoPE then rotates (Llama has no K norm), ready to
  store; :meth:`HFEngine.chunk_kv` computes one chunk on its own for position-independent
  reuse, optionally behind a neutral *sink prefix* that is then dropped;
* **reuse**: :meth:`HFEngine.prefill` takes :class:`ReusedKV` (post-RoPE K and V at the
  prompt's positions, which tokens are an exact prefix and which position-independent
  chunks) from any :class:`KVSource`, prefills the misses plus what the recompute
  policy selects, and returns the prompt's full KV;
* **generate**: :meth:`HFEngine.kv_cache` turns that KV into a transformers
  ``DynamicCache``; :meth:`HFEngine.generate` decodes greedily with the model's own
  forward, :meth:`HFEngine.continuation_logits` teacher-forces a continuation.

Sources of reused KV::

    CacheClientSource   lookup + fetch through nopecache.client's CacheClient (servers)

(the tests add an in-process source keyed by the client's own planner:
``tests/support/hf_store.py``).

Exact-prefix tokens are placed and never recomputed: with nothing else reused the
logits equal a full prefill's within fp32 rounding (the misses run through matrix
products of another shape than in a full prefill, which rounds differently in the
last bits; nope K re-rotated by the kernel adds at most an ulp per element).

Recommended settings, from bench/quality.py on SmolLM2-135M: the default policy
``recompute.DEFAULT_POLICY`` (``first_k(0.15)``: 15% of the reused token-layers, on each
chunk's first tokens) and chunks stored behind a sink prefix that looks like what
precedes such a chunk in a chat (``chunk_kv(ids, sink_prefix=...)``: a short system
message, plus the ``user`` header when the chunk is raw text; :data:`NEWLINE_SINK` is the
one-token fallback). Token ids belong to the tokenizer, so the engine assumes none.
Touching hits within one segment are one chunk for the policy (see
:meth:`ReusedKV.from_placed`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from nopecache.client.chunking import ChunkSpan, TokenIds, token_array
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.plan import ReusePlan
from nopecache.client.sync_client import CacheClient
from nopecache.integrations.hf.forward import (
    SUPPORTED_MODEL_TYPES,
    LlamaStack,
    PrefillOutput,
    UnsupportedModelError,
    check_supported,
    selective_prefill,
)
from nopecache.integrations.hf.gate import Tokenize, calibrate
from nopecache.integrations.hf.rope_check import check_engine_rope
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm
from nopecache.recompute.gate import DEFAULT_THRESHOLDS, GateThresholds, GateVerdict
from nopecache.recompute.policies import (
    DEFAULT_POLICY,
    NoRecompute,
    RecomputePolicy,
    ReuseLayout,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CacheClientSource",
    "CapturedKV",
    "HFEngine",
    "KVSource",
    "PrefillOutput",
    "ReusedKV",
    "UnsupportedModelError",
    "check_supported",
]

log = logging.getLogger(__name__)

NEWLINE_SINK: tuple[int, ...] = (198,)
"""SmolLM2's newline token: a one-token neutral prefix for ``chunk_kv(sink_prefix=...)``."""


@dataclass(frozen=True, slots=True)
class CapturedKV:
    """Pre-RoPE K and V of some tokens, ``[layers, tokens, kv_heads, head_dim]`` each.

    ``sink_prefix`` names the tokens the KV was computed behind (then dropped): such KV
    is not what a prompt starting with these tokens computes, so it must not be stored
    under exact-prefix keys.
    """

    k_nope: torch.Tensor
    v: torch.Tensor
    sink_prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.k_nope.dim() != 4 or self.k_nope.shape != self.v.shape:
            raise InvalidArgumentError(
                "CapturedKV",
                f"k_nope {tuple(self.k_nope.shape)} and v {tuple(self.v.shape)} "
                "must both be [layers, tokens, kv_heads, head_dim]",
            )

    @property
    def num_tokens(self) -> int:
        """Tokens held."""
        return int(self.k_nope.shape[1])


@dataclass(frozen=True, slots=True)
class ReusedKV:
    """KV a source found for a prompt: post-RoPE K and V at the prompt's positions, and where.

    ``k``/``v`` are ``[layers, prompt_tokens, kv_heads, head_dim]``; only the rows that
    ``layout`` marks as reused are read.
    """

    k: torch.Tensor
    v: torch.Tensor
    layout: ReuseLayout

    def __post_init__(self) -> None:
        if self.k.dim() != 4 or self.k.shape != self.v.shape:
            raise InvalidArgumentError(
                "ReusedKV.k",
                f"k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must both be "
                "[layers, tokens, kv_heads, head_dim]",
            )
        if self.k.shape[1] != self.layout.num_tokens:
            raise InvalidArgumentError(
                "ReusedKV.layout",
                f"covers {self.layout.num_tokens} tokens, k has {self.k.shape[1]}",
            )

    @classmethod
    def from_placed(
        cls,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: ReusePlan,
        placed: Sequence[ChunkSpan] | None = None,
        segments: Sequence[int] = (),
    ) -> ReusedKV:
        """From a plan and the target spans whose KV was actually placed (None: all hits).

        The exact prefix stops at the first prefix hit not placed; a position-independent
        hit counts only if placed. Placed hits that touch merge into one chunk of the
        layout unless a segment starts where they meet: the client cuts a segment into
        ~64-token blocks, but the tokens of one segment were computed together, so the
        policy sees one chunk (one start) per run of hits within a segment.
        """
        done = None if placed is None else set(placed)
        prefix_end = 0
        for hit in plan.prefix:
            if done is not None and hit.target not in done:
                break
            prefix_end = hit.target.end
        starts = {int(s) for s in segments}
        chunks: list[ChunkSpan] = []
        for h in plan.hits:
            if (done is not None and h.target not in done) or h.target.start < prefix_end:
                continue
            if chunks and chunks[-1].end == h.target.start and h.target.start not in starts:
                chunks[-1] = ChunkSpan(chunks[-1].start, h.target.end)
            else:
                chunks.append(h.target)
        return cls(k, v, ReuseLayout(plan.num_tokens, prefix_end, tuple(chunks)))


class KVSource(Protocol):
    """Where an engine gets reused KV for a prompt and puts the KV of prompts it computed."""

    def reuse(self, tokens: TokenIds, segments: Sequence[int] = ()) -> ReusedKV | None:
        """KV for the cached parts of ``tokens`` (None: nothing cached)."""
        ...

    def store(
        self,
        tokens: TokenIds,
        kv: CapturedKV,
        segments: Sequence[int] = (),
        *,
        prefix: bool = True,
        position_independent: bool = True,
    ) -> None:
        """Keep the nope KV of ``tokens`` (positions 0..n-1) for later reuse."""
        ...


class HFEngine:
    """A transformers Llama-family model with nopecache reuse, recompute and generation."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        name: str = "",
        revision: str = "",
        sink_prefix: Sequence[int] = (),
        on_prefill: Callable[[int, float], None] | None = None,
        policy: RecomputePolicy | None = None,
        rope: RopeSpec | None = None,
        gate: Tokenize | None = None,
        gate_thresholds: GateThresholds = DEFAULT_THRESHOLDS,
    ) -> None:
        """Wrap ``model``; raise :class:`UnsupportedModelError` if it cannot be run exactly.

        ``sink_prefix``: tokens :meth:`chunk_kv` computes chunks behind by default (e.g.
        :data:`NEWLINE_SINK` for SmolLM2; token ids are the tokenizer's, so none is assumed).
        ``on_prefill(tokens, seconds)`` is told after every :meth:`prefill` how many tokens
        it computed (per layer, on average) and how long it took: a client's
        ``observe_prefill`` (``CacheClientSource(client, engine=...)`` adds it), so the
        cost model compares fetches with this engine's real prefill rate.

        ``policy``: what :meth:`prefill` recomputes unless told otherwise (default
        ``DEFAULT_POLICY``). ``rope``: the RoPE description fetched K is rotated with
        (default: from the model's config). ``gate``: a tokenizer function; with it the
        engine runs the blend correctness gate now (``integrations/hf/gate.py``) and, when
        the gate refuses, reuses exact prefixes only: position-independent chunks become
        misses, each such prefill counted in ``blend_fallbacks`` (the verdict, with its
        figures, is ``gate_verdict`` and is logged). Whatever ``gate``, the RoPE
        description is checked against the model's own rotation (``rope_check.py``, no
        forward run); a mismatch turns position-independent reuse off as a refused gate
        does (``rope_check``, every figure logged), and ``CacheClientSource`` then stores
        and looks up exact prefixes only.
        """
        self.prefill_observers: list[Callable[[int, float], None]] = (
            [] if on_prefill is None else [on_prefill]
        )
        self.sink_prefix = tuple(int(t) for t in sink_prefix)
        self.stack = LlamaStack(model)
        self.model = model
        self.rope = rope if rope is not None else RopeSpec.from_hf_config(model.config)
        self.name = name or str(getattr(model.config, "_name_or_path", "") or "model")
        self.revision = revision
        self.policy = policy if policy is not None else DEFAULT_POLICY
        self.blend_fallbacks = 0
        self.gate_verdict: GateVerdict | None = None
        # The description against the model's own rotation (rope_check.py): cheap, always.
        self.rope_check = check_engine_rope(self.stack, self.rope, gate_thresholds)
        if self.rope_check.passed:
            log.info("nopecache: %s: %s", self.name, self.rope_check.summary())
        else:
            log.warning(
                "nopecache: %s: %s; position-independent reuse off, exact prefixes only; "
                "every figure:\n%s",
                self.name,
                self.rope_check.summary(),
                self.rope_check.report(),
            )
        if gate is not None:
            self.gate_verdict = calibrate(self, gate, self.policy, thresholds=gate_thresholds)
            if self.gate_verdict.passed:
                log.info("nopecache: %s: %s", self.name, self.gate_verdict.reason())
            else:
                log.warning("nopecache: %s: %s", self.name, self.gate_verdict.reason())

    @property
    def position_independent(self) -> bool:
        """False when the RoPE check refused the description: position-independent KV is
        neither reused nor stored (exact prefixes only)."""
        return self.rope_check.passed

    @property
    def blend_allowed(self) -> bool:
        """False when the RoPE check or the correctness gate refused blend mode (exact
        prefixes only)."""
        return self.position_independent and (self.gate_verdict is None or self.gate_verdict.passed)

    def fingerprint(self, form: StoredForm = StoredForm.NOPE) -> ModelFingerprint:
        """The model's KV identity for keys and blocks."""
        return ModelFingerprint.from_rope_spec(
            model=self.name,
            revision=self.revision,
            num_layers=self.stack.num_layers,
            num_kv_heads=self.stack.num_kv_heads,
            dtype=self.stack.dtype,
            form=form,
            rope=self.rope,
        )

    def _ids(self, tokens: TokenIds, name: str = "tokens") -> torch.Tensor:
        arr = token_array(tokens, name)
        if arr.size == 0:
            raise InvalidArgumentError(name, "needs at least one token")
        return torch.from_numpy(arr.astype(np.int64)).to(self.stack.device)

    def prefill(
        self,
        tokens: TokenIds,
        reused: ReusedKV | None = None,
        policy: RecomputePolicy | None = None,
        *,
        capture: bool = False,
        gate: bool = True,
    ) -> PrefillOutput:
        """Prefill ``tokens`` over ``reused`` KV, recomputing what ``policy`` selects.

        Without ``reused`` this is a full prefill (bit-identical to
        ``model(ids, logits_to_keep=1)``). ``policy`` defaults to the engine's. If the
        prompt's last token was reused it is computed anyway (its logits are needed).
        ``capture`` adds the nope K. When the correctness gate refused blend mode (and
        ``gate`` is True) reused chunks are computed as misses.
        """
        ids = self._ids(tokens)
        policy = policy if policy is not None else self.policy
        if gate and reused is not None and reused.layout.chunks and not self.blend_allowed:
            self.blend_fallbacks += 1
            exact = ReuseLayout(reused.layout.num_tokens, reused.layout.prefix_end)
            reused = ReusedKV(reused.k, reused.v, exact)
        if reused is not None and reused.layout.num_tokens != len(ids):
            raise InvalidArgumentError(
                "reused", f"covers {reused.layout.num_tokens} tokens, the prompt has {len(ids)}"
            )
        start = time.perf_counter()
        if reused is None:
            out = selective_prefill(self.stack, ids, ReuseLayout(len(ids)), policy, capture=capture)
        else:
            layout = reused.layout.without_last_token()
            out = selective_prefill(
                self.stack, ids, layout, policy, reused.k, reused.v, capture=capture
            )
        seconds = time.perf_counter() - start
        if self.prefill_observers and seconds > 0:
            # Tokens computed per layer on average: misses plus the recomputed reused ones.
            computed = max(1, round(float(out.computed.double().mean())))
            for observe in self.prefill_observers:
                observe(computed, seconds)
        return out

    def captured(self, prefill: PrefillOutput) -> CapturedKV:
        """The nope K and V of a full prefill run with ``capture=True``, to store."""
        if prefill.nope_k is None:
            raise InvalidArgumentError("prefill", "was run without capture=True")
        if prefill.layout.reused_tokens:
            raise InvalidArgumentError(
                "prefill", "reused cached KV: store only KV computed in full for this prompt"
            )
        return CapturedKV(prefill.nope_k, prefill.v)

    def chunk_kv(self, tokens: TokenIds, *, sink_prefix: Sequence[int] | None = None) -> CapturedKV:
        """Nope K and V of ``tokens`` computed on their own, for position-independent reuse.

        With a sink prefix (``sink_prefix``, else the engine's) the chunk is computed behind
        those tokens, whose KV is then dropped: the chunk's first token is not stored as
        the attention sink that the first token of a sequence becomes.
        """
        if sink_prefix is None:
            sink_prefix = self.sink_prefix
        ids = self._ids(tokens)
        skip = len(sink_prefix)
        if skip:
            ids = torch.cat((self._ids(sink_prefix, "sink_prefix"), ids))
        out = selective_prefill(self.stack, ids, ReuseLayout(len(ids)), NoRecompute(), capture=True)
        assert out.nope_k is not None
        return CapturedKV(
            out.nope_k[:, skip:].clone(),
            out.v[:, skip:].clone(),
            tuple(int(t) for t in sink_prefix),
        )

    def kv_cache(self, prefill: PrefillOutput) -> DynamicCache:
        """A transformers ``DynamicCache`` holding the prompt's KV (for the model's forward)."""
        cache = DynamicCache(config=self.model.config)
        for layer in range(self.stack.num_layers):
            cache.update(
                prefill.k[layer].transpose(0, 1)[None].contiguous(),
                prefill.v[layer].transpose(0, 1)[None].contiguous(),
                layer,
            )
        return cache

    @torch.no_grad()
    def continuation_logits(self, prefill: PrefillOutput, tokens: TokenIds) -> torch.Tensor:
        """Logits ``[1 + n, vocab]`` at the prompt end and after each of ``tokens[:-1]``...

        ...teacher-forced: row i predicts ``tokens[i]``, row n what follows them all.
        """
        ids = self._ids(tokens, "tokens")
        start = prefill.layout.num_tokens
        positions = torch.arange(start, start + len(ids), device=self.stack.device)[None]
        out = self.model(
            input_ids=ids[None],
            position_ids=positions,
            cache=self.kv_cache(prefill),
            use_cache=True,
        )
        return torch.cat((prefill.logits[None], out.logits[0].float()))

    @torch.no_grad()
    def generate(
        self, prefill: PrefillOutput, max_new_tokens: int, stop_tokens: Sequence[int] = ()
    ) -> list[int]:
        """Greedy tokens after the prompt (stop tokens included when reached)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise InvalidArgumentError("max_new_tokens", f"must be an int, got {max_new_tokens!r}")
        stop = set(stop_tokens)
        cache = self.kv_cache(prefill)
        position = prefill.layout.num_tokens
        token = int(prefill.logits.argmax())
        out: list[int] = []
        while len(out) < max_new_tokens:
            out.append(token)
            if token in stop or len(out) == max_new_tokens:
                break
            logits = self.model(
                input_ids=torch.tensor([[token]], device=self.stack.device),
                position_ids=torch.tensor([[position]], device=self.stack.device),
                cache=cache,
                use_cache=True,
            ).logits
            token = int(logits[0, -1].argmax())
            position += 1
        return out


def require_exact(kv: CapturedKV, prefix: bool) -> None:
    if prefix and kv.sink_prefix:
        raise InvalidArgumentError(
            "prefix",
            f"KV computed behind the sink prefix {list(kv.sink_prefix)} is not an exact "
            "prefix; store it with prefix=False",
        )


class CacheClientSource:
    """A :class:`KVSource` over nopecache's ``CacheClient`` (lookup, fetch, store)."""

    def __init__(
        self,
        client: CacheClient,
        engine: HFEngine | None = None,
        *,
        wait: bool = False,
        namespace: str | None = None,
    ) -> None:
        """Use ``client``, a ``CacheClient`` made for this engine's model.

        With ``engine`` every prefill it runs is reported to ``client.observe_prefill`` (the
        cost model then weighs fetches against this engine's real prefill rate).
        ``wait=False`` queues stores in the client's background queue (the engine is not
        held up); ``wait=True`` returns once the blocks are on their servers.
        ``namespace`` overrides the client config's for this source's keys.
        """
        self.client = client
        self.engine = engine
        self.wait = wait
        if engine is not None and client.observe_prefill not in engine.prefill_observers:
            engine.prefill_observers.append(client.observe_prefill)
        self.namespace = namespace

    @property
    def _position_independent(self) -> bool:
        return self.engine is None or self.engine.position_independent

    def reuse(self, tokens: TokenIds, segments: Sequence[int] = ()) -> ReusedKV | None:
        """Lookup and fetch through the client; failed blocks become misses."""
        plan = self.client.lookup(
            tokens,
            segments=list(segments) or None,
            namespace=self.namespace,
            allow_position_independent=self._position_independent,
        )
        if not plan.blocks:
            return None
        result = self.client.fetch(plan, tokens)
        if result.k is None or result.v is None or not result.placed:
            return None
        placed = [h.target for h in result.placed]
        return ReusedKV.from_placed(result.k, result.v, plan, placed, segments)

    def store(
        self,
        tokens: TokenIds,
        kv: CapturedKV,
        segments: Sequence[int] = (),
        *,
        prefix: bool = True,
        position_independent: bool = True,
    ) -> None:
        """Store nope K and V (computed at positions 0..n-1) through the client (exact
        prefix keys only when the engine's RoPE check refused its description)."""
        require_exact(kv, prefix)
        position_independent = position_independent and self._position_independent
        if not (prefix or position_independent):
            return
        self.client.store(
            tokens,
            (kv.k_nope, kv.v),
            0,
            form="nope",
            segments=list(segments) or None,
            namespace=self.namespace,
            prefix=prefix,
            position_independent=position_independent,
            wait=self.wait,
        )
