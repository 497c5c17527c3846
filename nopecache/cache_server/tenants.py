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

Quotas. :class:`QuotaLedger` bounds the bytes a tenant holds on this server, counted in
the unit the tiers allocate (``unit_bytes``: the page size of the page-pool tiers), so a
tenant's charge is what it really takes from everyone else: a 100-byte block on 64 KiB
pages costs 64 KiB. Every Put charges, a key seen before included: a block bigger than the
key's current charge pays the difference (the charge of a key is never stale-and-small
while a big block sits under it). A charge is released when the tenant deletes the block,
when the memory tiers drop it (the store's drop listeners call :meth:`QuotaLedger.forget`),
or when a *reconciliation* finds no tier holding it any more (Redis evicts by itself and
reports nothing): when a tenant's next block would not fit, the ledger first reconciles
(one ``Lookup`` of the tenant's charged keys) and only then refuses. Reconciliation runs
at most once per ``reconcile_interval_s`` per tenant. So a tenant never holds more than its
quota's worth of pages, and can never push out more than that of other tenants' data. A
quota is per server process: replicas sharing one Redis each count what was stored
through them. Named tenants are tracked even without a quota (their ``Stats`` show their
own blocks); the anonymous tenant only when it has a quota.

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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from nopecache.proto.contract import KEY_BYTES

if TYPE_CHECKING:
    from nopecache.cache_server.tiers import TierStats

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
    "own_stats",
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
    """One tenant's charges: stored key -> (bytes charged, charge sequence number)."""

    used: int = 0
    charges: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    reconciled_at: float = float("-inf")
    sweep_at: int = 4096


class QuotaLedger:
    """Per-tenant accounting, in allocation units, against quotas (see the module docstring)."""

    def __init__(
        self,
        *,
        reconcile_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        unit_bytes: int = 1,
    ) -> None:
        if unit_bytes < 1:
            raise ValueError(f"unit_bytes: must be >= 1, got {unit_bytes}")
        self._accounts: dict[str, _Account] = {}
        self._interval = reconcile_interval_s
        self._clock = clock
        self._seq = 0
        self.unit_bytes = unit_bytes

    def charge_for(self, size: int) -> int:
        """What a block of ``size`` bytes costs: whole allocation units."""
        return -(-size // self.unit_bytes) * self.unit_bytes

    def tracks(self, tenant: Tenant) -> bool:
        """Whether ``tenant``'s blocks are counted (a quota, or a namespace of its own)."""
        return bool(tenant.quota_bytes or tenant.namespace)

    def used_bytes(self, tenant: Tenant) -> int:
        """Bytes charged to ``tenant`` (an upper bound of what it holds)."""
        account = self._accounts.get(tenant.name)
        return account.used if account is not None else 0

    def charged_keys(self, tenant: Tenant) -> int:
        """How many blocks are charged to ``tenant``."""
        account = self._accounts.get(tenant.name)
        return len(account.charges) if account is not None else 0

    def charges(self, tenant: Tenant) -> list[tuple[bytes, int]]:
        """(stored key, bytes charged) of every block charged to ``tenant``."""
        account = self._accounts.get(tenant.name)
        if account is None:
            return []
        return [(key, size) for key, (size, _) in account.charges.items()]

    def _account(self, tenant: Tenant) -> _Account:
        return self._accounts.setdefault(tenant.name, _Account())

    def admit(self, tenant: Tenant, key: bytes, size: int) -> bool:
        """Charge a ``size``-byte block for ``key`` if the quota allows; True when admitted.

        A key already charged at least as much is admitted as it is; one charged less pays
        the difference. Tenants that are not tracked are always admitted.
        """
        if not self.tracks(tenant):
            return True
        account = self._account(tenant)
        charge = self.charge_for(size)
        current = account.charges.get(key)
        extra = charge - current[0] if current is not None else charge
        if extra <= 0:
            return True
        if tenant.quota_bytes and account.used + extra > tenant.quota_bytes:
            return False
        self._seq += 1
        account.charges[key] = (charge, self._seq)
        account.used += extra
        return True

    def charged(self, tenant: Tenant, key: bytes) -> int | None:
        """What ``key`` is charged to ``tenant`` now (None: nothing)."""
        account = self._accounts.get(tenant.name)
        found = account.charges.get(key) if account is not None else None
        return found[0] if found is not None else None

    def settle(self, tenant: Tenant, key: bytes, charge: int) -> None:
        """Set ``key``'s charge to ``charge`` bytes (what its stored block really costs:
        a Put answered ALREADY_PRESENT kept the block stored before, not its own)."""
        account = self._accounts.get(tenant.name)
        found = account.charges.get(key) if account is not None else None
        if account is None or found is None:
            return
        account.used += charge - found[0]
        account.charges[key] = (charge, found[1])

    def release(self, tenant: Tenant, keys: Iterable[bytes]) -> int:
        """Drop the charges of ``keys`` (deleted or never stored); the bytes released."""
        account = self._accounts.get(tenant.name)
        if account is None:
            return 0
        return self._release(account, keys)

    @staticmethod
    def _release(account: _Account, keys: Iterable[bytes]) -> int:
        freed = 0
        for key in keys:
            charge = account.charges.pop(key, None)
            if charge is not None:
                freed += charge[0]
        account.used -= freed
        return freed

    def forget(self, keys: Sequence[bytes]) -> list[str]:
        """Release the charges of stored ``keys`` that no tier holds any more, whoever owns
        them; the names of the tenants whose usage changed (a store drop listener).

        Stored keys are namespaced, so a key is charged to at most one tenant.
        """
        changed = []
        for name, account in self._accounts.items():
            if self._release(account, [k for k in keys if k in account.charges]):
                changed.append(name)
        return changed

    def sweep_due(self, tenant: Tenant) -> bool:
        """Whether a tenant without a quota has charged keys enough to recount them.

        Nothing else would ever release what Redis evicted by itself for such a tenant
        (it never reaches a quota), so its charges are recounted each time their number
        doubles: amortized, one lookup per key charged.
        """
        account = self._accounts.get(tenant.name)
        return account is not None and len(account.charges) >= account.sweep_at

    async def sweep(self, tenant: Tenant, lookup: LookupFn) -> int:
        """Recount ``tenant``'s charges now (``reconcile`` without its rate limit)."""
        account = self._account(tenant)
        account.reconciled_at = float("-inf")
        freed = await self.reconcile(tenant, lookup)
        account.sweep_at = max(4096, 2 * len(account.charges))
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


async def own_stats(
    ledger: QuotaLedger, tenant: Tenant, stats: Sequence[TierStats], lookup: LookupFn
) -> list[TierStats]:
    """``stats`` with occupancy counted over ``tenant``'s own blocks only (in charged
    pages, by the fastest tier holding each): what Stats shows a named tenant, who never
    sees the other tenants' totals."""
    charges = ledger.charges(tenant)
    where = await lookup([key for key, _ in charges])
    used = {s.name: 0 for s in stats}
    entries = dict(used)
    for (_, size), tier in zip(charges, where, strict=True):
        if isinstance(tier, str) and tier in used:
            used[tier] += size
            entries[tier] += 1
    return [replace(s, used_bytes=used[s.name], entries=entries[s.name]) for s in stats]
