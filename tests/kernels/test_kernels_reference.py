"""Properties of the torch reference (the CPU path of nopecache.kernels), and argument
validation of every entry point, torch and Triton alike."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nopecache.kernels import RopeSpec, api, reference
from nopecache.kernels import triton_rope as rotate_module
from nopecache.kernels.reference import (
    position_delta,
    rope_tolerance,
    rotate_reference,
)
from nopecache.kernels.rope_spec import Layout

LLAMA_LIKE = RopeSpec.default(head_dim=64, theta=500000.0)
PARTIAL = RopeSpec.default(head_dim=40, rotary_dim=16)
MLA = RopeSpec.mla(kv_lora_rank=24, qk_rope_head_dim=16)
GEOMETRIES = {"full": LLAMA_LIKE, "partial": PARTIAL, "mla": MLA}


def _spec(geometry: str, layout: Layout, scaling: float = 1.0) -> RopeSpec:
    return dataclasses.replace(GEOMETRIES[geometry], layout=layout, attention_scaling=scaling)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _angle_ulps(max_position: int, spec: RopeSpec) -> float:
    """fp32 ulps (of a pair) that two fp32 angles up to ``max_position`` may be off by,
    ~|angle| * 2**-24 each, plus 8 for cos/sin and the multiply-adds."""
    return 8 + 2 * max_position * max(spec.inv_freq)


def _assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> None:
    err = (actual.double() - expected.double()).abs()
    assert bool((err <= tol).all()), f"max excess over tolerance {(err - tol).max().item():.3g}"


def _rotate_fp64(
    k: torch.Tensor,
    delta: torch.Tensor,
    spec: RopeSpec,
    scale: float = 1.0,
    exact_angle: bool = False,
) -> torch.Tensor:
    """Independent float64 rotation. The angle is the fp32 product the kernels use, or
    with ``exact_angle`` the float64 product of the same fp32 frequencies."""
    inv32 = spec.inv_freq_tensor()
    if exact_angle:
        angle = delta.double()[:, None] * inv32.double()[None, :]
    else:
        angle = (delta.float()[:, None] * inv32[None, :]).double()
    cos, sin = (angle.cos() * scale)[:, None, :], (angle.sin() * scale)[:, None, :]
    x = k.double().clone()
    lo, half = spec.rotary_offset, spec.rotary_dim // 2
    rot = x[..., lo : lo + spec.rotary_dim]
    if spec.layout == "neox":
        x1, x2 = rot[..., :half].clone(), rot[..., half:].clone()
        rot[..., :half] = x1 * cos - x2 * sin
        rot[..., half:] = x2 * cos + x1 * sin
    else:
        x1, x2 = rot[..., 0::2].clone(), rot[..., 1::2].clone()
        rot[..., 0::2] = x1 * cos - x2 * sin
        rot[..., 1::2] = x2 * cos + x1 * sin
    return x


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("geometry", ["full", "partial", "mla"])
def test_nope_to_rope_matches_float64_formula(geometry: str, layout: Layout) -> None:
    spec = _spec(geometry, layout, scaling=1.25)
    k = _randn(33, 3, spec.head_dim)
    pos = torch.randint(0, 40000, (33,), generator=torch.Generator().manual_seed(1))
    out = api.rotate(k, None, pos, spec)
    expected = _rotate_fp64(k, pos, spec, scale=spec.attention_scaling)
    _assert_within(out, expected, rope_tolerance(expected, spec, torch.float32, ulps=8))
    lo, hi = spec.rotary_offset, spec.rotary_offset + spec.rotary_dim
    assert torch.equal(out[..., :lo], k[..., :lo]) and torch.equal(out[..., hi:], k[..., hi:])


def test_int_start_equals_arange_tensor() -> None:
    spec = _spec("partial", "gptj", scaling=1.1)
    k = _randn(19, 2, spec.head_dim, dtype=torch.bfloat16)
    run = torch.arange(7, 26)
    assert torch.equal(api.rotate(k, None, 7, spec), api.rotate(k, None, run, spec))
    assert torch.equal(api.rotate(k, 7, None, spec), api.rotate(k, run, None, spec))
    assert torch.equal(api.rotate(k, 7, 900, spec), api.rotate(k, run, run + 893, spec))
    assert torch.equal(api.rotate(k, run.int(), 900, spec), api.rotate(k, run, run + 893, spec))


def test_position_delta_is_integer_difference() -> None:
    to = torch.tensor([5, 131072, 0])
    assert position_delta(3, 10, 3, torch.device("cpu")).tolist() == [7]
    assert position_delta(None, to, 3, torch.device("cpu")).tolist() == [5, 131072, 0]
    assert position_delta(to, None, 3, torch.device("cpu")).tolist() == [-5, -131072, 0]
    assert position_delta(2, to, 3, torch.device("cpu")).tolist() == [3, 131069, -4]


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_chunked_rotation_equals_one_chunk(layout: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec("mla", layout, scaling=1.3)
    k = _randn(21, 2, spec.head_dim, dtype=torch.bfloat16)
    pos = torch.arange(100, 121) * 3
    whole = [api.rotate(k, None, pos, spec), api.rotate(k, pos, 5, spec), api.rotate(k, 4, 9, spec)]
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 4 * 2 * spec.rotary_dim)  # 4 tokens
    chunked = [
        api.rotate(k, None, pos, spec),
        api.rotate(k, pos, 5, spec),
        api.rotate(k, 4, 9, spec),
    ]
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_in_place_equals_out_of_place(dtype: torch.dtype) -> None:
    spec = _spec("mla", "neox", scaling=1.3)
    k = _randn(21, 2, spec.head_dim, dtype=dtype)
    pos = torch.arange(100, 121)
    expected = api.rotate(k, pos, 5, spec)
    into = torch.empty_like(k)
    assert api.rotate(k, pos, 5, spec, out=into) is into
    inplace = k.clone()
    assert api.rotate(inplace, pos, 5, spec, out=inplace) is inplace
    assert torch.equal(into, expected) and torch.equal(inplace, expected)


def test_strided_k_view_is_rotated_like_contiguous_copy() -> None:
    spec = _spec("full", "neox")
    kv = _randn(12, 2, 3, spec.head_dim)  # [tokens, k|v, heads, dim] as engines often keep it
    pos = torch.arange(12) * 3
    assert torch.equal(
        api.rotate(kv[:, 0], None, pos, spec), api.rotate(kv[:, 0].clone(), None, pos, spec)
    )


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("geometry", ["full", "mla"])
def test_unrotate_then_rotate_within_one_bf16_ulp_of_direct(geometry: str, layout: Layout) -> None:
    spec = _spec(geometry, layout)
    gen = torch.Generator().manual_seed(3)
    nope = _randn(64, 4, spec.head_dim, seed=3, dtype=torch.bfloat16)
    src = torch.randint(0, 100000, (64,), generator=gen)
    dst = torch.randint(0, 100000, (64,), generator=gen)
    post = api.rotate(nope, None, src, spec)
    direct = api.rotate(post, src, dst, spec)
    two_step = api.rotate(api.rotate(post, src, None, spec), None, dst, spec)
    _assert_within(two_step, direct, rope_tolerance(direct, spec, torch.bfloat16))


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_delta_up_to_128k_within_fp32_angle_error(layout: Layout) -> None:
    spec = _spec("full", layout)
    gen = torch.Generator().manual_seed(4)
    k = _randn(48, 2, spec.head_dim, seed=4)
    src = torch.randint(0, 1024, (48,), generator=gen)
    dst = torch.cat(
        (torch.tensor([131072, 131071]), torch.randint(64000, 131072, (46,), generator=gen))
    )
    out = api.rotate(k, src, dst, spec)
    expected = _rotate_fp64(k, dst - src, spec, exact_angle=True)
    # fp32 error of the angle itself: |angle| * 2**-24 relative to the pair's norm, i.e. at
    # most |angle| fp32 ulps of the pair, plus a few ulps of cos/sin and multiply-add.
    angle = (dst - src).double()[:, None, None] * spec.inv_freq_tensor().double()
    angle = torch.cat((angle, angle), -1) if layout == "neox" else angle.repeat_interleave(2, -1)
    tol = rope_tolerance(expected, spec, torch.float32) * (angle + 8)
    _assert_within(out, expected, tol)
    # ... and the error is that of the angle, not of a second rotation or of its delta:
    # a rotation by the fp32 product of the delta is tighter still.
    _assert_within(
        out, _rotate_fp64(k, dst - src, spec), rope_tolerance(expected, spec, torch.float32, 8)
    )


@pytest.mark.parametrize("layout", ["neox", "gptj"])
def test_attention_scaling_applied_exactly_once(layout: Layout) -> None:
    s = 1.0 + 0.1 * math.log(4.0)  # YaRN mscale for factor 4
    spec = _spec("partial", layout, scaling=s)
    k = _randn(16, 2, spec.head_dim, seed=5)
    p, q = torch.arange(16) * 2, torch.arange(16) + 40
    lo, hi = spec.rotary_offset, spec.rotary_offset + spec.rotary_dim
    post_p = api.rotate(k, None, p, spec)
    norm_ratio = post_p[..., lo:hi].norm(dim=-1) / k[..., lo:hi].norm(dim=-1)
    assert torch.allclose(norm_ratio, torch.full_like(norm_ratio, s), rtol=1e-6, atol=0)
    assert torch.equal(post_p[..., hi:], k[..., hi:])  # pass-through dims never scaled
    post_q = api.rotate(post_p, p, q, spec)  # rope -> rope keeps the single factor
    direct_q = api.rotate(k, None, q, spec)
    ulps = _angle_ulps(56, spec)  # 2.6e-5 of the pair: far below s - 1 = 0.14
    _assert_within(post_q, direct_q, rope_tolerance(direct_q, spec, torch.float32, ulps))
    back = api.rotate(post_q, q, None, spec)  # rope -> nope removes it once
    _assert_within(back, k, rope_tolerance(k, spec, torch.float32, ulps))


# --------------------------------------------------------------------------- paged scatter


def _scatter_inputs(
    spec: RopeSpec, dtype: torch.dtype, cache_dtype: torch.dtype, with_v: bool, slots_kind: str
) -> dict[str, Any]:
    """``slots_kind``: "rows" (random slots, some -1), "run" (consecutive), "blocks" (whole
    blocks in shuffled order): the three ways the CPU path writes."""
    tokens, heads, blocks, block_size, v_dim = 24, 2, 6, 8, 12
    gen = torch.Generator().manual_seed(6)
    if slots_kind == "run":
        slots = torch.arange(9, 9 + tokens)
    elif slots_kind == "blocks":
        chosen = torch.randperm(blocks, generator=gen)[: tokens // block_size]
        slots = (chosen[:, None] * block_size + torch.arange(block_size)).flatten()
    else:
        slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
        slots[[2, 11, 12]] = -1
    return {
        "k_nope": _randn(tokens, heads, spec.head_dim, seed=7, dtype=dtype),
        "v": _randn(tokens, heads, v_dim, seed=8, dtype=dtype) if with_v else None,
        "positions": torch.randint(0, 70000, (tokens,), generator=gen),
        "slot_mapping": slots,
        # Random fill: every slot not written must keep exactly these values.
        "k_cache": _randn(blocks, block_size, heads, spec.head_dim, seed=9, dtype=cache_dtype),
        "v_cache": _randn(blocks, block_size, heads, v_dim, seed=10, dtype=cache_dtype)
        if with_v
        else None,
        "spec": spec,
    }


def _expected_cache(args: dict[str, Any], rotated: torch.Tensor, which: str) -> torch.Tensor:
    cache = args[f"{which}_cache"].clone()
    flat = cache.view(-1, *cache.shape[2:])
    slots = args["slot_mapping"]
    keep = slots >= 0
    flat[slots[keep]] = rotated[keep].to(cache.dtype)
    return cache


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "geometry", "with_v", "slots_kind"),
    [
        (torch.bfloat16, torch.bfloat16, "full", True, "rows"),
        (torch.bfloat16, torch.bfloat16, "full", True, "run"),
        (torch.bfloat16, torch.bfloat16, "full", True, "blocks"),
        (torch.float32, torch.bfloat16, "partial", True, "rows"),
        (torch.float32, torch.bfloat16, "partial", True, "blocks"),
        (torch.float16, torch.float16, "mla", False, "rows"),
        (torch.float32, torch.float32, "mla", False, "run"),
        (torch.bfloat16, torch.bfloat16, "mla", False, "blocks"),
    ],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "5-token-chunks"])
def test_scatter_writes_exactly_the_slots_asked(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    geometry: str,
    with_v: bool,
    slots_kind: str,
    chunked: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = _spec(geometry, "neox", scaling=1.2)
    args = _scatter_inputs(spec, dtype, cache_dtype, with_v, slots_kind)
    if chunked:  # several chunks; block mode rounds them up to whole blocks
        monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 5 * 2 * spec.rotary_dim)
    rotated = rotate_reference(args["k_nope"].float(), None, args["positions"], spec)
    expected_k = _expected_cache(args, rotated, "k")
    expected_v = _expected_cache(args, args["v"], "v") if with_v else None
    api.rerope_scatter(**args)
    assert torch.equal(args["k_cache"], expected_k)
    if expected_v is not None:
        assert torch.equal(args["v_cache"], expected_v)


@pytest.mark.parametrize("slots_kind", ["rows", "blocks"])
def test_scatter_layers_equals_one_scatter_per_layer(slots_kind: str) -> None:
    spec = _spec("partial", "gptj", scaling=1.2)
    layers = [
        _scatter_inputs(spec, torch.bfloat16, torch.bfloat16, True, slots_kind) for _ in range(3)
    ]
    for i, args in enumerate(layers):  # distinct contents per layer
        args["k_nope"] = _randn(*args["k_nope"].shape, seed=20 + i, dtype=torch.bfloat16)
        args["v"] = _randn(*args["v"].shape, seed=30 + i, dtype=torch.bfloat16)
    k_caches = [a["k_cache"].clone() for a in layers]
    v_caches = [a["v_cache"].clone() for a in layers]
    first = layers[0]
    api.rerope_scatter_layers(
        torch.stack([a["k_nope"] for a in layers]),
        torch.stack([a["v"] for a in layers]),
        first["positions"],
        first["slot_mapping"],
        k_caches,
        v_caches,
        spec,
    )
    for i, args in enumerate(layers):
        api.rerope_scatter(**args)
        assert torch.equal(k_caches[i], args["k_cache"]) and torch.equal(
            v_caches[i], args["v_cache"]
        )


def test_scatter_with_every_slot_skipped_writes_nothing() -> None:
    spec = _spec("full", "neox")
    args = _scatter_inputs(spec, torch.bfloat16, torch.bfloat16, True, "rows")
    args["slot_mapping"] = torch.full_like(args["slot_mapping"], -1)
    before_k, before_v = args["k_cache"].clone(), args["v_cache"].clone()
    api.rerope_scatter(**args)
    assert torch.equal(args["k_cache"], before_k) and torch.equal(args["v_cache"], before_v)


def test_empty_inputs_are_no_ops() -> None:
    spec = _spec("full", "neox")
    k = torch.empty(0, 2, spec.head_dim)
    assert api.rotate(k, None, 0, spec).shape == (0, 2, spec.head_dim)
    cache = torch.zeros(2, 4, 2, spec.head_dim)
    api.rerope_scatter(k, None, 0, torch.empty(0, dtype=torch.int64), cache, None, spec)
    assert not bool(cache.any())


# --------------------------------------------------------------------------- bad arguments

HEAD = 16
SPEC = RopeSpec.default(head_dim=HEAD)


def _rotate_args() -> dict[str, Any]:
    return {
        "k": torch.ones(4, 2, HEAD),
        "from_pos": None,
        "to_pos": torch.arange(4),
        "spec": SPEC,
        "out": None,
    }


def _scatter_args() -> dict[str, Any]:
    return {
        "k_nope": torch.ones(4, 2, HEAD),
        "v": torch.ones(4, 2, 8),
        "positions": 3,
        "slot_mapping": torch.tensor([0, 5, -1, 11]),
        "k_cache": torch.zeros(3, 4, 2, HEAD),
        "v_cache": torch.zeros(3, 4, 2, 8),
        "spec": SPEC,
    }


def _layers_args() -> dict[str, Any]:
    return {
        "k_nope": torch.ones(2, 4, 2, HEAD),
        "v": torch.ones(2, 4, 2, 8),
        "positions": torch.arange(4),
        "slot_mapping": torch.tensor([0, 5, -1, 11]),
        "k_caches": [torch.zeros(3, 4, 2, HEAD), torch.zeros(3, 4, 2, HEAD)],
        "v_caches": [torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)],
        "spec": SPEC,
    }


Mutation = Callable[[dict[str, Any]], dict[str, Any]]
_BASE = {"rotate": _rotate_args, "scatter": _scatter_args, "layers": _layers_args}
BAD: list[tuple[str, str, str, Mutation]] = [
    # (entry, case id, argument named in the message, mutation of valid arguments)
    ("rotate", "k-not-tensor", "k", lambda a: a | {"k": [[1.0]]}),
    ("rotate", "k-2d", "k", lambda a: a | {"k": a["k"][0]}),
    ("rotate", "k-int", "k", lambda a: a | {"k": a["k"].long()}),
    ("rotate", "k-float64", "k", lambda a: a | {"k": a["k"].double()}),
    ("rotate", "k-head-dim", "k", lambda a: a | {"k": a["k"][..., :8]}),
    ("rotate", "k-strided-dim", "k", lambda a: a | {"k": torch.ones(4, HEAD, 2).transpose(1, 2)}),
    ("rotate", "both-nope", "from_pos", lambda a: a | {"to_pos": None}),
    ("rotate", "to-negative", "to_pos", lambda a: a | {"to_pos": torch.tensor([0, 1, -2, 3])}),
    ("rotate", "to-float", "to_pos", lambda a: a | {"to_pos": torch.arange(4.0)}),
    ("rotate", "to-length", "to_pos", lambda a: a | {"to_pos": torch.arange(5)}),
    ("rotate", "to-2d", "to_pos", lambda a: a | {"to_pos": torch.arange(4)[None]}),
    ("rotate", "to-bool", "to_pos", lambda a: a | {"to_pos": True}),
    ("rotate", "to-list", "to_pos", lambda a: a | {"to_pos": [0, 1, 2, 3]}),
    ("rotate", "to-too-large", "to_pos", lambda a: a | {"to_pos": api.MAX_POSITION - 2}),
    ("rotate", "to-device", "to_pos", lambda a: a | {"to_pos": torch.arange(4, device="meta")}),
    ("rotate", "from-negative-start", "from_pos", lambda a: a | {"from_pos": -1}),
    (
        "rotate",
        "out-dtype",
        "out",
        lambda a: a | {"out": torch.zeros(4, 2, HEAD, dtype=torch.float16)},
    ),
    ("rotate", "out-shape", "out", lambda a: a | {"out": torch.zeros(4, 3, HEAD)}),
    ("rotate", "out-partial-overlap", "out", lambda a: _overlapping_out(a)),
    ("rotate", "spec-type", "spec", lambda a: a | {"spec": "llama"}),
    ("scatter", "k-nope-head-dim", "k_nope", lambda a: a | {"k_nope": torch.ones(4, 2, 8)}),
    ("scatter", "k-nope-float64", "k_nope", lambda a: a | {"k_nope": a["k_nope"].double()}),
    ("scatter", "v-tokens", "v", lambda a: a | {"v": torch.ones(3, 2, 8)}),
    ("scatter", "v-without-cache", "v_cache", lambda a: a | {"v_cache": None}),
    ("scatter", "cache-without-v", "v_cache", lambda a: a | {"v": None}),
    ("scatter", "positions-none", "positions", lambda a: a | {"positions": None}),
    (
        "scatter",
        "positions-negative",
        "positions",
        lambda a: a | {"positions": torch.tensor([1, 2, -3, 4])},
    ),
    (
        "scatter",
        "slots-int32",
        "slot_mapping",
        lambda a: a | {"slot_mapping": a["slot_mapping"].int()},
    ),
    ("scatter", "slots-list", "slot_mapping", lambda a: a | {"slot_mapping": [0, 5, -1, 11]}),
    (
        "scatter",
        "slots-length",
        "slot_mapping",
        lambda a: a | {"slot_mapping": torch.tensor([0, 5, 11])},
    ),
    (
        "scatter",
        "slot-past-end",
        "slot_mapping",
        lambda a: a | {"slot_mapping": torch.tensor([0, 5, -1, 12])},
    ),
    (
        "scatter",
        "slot-below-skip",
        "slot_mapping",
        lambda a: a | {"slot_mapping": torch.tensor([0, -2, 1, 2])},
    ),
    ("scatter", "k-cache-3d", "k_cache", lambda a: a | {"k_cache": torch.zeros(12, 2, HEAD)}),
    ("scatter", "k-cache-heads", "k_cache", lambda a: a | {"k_cache": torch.zeros(3, 4, 1, HEAD)}),
    (
        "scatter",
        "k-cache-int",
        "k_cache",
        lambda a: a | {"k_cache": torch.zeros(3, 4, 2, HEAD, dtype=torch.int16)},
    ),
    (
        "scatter",
        "k-cache-strided",
        "k_cache",
        lambda a: a | {"k_cache": torch.zeros(4, 3, 2, HEAD).transpose(0, 1)},
    ),
    ("scatter", "v-cache-dim", "v_cache", lambda a: a | {"v_cache": torch.zeros(3, 4, 2, 9)}),
    ("scatter", "v-cache-blocks", "v_cache", lambda a: a | {"v_cache": torch.zeros(4, 4, 2, 8)}),
    ("scatter", "spec-head-dim", "k_nope", lambda a: a | {"spec": RopeSpec.default(head_dim=32)}),
    ("layers", "k-nope-3d", "k_nope", lambda a: a | {"k_nope": a["k_nope"][0]}),
    ("layers", "v-layers", "v", lambda a: a | {"v": a["v"][:1]}),
    ("layers", "k-caches-count", "k_caches", lambda a: a | {"k_caches": a["k_caches"][:1]}),
    (
        "layers",
        "k-caches-tensor",
        "k_caches",
        lambda a: a | {"k_caches": torch.zeros(2, 3, 4, 2, HEAD)},
    ),
    (
        "layers",
        "k-caches-mixed-dtype",
        "k_caches[1]",
        lambda a: a | {"k_caches": [a["k_caches"][0], a["k_caches"][1].half()]},
    ),
    ("layers", "v-caches-count", "v_caches", lambda a: a | {"v_caches": a["v_caches"] * 2}),
    (
        "layers",
        "v-caches-shape",
        "v_caches[0]",
        lambda a: a | {"v_caches": [torch.zeros(3, 4, 2, 4), a["v_caches"][1]]},
    ),
    (
        "layers",
        "slot-past-end",
        "slot_mapping",
        lambda a: a | {"slot_mapping": torch.tensor([0, 99, 1, 2])},
    ),
]


def _overlapping_out(args: dict[str, Any]) -> dict[str, Any]:
    storage = torch.ones(5, 2, HEAD)
    return args | {"k": storage[:4], "out": storage[1:]}


ENTRIES: dict[str, dict[str, Callable[..., Any]]] = {
    "torch": {
        "rotate": api.rotate,
        "scatter": api.rerope_scatter,
        "layers": api.rerope_scatter_layers,
    },
    "triton": {
        "rotate": rotate_module.rotate_triton,
        "scatter": rotate_module.rerope_scatter_triton,
        "layers": rotate_module.rerope_scatter_layers_triton,
    },
}


# Rejected by the Triton kernel only: the torch path writes through a strided cache view.
TRITON_ONLY = {(e, n, m) for e, c, n, m in BAD if c == "k-cache-strided"}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("entry", "name", "mutate"), [(e, n, m) for e, _, n, m in BAD], ids=[c for _, c, _, _ in BAD]
)
def test_bad_argument_raises_value_error_naming_it(
    backend: str, entry: str, name: str, mutate: Mutation
) -> None:
    if backend == "torch" and (entry, name, mutate) in TRITON_ONLY:
        pytest.skip("the torch path writes through strided caches (tested below)")
    args = mutate(_BASE[entry]())
    outputs = [
        t for key in ("out", "k_cache", "v_cache") if isinstance(t := args.get(key), torch.Tensor)
    ]
    outputs += [
        t for key in ("k_caches", "v_caches") if isinstance(args.get(key), list) for t in args[key]
    ]
    before = [t.clone() for t in outputs]
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        ENTRIES[backend][entry](**args)
    # Rejected before anything is written.
    assert all(torch.equal(t, b) for t, b in zip(outputs, before, strict=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("entry", ["rotate", "scatter", "layers"])
def test_valid_base_arguments_are_accepted(backend: str, entry: str) -> None:
    ENTRIES[backend][entry](**_BASE[entry]())


# -- strided caches and post-RoPE sources (the paged contract engines place through) ------


def _cpu_pages(blocks: int, block_size: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[blocks, block_size, heads, HEAD]`` of one vLLM CPU-attention-style
    cache ``[blocks, heads, block_size, 2 * HEAD]``: K transposed in each page, then V."""
    cache = torch.zeros(blocks, heads, block_size, 2 * HEAD)
    s_block, s_head = cache.stride(0), cache.stride(1)
    k = cache.as_strided((blocks, block_size, heads, HEAD), (s_block, 1, s_head, block_size))
    v = cache.as_strided(
        (blocks, block_size, heads, HEAD), (s_block, HEAD, s_head, 1), block_size * HEAD
    )
    return k, v


