"""Triton RoPE kernels and their host wrappers (the path ``nopecache.kernels.api`` takes
for CUDA tensors; under ``TRITON_INTERPRET=1`` they also run on CPU tensors, which is how
the tests compare them with ``nopecache.kernels.reference``).

One kernel, ``_rope_rows_kernel``, serves all three entry points. A program owns a tile of
``BLOCK_T`` tokens x ``BLOCK_H`` heads (x one layer) and holds the rotated pairs of a head
row in registers::

    src row  | pass-through | x1 ........ | x2 ........ | pass-through |   neox
             | pass-through | x1 x2 x1 x2 ...           | pass-through |   gptj
             0          rotary_offset           rotary_offset + rotary_dim   head_dim

Angles are computed in the kernel from the integer positions (``to - from`` in int64,
then fp32 times ``inv_freq``), so no cos/sin table is read from memory; cos/sin of a token
are shared by the ``BLOCK_H`` heads of the tile. Each element of K and V is read once and
written once. Offsets are int64 (a paged cache easily exceeds 2**31 elements).

``rerope_scatter_layers_triton`` is one launch for all layers: the per-layer caches are
separate allocations, so the kernel reads each layer's cache base address from a small
int64 table (``data_ptr`` of every cache) and casts it back to a pointer. This works both
compiled and under the interpreter (the interpreter reads CPU memory at raw addresses).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from nopecache.kernels.api import (
    Positions,
    validate_rotate,
    validate_scatter,
    validate_scatter_layers,
)
from nopecache.kernels.reference import rotation_scale
from nopecache.kernels.rope_spec import RopeSpec

# Position modes (constexpr FROM_MODE / TO_MODE; the kernel spells them as literals):
# 0 = absent (the nope side), 1 = an int start + arange, 2 = a tensor per token.
_NONE, _START, _TENSOR = 0, 1, 2

# Elements of the rotated tile one program holds (x1 and x2 each): keeps registers in
# check on a GPU and the program count low under the interpreter.
_TILE_PAIRS = 2048
# Width of the pass-through / V copy loop.
_BLOCK_COPY = 64


# Triton reads parameter annotations (constexpr, type hints that change specialisation),
# so jit functions annotate constexprs only; mypy is told so per function.


@triton.jit
def _round_to(x, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """Round fp32 ``x`` to ``dtype``, to nearest even (as torch does)."""
    if dtype == tl.bfloat16:
        # By hand: the interpreter's own fp32 -> bf16 cast truncates, and one code path
        # for both keeps the interpreter tests meaningful for the compiled kernel.
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays NaN (torch's canonical one)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def _convert(x, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """``x`` in storage ``dtype``: unchanged bits if it already is, else rounded via fp32."""
    if x.dtype == dtype:
        return x
    else:
        return _round_to(x.to(tl.float32), dtype)


@triton.jit
def _rope_rows_kernel(  # type: ignore[no-untyped-def]
    src_ptr,  # K rows to rotate: [layers?, tokens, heads, head_dim], last dim dense
    dst_ptr,  # rotated K: out rows, or the (first layer's) paged cache viewed as rows
    dst_table_ptr,  # int64 [layers] base address of each layer's K cache (LAYERED only)
    v_src_ptr,  # V rows [layers?, tokens, heads, v_dim] (HAS_V only)
    v_dst_ptr,  # V cache rows (HAS_V only), first layer's when LAYERED
    v_dst_table_ptr,  # int64 [layers] base address of each layer's V cache (LAYERED and HAS_V)
    from_ptr,  # int32/int64 [tokens] source positions (FROM_MODE == _TENSOR)
    to_ptr,  # int32/int64 [tokens] target positions (TO_MODE == _TENSOR)
    from_start,  # first source position (FROM_MODE == _START)
    to_start,  # first target position (TO_MODE == _START)
    slot_ptr,  # int64 [tokens] destination row of each token, -1 = skip (HAS_SLOTS)
    inv_freq_ptr,  # fp32 [HALF] frequency of each rotated pair
    scale,  # fp32 factor on cos and sin (attention scaling in or out), HAS_SCALE only
    n_tokens,  # tokens in this call
    n_heads,  # KV heads
    head_dim,  # K row length
    v_dim,  # V row length (HAS_V)
    rot_offset,  # first rotated dim of a K row
    stride_src_l,  # src element strides: layer, token, head
    stride_src_t,
    stride_src_h,
    stride_dst_t,  # dst element strides: row (token or slot), head
    stride_dst_h,
    stride_v_src_l,  # V src element strides: layer, token, head
    stride_v_src_t,
    stride_v_src_h,
    stride_v_dst_t,  # V dst element strides: row (slot), head
    stride_v_dst_h,
    stride_from,  # element strides of from_ptr, to_ptr and slot_ptr
    stride_to,
    stride_slot,
    HALF: tl.constexpr,  # rotary_dim // 2
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    GPTJ: tl.constexpr,  # pairs are (2i, 2i+1) rather than (i, i + HALF)
    FROM_MODE: tl.constexpr,  # _NONE, _START or _TENSOR
    TO_MODE: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # multiply cos and sin by `scale`
    HAS_SLOTS: tl.constexpr,  # destination row = slot_ptr[token], else = token
    COPY_PASS: tl.constexpr,  # copy dims outside the rotated range (not needed in place)
    HAS_V: tl.constexpr,  # also copy V rows to the same destination rows
    LAYERED: tl.constexpr,  # program_id(2) is the layer; bases come from the tables
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_COPY: tl.constexpr,  # dims per step of the pass-through and V copy loops
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    head = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    tok_ok = tok < n_tokens
    head_ok = head < n_heads
    tok64 = tok.to(tl.int64)
    head64 = head.to(tl.int64)

    if LAYERED:
        layer = tl.program_id(2).to(tl.int64)
        src_base = src_ptr + layer * stride_src_l
        dst_base = tl.load(dst_table_ptr + layer).to(dst_ptr.dtype, bitcast=True)
    else:
        src_base = src_ptr
        dst_base = dst_ptr

    if HAS_SLOTS:
        row = tl.load(slot_ptr + tok64 * stride_slot, mask=tok_ok, other=-1)
        row_ok = tok_ok & (row >= 0)
    else:
        row = tok64
        row_ok = tok_ok

    # Integer position difference, then one fp32 conversion: the angle of a delta is
    # computed exactly like the angle of a plain position in the engine's RoPE.
    if TO_MODE == 2:  # _TENSOR
        delta = tl.load(to_ptr + tok64 * stride_to, mask=tok_ok, other=0).to(tl.int64)
    elif TO_MODE == 1:  # _START
        delta = to_start + tok64
    else:
        delta = tl.zeros([BLOCK_T], dtype=tl.int64)
    if FROM_MODE == 2:  # _TENSOR
        delta -= tl.load(from_ptr + tok64 * stride_from, mask=tok_ok, other=0).to(tl.int64)
    elif FROM_MODE == 1:  # _START
        delta -= from_start + tok64

    pair = tl.arange(0, HALF_PAD)
    pair_ok = pair < HALF
    inv_freq = tl.load(inv_freq_ptr + pair, mask=pair_ok, other=0.0)
    angle = delta.to(tl.float32)[:, None] * inv_freq[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    if HAS_SCALE:
        cos = cos * scale
        sin = sin * scale
    cos = cos[:, None, :]
    sin = sin[:, None, :]

    if GPTJ:
        d1 = rot_offset + 2 * pair
        d2 = d1 + 1
    else:
        d1 = rot_offset + pair
        d2 = d1 + HALF
    src_rows = src_base + tok64[:, None, None] * stride_src_t + head64[None, :, None] * stride_src_h
    dst_rows = dst_base + row[:, None, None] * stride_dst_t + head64[None, :, None] * stride_dst_h
    mask = tok_ok[:, None, None] & head_ok[None, :, None] & pair_ok[None, None, :]
    x1 = tl.load(src_rows + d1[None, None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_rows + d2[None, None, :], mask=mask, other=0.0).to(tl.float32)
    out_dtype = dst_ptr.dtype.element_ty
    store_mask = mask & row_ok[:, None, None]
    tl.store(
        dst_rows + d1[None, None, :], _round_to(x1 * cos - x2 * sin, out_dtype), mask=store_mask
    )
    tl.store(
        dst_rows + d2[None, None, :], _round_to(x2 * cos + x1 * sin, out_dtype), mask=store_mask
    )

    if COPY_PASS:
        row_mask = (tok_ok & row_ok)[:, None, None] & head_ok[None, :, None]
        rot_end = rot_offset + 2 * HALF
        for d0 in range(0, rot_offset, BLOCK_COPY):
            d = d0 + tl.arange(0, BLOCK_COPY)
            m = row_mask & (d < rot_offset)[None, None, :]
            x = tl.load(src_rows + d[None, None, :], mask=m)
            tl.store(dst_rows + d[None, None, :], _convert(x, out_dtype), mask=m)
        for d0 in range(rot_end, head_dim, BLOCK_COPY):
            d = d0 + tl.arange(0, BLOCK_COPY)
            m = row_mask & (d < head_dim)[None, None, :]
            x = tl.load(src_rows + d[None, None, :], mask=m)
            tl.store(dst_rows + d[None, None, :], _convert(x, out_dtype), mask=m)

    if HAS_V:
        if LAYERED:
            v_src_base = v_src_ptr + layer * stride_v_src_l
            v_dst_base = tl.load(v_dst_table_ptr + layer).to(v_dst_ptr.dtype, bitcast=True)
        else:
            v_src_base = v_src_ptr
            v_dst_base = v_dst_ptr
        v_out_dtype = v_dst_ptr.dtype.element_ty
        v_src_rows = (
            v_src_base
            + tok64[:, None, None] * stride_v_src_t
            + head64[None, :, None] * stride_v_src_h
        )
        v_dst_rows = (
            v_dst_base
            + row[:, None, None] * stride_v_dst_t
            + head64[None, :, None] * stride_v_dst_h
        )
        v_mask = row_ok[:, None, None] & head_ok[None, :, None]
        for d0 in range(0, v_dim, BLOCK_COPY):
            d = d0 + tl.arange(0, BLOCK_COPY)
            m = v_mask & (d < v_dim)[None, None, :]
            x = tl.load(v_src_rows + d[None, None, :], mask=m)
            tl.store(v_dst_rows + d[None, None, :], _convert(x, v_out_dtype), mask=m)


def rotate_triton(
    k: torch.Tensor,
    from_pos: Positions | None,
    to_pos: Positions | None,
    spec: RopeSpec,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``rotate``: K ``[tokens, heads, head_dim]`` from ``from_pos`` to ``to_pos``."""
    validate_rotate(k, from_pos, to_pos, spec, out)
    tokens = k.shape[0]
    if out is None:
        out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return out
    in_place = out.data_ptr() == k.data_ptr()
    _launch(
        spec=spec,
        src=k,
        dst_rows=out,
        from_pos=from_pos,
        to_pos=to_pos,
        scale=rotation_scale(from_pos, to_pos, spec),
        slots=None,
        copy_pass=not in_place,
    )
    return out


