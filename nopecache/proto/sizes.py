"""Byte sizes written by people: ``"8GiB"``, ``"512MiB"``, ``"1.5KiB"``, ``"10MB"``, ``"1000000"``.

One parser for every size in the project: server options, tier URLs, client URLs.

Binary units (KiB, MiB, GiB, TiB: powers of 1024) and decimal units (KB, MB, GB, TB:
powers of 1000) are both accepted, because operators copy numbers from both worlds
(``kubectl`` uses ``Gi``, Redis ``maxmemory`` uses ``gb``). Unit letters are
case-insensitive and a bare ``Gi``/``Mi``/``Ki`` is read as GiB/MiB/KiB. A value must come
out as a whole number of bytes: ``"1.3B"`` is an error, not 1.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["SizeError", "format_size", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*$")


class SizeError(ValueError):
    """A byte size that cannot be parsed; the message names the field it came from."""


def parse_size(value: str | int, *, field: str) -> int:
    """Parse a byte size such as ``"8GiB"`` or ``1000000`` into a non-negative int."""
    if isinstance(value, bool):
        raise SizeError(f"{field}: expected a byte size, got the boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{field}: a byte size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise SizeError(f"{field}: expected a byte size string, got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise SizeError(
            f"{field}: cannot parse {value!r} as a byte size "
            "(examples: '8GiB', '512MiB', '10MB', '1000000')"
        )
    unit = match["unit"].lower()
    multiplier = _UNITS.get(unit)
    if multiplier is None:
        raise SizeError(
            f"{field}: unknown unit {match['unit']!r} in {value!r} "
            "(use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB)"
        )
    try:
        # Decimal, not float: "1.1GB" must be exactly 1_100_000_000, not 1_100_000_000.0000002.
        exact = Decimal(match["number"]) * multiplier
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only digits
        raise SizeError(f"{field}: cannot parse {value!r} as a byte size") from exc
    if exact != exact.to_integral_value():
        raise SizeError(f"{field}: {value!r} is not a whole number of bytes ({exact} B)")
    return int(exact)


def format_size(n_bytes: int) -> str:
    """Render a byte count with the largest binary unit that keeps it exact (``8GiB``)."""
    if n_bytes < 0:
        raise SizeError(f"n_bytes: a byte size cannot be negative, got {n_bytes}")
    for unit, multiplier in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n_bytes and n_bytes % multiplier == 0:
            return f"{n_bytes // multiplier}{unit}"
    return f"{n_bytes}B"