@pytest.mark.parametrize("slots", [[4, 5, 6, 7, 8], [9, -1, 2, 3, 12]], ids=["run", "scattered"])
@pytest.mark.parametrize("from_positions", [None, 7, "tensor"])
def test_strided_caches_receive_what_contiguous_caches_do(
    slots: list[int], from_positions: int | str | None
) -> None:
    layers, tokens, heads = 2, 5, 2
    k = _randn(layers, tokens, heads, HEAD, seed=11)
    v = _randn(layers, tokens, heads, HEAD, seed=12)
    src: int | torch.Tensor | None = (
        torch.tensor([3, 9, 1, 40, 2]) if from_positions == "tensor" else from_positions  # type: ignore[assignment]
    )
    slot_t = torch.tensor(slots)
    pages = [_cpu_pages(4, 4, heads) for _ in range(layers)]
    assert not pages[0][0].is_contiguous()
    plain_k = [torch.zeros(4, 4, heads, HEAD) for _ in range(layers)]
    plain_v = [torch.zeros(4, 4, heads, HEAD) for _ in range(layers)]
    api.rerope_scatter_layers(
        k, v, 7, slot_t, [p[0] for p in pages], [p[1] for p in pages], SPEC, from_positions=src
    )
    api.rerope_scatter_layers(k, v, 7, slot_t, plain_k, plain_v, SPEC, from_positions=src)
    for (pk, pv), ck, cv in zip(pages, plain_k, plain_v, strict=True):
        assert torch.equal(pk, ck) and torch.equal(pv, cv)
    written = torch.zeros(16, dtype=torch.bool)
    written[[s for s in slots if s >= 0]] = True
    assert bool(plain_k[0].view(16, heads, HEAD)[written].ne(0).any(-1).all())
    assert not bool(plain_k[0].view(16, heads, HEAD)[~written].any())


def test_post_rope_source_at_the_same_positions_is_copied_bit_exactly() -> None:
    k = _randn(2, 5, 2, HEAD, seed=13, dtype=torch.bfloat16)
    caches = [torch.zeros(2, 4, 2, HEAD, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.tensor([1, 2, -1, 3, 6])
    api.rerope_scatter_layers(k, None, 9, slots, caches, None, SPEC, from_positions=9)
    for layer, cache in enumerate(caches):
        rows = cache.view(8, 2, HEAD)
        assert torch.equal(rows[[1, 2, 3, 6]], k[layer, [0, 1, 3, 4]])


def test_post_rope_source_is_rotated_once_by_the_difference() -> None:
    spec = dataclasses.replace(SPEC, attention_scaling=1.25)  # never applied a second time
    k = _randn(1, 4, 2, HEAD, seed=14)
    src = torch.tensor([5, 0, 17, 3])
    caches = [torch.zeros(1, 4, 2, HEAD)]
    api.rerope_scatter_layers(k, None, 30, torch.arange(4), caches, None, spec, from_positions=src)
    assert torch.equal(caches[0].view(4, 2, HEAD), api.rotate(k[0], src, 30, spec))
