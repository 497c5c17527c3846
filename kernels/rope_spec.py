"""RopeSpec: everything needed to reproduce a model's rotary embedding on K.

Fields other modules rely on (do not rename):

    head_dim           last dim of K as cached (MLA: kv_lora_rank + qk_rope_head_dim)
    rotary_dim         number of rotated dims (even, <= head_dim - rotary_offset)
    rotary_offset      first rotated dim (0 normally; kv_lora_rank for MLA latents)
    layout             "neox" (rotate halves, HF Llama) or "gptj" (interleaved pairs)
    inv_freq           rotary_dim // 2 frequencies, one per rotated pair (fp32 values)
    attention_scaling  factor HF multiplies cos and sin by (YaRN mscale, LongRoPE); 1.0 otherwise
    scaling_type       "default", "linear", "dynamic", "llama3", "yarn", "longrope", ...

Rotated pair i is (d[i], d[i + rotary_dim/2]) for neox and (d[2i], d[2i+1]) for gptj,
both counted from ``rotary_offset``; dims outside the rotated range pass through.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import torch
import xxhash

Layout = Literal["neox", "gptj"]


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary-embedding parameters of one model's attention layers."""

    head_dim: int
    rotary_dim: int
    inv_freq: tuple[float, ...]
    layout: Layout = "neox"
    rotary_offset: int = 0
    attention_scaling: float = 1.0
    scaling_type: str = "default"

    def __post_init__(self) -> None:
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be positive and even, got {self.rotary_dim}")
        if self.rotary_offset < 0 or self.rotary_offset + self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_offset {self.rotary_offset} + rotary_dim {self.rotary_dim} "
                f"exceeds head_dim {self.head_dim}"
            )
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(
                f"inv_freq has {len(self.inv_freq)} entries, expected rotary_dim // 2 = "
                f"{self.rotary_dim // 2}"
            )
        if self.layout not in ("neox", "gptj"):
            raise ValueError(f"layout must be 'neox' or 'gptj', got {self.layout!r}")
        if not self.attention_scaling > 0:
            raise ValueError(f"attention_scaling must be positive, got {self.attention_scaling}")

    @classmethod
    def default(
        cls, head_dim: int, theta: float = 10000.0, rotary_dim: int | None = None
    ) -> RopeSpec:
        """Unscaled RoPE with base ``theta`` over ``rotary_dim`` (default: all) dims."""
        rd = head_dim if rotary_dim is None else rotary_dim
        inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))
        return cls(head_dim=head_dim, rotary_dim=rd, inv_freq=tuple(inv.tolist()))

    def inv_freq_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Frequencies as an fp32 tensor ``[rotary_dim // 2]`` on ``device``."""
        return torch.tensor(self.inv_freq, dtype=torch.float32, device=device)

    def digest(self) -> bytes:
        """Stable 16-byte digest of every number that affects the rotation."""
        h = xxhash.xxh3_128()
        h.update(
            struct.pack(
                "<4sIIIdH",
                b"rope",
                self.head_dim,
                self.rotary_dim,
                self.rotary_offset,
                self.attention_scaling,
                0 if self.layout == "neox" else 1,
            )
        )
        h.update(self.scaling_type.encode())
        # fp32 values, as the kernels use them.
        h.update(struct.pack(f"<{len(self.inv_freq)}f", *self.inv_freq))
        return h.digest()
