"""What ``nopecache-admin`` prints: aligned tables for people, one JSON document for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from nopecache.proto.sizes import format_size

__all__ = ["as_json", "percent", "size", "table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``headers``, columns left-aligned to their widest cell."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def size(n_bytes: int) -> str:
    """Bytes as a human size (``4KiB``); ``-`` for 0 where 0 means none."""
    return format_size(n_bytes)


def percent(part: int, whole: int) -> str:
    """``part / whole`` as a percentage with one decimal; ``-`` when ``whole`` is 0."""
    return f"{100 * part / whole:.1f}%" if whole else "-"


def as_json(document: dict[str, Any]) -> str:
    """One JSON document, keys in the order given."""
    return json.dumps(document, indent=2)
