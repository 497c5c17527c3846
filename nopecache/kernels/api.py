"""Public RoPE kernels: rotate K between positions, and scatter it into a paged KV cache.

Every entry point takes the same arguments on every device. CUDA tensors run the Triton
kernels of ``nopecache.kernels.triton_rope``; tensors on any other device run the plain-torch
code of ``nopecache.kernels.reference``. Arguments are validated here, once per call, and
a bad one raises ``ValueError`` whose message starts with the argument's name.

Positions
    ``Positions`` is either a 1-D int32/int64 tensor with one position per token, or an
    ``int`` ``start`` meaning ``start + arange(tokens)`` (generated inside the kernel, so a
    contiguous run needs no index tensor). Positions lie in ``[0, MAX_POSITION]``.

One rotation, fp32
    ``rotate`` turns K at ``from_pos`` into K at ``to_pos`` with a single rotation by the
    angle ``(to - from) * inv_freq``: the position difference is taken in integers, then
    multiplied by the fp32 frequencies, and cos/sin are evaluated in fp32. K is never
    un-rotated and re-rotated on the way (each extra rotation adds a rounding).

Attention scaling (YaRN mscale, LongRoPE factor)
    Hugging Face multiplies cos and sin by ``spec.attention_scaling`` for q and for k, so a
    post-RoPE K carries that factor exactly once, while nope K carries none. Factors do not
    compose across two rotations (rotating post-RoPE K again must not scale it again), so
    ``rotate`` rotates the unscaled form and applies the factor by what the ends are:

    ==========================  ==========================  ===========================
    from_pos                    to_pos                      K is multiplied by
    ==========================  ==========================  ===========================
    ``None`` (nope K)           positions (post-RoPE K)     ``attention_scaling``
    positions (post-RoPE K)     ``None`` (nope K)           ``1 / attention_scaling``
    positions                   positions                   nothing (factor kept as is)
    ==========================  ==========================  ===========================

Value checks and device syncs
    Shapes, dtypes, devices and int starts are checked on the host at no device cost. The
    range of a position or slot *tensor* needs its values: on CUDA that is one
    device-to-host copy per call (all tensors of the call at once), a sync that stalls
    the launching thread. ``check_values=False`` skips it for callers that checked once
    (``PagedKV`` checks its slot mapping when built): the kernel then still skips any slot
    outside ``[0, num_slots)`` instead of writing out of the cache, and a position outside
    ``[0, MAX_POSITION]`` gives wrong K for that token, never a bad memory access. CPU
    tensors are always checked (no sync to save).

Dims outside ``[spec.rotary_offset, spec.rotary_offset + spec.rotary_dim)`` (partial
rotary, the MLA latent) are copied through unchanged and unscaled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nopecache.kernels import reference
from nopecache.kernels.rope_spec import RopeSpec

Positions = torch.Tensor | int
"""A 1-D int tensor with one position per token, or ``start`` of ``start + arange(tokens)``."""

MAX_POSITION = 2**31 - 1
"""Largest position accepted (kernels hold positions and their differences in int32/int64)."""

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_POSITION_DTYPES = (torch.int32, torch.int64)


def rotate(
    k: torch.Tensor,
    from_pos: Positions | None,
    to_pos: Positions | None,
    spec: RopeSpec,
    out: torch.Tensor | None = None,
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """Rotate K ``[tokens, kv_heads, head_dim]`` from ``from_pos`` to ``to_pos``; ``None`` = nope.

    ``check_values=False`` skips the range check of position tensors on CUDA (see the
    module docstring); CPU tensors are always checked.
    """
    if _on_cuda(k):
        from nopecache.kernels.triton_rope import rotate_triton

        return rotate_triton(k, from_pos, to_pos, spec, out, check_values=check_values)
    validate_rotate(k, from_pos, to_pos, spec, out)
    return reference.rotate_reference(k, from_pos, to_pos, spec, out)


def rerope_scatter(
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
    """Rotate nope K to ``positions`` and write K and V into a paged cache at ``slot_mapping``.

    ``k_nope`` ``[tokens, kv_heads, head_dim]``, ``v`` ``[tokens, kv_heads, v_dim]``; the
    caches are vLLM's per-layer ``[num_blocks, block_size, kv_heads, dim]``, contiguous,
    of any float dtype (values are rounded to it). ``slot_mapping`` is int64 ``[tokens]``,
    ``slot = block * block_size + offset``, ``-1`` = skip the token. Slots must be
    distinct (which write wins for a repeated slot is unspecified). ``v`` and ``v_cache``
    are ``None`` for an MLA latent cache. Each element is read once and written once.
    """
    if _on_cuda(k_nope):
        from nopecache.kernels.triton_rope import rerope_scatter_triton

        rerope_scatter_triton(
            k_nope, v, positions, slot_mapping, k_cache, v_cache, spec, check_values=check_values
        )
        return
    validate_scatter(k_nope, v, positions, slot_mapping, k_cache, v_cache, spec, allow_strided=True)
    reference.rerope_scatter_reference(k_nope, v, positions, slot_mapping, k_cache, v_cache, spec)


def rerope_scatter_layers(
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
    """``rerope_scatter`` for all layers ``[layers, tokens, ...]`` into per-layer caches.

    ``k_caches`` (and ``v_caches``) hold one cache per layer, all of one shape, dtype and
    strides; on CUDA this is a single kernel launch (the caches' base addresses go in a
    table) and each cache must be contiguous. Off CUDA a cache may be any strided view
    ``[num_blocks, block_size, kv_heads, dim]`` of an engine's own layout (vLLM's CPU
    attention pages hold K transposed: a view with head_dim stride ``block_size``).

    ``from_positions``: None when ``k_nope`` is nope K (the default); else K is post-RoPE
    at those positions and is rotated once by ``positions - from_positions``, with no
    attention-scaling factor applied (it carries one already). Equal int starts are a
    copy: off CUDA a bit-exact one; on CUDA a rotation by angle 0 (``cos = 1``,
    ``sin = 0`` exactly), which reproduces every finite value (a zero may change sign).
    """
    args = (k_nope, v, positions, slot_mapping, k_caches, v_caches, spec)
    if _on_cuda(k_nope):
        from nopecache.kernels.triton_rope import rerope_scatter_layers_triton

        rerope_scatter_layers_triton(
            *args, from_positions=from_positions, check_values=check_values
        )
        return
    # check_values=False (the caller checked slots and positions, as PagedKV does): no
    # min/max pass over the slot mapping per call off CUDA either.
    validate_scatter_layers(
        *args, from_positions=from_positions, allow_strided=True, check_values=check_values
    )
    reference.rerope_scatter_layers_reference(*args, from_positions=from_positions)


# --------------------------------------------------------------------------- validation


def validate_rotate(
    k: torch.Tensor,
    from_pos: Positions | None,
    to_pos: Positions | None,
    spec: RopeSpec,
    out: torch.Tensor | None,
    *,
    check_values: bool = True,
) -> None:
    """Raise ``ValueError`` naming the first argument of ``rotate`` that is not acceptable."""
    _check_spec(spec)
    _check_float_tensor("k", k, 3)
    _check_rows("k", k)
    tokens = k.shape[0]
    if k.shape[2] != spec.head_dim:
        raise ValueError(f"k: last dim {k.shape[2]} != spec.head_dim {spec.head_dim}")
    if from_pos is None and to_pos is None:
        raise ValueError("from_pos: from_pos and to_pos are both None (nope to nope)")
    ranges: list[_Range] = []
    _check_positions("from_pos", from_pos, tokens, k.device, ranges, allow_none=True)
    _check_positions("to_pos", to_pos, tokens, k.device, ranges, allow_none=True)
    if out is not None:
        _check_float_tensor("out", out, 3)
        if out.shape != k.shape or out.dtype != k.dtype or out.device != k.device:
            raise ValueError(
                f"out: {_describe(out)} does not match k {_describe(k)} in shape/dtype/device"
            )
        _check_rows("out", out)
        if not _same_view(out, k) and _overlap(out, k):
            raise ValueError("out: overlaps k without being the same view (in place needs out=k)")
    if check_values:
        _check_ranges(ranges)


def validate_scatter(
    k_nope: torch.Tensor,
    v: torch.Tensor | None,
    positions: Positions,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    spec: RopeSpec,
    *,
    check_values: bool = True,
    allow_strided: bool = False,
) -> None:
    """Raise ``ValueError`` naming the first argument of ``rerope_scatter`` not acceptable.

    ``allow_strided``: caches may be strided views (the torch path writes through them; the
    Triton kernel needs contiguous ones).
    """
    _check_spec(spec)
    _check_float_tensor("k_nope", k_nope, 3)
    _check_rows("k_nope", k_nope)
    if v is not None:
        _check_float_tensor("v", v, 3)
        _check_rows("v", v)
    _check_scatter_common(
        k_nope,
        v,
        positions,
        slot_mapping,
        [k_cache],
        None if v_cache is None else [v_cache],
        spec,
        check_values,
        allow_strided=allow_strided,
    )


def validate_scatter_layers(
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
    allow_strided: bool = False,
) -> None:
    """Raise ``ValueError`` naming the first argument of ``rerope_scatter_layers`` not acceptable
    (``allow_strided``: as in ``validate_scatter``)."""
    _check_spec(spec)
    _check_float_tensor("k_nope", k_nope, 4)
    _check_rows("k_nope", k_nope)
    layers = k_nope.shape[0]
    if v is not None:
        _check_float_tensor("v", v, 4)
        _check_rows("v", v)
        if v.shape[0] != layers:
            raise ValueError(f"v: {v.shape[0]} layers, k_nope has {layers}")
    if isinstance(k_caches, torch.Tensor) or not isinstance(k_caches, Sequence):
        raise ValueError("k_caches: must be a sequence of per-layer cache tensors")
    if len(k_caches) != layers:
        raise ValueError(f"k_caches: {len(k_caches)} caches for {layers} layers of k_nope")
    if v_caches is not None:
        if isinstance(v_caches, torch.Tensor) or not isinstance(v_caches, Sequence):
            raise ValueError("v_caches: must be a sequence of per-layer cache tensors or None")
        if len(v_caches) != layers:
            raise ValueError(f"v_caches: {len(v_caches)} caches for {layers} layers of k_nope")
    _check_scatter_common(
        k_nope,
        v,
        positions,
        slot_mapping,
        list(k_caches),
        None if v_caches is None else list(v_caches),
        spec,
        check_values,
        from_positions=from_positions,
        allow_strided=allow_strided,
    )


# --------------------------------------------------------------------------- helpers


def _on_cuda(t: object) -> bool:
    """Whether to take the Triton path (anything else, bad arguments included, is checked
    and run by the torch path)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


