"""The transformers adapter's RoPE check (the comparison: ``kernels/rope_check.py``).

Position-independent reuse rotates stored nope K with the RoPE the engine *describes*
(``HFEngine.rope``). :func:`check_engine_rope` compares that description with the
rotation the adapter's own prefill applies to every layer (the model's rotary table in
transformers' order: ``LlamaStack.rotate_keys``) at 0, 1, the middle and the last of the
model's ``max_position_embeddings``, on seeded random pre-RoPE K, within the model
dtype's rounding (``GateThresholds.for_dtype``). It runs no forward, so every
``HFEngine`` runs it when it is made; a mismatch turns the engine's position-independent
path off (``HFEngine.position_independent``).
"""

from __future__ import annotations

from nopecache.integrations.hf.forward import LlamaStack
from nopecache.kernels import RopeSpec
from nopecache.kernels.rope_check import EngineRotation, RopeCheck, check_positions, check_rope
from nopecache.recompute.gate import GateThresholds

__all__ = ["check_engine_rope"]


def check_engine_rope(stack: LlamaStack, rope: RopeSpec, thresholds: GateThresholds) -> RopeCheck:
    """``rope`` against the rotation ``stack`` applies to each of its layers."""
    max_len = int(getattr(stack.model.config, "max_position_embeddings", 0) or 0) or 2048
    rotations: dict[str, EngineRotation | None] = {
        f"model.layers.{i}.self_attn": stack.rotate_keys for i in range(stack.num_layers)
    }
    return check_rope(
        rotations,
        rope,
        positions=check_positions(max_len),
        kv_heads=stack.num_kv_heads,
        dtype=stack.dtype,
        bound=thresholds.for_dtype(stack.dtype).max_rope_error,
        device=stack.device,
    )
