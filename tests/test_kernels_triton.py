"""The Triton kernels against the torch reference.

On a machine without CUDA these run the kernels under ``TRITON_INTERPRET=1`` (set by
conftest) on CPU tensors, at small shapes and small grids (the interpreter's cost grows
with the number of programs). ``gpu`` tests run the compiled kernels on CUDA tensors.
Comparisons: one ulp of the dtype at each rotated pair's norm (``rope_tolerance``);
pass-through dims, V and untouched cache slots bit-exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from nopecache.kernels import RopeSpec, api
from nopecache.kernels.reference import (
    rerope_scatter_layers_reference,
    rerope_scatter_reference,
    rope_tolerance,
    rotate_reference,
)
from nopecache.kernels.rope_spec import Layout
from nopecache.kernels.triton_rope import (
    rerope_scatter_layers_triton,
    rerope_scatter_triton,
    rotate_triton,
)

GEOMETRIES = {
    "full": RopeSpec.default(head_dim=32, theta=500000.0),
    "partial": RopeSpec.default(head_dim=40, rotary_dim=16),  # Phi/StableLM-like
    "mla": RopeSpec.mla(kv_lora_rank=24, qk_rope_head_dim=16),  # latent | k_pe
    "odd-pairs": RopeSpec.default(head_dim=28, rotary_dim=24),  # 12 pairs: padded tile
}
ULPS = {torch.bfloat16: 1.0, torch.float16: 1.0, torch.float32: 8.0}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _spec(geometry: str, layout: Layout, scaling: float = 1.0) -> RopeSpec:
    return dataclasses.replace(GEOMETRIES[geometry], layout=layout, attention_scaling=scaling)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, spec: RopeSpec) -> None:
    """Within one ulp (8 for fp32) of each rotated pair; every other dim bit-exact."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = rope_tolerance(expected, spec, expected.dtype, ULPS[expected.dtype]).to(actual.device)
    err = (actual.double() - expected.double()).abs()
    assert bool((err <= tol).all()), f"max excess over tolerance {(err - tol).max().item():.3g}"


def _positions(kind: str, tokens: int, seed: int) -> Any:
    if kind == "none":
        return None
    if kind == "start":
        return 3 + 1000 * seed
    if kind == "int32":
        return torch.randint(0, 70000, (tokens,), generator=_gen(seed), dtype=torch.int32)
    return torch.randint(0, 70000, (tokens,), generator=_gen(seed))


POSITION_PAIRS = [
    ("none", "tensor"),  # nope -> rope
    ("tensor", "none"),  # rope -> nope
    ("tensor", "tensor"),  # rope -> rope
    ("start", "start"),  # constant delta
    ("none", "start"),
    ("int32", "start"),
]