# (argument name, tensor, lowest allowed, highest allowed): checked together so that a
# CUDA caller pays for one device synchronisation, not one per tensor.
_Range = tuple[str, torch.Tensor, int, int]


def _check_scatter_common(
    k_nope: torch.Tensor,
    v: torch.Tensor | None,
    positions: Positions,
    slot_mapping: torch.Tensor,
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor] | None,
    spec: RopeSpec,
    check_values: bool,
    *,
    from_positions: Positions | None = None,
    allow_strided: bool = False,
) -> None:
    """Checks shared by the one-layer and the all-layers scatter (leading layer dim aside)."""
    tokens, heads, head_dim = k_nope.shape[-3:]
    if head_dim != spec.head_dim:
        raise ValueError(f"k_nope: last dim {head_dim} != spec.head_dim {spec.head_dim}")
    if v is not None:
        if v.shape[-3:-1] != (tokens, heads):
            raise ValueError(f"v: shape {tuple(v.shape)} does not match k_nope's tokens and heads")
        if v.device != k_nope.device:
            raise ValueError(f"v: on {v.device}, k_nope on {k_nope.device}")
    if (v is None) != (v_caches is None):
        raise ValueError(
            "v_cache: must be given exactly when v is (None for MLA, where the latent holds all)"
        )
    ranges: list[_Range] = []
    _check_positions("positions", positions, tokens, k_nope.device, ranges, allow_none=False)
    _check_positions(
        "from_positions", from_positions, tokens, k_nope.device, ranges, allow_none=True
    )
    if not isinstance(slot_mapping, torch.Tensor):
        raise ValueError(f"slot_mapping: expected a tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping: dtype must be torch.int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping: shape {tuple(slot_mapping.shape)}, expected ({tokens},)")
    if slot_mapping.device != k_nope.device:
        raise ValueError(f"slot_mapping: on {slot_mapping.device}, k_nope on {k_nope.device}")
    layered = k_nope.dim() == 4
    k_name = "k_caches" if layered else "k_cache"
    v_name = "v_caches" if layered else "v_cache"
    first = _check_caches(k_name, k_caches, layered, heads, head_dim, k_nope.device, allow_strided)
    capacity = first.shape[0] * first.shape[1]
    if v is not None and v_caches is not None:
        v_first = _check_caches(
            v_name, v_caches, layered, heads, v.shape[-1], k_nope.device, allow_strided
        )
        if v_first.shape[:2] != first.shape[:2]:
            raise ValueError(
                f"{v_name}: [num_blocks, block_size] {tuple(v_first.shape[:2])} differs from "
                f"{k_name}'s {tuple(first.shape[:2])}"
            )
    ranges.append(("slot_mapping", slot_mapping, -1, capacity - 1))
    if check_values:
        _check_ranges(ranges)


