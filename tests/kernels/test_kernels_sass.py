"""Machine-code facts of every production kernel variant, compiled for sm_90 without a GPU.

``tests/sass_probe.py`` calls the real host wrappers with CPU tensors, records the launch
they make, specialises it with Triton's JIT binder for an H100-class target and compiles
it (a subprocess: this process runs the kernels under ``TRITON_INTERPRET``, and the
interpreter's patched ``triton.language`` cannot compile). What is asserted is what makes
the kernels bandwidth-bound rather than instruction-bound on Hopper:

* every global store of K and V is 128 bits wide (``STG.E.128``: 8 bf16 per instruction;
  the all-layers path once stored one 16-bit element per instruction, because the cache
  addresses read from the table carried no alignment);
* every load of K and V is 128 bits wide (no ``LDG.E.U16``: the GPT-J layout once loaded
  its pairs with stride 2);
* no local memory (no ``STL``/``LDL``, no stack): no spills, and no libdevice sinf/cosf
  slow path (a table walk in local memory past ~1e5 radians);
* at most ``MAX_REGISTERS`` registers per thread, so that at 4 warps per program at least
  5 programs fit on an SM (65536 registers) and enough bytes are in flight;
* accurate cos/sin (no ``.approx`` instruction).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

MAX_REGISTERS = 96
PROBE = Path(__file__).resolve().parents[1] / "support" / "sass_probe.py"
FALLBACK = "layers_llama_misaligned_fallback"


@pytest.fixture(scope="module")
def facts() -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(PROBE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    return {row["variant"]: row for row in rows}


PRODUCTION = [
    "layers_llama_bf16_start",
    "layers_llama_bf16_tensor",
    "layers_llama_fp32_to_bf16",
    "layers_llama_fp16_to_bf16",
    "layers_mla_gptj_bf16",
    "single_llama_bf16_start",
    "rotate_llama_bf16_unrope_inplace",
    "rotate_llama_bf16_rope_to_rope",
]


@pytest.mark.slow
def test_every_variant_compiles(facts: dict[str, dict[str, Any]]) -> None:
    assert sorted(facts) == sorted([*PRODUCTION, FALLBACK])


@pytest.mark.slow
@pytest.mark.parametrize("variant", PRODUCTION)
def test_cache_writes_are_128_bit_stores(facts: dict[str, dict[str, Any]], variant: str) -> None:
    stores = facts[variant]["stg"]
    assert set(stores) == {"E.128"}, stores
    assert stores["E.128"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant", PRODUCTION)
def test_row_loads_are_128_bit(facts: dict[str, dict[str, Any]], variant: str) -> None:
    loads = facts[variant]["ldg"]
    # 128-bit K/V rows (EF: evict-first, the read-once streams); 32/64-bit loads are the
    # per-token slots and positions and the per-layer cache addresses.
    assert set(loads) <= {"E.128", "E.EF.128", "E.64", "E"}, loads
    assert loads.get("E.128", 0) + loads.get("E.EF.128", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("variant", [*PRODUCTION, FALLBACK])
def test_no_local_memory_and_registers_bounded(
    facts: dict[str, dict[str, Any]], variant: str
) -> None:
    row = facts[variant]
    assert (row["stl"], row["ldl"], row["local_bytes"], row["stack_bytes"]) == (0, 0, 0, 0)
    assert not row["approx"]
    if variant != FALLBACK:  # the unaligned fallback trades registers for narrow stores
        assert row["regs"] <= MAX_REGISTERS, row
        assert row["num_warps"] == 4


@pytest.mark.slow
def test_misaligned_caches_fall_back_to_narrow_stores(facts: dict[str, dict[str, Any]]) -> None:
    # A cache whose base is not 16-byte aligned must not get the alignment hint: the
    # variant without it writes 16 bits at a time (wide stores would fault).
    assert set(facts[FALLBACK]["stg"]) == {"E.U16"}


@pytest.mark.slow
def test_serving_launches_share_one_specialisation() -> None:
    # Blocks of 1..1000 tokens at starts 0..123457, slot mappings sliced at odd tokens:
    # one kernel variant for all (a new one would compile, for seconds, mid-request).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(PROBE), "--keys"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    keys = done.stdout.splitlines()
    assert len(keys) == 5
    assert len(set(keys)) == 1
