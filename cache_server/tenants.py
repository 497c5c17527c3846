"""Tenants: who owns a block, how their keys are kept apart, and how many bytes each may hold.

Namespaces. Every block a tenant stores lives under a *stored key* that no other tenant
can name::

    stored key = tag (8 bytes) || client key (16 bytes)        24 bytes
    tag        = blake2b-64(tenant name, person="nopecache-tenant")

The prefix makes tenants' key spaces disjoint by construction, not by a hash that an
attacker could try to collide: tenant A knowing B's client key K still only reaches
``tag_A || K``, which differs from ``tag_B || K`` in the tag. Every RPC (Lookup, Put,
Get, Delete) goes through the caller's namespace, so A cannot look up, fetch, delete or
time-probe B's blocks. The tags of all configured tenants are checked to be distinct
at start-up. Without authentication there is one tenant, :data:`ANONYMOUS`, whose
namespace is empty (stored key = client key): the embedded mode pays nothing. Stored
keys never leave the server; blocks keep the client key in their header.

Quotas. :class:`QuotaLedger` bounds the bytes a tenant holds on this server. A block is
charged when a Put by the tenant stores it (or finds it already stored) and released when
the tenant deletes it. Evictions happen inside the tiers (LRU in memory, Redis's own
maxmemory policy and TTLs) and are not reported one by one, so the ledger is an upper
bound: when a tenant's next block would not fit, the ledger first *reconciles* (one
``Lookup`` of the tenant's charged keys; the ones no tier holds any more are released)
and only then refuses. Reconciliation runs at most once per ``reconcile_interval_s`` per
tenant. A quota is per server process: replicas sharing one Redis each count what was
stored through them.

Concurrency: the ledger is used from the event loop only. ``admit`` checks and charges
without awaiting, so two concurrent Puts cannot both take the last free bytes; each
charge carries a sequence number so that a reconciliation that awaited a lookup never
releases a key charged again meanwhile.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from nopecache.proto.contract import KEY_BYTES

__all__ = [
    "ANONYMOUS",
    "CURRENT_TENANT",
    "NAMESPACE_BYTES",
    "QuotaLedger",
    "Tenant",
    "TenantError",
    "check_distinct",
    "current_tenant",
    "namespace_tag",
    "namespaced_keys",
]

NAMESPACE_BYTES = 8
_PERSON = b"nopecache-tenant"
# Letters, digits and ._- (a Prometheus label value and a log token without quoting).
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TenantError(ValueError):
    """A tenant definition is invalid; the message names the tenant and the field."""


def namespace_tag(name: str) -> bytes:
    """The 8-byte key prefix of the tenant called ``name``."""
    return hashlib.blake2b(name.encode(), digest_size=NAMESPACE_BYTES, person=_PERSON).digest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant: its name (metrics, logs), key namespace and byte quota (0: unlimited)."""

    name: str
    quota_bytes: int = 0
    namespace: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise TenantError(
                f"tenant name: {self.name!r} must be 1-64 characters of letters, digits, "
                "'.', '_' or '-', starting with a letter or digit"
            )
        if isinstance(self.quota_bytes, bool) or not isinstance(self.quota_bytes, int):
            raise TenantError(f"tenant {self.name}: quota_bytes must be an int")
        if self.quota_bytes < 0:
            raise TenantError(f"tenant {self.name}: quota_bytes must be >= 0")
        if len(self.namespace) not in (0, NAMESPACE_BYTES):
            raise TenantError(
                f"tenant {self.name}: namespace must be empty or {NAMESPACE_BYTES} bytes"
            )

    @classmethod
    def named(cls, name: str, quota_bytes: int = 0) -> Tenant:
        """A tenant with its own namespace derived from ``name``."""
        cls(name)  # validate the name before hashing it
        return cls(name, quota_bytes, namespace_tag(name))

    def stored_key(self, key: bytes) -> bytes:
        """Where this tenant's block ``key`` lives in the tiers."""
        return self.namespace + key


# The only tenant when authentication is off: the embedded mode, keys stored as given.
ANONYMOUS = Tenant("anonymous")

CURRENT_TENANT: contextvars.ContextVar[Tenant] = contextvars.ContextVar(
    "nopecache_tenant", default=ANONYMOUS
)


def current_tenant() -> Tenant:
    """The tenant of the RPC being served (set by the request gate; ANONYMOUS otherwise)."""
    return CURRENT_TENANT.get()