def _check_caches(
    name: str,
    caches: list[torch.Tensor],
    indexed: bool,
    heads: int,
    head_dim: int,
    device: torch.device,
    allow_strided: bool,
) -> torch.Tensor:
    """Every cache is a ``[num_blocks, block_size, heads, head_dim]`` like the first."""
    first: torch.Tensor | None = None
    for i, cache in enumerate(caches):
        label = f"{name}[{i}]" if indexed else name
        _check_float_tensor(label, cache, 4)
        if cache.shape[2:] != (heads, head_dim):
            raise ValueError(
                f"{label}: shape {tuple(cache.shape)}, expected [num_blocks, block_size, "
                f"{heads}, {head_dim}]"
            )
        if cache.device != device:
            raise ValueError(f"{label}: on {cache.device}, inputs on {device}")
        # The Triton kernel addresses slots as rows of one [slots, heads, dim] tensor; the
        # torch path writes through any strided view (an engine's own page layout).
        if not (allow_strided and device.type != "cuda") and not cache.is_contiguous():
            raise ValueError(f"{label}: must be contiguous")
        if first is None:
            first = cache
        elif (
            cache.shape != first.shape
            or cache.dtype != first.dtype
            or cache.stride() != first.stride()
        ):
            raise ValueError(
                f"{label}: {_describe(cache)} strides {cache.stride()} differ from "
                f"{name}[0] {_describe(first)} strides {first.stride()}"
            )
    if first is None:
        raise ValueError(f"{name}: no caches given")
    return first


