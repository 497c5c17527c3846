"""Does a RoPE description reproduce an engine's own rotation? Checked, not assumed.

Every position-independent block is stored as nope K (post-RoPE K un-rotated with the
connector's :class:`RopeSpec`, or pre-RoPE K as captured) and re-rotated with the same
spec wherever it lands. If the spec is not the rotation the engine applies (another base,
a scaling the config does not name, the GPT-J instead of the NeoX pair layout, a layer
that does not rotate at all, a table the engine picks per setting), every such block is
wrong KV for every engine that reuses it, and nothing downstream notices.

:func:`check_rope` compares the two on the engine's own rotary modules, without running
the model: seeded random pre-RoPE K ``[positions, kv_heads, head_dim]`` in the model's
dtype goes through each layer's rotation (``EngineRotation``) and through
:func:`~nopecache.kernels.api.rotate` with the spec (fp32), at a few positions
(:func:`check_positions`: 0, 1, the middle and the last of the engine's context). Each
(layer, position) is one :class:`RopeFigure`: :func:`rotation_error`, the largest
difference relative to the largest |K| of the engine's output, against a bound the caller
gives (the model dtype's rounding: ``recompute.gate.GateThresholds.for_dtype``). A layer
without a rotary module does not rotate, so its rotation is the identity: a mismatch with
any spec that rotates.

The same :func:`rotation_error` is what the blend correctness gate measures inside a
full forward (``integrations/vllm/gate.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from nopecache.kernels.api import rotate
from nopecache.kernels.rope_spec import RopeSpec

__all__ = [
    "EngineRotation",
    "RopeCheck",
    "RopeFigure",
    "check_positions",
    "check_rope",
    "relative_error",
    "rotation_error",
]

EngineRotation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""An engine layer's own rotation: ``(positions [n] int64, pre-RoPE K [n, kv_heads,
head_dim])`` -> post-RoPE K of the same shape and dtype (the input left unchanged)."""


def relative_error(described: torch.Tensor, engine: torch.Tensor) -> float:
    """Largest |described - engine| over the largest |engine| of two post-RoPE K tensors."""
    if described.shape != engine.shape:
        raise ValueError(
            f"described: shape {tuple(described.shape)} != the engine's {tuple(engine.shape)}"
        )
    scale = float(engine.float().abs().max()) or 1.0
    return float((described.float() - engine.float()).abs().max()) / scale


def rotation_error(
    pre_k: torch.Tensor, post_k: torch.Tensor, positions: torch.Tensor, spec: RopeSpec
) -> float:
    """:func:`relative_error` of ``spec``'s rotation (fp32) of pre-RoPE ``pre_k`` ``[n, heads,
    head_dim]`` to ``positions`` against the engine's ``post_k`` of the same K."""
    described = rotate(pre_k.float().contiguous(), None, positions, spec)
    return relative_error(described, post_k)


def check_positions(max_len: int) -> tuple[int, ...]:
    """Positions checked in a context of ``max_len`` tokens: 0, 1, the middle, the last."""
    if max_len < 1:
        raise ValueError(f"max_len: must be >= 1, got {max_len}")
    return tuple(sorted({p for p in (0, 1, max_len // 2, max_len - 1) if p < max_len}))


@dataclass(frozen=True, slots=True)
class RopeFigure:
    """One layer at one position: the spec's rotation against the engine's."""

    layer: str
    position: int
    error: float
    bound: float
    rotary: bool = True
    """False: the layer has no rotary module (it does not rotate)."""

    @property
    def passed(self) -> bool:
        """True when the error is within the bound."""
        return self.error <= self.bound

    def __str__(self) -> str:
        where = "" if self.rotary else " (no rotary embedding)"
        return (
            f"{self.layer}{where} at position {self.position}: error {self.error:.3e} "
            f"(bound {self.bound:.3e})"
        )


@dataclass(frozen=True, slots=True)
class RopeCheck:
    """Every figure of a check; it passes when each one does."""

    figures: tuple[RopeFigure, ...]

    @property
    def passed(self) -> bool:
        """True when every figure is within its bound."""
        return all(f.passed for f in self.figures)

    @property
    def failures(self) -> tuple[RopeFigure, ...]:
        """The figures over their bound."""
        return tuple(f for f in self.figures if not f.passed)

    @property
    def max_error(self) -> float:
        """The largest error measured (0 without figures)."""
        return max((f.error for f in self.figures), default=0.0)

    def summary(self) -> str:
        """One line: layers, positions, the largest error, the failures."""
        layers = len({f.layer for f in self.figures})
        positions = sorted({f.position for f in self.figures})
        bound = max((f.bound for f in self.figures), default=0.0)
        head = (
            f"RoPE check {'passed' if self.passed else 'failed'}: {layers} layers at "
            f"positions {positions}, largest error {self.max_error:.3e} (bound {bound:.3e})"
        )
        if self.passed:
            return head
        return f"{head}, {len(self.failures)} figures over the bound"

    def report(self) -> str:
        """Every figure, one line each (for the log)."""
        return "\n".join(str(f) for f in self.figures)


def check_rope(
    rotations: Mapping[str, EngineRotation | None],
    spec: RopeSpec,
    *,
    positions: Sequence[int],
    kv_heads: int,
    dtype: torch.dtype,
    bound: float,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> RopeCheck:
    """Each layer's own rotation (None: the layer does not rotate) against ``spec`` at
    ``positions``, on seeded random pre-RoPE K in ``dtype`` (see the module docstring)."""
    if not rotations:
        raise ValueError("rotations: the check needs at least one layer")
    gen = torch.Generator().manual_seed(seed)
    pre = torch.randn(len(positions), kv_heads, spec.head_dim, generator=gen)
    pre = pre.to(dtype=dtype, device=device)
    pos = torch.tensor(list(positions), dtype=torch.int64, device=device)
    figures: list[RopeFigure] = []
    for layer, rotation in rotations.items():
        post = pre.clone() if rotation is None else rotation(pos, pre.clone())
        for i, p in enumerate(positions):
            error = rotation_error(pre[i : i + 1], post[i : i + 1], pos[i : i + 1], spec)
            figures.append(RopeFigure(layer, int(p), error, bound, rotation is not None))
    return RopeCheck(tuple(figures))
