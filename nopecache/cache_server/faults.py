"""Fault injection on the read paths, for testing and staging only (``--fault-injection``).

Off by default. When on, a seeded share of the blocks the server *sends* is damaged on
the way out, so that a client's verification and fallbacks can be proven end to end
(the parity harness runs engines against such a server)::

    --fault-injection "seed=7,rate=0.2,kinds=flip,truncate,drop,delay,delay_ms=50"

    seed       int      the fault sequence: the same seed and the same reads give the same
                        faults (one generator per read path, so paths do not disturb
                        each other's sequence)
    rate       float    share of block reads faulted, in [0, 1] (0: nothing injected)
    kinds      list     drawn uniformly per faulted read, among:
                          flip_payload  one payload byte XORed with a non-zero mask
                          flip_header   one byte before the payload (prefix, header, padding) XORed
                          flip          both of the above
                          truncate      the block cut short (announced with its new size)
                          drop          the block answered as a miss
                          delay         the block sent after ``delay_ms``
                        (default: all)
    delay_ms   int      the bounded delay, in [1, 60000] (default 50)

What is stored is never modified: a flip or a truncation acts on a copy of the bytes
being sent. Read paths (the ``path`` label):

* ``get``: the gRPC Get, data frames and the shared-memory window alike;
* ``bulk``: the bulk byte stream;
* ``zero_copy``: LeaseGet. The client maps the stored pages read-only, so flipping them
  would corrupt the store for every reader: a ``delay`` delays the LeaseGet answer, every
  other kind refuses that key's lease (counted as kind ``refuse_lease``). The client then
  fetches the key over a copying path, where the read draws a fault of its own.

Counted as ``nopecache_faults_injected_total{kind,path}``. Concurrency: everything runs
on the server's event loop; the generators change only between awaits.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from nopecache.proto.block import MAGIC, PREFIX, payload_offset

__all__ = [
    "MAX_DELAY_MS",
    "PATHS",
    "REFUSE_LEASE",
    "Fault",
    "FaultInjector",
    "FaultKind",
    "FaultPath",
    "FaultSpec",
    "FaultSpecError",
    "parse_fault_spec",
]

FaultPath = Literal["get", "bulk", "zero_copy"]
PATHS: tuple[FaultPath, ...] = ("get", "bulk", "zero_copy")
MAX_DELAY_MS = 60_000
# The counter's kind for a zero-copy read whose lease was refused instead of damaged.
REFUSE_LEASE = "refuse_lease"

# What a read path hands over: a blob, or the views of its pages in order.
Sent = bytes | memoryview | Sequence[memoryview]
S = TypeVar("S", bound=Sent)


class FaultKind(enum.Enum):
    """What a faulted read does to the block it sends."""

    FLIP_PAYLOAD = "flip_payload"
    FLIP_HEADER = "flip_header"
    TRUNCATE = "truncate"
    DROP = "drop"
    DELAY = "delay"


# ``flip`` in a spec stands for both flips.
_ALIASES = {"flip": (FaultKind.FLIP_PAYLOAD, FaultKind.FLIP_HEADER)}
_KEYS = ("seed", "rate", "kinds", "delay_ms")


class FaultSpecError(ValueError):
    """A fault-injection spec is malformed; the message names the bad part."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What to inject and how often (module docstring); validated on construction."""

    seed: int
    rate: float
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    delay_ms: int = 50

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise FaultSpecError(f"seed: must be an integer, got {self.seed!r}")
        if not 0.0 <= self.rate <= 1.0:
            raise FaultSpecError(f"rate: must be in [0, 1], got {self.rate}")
        if not self.kinds or not all(isinstance(k, FaultKind) for k in self.kinds):
            raise FaultSpecError(f"kinds: at least one of {_names()}, got {self.kinds!r}")
        if len(set(self.kinds)) != len(self.kinds):
            raise FaultSpecError(f"kinds: listed twice in {[k.value for k in self.kinds]}")
        if not 1 <= self.delay_ms <= MAX_DELAY_MS:
            raise FaultSpecError(f"delay_ms: must be in [1, {MAX_DELAY_MS}], got {self.delay_ms}")

    def __str__(self) -> str:
        kinds = ",".join(k.value for k in self.kinds)
        return f"seed={self.seed},rate={self.rate},kinds={kinds},delay_ms={self.delay_ms}"


def _names() -> list[str]:
    return [k.value for k in FaultKind] + list(_ALIASES)


def _kind(name: str) -> tuple[FaultKind, ...]:
    name = name.strip().lower()
    if name in _ALIASES:
        return _ALIASES[name]
    try:
        return (FaultKind(name),)
    except ValueError:
        raise FaultSpecError(f"kinds: {name!r} is not one of {_names()}") from None


