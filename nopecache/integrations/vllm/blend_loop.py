"""Blend mode's layer loop on vLLM's own modules and paged cache (worker side).

The loop itself is ``nopecache.recompute.selective.run_selective``, the one the
transformers integration (``nopecache.integrations.hf``) runs; this module gives it a
:class:`VllmStack` (the served model's embedding, norms, fused QKV projection with its
rotary embedding, output projection and MLP: vLLM's modules, vLLM's weights, no copy,
reached through ``compat``) and a :class:`PagedLayerKV` (each layer's K/V of positions
``[0, end)`` read from vLLM's paged cache through the connector's KVLayout, fresh rows
written back through it). So the tokens of a claimed range attend to everything before
them: vLLM's locally cached blocks, the loaded blocks and the fresh rows.

Finding the model. vLLM 0.32 hands a KV connector its caches, never the model (LMCache's
CacheBlend patches vLLM's model runner to register it). :func:`find_model` looks for the
one module tree, among the live objects of the worker process, under which every
attention layer vLLM registered in ``static_forward_context`` for the caches the
connector was handed resolves, by identity, at its own name. That tree is the model the
runner serves: the same modules, the same weights. It is safe to call them here because
the loop runs on the model runner's thread inside ``start_load_kv``, before the step's
forward and under no_grad, and the modules keep no state between calls (their forward
is a pure function of weights and inputs; the attention layers, which do read the
forward context, are never called: attention here is the loop's own over the paged
cache).
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.errors import BlendUnavailableError
from nopecache.integrations.vllm.layout import KVLayout
from nopecache.recompute.selective import Projection

__all__ = ["BlendUnavailableError", "PagedLayerKV", "VllmStack", "find_model"]


def find_model(attention_layers: Mapping[str, nn.Module]) -> nn.Module:
    """The module tree whose attention layers are ``attention_layers`` (by name and identity)."""
    if not attention_layers:
        raise BlendUnavailableError("no attention layers registered")
    names = sorted(attention_layers)
    first = attention_layers[names[0]]
    found: list[nn.Module] = []
    for obj in gc.get_objects():
        # type(), not isinstance(): a proxy object's __class__ may warn or raise.
        if not issubclass(type(obj), nn.Module) or obj is first:
            continue
        try:
            if all(obj.get_submodule(n) is attention_layers[n] for n in names):
                found.append(obj)
        except AttributeError:
            continue
    if len(found) != 1:
        raise BlendUnavailableError(
            f"{len(found)} module trees hold the registered attention layers (expected 1)"
        )
    return found[0]


class _VllmProjection:
    """Q/K/V of the running tokens, from vLLM's fused QKV projection and rotary embedding."""

    def __init__(self, stack: VllmStack, layer: int, x: torch.Tensor, positions: torch.Tensor):
        n = x.shape[0]
        q, k, v = compat.qkv_rope(stack.attns[layer], x, positions)
        self._q = q.reshape(n, stack.num_heads, stack.head_dim)
        self.k = k.reshape(n, stack.num_kv_heads, stack.head_dim)
        self.v = v.reshape(n, stack.num_kv_heads, stack.head_dim)
        self.nope_k: torch.Tensor | None = None  # vLLM's K is post-RoPE

    def queries(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Post-RoPE queries of ``rows`` (computed with K and V, here only selected)."""
        return self._q if rows is None else self._q[rows]


class VllmStack:
    """A vLLM Llama-family model as the selective loop's Stack.

    The stream is vLLM's ``(hidden_states, residual)`` pair, and each layer runs in
    vLLM's own order (fused residual-add norms), so a token computed here takes the
    same operations as in vLLM's forward. The modules and their calling conventions
    come from ``compat`` (``llama_modules``, ``qkv_rope``, ``residual_norm``).
    """

    def __init__(self, model: nn.Module) -> None:
        """Take the submodules of ``model`` (a ``*ForCausalLM``); BlendUnavailableError if
        its layout is not Llama's."""
        modules = compat.llama_modules(model)
        self.embed_tokens = modules.embed_tokens
        self.input_norms = modules.input_norms
        self.post_norms = modules.post_norms
        self.mlps = modules.mlps
        self.attns = modules.attns
        self.num_layers = len(modules.attns)
        self.num_heads = modules.num_heads
        self.num_kv_heads = modules.num_kv_heads
        self.head_dim = modules.head_dim
        self.scaling = modules.scaling
        self.dtype: torch.dtype = modules.weight.dtype
        self.device: torch.device = modules.weight.device

    def embed(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """vLLM's embedding of ``ids``; no residual yet."""
        return self.embed_tokens(ids), None

    def attention_input(
        self, layer: int, stream: tuple[torch.Tensor | None, torch.Tensor | None]
    ) -> tuple[tuple[None, torch.Tensor], torch.Tensor]:
        """The input norm as vLLM's decoder layer applies it (fused with the residual add)."""
        hidden, residual = stream
        assert hidden is not None
        x, residual = compat.residual_norm(self.input_norms[layer], hidden, residual)
        return (None, residual), x

    def project(self, layer: int, x: torch.Tensor, positions: torch.Tensor) -> Projection:
        """The layer's Q/K/V at ``positions``."""
        return _VllmProjection(self, layer, x, positions)

    def finish_layer(
        self, layer: int, stream: tuple[None, torch.Tensor], attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, post-attention norm (with the residual add) and MLP."""
        _, residual = stream
        out = compat.output_projection(self.attns[layer], attn.to(self.dtype))
        x, residual = compat.residual_norm(self.post_norms[layer], out, residual)
        return self.mlps[layer](x), residual

    def select(
        self, stream: tuple[torch.Tensor | None, torch.Tensor | None], keep: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The rows of the stream where ``keep`` is True."""
        hidden, residual = stream
        return (
            None if hidden is None else hidden[keep],
            None if residual is None else residual[keep],
        )


class PagedLayerKV:
    """Each layer's K/V of positions ``[0, T)`` in vLLM's paged cache, for the loop."""

    def __init__(
        self, layout: KVLayout, caches: Sequence[torch.Tensor], slots: torch.Tensor
    ) -> None:
        """``slots`` ``[T]``: the cache slot of every position (from the request's blocks)."""
        self.layout = layout
        self.caches = caches
        self.slots = slots
        self._index = -1
        self._k = self._v = torch.empty(0)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the layer's K/V (the loop writes fresh rows into it, then commits)."""
        self._k, self._v = self.layout.read(self.caches[index], self.slots)
        self._index = index
        return self._k, self._v

    def cached(self, index: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached rows, as read before any fresh row was written."""
        assert index == self._index, "cached() is called after layer() of the same layer"
        return self._k[rows].clone(), self._v[rows].clone()

    def commit(self, index: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the fresh rows into vLLM's cache, where its attention reads them."""
        self.layout.write(self.caches[index], self.slots[rows], k, v)