def check_distinct(tenants: Iterable[Tenant]) -> None:
    """Raise TenantError if two tenants share a name or a namespace tag."""
    by_tag: dict[bytes, str] = {}
    names: set[str] = set()
    for t in tenants:
        if t.name in names:
            raise TenantError(f"tenant {t.name}: defined twice")
        names.add(t.name)
        other = by_tag.setdefault(t.namespace, t.name)
        if other != t.name:
            raise TenantError(f"tenants {other} and {t.name}: namespace tags collide; rename one")


def namespaced_keys(namespace: bytes, packed: bytes | memoryview) -> list[bytes]:
    """The stored keys for the packed 16-byte client ``keys`` (length already checked)."""
    count = len(packed) // KEY_BYTES
    width = len(namespace) + KEY_BYTES
    # One numpy pass instead of a Python concatenation per key: thousands of keys per RPC.
    out = np.empty((count, width), dtype=np.uint8)
    out[:, : len(namespace)] = np.frombuffer(namespace, dtype=np.uint8)
    out[:, len(namespace) :] = np.frombuffer(packed, dtype=np.uint8).reshape(count, KEY_BYTES)
    keys: list[bytes] = out.view(np.dtype(f"V{width}")).ravel().tolist()
    return keys


LookupFn = Callable[[Sequence[bytes]], Awaitable[Sequence[object | None]]]


@dataclass(slots=True)
class _Account:
    """One tenant's charges: stored key -> (bytes, charge sequence number)."""

    used: int = 0
    charges: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    reconciled_at: float = float("-inf")


class QuotaLedger:
    """Per-tenant byte accounting against quotas (see the module docstring)."""

    def __init__(
        self,
        *,
        reconcile_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._accounts: dict[str, _Account] = {}
        self._interval = reconcile_interval_s
        self._clock = clock
        self._seq = 0

    def used_bytes(self, tenant: Tenant) -> int:
        """Bytes charged to ``tenant`` (an upper bound of what it holds)."""
        account = self._accounts.get(tenant.name)
        return account.used if account is not None else 0

    def charged_keys(self, tenant: Tenant) -> int:
        """How many blocks are charged to ``tenant``."""
        account = self._accounts.get(tenant.name)
        return len(account.charges) if account is not None else 0

    def admit(self, tenant: Tenant, key: bytes, size: int) -> bool:
        """Charge ``size`` bytes for ``key`` if the quota allows; True when admitted.

        A key already charged is admitted without a second charge. Tenants without a quota
        are always admitted and not tracked.
        """
        if not tenant.quota_bytes:
            return True
        account = self._accounts.setdefault(tenant.name, _Account())
        if key in account.charges:
            return True
        if account.used + size > tenant.quota_bytes:
            return False
        self._seq += 1
        account.charges[key] = (size, self._seq)
        account.used += size
        return True

    def release(self, tenant: Tenant, keys: Iterable[bytes]) -> int:
        """Drop the charges of ``keys`` (deleted or never stored); the bytes released."""
        account = self._accounts.get(tenant.name)
        if account is None:
            return 0
        freed = 0
        for key in keys:
            charge = account.charges.pop(key, None)
            if charge is not None:
                freed += charge[0]
        account.used -= freed
        return freed

    def reconcile_due(self, tenant: Tenant) -> bool:
        """Whether ``reconcile`` would run now for ``tenant`` (rate limit passed)."""
        account = self._accounts.get(tenant.name)
        return account is not None and self._clock() - account.reconciled_at >= self._interval

    async def reconcile(self, tenant: Tenant, lookup: LookupFn) -> int:
        """Release the charges of blocks no tier holds any more; the bytes released.

        ``lookup`` answers, per stored key, None when no tier holds it (TieredStore.lookup).
        Does nothing (returns 0) when the last reconciliation was under the interval ago.
        """
        if not self.reconcile_due(tenant):
            return 0
        account = self._accounts[tenant.name]
        account.reconciled_at = self._clock()
        snapshot = list(account.charges.items())
        if not snapshot:
            return 0
        found = await lookup([key for key, _ in snapshot])
        freed = 0
        for (key, (size, seq)), where in zip(snapshot, found, strict=True):
            if where is not None:
                continue
            current = account.charges.get(key)
            # Charged again while the lookup ran: that charge is for a new copy; keep it.
            if current is not None and current[1] == seq:
                del account.charges[key]
                freed += size
        account.used -= freed
        return freed
