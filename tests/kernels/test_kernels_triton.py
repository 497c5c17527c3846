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


@pytest.mark.parametrize("source", ["same-start", "tensor"])
def test_rerope_scatter_layers_from_post_rope_positions_matches_reference(source: str) -> None:
    # Post-RoPE K (stored form ROPE): a copy at the same positions, one rotation by the
    # difference elsewhere; the attention scaling (1.2) is never applied again.
    spec = _spec("full", "neox", scaling=1.2)
    case = _scatter_case(spec, torch.bfloat16, torch.bfloat16, True, layers=2)
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None and v_ref is not None
    tokens = case["k_nope"].shape[1]
    to_pos: int | torch.Tensor = 300
    from_pos: int | torch.Tensor = 300
    if source == "tensor":
        to_pos = case["positions"]
        from_pos = torch.arange(tokens, dtype=torch.int64) * 7 + 2
    args = (case["k_nope"], case["v"], to_pos, case["slot_mapping"])
    rerope_scatter_layers_triton(
        *args, case["k_cache"], case["v_cache"], spec, from_positions=from_pos
    )
    rerope_scatter_layers_reference(*args, k_ref, v_ref, spec, from_positions=from_pos)
    if source == "same-start":  # the reference copies; the kernel's angle-0 rotation too
        _assert_caches(case["k_cache"], k_ref, case["slot_mapping"], None)
    else:
        _assert_caches(case["k_cache"], k_ref, case["slot_mapping"], spec)
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
# tests/kernels/test_kernels_sass.py.


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


def _cuda(x: Any) -> Any:
    return x.cuda() if isinstance(x, torch.Tensor) else x


