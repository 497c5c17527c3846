"""An in-process :class:`KVSource` for the transformers adapter's tests: no server.

Blocks live in a dict, cut, keyed and planned exactly as the nopecache client does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nopecache.client.chunking import Chunker, FixedChunker, TokenIds, token_array
from nopecache.client.config import DEFAULT_CHUNKER, DEFAULT_PREFIX_BLOCK_TOKENS, ClientConfig
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.keyplan import KeyPlanner
from nopecache.client.keys import BlockKey
from nopecache.client.plan import ReusePlan, plan_reuse
from nopecache.integrations.hf.adapter import CapturedKV, HFEngine, ReusedKV, require_exact
from nopecache.kernels.api import rotate
from nopecache.proto.block import StoredForm


@dataclass(frozen=True, slots=True)
class _Block:
    tokens: np.ndarray
    k_nope: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    v: torch.Tensor


class InProcessStore:
    """Blocks in a dict, cut, keyed and planned exactly as the nopecache client does.

    The client's own :class:`~nopecache.client.keyplan.KeyPlanner` (prefix chain on the
    ``prefix_block_tokens`` grid, content chunks per segment) and ``plan_reuse``; fetch
    rotates nope K to the target positions with the nopecache kernel. No server, no cost
    model (every found block is a hit). Single-threaded (no lock).
    """

    def __init__(
        self,
        engine: HFEngine,
        config: ClientConfig | None = None,
        *,
        namespace: str | None = None,
        prefix_block_tokens: int | None = None,
        chunker: Chunker | None = None,
    ) -> None:
        """An empty store for ``engine``'s model, keyed as a client with ``config`` would.

        ``prefix_block_tokens`` and ``chunker`` override the config's, as in the client.
        """
        # Without a config: the client's defaults (a config needs server addresses).
        block = DEFAULT_PREFIX_BLOCK_TOKENS if config is None else config.prefix_block_tokens
        content = DEFAULT_CHUNKER if config is None else config.content_chunker()
        ns = "" if config is None else config.namespace
        fingerprint = engine.fingerprint(StoredForm.NOPE)
        self.rope = engine.rope
        self.fingerprint = fingerprint
        self.planner = KeyPlanner(
            fingerprint,
            ns if namespace is None else namespace,
            FixedChunker(block if prefix_block_tokens is None else prefix_block_tokens),
            content if chunker is None else chunker,
            content,
        )
        self.blocks: dict[BlockKey, _Block] = {}

    def store(
        self,
        tokens: TokenIds,
        kv: CapturedKV,
        segments: Sequence[int] = (),
        *,
        prefix: bool = True,
        position_independent: bool = True,
    ) -> None:
        """Keep the blocks of ``tokens`` the client would store (prefix chain, content keys)."""
        arr = token_array(tokens)
        if kv.num_tokens != len(arr):
            raise InvalidArgumentError("kv", f"holds {kv.num_tokens} tokens, tokens has {len(arr)}")
        require_exact(kv, prefix)
        chunker = self.planner.pi_chunker(None, list(segments) or None)
        pre, pi = self.planner.keys(arr, None, chunker, prefix=prefix, pi=position_independent)
        for chunk in (*pre, *pi):
            s = chunk.span
            self.blocks[chunk.key] = _Block(
                arr[s.start : s.end].copy(), kv.k_nope[:, s.start : s.end], kv.v[:, s.start : s.end]
            )

    def lookup(
        self, tokens: TokenIds, segments: Sequence[int] = (), *, position_independent: bool = True
    ) -> ReusePlan:
        """The reuse plan of ``tokens`` cut at ``segments``, as the client plans it."""
        arr = token_array(tokens)
        chunker = self.planner.pi_chunker(None, list(segments) or None)
        chain, pi = self.planner.keys(arr, None, chunker, prefix=True, pi=position_independent)
        found = {c.key: StoredForm.NOPE for c in (*chain, *pi) if c.key in self.blocks}
        return plan_reuse(len(arr), chain, pi, found)

    def fetch(self, plan: ReusePlan, tokens: TokenIds, segments: Sequence[int] = ()) -> ReusedKV:
        """K rotated to each hit's target positions and V, in prompt-shaped tensors."""
        arr = token_array(tokens)
        any_block = next(iter(self.blocks.values()), None)
        if any_block is None or not plan.blocks:
            raise InvalidArgumentError("plan", "has no hits to fetch")
        layers, _, heads, dim = any_block.k_nope.shape
        k = torch.zeros((layers, len(arr), heads, dim), dtype=any_block.k_nope.dtype)
        v = torch.zeros_like(k)
        for hit in plan.blocks:
            block = self.blocks[hit.key]
            src, dst = hit.source, hit.target
            if not np.array_equal(block.tokens[src.start : src.end], arr[dst.start : dst.end]):
                raise InvalidArgumentError("tokens", f"differ from the block placed at {dst}")
            # One rotation for all layers: the layers of a token share its position.
            nope = block.k_nope[:, src.start : src.end].transpose(0, 1)
            rotated = rotate(
                nope.reshape(len(dst), layers * heads, dim), None, dst.start, self.rope
            )
            k[:, dst.start : dst.end] = rotated.view(len(dst), layers, heads, dim).transpose(0, 1)
            v[:, dst.start : dst.end] = block.v[:, src.start : src.end]
        return ReusedKV.from_placed(k, v, plan, segments=segments)

    def reuse(self, tokens: TokenIds, segments: Sequence[int] = ()) -> ReusedKV | None:
        """Lookup and fetch: KV for the cached parts of ``tokens`` (None: nothing cached)."""
        plan = self.lookup(tokens, segments)
        return self.fetch(plan, tokens, segments) if plan.blocks else None