@pytest.mark.parametrize(("from_kind", "to_kind"), POSITION_PAIRS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_matches_reference(
    dtype: torch.dtype, layout: Layout, geometry: str, from_kind: str, to_kind: str
) -> None:
    spec = _spec(geometry, layout, scaling=1.25 if geometry == "partial" else 1.0)
    tokens, heads = 13, 3
    k = _randn(tokens, heads, spec.head_dim, seed=1, dtype=dtype)
    src, dst = _positions(from_kind, tokens, 2), _positions(to_kind, tokens, 3)
    _assert_close(rotate_triton(k, src, dst, spec), rotate_reference(k, src, dst, spec), spec)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_rotate_several_programs_per_axis(layout: Layout) -> None:
    # 20 heads > BLOCK_H = 16 and 70 tokens > BLOCK_T: a 3 x 2 grid with ragged edges.
    spec = _spec("full", layout, scaling=1.1)
    k = _randn(70, 20, spec.head_dim, seed=4, dtype=torch.bfloat16)
    pos = torch.randint(0, 131072, (70,), generator=_gen(5))
    _assert_close(rotate_triton(k, None, pos, spec), rotate_reference(k, None, pos, spec), spec)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_in_place_and_strided_view(dtype: torch.dtype) -> None:
    spec = _spec("mla", "neox", scaling=1.3)
    kv = _randn(11, 2, 3, spec.head_dim, seed=6, dtype=dtype)  # [tokens, k|v, heads, dim]
    k = kv[:, 0]
    pos = torch.arange(50, 61)
    expected = rotate_reference(k, pos, 7, spec)
    v_before = kv[:, 1].clone()
    assert rotate_triton(k, pos, 7, spec, out=k) is k
    _assert_close(kv[:, 0], expected, spec)
    assert torch.equal(kv[:, 1], v_before)  # the interleaved V rows are not touched


def _scatter_case(
    spec: RopeSpec, dtype: torch.dtype, cache_dtype: torch.dtype, with_v: bool, layers: int
) -> dict[str, Any]:
    tokens, heads, blocks, block_size, v_dim = 21, 3, 5, 8, 20
    slots = torch.randperm(blocks * block_size, generator=_gen(7))[:tokens]
    slots[[0, 9, 10]] = -1
    lead = (layers,) if layers else ()
    return {
        "k_nope": _randn(*lead, tokens, heads, spec.head_dim, seed=8, dtype=dtype),
        "v": _randn(*lead, tokens, heads, v_dim, seed=9, dtype=dtype) if with_v else None,
        "positions": torch.randint(0, 90000, (tokens,), generator=_gen(10)),
        "slot_mapping": slots,
        # Random fill: slots not written must keep these exact values.
        "k_cache": [
            _randn(blocks, block_size, heads, spec.head_dim, seed=11 + i, dtype=cache_dtype)
            for i in range(max(layers, 1))
        ],
        "v_cache": [
            _randn(blocks, block_size, heads, v_dim, seed=21 + i, dtype=cache_dtype)
            for i in range(max(layers, 1))
        ]
        if with_v
        else None,
    }


def _clone_caches(caches: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    return None if caches is None else [c.clone() for c in caches]


def _assert_caches(
    actual: list[torch.Tensor],
    expected: list[torch.Tensor],
    slots: torch.Tensor,
    spec: RopeSpec | None,
) -> None:
    """Written slots within tolerance (or exact for V: spec None); all other slots exact."""
    written = torch.zeros(actual[0].shape[0] * actual[0].shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for a, e in zip(actual, expected, strict=True):
        a_rows, e_rows = a.view(-1, *a.shape[2:]), e.view(-1, *e.shape[2:])
        assert torch.equal(a_rows[~written], e_rows[~written])
        if spec is None:
            assert torch.equal(a_rows[written], e_rows[written])
        else:
            _assert_close(a_rows[written], e_rows[written], spec)


@pytest.mark.parametrize(
    ("geometry", "layout", "dtype", "cache_dtype", "with_v"),
    [
        ("full", "neox", torch.bfloat16, torch.bfloat16, True),
        ("partial", "gptj", torch.float32, torch.bfloat16, True),  # converts to the cache dtype
        ("odd-pairs", "neox", torch.float16, torch.float16, True),
        ("mla", "neox", torch.bfloat16, torch.bfloat16, False),  # latent cache, no V
        ("mla", "gptj", torch.float32, torch.float32, False),
    ],
)
def test_rerope_scatter_matches_reference(
    geometry: str, layout: Layout, dtype: torch.dtype, cache_dtype: torch.dtype, with_v: bool
) -> None:
    spec = _spec(geometry, layout, scaling=1.2)
    case = _scatter_case(spec, dtype, cache_dtype, with_v, layers=0)
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None
    args = (case["k_nope"], case["v"], case["positions"], case["slot_mapping"])
    rerope_scatter_triton(
        *args, case["k_cache"][0], None if v_ref is None else case["v_cache"][0], spec
    )
    rerope_scatter_reference(*args, k_ref[0], None if v_ref is None else v_ref[0], spec)
    _assert_caches(case["k_cache"], k_ref, case["slot_mapping"], spec)
    if v_ref is not None:
        _assert_caches(case["v_cache"], v_ref, case["slot_mapping"], None)


@pytest.mark.parametrize(("geometry", "with_v"), [("full", True), ("mla", False)])
def test_rerope_scatter_layers_one_launch_matches_reference(geometry: str, with_v: bool) -> None:
    spec = _spec(geometry, "neox", scaling=1.2)
    case = _scatter_case(spec, torch.bfloat16, torch.bfloat16, with_v, layers=3)
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None
    args = (case["k_nope"], case["v"], case["positions"], case["slot_mapping"])
    rerope_scatter_layers_triton(*args, case["k_cache"], case["v_cache"], spec)
    rerope_scatter_layers_reference(*args, k_ref, v_ref, spec)
    _assert_caches(case["k_cache"], k_ref, case["slot_mapping"], spec)
    if v_ref is not None:
        _assert_caches(case["v_cache"], v_ref, case["slot_mapping"], None)


def test_fp32_to_bf16_cache_rounds_to_nearest_even_like_torch() -> None:
    # Angle 0 (position 0) leaves fp32 values as they are, so the cache holds exactly their
    # bf16 rounding: ties go to even, a round-up may carry into the exponent, and
    # inf / NaN (in pass-through dims, where no arithmetic touches them) survive.
    values = [1 + 2**-8, 1 + 3 * 2**-8, 2 - 2**-9, -(2 - 2**-9), 1.5 + 2**-9, 3.0, 0.25 + 2**-11]
    row = torch.tensor((values * 6)[:40], dtype=torch.float32)  # one head row of "partial"
    row[[30, 31, 32]] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    k_nope = row.repeat(2, 1, 1).reshape(2, 1, 40)
    spec = _spec("partial", "neox")
    cache = torch.zeros(1, 4, 1, 40, dtype=torch.bfloat16)
    at_zero = torch.zeros(2, dtype=torch.int64)
    rerope_scatter_triton(k_nope, None, at_zero, torch.tensor([1, 3]), cache, None, spec)
    expected = row.to(torch.bfloat16)
    number = ~expected.isnan()  # NaN bit patterns differ even between torch's own paths
    for slot in (1, 3):
        got = cache[0, slot, 0]
        assert torch.equal(got[number].view(torch.int16), expected[number].view(torch.int16))
        assert bool(got[~number].isnan().all())


def test_rerope_scatter_int_start_positions() -> None:
    spec = _spec("full", "gptj")
    case = _scatter_case(spec, torch.bfloat16, torch.bfloat16, True, layers=0)
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None and v_ref is not None
    args = (case["k_nope"], case["v"], 4096, case["slot_mapping"])
    rerope_scatter_triton(*args, case["k_cache"][0], case["v_cache"][0], spec)
    rerope_scatter_reference(*args, k_ref[0], v_ref[0], spec)
    _assert_caches(case["k_cache"], k_ref, case["slot_mapping"], spec)
    _assert_caches(case["v_cache"], v_ref, case["slot_mapping"], None)


# --------------------------------------------------------------------------- compiled


def test_rerope_scatter_layers_misaligned_cache_falls_back() -> None:
    # A cache view 2 bytes past a 16-byte boundary takes the variant without the
    # alignment hint; it must write the same values.
    spec = _spec("full", "neox", scaling=1.2)
    case = _scatter_case(spec, torch.bfloat16, torch.bfloat16, True, layers=2)
    shape = case["k_cache"][0].shape
    odd = [torch.empty(shape.numel() + 1, dtype=torch.bfloat16)[1:].view(shape) for _ in range(2)]
    for o, c in zip(odd, case["k_cache"], strict=True):
        o.copy_(c)
    assert odd[0].data_ptr() % 16 != 0
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None and v_ref is not None
    args = (case["k_nope"], case["v"], case["positions"], case["slot_mapping"])
    rerope_scatter_layers_triton(*args, odd, case["v_cache"], spec)
    rerope_scatter_layers_reference(*args, k_ref, v_ref, spec)
    _assert_caches(odd, k_ref, case["slot_mapping"], spec)
    _assert_caches(case["v_cache"], v_ref, case["slot_mapping"], None)


def test_unchecked_slots_out_of_range_are_skipped_not_written() -> None:
    # check_values=False skips the host range check (a device sync on CUDA); the kernel
    # still must not write outside the cache: such slots are skipped like -1.
    spec = _spec("full", "neox")
    case = _scatter_case(spec, torch.bfloat16, torch.bfloat16, True, layers=2)
    capacity = case["k_cache"][0].shape[0] * case["k_cache"][0].shape[1]
    # One allocation for both layers' caches: a write past layer 0's end would land in 1.
    k_all = torch.cat([c[None] for c in case["k_cache"]])
    v_all = torch.cat([c[None] for c in case["v_cache"]])
    before_k, before_v = k_all.clone(), v_all.clone()
    slots = case["slot_mapping"].clone()
    slots[1], slots[2] = capacity, -7
    valid = slots.clone()
    valid[[1, 2]] = -1
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None and v_ref is not None
    args = (case["k_nope"], case["v"], case["positions"])
    with pytest.raises(ValueError, match="slot_mapping"):
        rerope_scatter_layers_triton(*args, slots, list(k_all), list(v_all), spec)
    assert torch.equal(k_all, before_k) and torch.equal(v_all, before_v)
    rerope_scatter_layers_triton(*args, slots, list(k_all), list(v_all), spec, check_values=False)
    rerope_scatter_layers_reference(*args, valid, k_ref, v_ref, spec)
    _assert_caches(list(k_all), k_ref, valid, spec)
    _assert_caches(list(v_all), v_ref, valid, None)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_rotate_at_positions_near_the_limit(layout: Layout) -> None:
    # Angles up to 2**31 radians: the kernel's own range reduction (no libdevice slow path)
    # must stay within the fp32 tolerance everywhere.
    spec = _spec("full", layout)
    k = _randn(16, 2, spec.head_dim, seed=12, dtype=torch.float32)
    pos = torch.tensor([0, 1, 105_000, 105_616, 131_071, 10**6, 2**24 + 1, 2**31 - 1] * 2)
    _assert_close(rotate_triton(k, None, pos, spec), rotate_reference(k, None, pos, spec), spec)
    back = torch.flip(pos, (0,))
    _assert_close(rotate_triton(k, pos, back, spec), rotate_reference(k, pos, back, spec), spec)


# The compiled kernels' machine code (sm_90, no GPU needed) is checked in
# tests/test_kernels_sass.py.


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(("from_kind", "to_kind"), POSITION_PAIRS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_rotate_matches_reference(
    dtype: torch.dtype, layout: Layout, geometry: str, from_kind: str, to_kind: str
) -> None:
    spec = _spec(geometry, layout, scaling=1.25)
    tokens, heads = 300, 8
    k = _randn(tokens, heads, spec.head_dim, seed=1, dtype=dtype)
    src, dst = _positions(from_kind, tokens, 2), _positions(to_kind, tokens, 3)
    expected = rotate_reference(k, src, dst, spec)
    cuda = [x.cuda() if isinstance(x, torch.Tensor) else x for x in (k, src, dst)]
    _assert_close(rotate_triton(cuda[0], cuda[1], cuda[2], spec).cpu(), expected, spec)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("geometry", "with_v"), [("full", True), ("partial", True), ("mla", False)]
)
def test_gpu_rerope_scatter_layers_matches_reference(geometry: str, with_v: bool) -> None:
    spec = _spec(geometry, "neox", scaling=1.2)
    case = _scatter_case(spec, torch.bfloat16, torch.bfloat16, with_v, layers=4)
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None
    rerope_scatter_layers_reference(
        case["k_nope"], case["v"], case["positions"], case["slot_mapping"], k_ref, v_ref, spec
    )
    k_gpu = [c.cuda() for c in case["k_cache"]]
    v_gpu = None if case["v_cache"] is None else [c.cuda() for c in case["v_cache"]]
    api.rerope_scatter_layers(  # dispatches CUDA tensors to the Triton kernel
        case["k_nope"].cuda(),
        None if case["v"] is None else case["v"].cuda(),
        case["positions"].cuda(),
        case["slot_mapping"].cuda(),
        k_gpu,
        v_gpu,
        spec,
    )
    _assert_caches([c.cpu() for c in k_gpu], k_ref, case["slot_mapping"], spec)
    if v_gpu is not None and v_ref is not None:
        _assert_caches([c.cpu() for c in v_gpu], v_ref, case["slot_mapping"], None)
