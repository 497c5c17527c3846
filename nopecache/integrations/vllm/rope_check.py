"""The start-up RoPE check in a vLLM worker (the comparison: ``kernels/rope_check.py``).

vLLM's K is post-RoPE: a worker that stores position-independent blocks un-rotates it
with the connector's ``RopeSpec`` (every engine with ``save`` on: the client stores
content keys beside the exact prefix), and one that loads them (``pi_reuse`` other than
``off``) re-rotates with it. Both are right only if the spec is the rotation vLLM
applies, layer by layer, at this engine's settings. So at start-up
(``register_kv_caches``) the worker finds the served model (``blend_loop.find_model``),
takes each registered attention layer's own ``rotary_emb`` (``compat.layer_rotary``:
the layer's rotation as its forward calls it, ``compat.rotate_keys``; a layer without
one does not rotate) and compares it with the spec at 0, 1, the middle and the end of
``max_model_len`` on seeded random pre-RoPE K, within the model dtype's rounding
(``GateThresholds.for_dtype``). ``rope_override`` is the spec, so it is checked the
same way.

A mismatch, or a model the check cannot reach, turns position-independent store and load
off for the engine (``WorkerSide.refuse_position_independent``): the worker stores exact
prefix keys only, and the scheduler half, told through the start-up handshake
(``NopecacheHandshake.pi_refused``), looks up exact prefixes only. Every figure is
logged, and the refusal is counted (``vllm:nopecache_rope_check_failed``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from torch import nn

from nopecache.integrations.vllm import compat
from nopecache.integrations.vllm.blend_loop import find_model
from nopecache.kernels.rope_check import EngineRotation

__all__ = ["engine_rotations", "module_rotations"]


def module_rotations(
    model: nn.Module, attention_names: list[str]
) -> dict[str, EngineRotation | None]:
    """Each attention layer's own rotation in ``model`` (None: the layer has no rotary
    embedding), by the name vLLM registered the layer under."""
    rotations: dict[str, EngineRotation | None] = {}
    for name in attention_names:
        rotary = compat.layer_rotary(model, name)
        rotations[name] = None if rotary is None else partial(compat.rotate_keys, rotary)
    return rotations


def engine_rotations(attention_layers: Mapping[str, nn.Module]) -> dict[str, EngineRotation | None]:
    """:func:`module_rotations` of the served model, found from its registered attention
    layers (``BlendUnavailableError`` when it cannot be found)."""
    return module_rotations(find_model(attention_layers), list(attention_layers))
