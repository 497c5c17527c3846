"""Triton RoPE kernels and their host wrappers (the path ``nopecache.kernels.api`` takes
for CUDA tensors; under ``TRITON_INTERPRET=1`` they also run on CPU tensors, which is how
the tests compare them with ``nopecache.kernels.reference``).

One kernel, ``_rope_rows_kernel``, serves all three entry points. A program owns a tile of
``BLOCK_T`` tokens x ``BLOCK_H`` heads (x one layer). It computes cos/sin of the tile's
``[BLOCK_T, rotary_dim / 2]`` angles once, then walks its heads one at a time, holding a
head's rotated pairs in registers::

    src row  | pass-through | x1 ........ | x2 ........ | pass-through |   neox
             | pass-through | x1 x2 x1 x2 ...           | pass-through |   gptj
             0          rotary_offset           rotary_offset + rotary_dim   head_dim

Every access to a row is contiguous and 128 bits wide where the row allows it (gptj rows
are loaded whole and split into pairs in registers); a head's V row is loaded before its
K math so that both loads are in flight together. Angles are computed in the kernel from
the integer positions (``to - from`` in int64, then fp32 times ``inv_freq``), reduced by
pi/2 in fp64 and evaluated by fp32 polynomials (``_sincos``), so no cos/sin table is read
from memory. Each element of K and V is read once and written once. Offsets are int64 (a
paged cache easily exceeds 2**31 elements). ``tests/kernels/test_kernels_sass.py`` pins what the
compiled kernels look like on sm_90.

``rerope_scatter_layers_triton`` is one launch for all layers: the per-layer caches are
separate allocations, so the kernel reads each layer's cache base address from a small
int64 table (``data_ptr`` of every cache) and casts it back to a pointer. This works both
compiled and under the interpreter (the interpreter reads CPU memory at raw addresses).
The table carries no alignment, so the host checks ``data_ptr() % 16`` of every cache and
the kernel asserts it with ``tl.multiple_of`` (``ALIGNED``): without it every cache write
was a 16-bit store.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass

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

# K elements of one head step of a program (see ``tile_for``).
_TILE_ELEMENTS = 2048
# Widest step of the pass-through / V copies (128 dims: one 128-bit access per thread
# per 8 rows of bf16 at 4 warps, and a whole Llama V row per step).
_BLOCK_COPY = 128


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


# Reduction of an angle by pi/2 in two parts (Cody-Waite): _PIO2_HI has 22 significant
# bits, so k * _PIO2_HI is exact in fp64 for every |k| < 2**31 (all angles the API admits).
_TWO_OVER_PI = tl.constexpr(0.6366197723675814)
_PIO2_HI = tl.constexpr(1.5707964897155762)
_PIO2_LO = tl.constexpr(-1.629206795526437e-07)


@triton.jit
def _sincos(angle):  # type: ignore[no-untyped-def]
    """(sin, cos) of fp32 ``angle``: reduced to [-pi/4, pi/4] in fp64, then fp32 polynomials.

    libdevice's sinf/cosf switch to a slow path (a table walk in local memory) beyond
    ~1e5 radians, which RoPE angles reach at long positions; this reduction is exact for
    any angle, branch-free, and evaluates identically under the interpreter.
    """
    x = angle.to(tl.float64)
    k = tl.floor(x * _TWO_OVER_PI + 0.5)
    r = ((x - k * _PIO2_HI) - k * _PIO2_LO).to(tl.float32)
    q = k.to(tl.int32)
    z = r * r
    # Minimax polynomials for |r| <= pi/4 (the classic single-precision coefficients).
    s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    c = (1.0 - 0.5 * z) + z * z * (
        4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5)
    )
    swap = (q & 1) != 0
    sin = tl.where(swap, c, s)
    cos = tl.where(swap, s, c)
    sin = tl.where((q & 2) != 0, -sin, sin)
    cos = tl.where(((q + 1) & 2) != 0, -cos, cos)
    return sin, cos


@triton.jit
def _copy_dims(  # type: ignore[no-untyped-def]
    src_rows,  # [BLOCK_T] pointers to the first element of each source row
    dst_rows,  # [BLOCK_T] pointers to the first element of each destination row
    row_mask,  # [BLOCK_T] which rows to copy
    START: tl.constexpr,  # first dim to copy
    STOP: tl.constexpr,  # one past the last dim
    BLOCK: tl.constexpr,  # dims per step
):
    """Copy dims ``[START, STOP)`` of each row, converting to the destination dtype."""
    out_dtype = dst_rows.dtype.element_ty
    for d0 in tl.static_range(START, STOP, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        # (The interpreter needs a mask of the full shape; compiled, the dim test folds.)
        m = row_mask[:, None] & (d < STOP)[None, :]
        x = tl.load(src_rows[:, None] + d[None, :], mask=m, eviction_policy="evict_first")
        tl.store(dst_rows[:, None] + d[None, :], _convert(x, out_dtype), mask=m)


# Scalars that change per call (lengths, starts) are not specialised on: a new value must
# not compile a new variant in the serving path. Nor is the alignment of the per-token
# index arrays (a slot mapping sliced at an odd token is 8-byte aligned): only their
# elements are read. Strides and the row pointers are, for 128-bit accesses.
@triton.jit(
    do_not_specialize=["from_start", "to_start", "n_tokens", "n_slots"],
    do_not_specialize_on_alignment=[
        "dst_table_ptr",
        "v_dst_table_ptr",
        "from_ptr",
        "to_ptr",
        "slot_ptr",
        "inv_freq_ptr",
    ],
)
def _rope_rows_kernel(  # type: ignore[no-untyped-def]
    src_ptr,  # K rows to rotate: [layers?, tokens, heads, HEAD_DIM], last dim dense
    dst_ptr,  # rotated K: out rows, or the (first layer's) paged cache viewed as rows
    dst_table_ptr,  # int64 [layers] base address of each layer's K cache (LAYERED only)
    v_src_ptr,  # V rows [layers?, tokens, heads, V_DIM] (HAS_V only)
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
    n_slots,  # destination rows per layer: slots outside [0, n_slots) are skipped
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
    HEAD_DIM: tl.constexpr,  # K row length
    V_DIM: tl.constexpr,  # V row length (HAS_V)
    ROT_OFFSET: tl.constexpr,  # first rotated dim of a K row
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
    ALIGNED: tl.constexpr,  # every table address is a multiple of 16 bytes
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # heads per program (a loop: cos/sin are computed once for all)
    BLOCK_COPY: tl.constexpr,  # dims per step of the pass-through and V copies
):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < n_tokens
    tok64 = tok.to(tl.int64)

    if LAYERED:
        layer = tl.program_id(2).to(tl.int64)
        src_base = src_ptr + layer * stride_src_l
        dst_base = tl.load(dst_table_ptr + layer).to(dst_ptr.dtype, bitcast=True)
        if ALIGNED:
            # The table's int64 carries no alignment; the host checked data_ptr() % 16 of
            # every cache, and this lets the cache writes be 128-bit stores.
            dst_base = tl.multiple_of(dst_base, 16)
        if HAS_V:
            v_src_base = v_src_ptr + layer * stride_v_src_l
            v_dst_base = tl.load(v_dst_table_ptr + layer).to(v_dst_ptr.dtype, bitcast=True)
            if ALIGNED:
                v_dst_base = tl.multiple_of(v_dst_base, 16)
    else:
        src_base = src_ptr
        dst_base = dst_ptr
        if HAS_V:
            v_src_base = v_src_ptr
            v_dst_base = v_dst_ptr

    if HAS_SLOTS:
        row = tl.load(slot_ptr + tok64 * stride_slot, mask=tok_ok, other=-1)
        # A bounds check in the kernel keeps a bad slot from writing out of the cache when
        # the caller skipped the host-side value checks (they cost a device sync).
        row_ok = tok_ok & (row >= 0) & (row < n_slots)
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

    # cos/sin of the tile [BLOCK_T, HALF_PAD], computed once and reused by every head below.
    pair = tl.arange(0, HALF_PAD)
    pair_ok = pair < HALF
    inv_freq = tl.load(inv_freq_ptr + pair, mask=pair_ok, other=0.0)
    angle = delta.to(tl.float32)[:, None] * inv_freq[None, :]
    sin, cos = _sincos(angle)
    if HAS_SCALE:
        cos = cos * scale
        sin = sin * scale
    out_dtype = dst_ptr.dtype.element_ty
    if HAS_V:
        v_out_dtype = v_dst_ptr.dtype.element_ty

    for h in tl.static_range(BLOCK_H):
        head = pid_h * BLOCK_H + h
        head64 = head.to(tl.int64)
        # A [BLOCK_T] test: the interpreter would turn a scalar one into an int32 mask.
        ok = row_ok & ((tok * 0 + head) < n_heads)
        src_rows = src_base + tok64 * stride_src_t + head64 * stride_src_h
        dst_rows = dst_base + row * stride_dst_t + head64 * stride_dst_h

        if HAS_V:
            # V first: its loads are in flight while K is rotated.
            v_src_rows = v_src_base + tok64 * stride_v_src_t + head64 * stride_v_src_h
            v_dst_rows = v_dst_base + row * stride_v_dst_t + head64 * stride_v_dst_h
            v_d = tl.arange(0, BLOCK_COPY)
            v_m = ok[:, None] & (v_d < V_DIM)[None, :]
            v_first = tl.load(
                v_src_rows[:, None] + v_d[None, :], mask=v_m, eviction_policy="evict_first"
            )

        if GPTJ:
            # Pairs are adjacent: one contiguous load of the rotated dims, split in registers.
            d = ROT_OFFSET + tl.arange(0, 2 * HALF_PAD)
            m = ok[:, None] & (d < ROT_OFFSET + 2 * HALF)[None, :]
            x = tl.load(
                src_rows[:, None] + d[None, :], mask=m, other=0.0, eviction_policy="evict_first"
            )
            x1, x2 = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_T, HALF_PAD, 2)))
            y1 = _round_to(x1 * cos - x2 * sin, out_dtype)
            y2 = _round_to(x2 * cos + x1 * sin, out_dtype)
            y = tl.reshape(tl.join(y1, y2), (BLOCK_T, 2 * HALF_PAD))
            tl.store(dst_rows[:, None] + d[None, :], y, mask=m)
        else:
            d1 = ROT_OFFSET + pair
            m = ok[:, None] & pair_ok[None, :]
            x1 = tl.load(
                src_rows[:, None] + d1[None, :], mask=m, other=0.0, eviction_policy="evict_first"
            ).to(tl.float32)
            x2 = tl.load(
                src_rows[:, None] + (d1 + HALF)[None, :],
                mask=m,
                other=0.0,
                eviction_policy="evict_first",
            ).to(tl.float32)
            tl.store(
                dst_rows[:, None] + d1[None, :], _round_to(x1 * cos - x2 * sin, out_dtype), mask=m
            )
            tl.store(
                dst_rows[:, None] + (d1 + HALF)[None, :],
                _round_to(x2 * cos + x1 * sin, out_dtype),
                mask=m,
            )

        if COPY_PASS:
            if ROT_OFFSET > 0:
                _copy_dims(src_rows, dst_rows, ok, 0, ROT_OFFSET, BLOCK_COPY)
            if ROT_OFFSET + 2 * HALF < HEAD_DIM:
                _copy_dims(src_rows, dst_rows, ok, ROT_OFFSET + 2 * HALF, HEAD_DIM, BLOCK_COPY)

        if HAS_V:
            tl.store(v_dst_rows[:, None] + v_d[None, :], _convert(v_first, v_out_dtype), mask=v_m)
            if BLOCK_COPY < V_DIM:
                _copy_dims(v_src_rows, v_dst_rows, ok, BLOCK_COPY, V_DIM, BLOCK_COPY)


def rotate_triton(
    k: torch.Tensor,
    from_pos: Positions | None,
    to_pos: Positions | None,
    spec: RopeSpec,
    out: torch.Tensor | None = None,
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """Triton ``rotate``: K ``[tokens, heads, head_dim]`` from ``from_pos`` to ``to_pos``."""
    validate_rotate(k, from_pos, to_pos, spec, out, check_values=check_values)
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
    *,
    check_values: bool = True,
) -> None:
    """Triton ``rerope_scatter``: rotate nope K to ``positions``, write K and V at the slots."""
    validate_scatter(
        k_nope, v, positions, slot_mapping, k_cache, v_cache, spec, check_values=check_values
    )
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
    *,
    from_positions: Positions | None = None,
    check_values: bool = True,
) -> None:
    """Triton ``rerope_scatter_layers``: all layers in one launch via a cache address table.

    ``from_positions`` (post-RoPE K, see ``api.rerope_scatter_layers``): equal int starts
    launch with no positions at all (delta 0: cos 1, sin 0, no scaling).
    """
    validate_scatter_layers(
        k_nope,
        v,
        positions,
        slot_mapping,
        k_caches,
        v_caches,
        spec,
        from_positions=from_positions,
        check_values=check_values,
    )
    if k_nope.shape[1] == 0:
        return
    k_ptrs = tuple(c.data_ptr() for c in k_caches)
    v_ptrs = None if v_caches is None else tuple(c.data_ptr() for c in v_caches)
    # 128-bit cache writes need 16-byte aligned bases (any allocator's tensors are; a view
    # at an odd offset is not): otherwise the kernel variant without the hint, one element
    # per store.
    aligned = all(p % 16 == 0 for p in k_ptrs + (v_ptrs or ()))
    from_pos: Positions | None = from_positions
    to_pos: Positions | None = positions
    scale = spec.attention_scaling
    if from_positions is not None:
        scale = 1.0  # post-RoPE K carries the factor already
        if isinstance(from_positions, int) and from_positions == positions:
            from_pos = to_pos = None  # same positions: a copy (angle 0)
    _launch(
        spec=spec,
        src=k_nope,
        dst_rows=_rows(k_caches[0]),
        from_pos=from_pos,
        to_pos=to_pos,
        scale=scale,
        slots=slot_mapping,
        copy_pass=True,
        v_src=v,
        v_dst_rows=None if v_caches is None else _rows(v_caches[0]),
        dst_table=_address_table(k_ptrs, k_nope.device),
        v_dst_table=None if v_ptrs is None else _address_table(v_ptrs, k_nope.device),
        aligned=aligned,
    )


def warm_up(
    spec: RopeSpec,
    dtype: torch.dtype,
    num_kv_heads: int,
    v_head_dim: int,
    device: torch.device,
) -> None:
    """Compile the kernel variants placement and store launch, before the first request.

    The variants depend on the model (spec, dtype, heads, dims), never on token counts or
    positions (those scalars are not specialised on), so a one-token launch of each on a
    scratch cache compiles exactly what serving will run.
    """
    layers, blocks = 2, 1
    k = torch.zeros((layers, 1, num_kv_heads, spec.head_dim), dtype=dtype, device=device)
    v = (
        torch.zeros((layers, 1, num_kv_heads, v_head_dim), dtype=dtype, device=device)
        if v_head_dim
        else None
    )
    k_caches = [torch.zeros((blocks, 16, *k.shape[2:]), dtype=dtype, device=device)] * layers
    v_caches = (
        None
        if v is None
        else [torch.zeros((blocks, 16, *v.shape[2:]), dtype=dtype, device=device)] * layers
    )
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    rerope_scatter_layers_triton(k, v, 0, slots, k_caches, v_caches, spec, check_values=False)
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    rotate_triton(k[0], positions, None, spec, out=k[0], check_values=False)  # un-RoPE on store
    rotate_triton(k[0], 0, 1, spec, out=k[1], check_values=False)  # ROPE block, moved


@functools.lru_cache(maxsize=64)
def _inv_freq(spec: RopeSpec, device: torch.device) -> torch.Tensor:
    """``spec.inv_freq`` on ``device``, built once (not a host-to-device copy per call)."""
    return spec.inv_freq_tensor(device)


@functools.lru_cache(maxsize=64)
def _address_table(ptrs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 device tensor of cache base addresses, built once per set of caches.

    Rebuilding it per call would be a host-to-device copy (and a sync) per block placed;
    an engine's caches live as long as the engine, so the same table serves every call.
    A table only holds addresses: it stays right even if a freed cache's address is
    reused by a new allocation.
    """
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous paged cache ``[blocks, block_size, heads, dim]`` as ``[slots, heads, dim]``."""
    return cache.view(-1, cache.shape[2], cache.shape[3])


def _mode(pos: Positions | None) -> int:
    if pos is None:
        return _NONE
    return _START if isinstance(pos, int) else _TENSOR


@dataclass(frozen=True, slots=True)
class Tile:
    """Launch shape of one kernel variant: tokens and heads per program, warps per program."""

    block_t: int
    block_h: int
    num_warps: int
    block_copy: int


def tile_for(spec: RopeSpec, heads: int, v_dim: int) -> Tile:
    """The tile for a model's shapes (never for a token count: no recompile per call size).

    Each program rotates ``block_t`` tokens of ``block_h`` heads, one head at a time, with
    cos/sin computed once for the tile. A head step moves ``block_t * rotary_dim`` K
    elements: 16 tokens of a 128-dim head is 2048 elements, 16 per thread of 4 warps,
    two 128-bit accesses each for K and for V, about 60 registers: enough programs stay
    resident per SM to keep the ~25 KB in flight that HBM3 needs per SM. Up to 8 heads share
    one cos/sin tile (all of Llama-3's KV heads): the sincos work per element is 1/8.
    Chosen from those counts, not yet from a sweep on a GPU (``bench/kernels.py --sweep``).
    """
    half_pad = triton.next_power_of_2(spec.rotary_dim // 2)
    block_t = max(1, min(64, _TILE_ELEMENTS // (2 * half_pad)))
    widest = max(v_dim, spec.head_dim - spec.rotary_dim, 1)
    block_copy = min(_BLOCK_COPY, triton.next_power_of_2(widest))
    return Tile(block_t=block_t, block_h=min(heads, 8), num_warps=4, block_copy=block_copy)


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
    aligned: bool = True,
    tile: Tile | None = None,
) -> None:
    """Launch ``_rope_rows_kernel`` over (tokens, heads[, layers]) on ``src``'s device."""
    layered = dst_table is not None
    layers = src.shape[0] if layered else 1
    tokens, heads = src.shape[-3], src.shape[-2]
    has_v = v_src is not None and v_dst_rows is not None
    v_dim = v_src.shape[-1] if has_v and v_src is not None else 0
    tile = tile or tile_for(spec, heads, v_dim)
    grid = (triton.cdiv(tokens, tile.block_t), triton.cdiv(heads, tile.block_h), layers)
    # Unused pointer arguments still need a tensor; any of the right device will do.
    inv_freq = _inv_freq(spec, src.device)
    from_t = from_pos if isinstance(from_pos, torch.Tensor) else inv_freq
    to_t = to_pos if isinstance(to_pos, torch.Tensor) else inv_freq
    slot_t = slots if slots is not None else inv_freq
    v_s = v_src if has_v and v_src is not None else src
    v_d = v_dst_rows if has_v and v_dst_rows is not None else dst_rows
    # Launch on the tensors' device (Triton launches on the *current* device, which on a
    # worker thread is device 0 whatever the tensors' device is), on its current stream.
    with _on_device(src.device):
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
            dst_rows.shape[0],
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
            HEAD_DIM=spec.head_dim,
            V_DIM=v_dim,
            ROT_OFFSET=spec.rotary_offset,
            HALF=spec.rotary_dim // 2,
            HALF_PAD=triton.next_power_of_2(spec.rotary_dim // 2),
            GPTJ=spec.layout == "gptj",
            FROM_MODE=_mode(from_pos),
            TO_MODE=_mode(to_pos),
            HAS_SCALE=scale != 1.0,
            HAS_SLOTS=slots is not None,
            COPY_PASS=copy_pass,
            HAS_V=has_v,
            LAYERED=layered,
            ALIGNED=aligned,
            BLOCK_T=tile.block_t,
            BLOCK_H=tile.block_h,
            BLOCK_COPY=tile.block_copy,
            num_warps=tile.num_warps,
            enable_fp_fusion=False,
        )


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.device(device)`` for a CUDA device; nothing for the interpreter's CPU."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
