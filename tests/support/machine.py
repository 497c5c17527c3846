"""What a machine gives the vLLM engines tests and benches start: cores and memory.

Cores: every engine runs one OpenMP thread (``VLLM_CPU_OMP_THREADS_BIND=<core>``: a KV
connector reserves a core and would otherwise change the thread count, which changes bf16
results). Binding every engine to core 0 left the other cores idle while four engines
shared one; :func:`core_for` spreads engines round robin over the cores this process may
use (``os.sched_getaffinity``), so the n-th engine a process starts gets core
``cores[n % len(cores)]``.

Memory: a vLLM CPU engine (its front end and its engine-core process, the model, 1 GiB of
KV cache) holds about :data:`ENGINE_GIB`; five fit in 24 GiB and a sixth gets one of them
OOM-killed halfway through a run. :func:`require_memory` refuses to start engines the
machine cannot hold, naming how much is free and how much they need.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "ENGINE_GIB",
    "NotEnoughMemory",
    "allowed_cores",
    "available_gib",
    "core_for",
    "require_memory",
]

ENGINE_GIB = 3.0
"""Resident memory of one vLLM CPU engine with SmolLM2-135M and 1 GiB of KV cache (both
processes), rounded up from what ``ps`` shows for one here (~2.5 GiB)."""
_MARGIN_GIB = 1.0  # the parent, the cache server and the page cache a start reads through


class NotEnoughMemory(RuntimeError):
    """The machine has too little free memory for the engines about to start."""


def allowed_cores() -> list[int]:
    """The CPU cores this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


def core_for(index: int) -> int:
    """The core the ``index``-th engine binds its thread to: round robin over the cores."""
    cores = allowed_cores()
    return cores[index % len(cores)]


def available_gib(meminfo: Path = Path("/proc/meminfo")) -> float:
    """``MemAvailable`` in GiB: what the kernel can give without swapping."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)  # the line is in KiB
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def require_memory(engines: int, meminfo: Path = Path("/proc/meminfo")) -> None:
    """Raise :class:`NotEnoughMemory` unless ``engines`` more engines fit in free memory."""
    need = engines * ENGINE_GIB + _MARGIN_GIB
    free = available_gib(meminfo)
    if free < need:
        raise NotEnoughMemory(
            f"{engines} vLLM engines need about {need:.1f} GiB ({ENGINE_GIB:.1f} GiB each "
            f"plus {_MARGIN_GIB:.1f}) but only {free:.1f} GiB is available (MemAvailable in "
            f"{meminfo}); stop other engines or run fewer at once"
        )