def _cuda_list(xs: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    return None if xs is None else [x.cuda() for x in xs]


def _cpu_list(xs: list[torch.Tensor] | None) -> list[torch.Tensor]:
    assert xs is not None
    return [x.cpu() for x in xs]


GPU_SCATTER_CASES = [
    # (geometry, layout, K dtype, cache dtype, with V, positions "tensor" or an int start)
    ("full", "neox", torch.bfloat16, torch.bfloat16, True, 120_000),  # placement's int start
    ("full", "gptj", torch.float32, torch.bfloat16, True, "tensor"),  # fp32 K -> bf16 cache
    ("full", "neox", torch.float16, torch.bfloat16, True, 7),  # fp16 K -> bf16 cache
    ("partial", "neox", torch.bfloat16, torch.float16, True, "tensor"),
    ("odd-pairs", "gptj", torch.float16, torch.float16, True, 3),
    ("mla", "gptj", torch.bfloat16, torch.bfloat16, False, 2**20),  # DeepSeek MLA in vLLM
    ("mla", "neox", torch.float32, torch.float32, False, "tensor"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layers", [0, 3], ids=["single-layer", "all-layers"])
@pytest.mark.parametrize(
    ("geometry", "layout", "dtype", "cache_dtype", "with_v", "pos"), GPU_SCATTER_CASES
)
def test_gpu_scatter_matches_reference(
    geometry: str,
    layout: Layout,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    with_v: bool,
    pos: Any,
    layers: int,
) -> None:
    spec = _spec(geometry, layout, scaling=1.2)
    case = _scatter_case(spec, dtype, cache_dtype, with_v, layers=layers)
    positions = case["positions"] if pos == "tensor" else pos
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None
    k_gpu, v_gpu = _cuda_list(case["k_cache"]), _cuda_list(case["v_cache"])
    assert k_gpu is not None
    args = (case["k_nope"], case["v"], positions, case["slot_mapping"])
    k, v, slots = _cuda(case["k_nope"]), _cuda(case["v"]), case["slot_mapping"].cuda()
    if layers:
        rerope_scatter_layers_reference(*args, k_ref, v_ref, spec)
        api.rerope_scatter_layers(k, v, _cuda(positions), slots, k_gpu, v_gpu, spec)
    else:
        rerope_scatter_reference(*args, k_ref[0], None if v_ref is None else v_ref[0], spec)
        v_cache = None if v_gpu is None else v_gpu[0]
        api.rerope_scatter(k, v, _cuda(positions), slots, k_gpu[0], v_cache, spec)
    _assert_caches(_cpu_list(k_gpu), k_ref, case["slot_mapping"], spec)
    if v_ref is not None:
        _assert_caches(_cpu_list(v_gpu), v_ref, case["slot_mapping"], None)


@pytest.mark.gpu
def test_gpu_scatter_into_caches_over_2_31_elements() -> None:
    # int64 offsets: slots past element 2**31 of a bf16 cache (4.3 GB per layer).
    spec = _spec("full", "neox")
    heads, dim, block_size = 8, spec.head_dim, 16
    blocks = 2**31 // (block_size * heads * dim) + 64
    need = 2 * 2 * blocks * block_size * heads * dim * 2  # K and V, two layers, bf16
    if torch.cuda.mem_get_info()[0] < need + 2**30:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free device memory")
    tokens = 48
    capacity = blocks * block_size
    slots = torch.cat([torch.arange(capacity - 40, capacity), torch.arange(8)])  # the far end
    k = _randn(2, tokens, heads, dim, seed=30, dtype=torch.bfloat16)
    v = _randn(2, tokens, heads, dim, seed=31, dtype=torch.bfloat16)
    shape = (blocks, block_size, heads, dim)
    k_caches = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    v_caches = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    assert k_caches[0].numel() > 2**31
    api.rerope_scatter_layers(k.cuda(), v.cuda(), 5000, slots.cuda(), k_caches, v_caches, spec)
    # The reference writes the same tokens into a small cache at slots 0..tokens-1.
    small = [torch.zeros(1, tokens, heads, dim, dtype=torch.bfloat16) for _ in range(4)]
    rerope_scatter_layers_reference(k, v, 5000, torch.arange(tokens), small[:2], small[2:], spec)
    for layer in range(2):
        got_k = k_caches[layer].view(-1, heads, dim)[slots.cuda()].cpu()
        got_v = v_caches[layer].view(-1, heads, dim)[slots.cuda()].cpu()
        _assert_close(got_k, small[layer][0], spec)
        assert torch.equal(got_v, small[2 + layer][0])
        assert not k_caches[layer].view(-1, heads, dim)[8 : capacity - 40].any()


@pytest.mark.gpu
def test_gpu_launches_on_the_tensors_device_from_any_thread() -> None:
    # The client's worker thread has device 0 current; caches on another device must get
    # launches there (with device 0 current they would read device-1 pointers on device 0).
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    import threading

    spec = _spec("full", "neox", scaling=1.2)
    case = _scatter_case(spec, torch.bfloat16, torch.bfloat16, True, layers=2)
    dev = torch.device("cuda", 1)
    k_ref, v_ref = _clone_caches(case["k_cache"]), _clone_caches(case["v_cache"])
    assert k_ref is not None and v_ref is not None
    args = (case["k_nope"], case["v"], 77, case["slot_mapping"])
    rerope_scatter_layers_reference(*args, k_ref, v_ref, spec)
    k_gpu = [c.to(dev) for c in case["k_cache"]]
    v_gpu = [c.to(dev) for c in case["v_cache"]]
    k, v, slots = case["k_nope"].to(dev), case["v"].to(dev), case["slot_mapping"].to(dev)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            torch.cuda.set_device(0)
            api.rerope_scatter_layers(k, v, 77, slots, k_gpu, v_gpu, spec)
            torch.cuda.synchronize(dev)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    _assert_caches([c.cpu() for c in k_gpu], k_ref, case["slot_mapping"], spec)
    _assert_caches([c.cpu() for c in v_gpu], v_ref, case["slot_mapping"], None)


@pytest.mark.gpu
def test_gpu_warm_up_compiles_every_variant_serving_launches() -> None:
    # Token counts and start positions are not specialised on: after warm_up, calls of
    # other sizes and starts compile nothing new.
    from nopecache.kernels.triton_rope import _rope_rows_kernel, warm_up

    spec = RopeSpec.default(head_dim=128, theta=500000.0)
    device = torch.device("cuda", torch.cuda.current_device())
    warm_up(spec, torch.bfloat16, 8, 128, device)
    compiled = len(_rope_rows_kernel.device_caches[device.index][0])
    for tokens, start in [(1, 0), (17, 1), (256, 16), (4096, 123_457)]:
        k = torch.randn(2, tokens, 8, 128, device=device).bfloat16()
        caches = [torch.zeros(tokens, 16, 8, 128, device=device).bfloat16() for _ in range(4)]
        slots = torch.arange(tokens, device=device) * 16
        api.rerope_scatter_layers(k, k, start, slots, caches[:2], caches[2:], spec)
        api.rotate(k[0], torch.arange(tokens, device=device) + start, None, spec, out=k[0])
    assert len(_rope_rows_kernel.device_caches[device.index][0]) == compiled
