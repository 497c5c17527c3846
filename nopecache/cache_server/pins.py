"""Pins: blocks an operator keeps resident (Admin.Pin), soft with a TTL or hard.

A pin is held per *stored* key (tenant tag || client key), so a tenant can only ever pin
its own blocks: the namespace is applied before a key reaches this table. What a pin
does:

- the memory tiers never evict a pinned block (``PagedTier.keep`` asks :meth:`holds`);
  a put that would need a pinned block's pages goes to the next tier instead;
- the Redis copy of a pinned block has no TTL while the pin holds (``PERSIST``), and gets
  the tier's TTL back when the pin ends (unpin, or a soft pin expiring: :meth:`expired`,
  swept by the server's monitor loop); so a pin survives a demotion to Redis;
- its bytes count against the tenant's quota: the ledger keeps the block charged, and a
  pin that would take a tenant's pinned bytes over its quota is refused.

Soft pins expire ``ttl_s`` after they were (re)pinned; the TTL is capped by the server's
``pin_max_ttl_s``. Hard pins last until unpinned or flushed. Re-pinning a key replaces
its pin (hard wins over nothing, a new soft TTL over the old one).

Concurrency: used from the event loop only; no lock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Pin", "PinKind", "PinTable"]


class PinKind(enum.IntEnum):
    """How a key is pinned; the value is the byte AdminLookupReply.pins carries."""

    NONE = 0
    SOFT = 1
    HARD = 2


@dataclass(frozen=True, slots=True)
class Pin:
    """One pin: whose block, how many bytes it holds, and when it ends (None: hard)."""

    tenant: str
    size: int
    expires_at: float | None

    @property
    def kind(self) -> PinKind:
        """SOFT or HARD."""
        return PinKind.HARD if self.expires_at is None else PinKind.SOFT


class PinTable:
    """Stored key -> :class:`Pin`; the memory tiers ask it before evicting."""

    def __init__(self, max_ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_ttl_s <= 0:
            raise ValueError(f"max_ttl_s: must be > 0, got {max_ttl_s}")
        self.max_ttl_s = max_ttl_s
        self._clock = clock
        self._pins: dict[bytes, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def ttl_for(self, ttl_s: float | None) -> float:
        """The TTL a soft pin asked for ``ttl_s`` gets (None or 0: the maximum)."""
        if not ttl_s:
            return self.max_ttl_s
        return min(ttl_s, self.max_ttl_s)

    def pin(self, key: bytes, tenant: str, size: int, *, hard: bool, ttl_s: float) -> None:
        """Pin ``key`` (replacing any pin it had): hard, or soft for ``ttl_s`` seconds."""
        expires = None if hard else self._clock() + ttl_s
        self._pins[key] = Pin(tenant, size, expires)

    def unpin(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop the pins of ``keys``; the keys that were pinned."""
        return [key for key in keys if self._pins.pop(key, None) is not None]

    def pinned_keys(self) -> list[bytes]:
        """Every pinned key (expired soft pins included until swept)."""
        return list(self._pins)

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is pinned now (an expired soft pin no longer holds)."""
        pin = self._pins.get(key)
        if pin is None:
            return False
        return pin.expires_at is None or pin.expires_at > self._clock()

    def get(self, key: bytes) -> Pin | None:
        """The pin of ``key`` if it holds now."""
        return self._pins.get(key) if self.holds(key) else None

    def ttl_left(self, key: bytes) -> float:
        """Seconds left on the soft pin of ``key`` (0 when hard or not pinned)."""
        pin = self.get(key)
        if pin is None or pin.expires_at is None:
            return 0.0
        return pin.expires_at - self._clock()

    def expired(self) -> list[bytes]:
        """Remove the soft pins whose TTL ran out; their keys (their Redis TTL comes back)."""
        now = self._clock()
        gone = [
            k for k, p in self._pins.items() if p.expires_at is not None and p.expires_at <= now
        ]
        for key in gone:
            del self._pins[key]
        return gone

    def of_tenant(self, tenant: str) -> list[bytes]:
        """The keys ``tenant`` has pinned now."""
        return [k for k, p in self._pins.items() if p.tenant == tenant and self.holds(k)]

    def pinned_bytes(self, tenant: str) -> int:
        """Bytes ``tenant`` holds pinned now."""
        return sum(p.size for k, p in self._pins.items() if p.tenant == tenant and self.holds(k))