def rerope_scatter_triton(
    k_nope: torch.Tensor,
    v: torch.Tensor | None,
    positions: Positions,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    spec: RopeSpec,
) -> None:
    """Triton ``rerope_scatter``: rotate nope K to ``positions``, write K and V at the slots."""
    validate_scatter(k_nope, v, positions, slot_mapping, k_cache, v_cache, spec)
    if k_nope.shape[0] == 0:
        return
    _launch(
        spec=spec,
        src=k_nope,
        dst_rows=_rows(k_cache),
        from_pos=None,
        to_pos=positions,
        scale=spec.attention_scaling,
        slots=slot_mapping,
        copy_pass=True,
        v_src=v,
        v_dst_rows=None if v_cache is None else _rows(v_cache),
    )


def rerope_scatter_layers_triton(
    k_nope: torch.Tensor,
    v: torch.Tensor | None,
    positions: Positions,
    slot_mapping: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor] | None,
    spec: RopeSpec,
) -> None:
    """Triton ``rerope_scatter_layers``: all layers in one launch via a cache address table."""
    validate_scatter_layers(k_nope, v, positions, slot_mapping, k_caches, v_caches, spec)
    if k_nope.shape[1] == 0:
        return
    device = k_nope.device
    k_table = torch.tensor([c.data_ptr() for c in k_caches], dtype=torch.int64, device=device)
    v_table = (
        None
        if v_caches is None
        else torch.tensor([c.data_ptr() for c in v_caches], dtype=torch.int64, device=device)
    )
    _launch(
        spec=spec,
        src=k_nope,
        dst_rows=_rows(k_caches[0]),
        from_pos=None,
        to_pos=positions,
        scale=spec.attention_scaling,
        slots=slot_mapping,
        copy_pass=True,
        v_src=v,
        v_dst_rows=None if v_caches is None else _rows(v_caches[0]),
        dst_table=k_table,
        v_dst_table=v_table,
    )


