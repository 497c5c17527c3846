"""Compile the kernels' production launches for sm_90 on a machine without a GPU and read
their machine code (run as a script, in a process without ``TRITON_INTERPRET``).

The host wrappers of ``nopecache.kernels.triton_rope`` are called for real, with CPU
tensors in the shapes of each variant; the kernel object they launch is swapped for a
recorder that keeps the launch's arguments. Each recorded launch is then specialised by
Triton's own JIT binder for a CUDA target (the same divisibility and constant
specialisations a launch on an H100 gets), compiled with ``triton.compile`` and
disassembled with the ``cuobjdump`` Triton ships. Prints one JSON object per variant:

``{"variant", "regs", "local_bytes", "stack_bytes", "stl", "ldl", "stg", "ldg", "num_warps"}`` where ``stg``/``ldg`` map
an instruction's width suffix (``E.128``, ``E.U16``, ...) to its count.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

assert "TRITON_INTERPRET" not in os.environ, "compile in a process without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from nopecache.kernels import RopeSpec  # noqa: E402
from nopecache.kernels import triton_rope as tr  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


class _Recorder:
    """Stands in for the jitted kernel: ``kernel[grid](*args, **kwargs)`` records a launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((args, kwargs))

        return launch


def _aligned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    # torch's CPU allocator aligns to 64 bytes, as the CUDA caching allocator aligns to 512.
    t = torch.zeros(*shape, dtype=dtype)
    assert t.data_ptr() % 16 == 0
    return t


LLAMA = RopeSpec.default(head_dim=128, theta=500000.0)
MLA = RopeSpec.mla(kv_lora_rank=512, qk_rope_head_dim=64)
MLA_GPTJ = RopeSpec(**{**{f: getattr(MLA, f) for f in MLA.__dataclass_fields__}, "layout": "gptj"})
T, H, L, BLOCKS, BS = 64, 8, 4, 8, 16


def _layers(spec: RopeSpec, dtype: torch.dtype, cache: torch.dtype, v: bool, pos: Any) -> None:
    d = spec.head_dim
    k = _aligned(L, T, H if v else 1, d, dtype=dtype)
    vv = _aligned(L, T, H, d, dtype=dtype) if v else None
    kc = [_aligned(BLOCKS, BS, H if v else 1, d, dtype=cache) for _ in range(L)]
    vc = [_aligned(BLOCKS, BS, H, d, dtype=cache) for _ in range(L)] if v else None
    slots = torch.arange(T, dtype=torch.int64)
    tr.rerope_scatter_layers_triton(k, vv, pos, slots, kc, vc, spec)


def _misaligned() -> None:
    """Caches at a 2-byte offset: the fallback variant (no alignment hint) must compile."""
    d = LLAMA.head_dim
    k, v = _aligned(L, T, H, d, dtype=torch.bfloat16), _aligned(L, T, H, d, dtype=torch.bfloat16)
    n = BLOCKS * BS * H * d
    kc = [_aligned(n + 1, dtype=torch.bfloat16)[1:].view(BLOCKS, BS, H, d) for _ in range(L)]
    vc = [_aligned(BLOCKS, BS, H, d, dtype=torch.bfloat16) for _ in range(L)]
    tr.rerope_scatter_layers_triton(k, v, 5, torch.arange(T, dtype=torch.int64), kc, vc, LLAMA)


def _single(spec: RopeSpec, dtype: torch.dtype, cache: torch.dtype) -> None:
    d = spec.head_dim
    k, v = _aligned(T, H, d, dtype=dtype), _aligned(T, H, d, dtype=dtype)
    kc, vc = _aligned(BLOCKS, BS, H, d, dtype=cache), _aligned(BLOCKS, BS, H, d, dtype=cache)
    tr.rerope_scatter_triton(k, v, 7, torch.arange(T, dtype=torch.int64), kc, vc, spec)


def _rotate(spec: RopeSpec, dtype: torch.dtype, from_pos: Any, to_pos: Any, in_place: bool) -> None:
    k = _aligned(T, H, spec.head_dim, dtype=dtype)
    tr.rotate_triton(k, from_pos, to_pos, spec, out=k if in_place else None)


