"""The placement-kernel probe of vLLM engine tests (see ``sitecustomize.py`` here)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

__all__ = ["KernelProbe"]


class KernelProbe:
    """A file the engines' placement-kernel calls are logged to, and its reader."""

    def __init__(self, path: Path) -> None:
        """Log to ``path`` (created empty)."""
        self.path = path
        path.write_text("")
        self._read = 0

    def env(self) -> dict[str, str]:
        """Environment for an engine whose kernel calls are to be logged."""
        here = str(Path(__file__).parent)
        rest = os.environ.get("PYTHONPATH", "")
        return {
            "NOPECACHE_KERNEL_PROBE": str(self.path),
            "PYTHONPATH": f"{here}:{rest}" if rest else here,
        }

    def take(self) -> Counter[str]:
        """Slots written per mode (nope, same, moved) since the last call, and ``calls``."""
        lines = self.path.read_text().splitlines()
        new, self._read = lines[self._read :], len(lines)
        out: Counter[str] = Counter()
        for line in new:
            _, mode, slots = line.split()
            out[mode] += int(slots)
            out["calls"] += 1
        return out
