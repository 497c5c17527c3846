"""Host memory ranges registered with CUDA as page-locked (``cudaHostRegister``).

The same-host zero-copy path registers its read-only mapping of the server's pool
(``zero_copy.Arena.register_cuda``); placement (``StagingRing``) copies a block that lies
inside a registered range straight to the GPU with one DMA, instead of first copying it
into a pinned staging buffer. Thread-safe: ranges change on the loop, lookups run on the
placement worker.
"""

from __future__ import annotations

import bisect
import threading

__all__ = ["add", "holds", "remove"]

_lock = threading.Lock()
_starts: list[int] = []
_ends: list[int] = []


def add(start: int, size: int) -> None:
    """Record ``[start, start + size)`` as registered."""
    with _lock:
        i = bisect.bisect_left(_starts, start)
        _starts.insert(i, start)
        _ends.insert(i, start + size)


def remove(start: int) -> None:
    """Forget the range that starts at ``start`` (before unregistering it)."""
    with _lock:
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            del _starts[i]
            del _ends[i]


def holds(start: int, size: int) -> bool:
    """Whether ``[start, start + size)`` lies inside one registered range."""
    with _lock:
        i = bisect.bisect_right(_starts, start) - 1
        return i >= 0 and start + size <= _ends[i]
