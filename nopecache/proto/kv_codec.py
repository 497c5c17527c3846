"""Compact stored forms of a block's payload: what ``kv_codec`` a client chose, and the math.

A codec trades exactness for bytes: a block stored with one is approximate KV (never a
bit-exact prefix; the fingerprint names the codec, so no key is shared with the block's
uncompressed form). The block header's ``dtype`` stays the engine's dtype: it is what the
payload decodes *to*; ``codec`` says how the payload holds it::

    codec   payload (C-contiguous, little-endian, in this order)
    none    K dtype [L, T, H, D]  | V dtype [L, T, H, Dv]
    fp8     K e4m3  [L, T, H, D]  | V e4m3  [L, T, H, Dv] | k_scale f32 [L, H] | v_scale f32 [L, H]
    k16v8   K dtype [L, T, H, D]  | V e4m3  [L, T, H, Dv]                      | v_scale f32 [L, H]

(L layers, T tokens, H KV heads; MLA has no V, so ``fp8`` holds K and ``k_scale`` only and
``k16v8`` does not apply.) e4m3 is ``torch.float8_e4m3fn``: finite range +-448, 3 mantissa
bits. One scale per layer and KV head of the block (``amax / 448`` over the block's tokens
and channels; 1.0 for an all-zero head), so a head with large values never flattens a
quiet one. Encoding computes in fp32: ``q = clamp(x / scale, +-448)`` cast with torch's
round-to-nearest-even; decoding is ``(q.float() * scale).to(dtype)``.

Why these two: fp8 halves a bf16 block (0.5 plus 8 bytes per layer and head); K16/V8 keeps
K exact, where attention scores are most sensitive (a rounding error in K moves every
softmax weight of the row; one in V moves only its own contribution), at 0.75 the bytes.

Nothing here needs torch until a tensor is encoded or decoded: the server sizes and checks
payloads with :func:`payload_layout` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "CODECS",
    "E4M3_MAX",
    "PayloadLayout",
    "decode_payload",
    "encode_tensors",
    "payload_layout",
]

CODECS: tuple[str, ...] = ("none", "fp8", "k16v8")
# The largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max).
E4M3_MAX = 448.0
_SCALE_BYTES = 4  # float32


class CodecError(ValueError):
    """A codec the payload cannot take (unknown name, a dtype or form it does not apply to)."""


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    """Byte sizes of a payload's parts, in payload order (K, V, k_scale, v_scale)."""

    k_nbytes: int
    v_nbytes: int
    k_scale_nbytes: int
    v_scale_nbytes: int

    @property
    def nbytes(self) -> int:
        """The whole payload's size."""
        return self.k_nbytes + self.v_nbytes + self.k_scale_nbytes + self.v_scale_nbytes


def payload_layout(
    codec: str, itemsize: int, shape: tuple[int, int, int, int], v_head_dim: int
) -> PayloadLayout:
    """The part sizes of a payload holding K ``shape`` (and V of ``v_head_dim``, 0: none)
    of ``itemsize``-byte elements under ``codec``; CodecError when it does not apply."""
    if codec not in CODECS:
        raise CodecError(f"codec: {codec!r} is not one of {list(CODECS)}")
    layers, tokens, heads, head_dim = shape
    k_elems = layers * tokens * heads * head_dim
    v_elems = layers * tokens * heads * v_head_dim
    if codec == "none":
        return PayloadLayout(itemsize * k_elems, itemsize * v_elems, 0, 0)
    if itemsize < 2:
        raise CodecError(f"codec: {codec} needs a 2- or 4-byte dtype, the block's is 1 byte")
    scales = _SCALE_BYTES * layers * heads
    if codec == "fp8":
        return PayloadLayout(k_elems, v_elems, scales, scales if v_head_dim else 0)
    if not v_head_dim:
        raise CodecError("codec: k16v8 needs V (a block without V, MLA, has nothing to shrink)")
    return PayloadLayout(itemsize * k_elems, v_elems, 0, scales)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [L, T, H, D] as e4m3 with one fp32 scale per layer and head ([L, H])."""
    import torch

    x = x.detach()
    # |x| and its max are exact in x's own dtype: no fp32 copy is needed for them.
    amax = x.abs().amax(dim=(1, 3)).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # One fp32 temporary (a copy even of fp32 K: the caller's tensor is never written),
    # divided and clamped in place; the cast rounds to nearest even.
    xf = x.to(torch.float32, copy=True).div_(scale[:, None, :, None])
    xf.clamp_(-E4M3_MAX, E4M3_MAX)
    return xf.to(torch.float8_e4m3fn), scale


def encode_tensors(codec: str, k: torch.Tensor, v: torch.Tensor | None) -> list[torch.Tensor]:
    """The payload's parts for K (and V) under ``codec``, in payload order, on K's device
    (``none``: K and V as given)."""
    if codec == "none":
        return [k] if v is None else [k, v]
    if k.element_size() < 2:
        raise CodecError(f"codec: {codec} needs a 2- or 4-byte dtype, the block's is {k.dtype}")
    if codec == "k16v8":
        if v is None:
            raise CodecError("codec: k16v8 needs V (a block without V, MLA, has nothing to shrink)")
        vq, v_scale = _quantize(v)
        return [k, vq, v_scale]
    if codec != "fp8":
        raise CodecError(f"codec: {codec!r} is not one of {list(CODECS)}")
    kq, k_scale = _quantize(k)
    if v is None:
        return [kq, k_scale]
    vq, v_scale = _quantize(v)
    return [kq, vq, k_scale, v_scale]


def _dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.float().mul_(scale[:, None, :, None]).to(dtype)


def decode_payload(
    codec: str,
    data: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, int, int, int],
    v_head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K and V in ``dtype`` from a payload's bytes ``data`` (1-D uint8, on any device; the
    result is on the same device): fresh tensors, except K of ``k16v8`` and both of
    ``none``, which view ``data``."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    lay = payload_layout(codec, itemsize, shape, v_head_dim)
    if data.numel() != lay.nbytes:
        raise CodecError(f"payload: {data.numel()} bytes, {codec} {list(shape)} needs {lay.nbytes}")
    layers, tokens, heads, _ = shape
    v_shape = (layers, tokens, heads, v_head_dim)
    at = 0

    def take(n: int) -> torch.Tensor:
        nonlocal at
        part = data[at : at + n]
        at += n
        return part

    def scales(n: int) -> torch.Tensor:
        # Tiny; cloned so that the fp32 view is aligned wherever the payload put them.
        return take(n).clone().view(torch.float32).view(layers, heads)

    k_raw, v_raw = take(lay.k_nbytes), take(lay.v_nbytes)
    e4m3 = torch.float8_e4m3fn
    if codec == "fp8":
        k = _dequantize(k_raw.view(e4m3).view(shape), scales(lay.k_scale_nbytes), dtype)
    else:
        k = k_raw.view(dtype).view(shape)
    if not v_head_dim:
        return k, None
    if codec == "none":
        return k, v_raw.view(dtype).view(v_shape)
    return k, _dequantize(v_raw.view(e4m3).view(v_shape), scales(lay.v_scale_nbytes), dtype)