@functools.lru_cache(maxsize=64)
def _inv_freq(spec: RopeSpec, device: torch.device) -> torch.Tensor:
    """``spec.inv_freq`` on ``device``, built once (not a host-to-device copy per call)."""
    return spec.inv_freq_tensor(device)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous paged cache ``[blocks, block_size, heads, dim]`` as ``[slots, heads, dim]``."""
    return cache.view(-1, cache.shape[2], cache.shape[3])


def _mode(pos: Positions | None) -> int:
    if pos is None:
        return _NONE
    return _START if isinstance(pos, int) else _TENSOR


def _launch(
    *,
    spec: RopeSpec,
    src: torch.Tensor,
    dst_rows: torch.Tensor,
    from_pos: Positions | None,
    to_pos: Positions | None,
    scale: float,
    slots: torch.Tensor | None,
    copy_pass: bool,
    v_src: torch.Tensor | None = None,
    v_dst_rows: torch.Tensor | None = None,
    dst_table: torch.Tensor | None = None,
    v_dst_table: torch.Tensor | None = None,
) -> None:
    """Pick tile sizes and launch ``_rope_rows_kernel`` over (tokens, heads[, layers])."""
    layered = dst_table is not None
    layers = src.shape[0] if layered else 1
    tokens, heads = src.shape[-3], src.shape[-2]
    half = spec.rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(heads), 16)
    block_t = max(1, min(_TILE_PAIRS // (block_h * half_pad), triton.next_power_of_2(tokens)))
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(heads, block_h), layers)
    has_v = v_src is not None and v_dst_rows is not None
    # Unused pointer arguments still need a tensor; any of the right device will do.
    inv_freq = _inv_freq(spec, src.device)
    from_t = from_pos if isinstance(from_pos, torch.Tensor) else inv_freq
    to_t = to_pos if isinstance(to_pos, torch.Tensor) else inv_freq
    slot_t = slots if slots is not None else inv_freq
    v_s = v_src if has_v and v_src is not None else src
    v_d = v_dst_rows if has_v and v_dst_rows is not None else dst_rows
    _rope_rows_kernel[grid](
        src,
        dst_rows,
        dst_table if dst_table is not None else inv_freq,
        v_s,
        v_d,
        v_dst_table if v_dst_table is not None else inv_freq,
        from_t,
        to_t,
        from_pos if isinstance(from_pos, int) else 0,
        to_pos if isinstance(to_pos, int) else 0,
        slot_t,
        inv_freq,
        float(scale),
        tokens,
        heads,
        spec.head_dim,
        v_s.shape[-1],
        spec.rotary_offset,
        src.stride(0) if layered else 0,
        src.stride(-3),
        src.stride(-2),
        dst_rows.stride(0),
        dst_rows.stride(1),
        v_s.stride(0) if layered else 0,
        v_s.stride(-3),
        v_s.stride(-2),
        v_d.stride(0),
        v_d.stride(1),
        from_t.stride(0),
        to_t.stride(0),
        slot_t.stride(0),
        HALF=half,
        HALF_PAD=half_pad,
        GPTJ=spec.layout == "gptj",
        FROM_MODE=_mode(from_pos),
        TO_MODE=_mode(to_pos),
        HAS_SCALE=scale != 1.0,
        HAS_SLOTS=slots is not None,
        COPY_PASS=copy_pass,
        HAS_V=has_v,
        LAYERED=layered,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_COPY=_BLOCK_COPY,
        enable_fp_fusion=False,
    )
