"""The storage-tier interface every tier implements, and the values it speaks in.

A tier maps opaque keys (the 16-byte block keys; any non-empty ``bytes`` works) to opaque
blobs (a serialised block: header + payload). Tiers never look inside a blob.

Six methods make a tier: ``contains_many``, ``get``, ``put``, ``delete``, ``stats`` and
``close``. The batched variants (``contains``, ``get_many``, ``delete_many``) have default
implementations in terms of those; a tier overrides them when it can batch for real
(Redis pipelines).

Expected outcomes are values: a miss is ``None``, a put that did not happen says why in
:class:`PutStatus`, an unreachable Redis is ``healthy=False`` plus misses. Exceptions are
for bugs and bad configuration (:class:`TierConfigError`, :class:`TierClosedError`).

Concurrency: a tier instance belongs to one asyncio event loop. It is not thread-safe and
not fork-safe (a Redis connection or a CUDA context must not cross ``fork``).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = [
    "SECRET_QUERY_KEYS",
    "BlobLike",
    "Evicted",
    "KeepSet",
    "PutResult",
    "PutStatus",
    "Tier",
    "TierClosedError",
    "TierConfigError",
    "TierError",
    "TierName",
    "TierStats",
    "check_key",
    "query_options",
    "redact_url",
]

TierName = Literal["cuda", "cpu", "disk", "redis"]
# What ``put`` accepts: any C-contiguous buffer (a tier copies it before returning).
BlobLike = bytes | bytearray | memoryview

# Query-string options whose value must never appear in logs, metrics or stats.
SECRET_QUERY_KEYS = frozenset({"password", "ssl_password", "token"})


class KeepSet(Protocol):
    """Keys a memory tier must not evict (the server's pins); see pins.PinTable."""

    def __len__(self) -> int: ...

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is kept now."""
        ...

    def pinned_keys(self) -> list[bytes]:
        """Every key that may be kept (a superset of those held now)."""
        ...


class TierError(Exception):
    """Base class of the errors raised by storage tiers."""


class TierConfigError(TierError, ValueError):
    """A tier URL or tier argument is invalid; the message names the offending part."""


class TierClosedError(TierError, RuntimeError):
    """An operation was attempted on a tier after ``close()``."""


class PutStatus(enum.Enum):
    """What a tier did with a blob handed to ``put``."""

    STORED = "stored"
    ALREADY_PRESENT = "already_present"
    # Larger than anything this tier can ever hold; nothing was evicted for it.
    TOO_LARGE = "too_large"
    # The tier could not be reached (Redis down or slow); nothing changed.
    UNAVAILABLE = "unavailable"
    # Room could only be made by evicting pinned blocks (pins.py): nothing was evicted.
    FULL = "full"


@dataclass(frozen=True, slots=True)
class Evicted:
    """An entry a tier removed to make room; ``blob`` is None when not requested."""

    key: bytes
    blob: bytes | None


@dataclass(frozen=True, slots=True)
class PutResult:
    """The outcome of one ``Tier.put``: its status and the entries evicted for it (LRU first)."""

    status: PutStatus
    evicted: tuple[Evicted, ...] = ()


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier: occupancy, capacity and health.

    ``used_bytes`` is what counts against ``capacity_bytes`` (for the page-pool tiers:
    pages in use x page size; for Redis: the server's ``used_memory``, summed over cluster
    primaries). ``capacity_bytes`` is None when the tier has no limit it knows of.
    ``url`` never contains a password.
    """

    name: TierName
    url: str
    used_bytes: int
    capacity_bytes: int | None
    entries: int
    healthy: bool

    def __post_init__(self) -> None:
        if self.used_bytes < 0:
            raise ValueError(f"used_bytes: must be >= 0, got {self.used_bytes}")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {self.capacity_bytes}")
        if self.entries < 0:
            raise ValueError(f"entries: must be >= 0, got {self.entries}")


class Tier(ABC):
    """One storage tier (GPU memory, host memory, Redis): async, keyed by bytes."""

    name: ClassVar[TierName]
    # Whether every blob this tier returns was put by this process (after the service
    # checked it). An untrusted tier's reads are checked again by the store.
    trusted: ClassVar[bool] = True
    # Keys this tier must not evict nor expire (the server's pins); None: none.
    keep: KeepSet | None = None
    # Stored values found damaged since start (each deleted, never served): the tiers
    # that can hold damage (Redis, disk) count them; the server exports the running count.
    corrupt_values: int = 0

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL this tier was built from, with secrets removed."""

    @property
    @abstractmethod
    def max_blob_bytes(self) -> int:
        """The largest blob ``put`` can ever accept."""

    @property
    def healthy(self) -> bool:
        """Whether the last operation reached the backing store (always True in memory)."""
        return True

    @abstractmethod
    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys`` are present; a query only (does not refresh recency)."""

    @abstractmethod
    async def get(self, key: bytes) -> bytes | None:
        """The blob stored under ``key`` (a private copy), or None on a miss."""

    @abstractmethod
    async def put(self, key: bytes, blob: BlobLike, *, keep_evicted: bool = True) -> PutResult:
        """Store ``blob`` under ``key``, evicting as needed; evicted blobs are returned
        when ``keep_evicted`` (so the caller can demote them), else only their keys."""

    @abstractmethod
    async def delete(self, key: bytes) -> bool:
        """Remove ``key``; True if it was present."""

    @abstractmethod
    async def stats(self) -> TierStats:
        """A snapshot of occupancy and health."""

    @abstractmethod
    async def close(self) -> None:
        """Release memory and connections; later operations raise TierClosedError."""

    async def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """Every stored key starting with ``prefix`` (b"": all); an admin flush's scan."""
        raise NotImplementedError(f"{self.name} tier: keys_with_prefix")

    async def flush(self) -> None:
        """Finish the writes in flight and make them durable (a disk's fsync); memory and
        Redis tiers have nothing to do."""
        return None

    async def hold(self, keys: Sequence[bytes], held: bool) -> None:
        """Keep ``keys`` from expiring while ``held`` (a pin), or let them expire again.

        Memory tiers ask their ``keep`` predicate at eviction time instead: nothing to do.
        """
        return None

    async def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present."""
        return (await self.contains_many((key,)))[0]

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The blobs for ``keys`` in order, None for each miss."""
        return [await self.get(key) for key in keys]

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove ``keys``; for each, whether it was present."""
        return [await self.delete(key) for key in keys]

    async def get_into(self, key: bytes, out: memoryview) -> int | None:
        """Copy the blob of ``key`` into ``out`` and return its size n (``out[:n]`` holds
        it), refreshing recency; None on a miss. A blob larger than ``out`` is not copied
        (the size says how much room it needs) and does not refresh recency.

        The default goes through ``get``; a tier whose bytes live in memory copies them
        straight into ``out`` instead (no intermediate blob).
        """
        blob = await self.get(key)
        if blob is None:
            return None
        if len(blob) <= out.nbytes:
            out[: len(blob)] = blob
        return len(blob)


def check_key(key: object, field: str = "key") -> bytes:
    """Return ``key`` if it is non-empty bytes, else raise TypeError/ValueError naming it."""
    if type(key) is not bytes:
        raise TypeError(f"{field}: expected bytes, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{field}: must not be empty")
    return key


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo and secret query options) replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hosts = netloc.rsplit("@", 1)
        user, sep, password = userinfo.partition(":")
        if sep and password:
            userinfo = f"{user}:***"
        netloc = f"{userinfo}@{hosts}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if k in SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*/:,"
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def query_options(query: str, *, allowed: frozenset[str], url: str) -> dict[str, str]:
    """Parse a URL query into a dict, refusing unknown or repeated options (names them)."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in allowed:
            raise TierConfigError(
                f"{redact_url(url)}: unknown option {name!r} (known: {', '.join(sorted(allowed))})"
            )
        if name in options:
            raise TierConfigError(f"{redact_url(url)}: option {name!r} given twice")
        options[name] = value
    return options