def _check_spec(spec: RopeSpec) -> None:
    if not isinstance(spec, RopeSpec):
        raise ValueError(f"spec: expected a RopeSpec, got {type(spec).__name__}")


def _check_float_tensor(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype must be bfloat16, float16 or float32, got {t.dtype}")


def _check_rows(name: str, t: torch.Tensor) -> None:
    """The kernels read whole head rows: the last dim must be dense."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, strides are {t.stride()}")


def _check_positions(
    name: str,
    pos: Positions | None,
    tokens: int,
    device: torch.device,
    ranges: list[_Range],
    *,
    allow_none: bool,
) -> None:
    if pos is None:
        if not allow_none:
            raise ValueError(f"{name}: must not be None")
        return
    if isinstance(pos, bool) or not isinstance(pos, int | torch.Tensor):
        raise ValueError(
            f"{name}: expected an int start or an int tensor, got {type(pos).__name__}"
        )
    if isinstance(pos, int):
        if pos < 0 or pos + max(tokens - 1, 0) > MAX_POSITION:
            raise ValueError(
                f"{name}: start {pos} puts positions outside [0, {MAX_POSITION}] "
                f"for {tokens} tokens"
            )
        return
    if pos.dtype not in _POSITION_DTYPES:
        raise ValueError(f"{name}: dtype must be torch.int32 or torch.int64, got {pos.dtype}")
    if pos.shape != (tokens,):
        raise ValueError(f"{name}: shape {tuple(pos.shape)}, expected ({tokens},)")
    if pos.device != device:
        raise ValueError(f"{name}: on {pos.device}, expected {device}")
    ranges.append((name, pos, 0, MAX_POSITION))


def _check_ranges(ranges: list[_Range]) -> None:
    """Check every (name, tensor, lo, hi) with at most one device-to-host transfer."""
    ranges = [r for r in ranges if r[1].numel() > 0]
    if not ranges:
        return
    bounds = torch.stack(
        [torch.stack(torch.aminmax(t)).to(torch.int64) for _, t, _, _ in ranges]
    ).tolist()
    for (name, _, lo, hi), (tmin, tmax) in zip(ranges, bounds, strict=True):
        if tmin < lo or tmax > hi:
            raise ValueError(f"{name}: values span [{tmin}, {tmax}], allowed [{lo}, {hi}]")


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of two tensors intersect (conservative for strided views)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