POS = torch.arange(T, dtype=torch.int64)
# The production variants: what placement (int start), the store path (un-rotate) and the
# benchmark (a position tensor) launch, and the dtype-converting and MLA paths.
VARIANTS: dict[str, Callable[[], None]] = {
    "layers_llama_bf16_start": lambda: _layers(LLAMA, torch.bfloat16, torch.bfloat16, True, 5),
    "layers_llama_bf16_tensor": lambda: _layers(LLAMA, torch.bfloat16, torch.bfloat16, True, POS),
    "layers_llama_fp32_to_bf16": lambda: _layers(LLAMA, torch.float32, torch.bfloat16, True, 5),
    "layers_llama_fp16_to_bf16": lambda: _layers(LLAMA, torch.float16, torch.bfloat16, True, 5),
    "layers_mla_gptj_bf16": lambda: _layers(MLA_GPTJ, torch.bfloat16, torch.bfloat16, False, 5),
    "layers_llama_misaligned_fallback": _misaligned,
    "single_llama_bf16_start": lambda: _single(LLAMA, torch.bfloat16, torch.bfloat16),
    "rotate_llama_bf16_unrope_inplace": lambda: _rotate(LLAMA, torch.bfloat16, POS, None, True),
    "rotate_llama_bf16_rope_to_rope": lambda: _rotate(LLAMA, torch.bfloat16, 3, 9, False),
}


def _compile(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Specialise one launch as the JIT would on an sm_90 device, and compile it."""
    kernel = tr._rope_rows_kernel
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options=options.__dict__)


def _facts(name: str, compiled: Any) -> dict[str, Any]:
    sass: str = compiled.asm["sass"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        cuobjdump = triton.knobs.nvidia.cuobjdump.path
        usage = subprocess.check_output([cuobjdump, "-res-usage", f.name], text=True)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))  # type: ignore[union-attr]
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))  # type: ignore[union-attr]
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # type: ignore[union-attr]
    stg = collections.Counter(re.findall(r"\bSTG\.([\w.]+)", sass))
    ldg = collections.Counter(re.findall(r"\bLDG\.([\w.]+)", sass))
    return {
        "variant": name,
        "regs": regs,
        "local_bytes": local,
        "stack_bytes": stack,
        "stl": len(re.findall(r"\bSTL\b", sass)),
        "ldl": len(re.findall(r"\bLDL\b", sass)),
        "sts": len(re.findall(r"\bSTS\b", sass)),
        "lds": len(re.findall(r"\bLDS\b", sass)),
        "stg": dict(stg),
        "ldg": dict(ldg),
        "num_warps": compiled.metadata.num_warps,
        "approx": ".approx" in compiled.asm["ptx"],
    }


def _serving_launches() -> None:
    """What placement launches for blocks of different sizes at different places."""
    d = LLAMA.head_dim
    kc = [_aligned(64, BS, H, d, dtype=torch.bfloat16) for _ in range(L)]
    vc = [_aligned(64, BS, H, d, dtype=torch.bfloat16) for _ in range(L)]
    slot_mapping = torch.arange(64 * BS, dtype=torch.int64)
    for tokens, start in [(1, 0), (7, 1), (16, 16), (300, 4097), (1000, 123_457)]:
        k = _aligned(L, tokens, H, d, dtype=torch.bfloat16)
        v = _aligned(L, tokens, H, d, dtype=torch.bfloat16)
        slots = slot_mapping[start % 3 : start % 3 + tokens]  # odd offsets: 8-byte aligned
        tr.rerope_scatter_layers_triton(k, v, start, slots, kc, vc, LLAMA, check_values=False)


def keys() -> None:
    """Print the JIT's specialisation of each serving launch, one line each."""
    backend = make_backend(TARGET)
    kernel = tr._rope_rows_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    recorder = _Recorder()
    tr._rope_rows_kernel = recorder
    try:
        _serving_launches()
    finally:
        tr._rope_rows_kernel = kernel
    for args, kwargs in recorder.launches:
        _, specialization, options = binder(*args, **kwargs)
        print(json.dumps([repr(specialization), repr(sorted(options.items()))]))


def main(names: list[str]) -> None:
    """Compile the named variants (all without names) and print their facts."""
    real = tr._rope_rows_kernel
    for name in names or list(VARIANTS):
        recorder = _Recorder()
        tr._rope_rows_kernel = recorder
        try:
            VARIANTS[name]()
        finally:
            tr._rope_rows_kernel = real
        for args, kwargs in recorder.launches:
            print(json.dumps(_facts(name, _compile(args, kwargs))), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--keys"]:
        keys()
    else:
        main(sys.argv[1:])