def parse_fault_spec(text: str) -> FaultSpec | None:
    """The spec of ``key=value`` pairs (``kinds`` takes a comma list); None for "" / "off"."""
    text = text.strip()
    if text.lower() in ("", "off", "none", "0"):
        return None
    values: dict[str, list[str]] = {}
    current = ""
    for item in text.split(","):
        name, eq, value = item.partition("=")
        if eq:
            current = name.strip().lower()
            if current not in _KEYS:
                raise FaultSpecError(f"{current!r} is not one of {list(_KEYS)}")
            if current in values:
                raise FaultSpecError(f"{current}: given twice")
            values[current] = [value.strip()]
        elif current == "kinds" and item.strip():
            values["kinds"].append(item.strip())
        else:
            raise FaultSpecError(f"{item.strip()!r}: expected key=value (keys {list(_KEYS)})")
    if "rate" not in values:
        raise FaultSpecError("rate: required (the share of reads faulted, in [0, 1])")
    try:
        seed = int(values.get("seed", ["0"])[0])
    except ValueError:
        raise FaultSpecError(f"seed: expected an integer, got {values['seed'][0]!r}") from None
    try:
        rate = float(values["rate"][0])
    except ValueError:
        raise FaultSpecError(f"rate: expected a number, got {values['rate'][0]!r}") from None
    try:
        delay_ms = int(values.get("delay_ms", ["50"])[0])
    except ValueError:
        raise FaultSpecError(
            f"delay_ms: expected an integer, got {values['delay_ms'][0]!r}"
        ) from None
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    if "kinds" in values:
        kinds = tuple(k for name in values["kinds"] for k in _kind(name))
    return FaultSpec(seed=seed, rate=rate, kinds=kinds, delay_ms=delay_ms)


@dataclass(frozen=True, slots=True)
class Fault:
    """One drawn fault: its kind, where in the block (``at`` in [0, 1)) and the XOR mask."""

    kind: FaultKind
    at: float
    mask: int


class FaultInjector:
    """Draws faults per read path from the spec and applies them to copies of sent bytes."""

    def __init__(self, spec: FaultSpec, count: Callable[[str, str], None]) -> None:
        """Faults of ``spec``; ``count(kind, path)`` is called once per fault injected."""
        self.spec = spec
        self._count = count
        # One generator per path: a path's sequence depends on its own reads only.
        self._rngs = {p: random.Random(f"{spec.seed}:{p}") for p in PATHS}

    def draw(self, path: FaultPath) -> Fault | None:
        """The next read's fault on ``path`` (None: served as stored); not yet counted."""
        rng = self._rngs[path]
        # Always the same draws per read, so the sequence does not depend on outcomes.
        roll, pick, at, mask = (
            rng.random(),
            rng.randrange(1 << 30),
            rng.random(),
            rng.randrange(255),
        )
        if roll >= self.spec.rate:
            return None
        return Fault(self.spec.kinds[pick % len(self.spec.kinds)], at, mask + 1)

    def counted(self, kind: str, path: FaultPath) -> None:
        """Count one fault injected (a kind name, or ``refuse_lease``) on ``path``."""
        self._count(kind, path)

    @property
    def delay_s(self) -> float:
        """The delay of a ``delay`` fault, in seconds."""
        return self.spec.delay_ms / 1000

    async def tamper(self, path: FaultPath, sent: S) -> S | bytes | None:
        """What to send instead of ``sent`` on ``path``: ``sent`` itself (no fault, or
        after a delay), a damaged copy (bytes), or None to answer a miss."""
        fault = self.draw(path)
        if fault is None:
            return sent
        self._count(fault.kind.value, path)
        if fault.kind is FaultKind.DELAY:
            await asyncio.sleep(self.delay_s)
            return sent
        if fault.kind is FaultKind.DROP:
            return None
        return damaged(fault, sent)


def damaged(fault: Fault, sent: Sent) -> bytes:
    """A copy of ``sent`` with ``fault`` (a flip or a truncation) applied; the original
    bytes are never written."""
    blob = bytearray(sent if isinstance(sent, bytes | memoryview) else b"".join(sent))
    n = len(blob)
    if fault.kind is FaultKind.TRUNCATE:
        # At least one byte gone, at least one kept (an empty hit breaks the wire contract,
        # which is a different failure).
        return bytes(blob[: max(1, min(n - 1, int(fault.at * n)))]) if n > 1 else b""
    start, end = _header_end(blob), n
    if fault.kind is FaultKind.FLIP_HEADER:
        start, end = 0, start
    if end <= start:  # nothing of that part: flip anywhere
        start, end = 0, n
    if n:
        blob[start + int(fault.at * (end - start))] ^= fault.mask
    return bytes(blob)


def _header_end(blob: bytearray) -> int:
    """Where the block's payload starts (after prefix, msgpack header and padding); the
    whole blob when it does not start like a block."""
    if len(blob) < PREFIX.size:
        return len(blob)
    magic, header_len, _ = PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        return len(blob)
    return min(len(blob), payload_offset(header_len))
