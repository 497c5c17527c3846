"""``nopecache.v1.Admin``: what an operator acts with (nopecache-admin speaks it).

Each RPC is request -> role check -> domain call -> reply. The domain lives elsewhere:
the tier chain (store.py) for lookups, flushes and TTL holds, the pin table (pins.py), the
quota ledger (tenants.py), the Put rules' drain flag (transfer_put.py). Roles come from
:data:`~nopecache.cache_server.roles.CURRENT_PRINCIPAL` (set by the AdminGate):

    verb         admin                         tenant token
    AdminStats   every tenant, every tier      itself; tiers counted over its own blocks
    AdminLookup  any tenant's keys             its own keys
    Flush        a tenant, or all              its own namespace
    Pin/Unpin    any tenant's keys             its own keys
    Drain        yes                           PERMISSION_DENIED
    GetQuota     every tenant                  itself
    SetQuota     yes                           PERMISSION_DENIED

A ``tenant`` field naming a tenant the server does not know is NOT_FOUND; a tenant naming
another tenant is PERMISSION_DENIED; malformed keys are INVALID_ARGUMENT naming the field,
and so is a request that is not valid protobuf (a raising deserializer would make gRPC
answer UNKNOWN: the requests are parsed leniently, calls.py, and refused here).

Pins and quotas: a pin keeps its block charged to the tenant (the ledger charges it if a
restart forgot it), and the tenant's pinned bytes may not exceed its quota
(RESOURCE_EXHAUSTED, nothing pinned).

Concurrency: event loop only, like the KVCache service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import grpc
from google.protobuf.message import Message

from nopecache.cache_server.auth import RequestGate
from nopecache.cache_server.calls import MalformedRequest, lenient_parser
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.pins import PinKind, PinTable
from nopecache.cache_server.refusal import Refusal
from nopecache.cache_server.roles import ADMIN_SERVICE_NAME, CURRENT_PRINCIPAL, Principal
from nopecache.cache_server.service import KVCacheService
from nopecache.cache_server.store import TieredStore
from nopecache.cache_server.tenants import Tenant, own_stats
from nopecache.cache_server.tiers import redact_url
from nopecache.cache_server.tiers.cpu import PagedTier
from nopecache.proto import cache_pb2 as pb

__all__ = ["AdminService", "add_admin_to_server"]

# How often Drain(wait) looks at the in-flight count.
_DRAIN_POLL_S = 0.05


class AdminService:
    """The Admin RPCs over one server's store, KVCache service, gate and pins."""

    def __init__(
        self,
        store: TieredStore,
        kv: KVCacheService,
        gate: RequestGate,
        pins: PinTable,
        metrics: ServerMetrics,
        *,
        on_drain: Callable[[], Awaitable[None]],
    ) -> None:
        """``on_drain`` runs once, when the server starts draining (readiness off)."""
        self._metrics = metrics
        self._store = store
        self._kv = kv
        self._gate = gate
        self._pins = pins
        self._on_drain = on_drain
        self._codes = {t.name: i + 1 for i, t in enumerate(store.tiers)}

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
        await context.abort(code, msg)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def _tenants(self) -> dict[str, Tenant]:
        return {t.name: self._gate.current(t) for t in self._gate.tenants}

    async def _target(self, context: grpc.aio.ServicerContext, name: str) -> Tenant:
        """The tenant a request acts on: ``name`` (admin), or the caller itself."""
        who = CURRENT_PRINCIPAL.get()
        if not who.admin:
            assert who.tenant is not None
            if name and name != who.tenant.name:
                await self._fail(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"tenant: a tenant token acts on its own tenant ({who.tenant.name}) only",
                )
            return who.tenant
        tenants = self._tenants()
        if not name:
            if len(tenants) == 1:
                return next(iter(tenants.values()))
            await self._fail(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tenant: required with an admin token (known: {', '.join(sorted(tenants))})",
            )
        tenant = tenants.get(name)
        if tenant is None:
            await self._fail(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"tenant: no tenant {name!r} (known: {', '.join(sorted(tenants))})",
            )
        return tenant

    async def _admin_only(self, context: grpc.aio.ServicerContext, verb: str) -> Principal:
        who = CURRENT_PRINCIPAL.get()
        if not who.admin:
            await self._fail(
                context, grpc.StatusCode.PERMISSION_DENIED, f"{verb}: needs an admin token"
            )
        return who

    async def _keys(
        self, context: grpc.aio.ServicerContext, packed: bytes, field: str, tenant: Tenant
    ) -> list[bytes]:
        try:
            return self._kv.gets.keys(packed, field, tenant.namespace)
        except Refusal as r:
            code = grpc.StatusCode.INVALID_ARGUMENT
            if r.reason == "too_many_keys":
                code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await self._fail(context, code, r.message)

    def _in_flight(self, tenant: str | None = None) -> int:
        return self._gate.limiter.in_flight(tenant)

    # -- RPCs ----------------------------------------------------------------------------
    async def AdminStats(
        self, request: pb.AdminStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminStatsReply:
        """Per-tier and per-tenant statistics (a tenant sees itself only)."""
        who = CURRENT_PRINCIPAL.get()
        stats = await self._store.stats()
        if who.admin and not request.tenant:
            tenants = list(self._tenants().values())
        else:
            tenants = [await self._target(context, request.tenant)]
        if not who.admin:
            assert who.tenant is not None
            stats = await own_stats(self._kv.quotas, who.tenant, stats, self._store.lookup)
        sample = self._metrics.registry.get_sample_value
        tiers = []
        for s, tier in zip(stats, self._store.tiers, strict=True):
            page = tier.page_bytes if isinstance(tier, PagedTier) else 0
            tiers.append(
                pb.AdminTierStats(
                    name=s.name,
                    url=redact_url(s.url),
                    entries=s.entries,
                    used_bytes=s.used_bytes,
                    capacity_bytes=s.capacity_bytes or 0,
                    pages=s.used_bytes // page if page else 0,
                    hits=int(sample("nopecache_hits_total", {"tier": s.name}) or 0)
                    if who.admin
                    else 0,
                    evictions=int(sample("nopecache_evictions_total", {"tier": s.name}) or 0)
                    if who.admin
                    else 0,
                    healthy=s.healthy,
                )
            )
        page_bytes = self._store.page_bytes
        out = []
        for tenant in tenants:
            used = self._kv.quotas.used_bytes(tenant)
            hits, misses = self._kv.gets.tally.get(tenant.name, (0, 0))
            pinned = self._pins.of_tenant(tenant.name)
            out.append(
                pb.AdminTenantStats(
                    tenant=tenant.name,
                    entries=self._kv.quotas.charged_keys(tenant),
                    used_bytes=used,
                    pages=used // page_bytes,
                    quota_bytes=tenant.quota_bytes,
                    pinned_entries=len(pinned),
                    pinned_bytes=self._pins.pinned_bytes(tenant.name),
                    hits=hits,
                    misses=misses,
                    in_flight=self._in_flight(tenant.name if tenant.namespace else None),
                )
            )
        return pb.AdminStatsReply(
            server=self._kv.server_info,
            tiers=tiers,
            tenants=out,
            misses=int(sample("nopecache_misses_total") or 0) if who.admin else 0,
            in_flight=self._in_flight() if who.admin else 0,
            draining=self._kv.puts.draining,
            page_bytes=page_bytes,
        )

    async def AdminLookup(
        self, request: pb.AdminLookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminLookupReply:
        """Which keys exist, in which tier, and how they are pinned."""
        tenant = await self._target(context, request.tenant)
        keys = await self._keys(context, request.keys, "AdminLookupRequest.keys", tenant)
        where = await self._store.lookup(keys)
        pins = self._pins
        return pb.AdminLookupReply(
            tiers=bytes(self._codes[w] if w is not None else 0 for w in where),
            tier_names=[t.name for t in self._store.tiers],
            pins=bytes((p.kind if (p := pins.get(k)) is not None else PinKind.NONE) for k in keys),
            pin_ttl_ms=[int(pins.ttl_left(k) * 1000) for k in keys],
        )

    async def Flush(
        self, request: pb.FlushRequest, context: grpc.aio.ServicerContext
    ) -> pb.FlushReply:
        """Delete a tenant's namespace, or everything (admin, ``all``)."""
        if request.all:
            await self._admin_only(context, "flush all")
            if request.tenant:
                await self._fail(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "FlushRequest: give either tenant or all, not both",
                )
            prefix = b""
            affected = list(self._tenants().values())
        else:
            tenant = await self._target(context, request.tenant)
            prefix = tenant.namespace
            affected = [tenant]
        keys = await self._store.keys_with_prefix(prefix)
        deleted = await self._store.delete(keys) if keys else 0
        self._kv.removals.cleared(prefix)
        unpinned = self._pins.unpin([k for k in self._pins.pinned_keys() if k.startswith(prefix)])
        for tenant in affected:
            self._kv.quotas.release(tenant, [k for k, _ in self._kv.quotas.charges(tenant)])
        return pb.FlushReply(deleted=deleted, unpinned=len(unpinned))

    async def Pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.PinReply:
        """Pin the present keys (soft with a capped TTL, or hard)."""
        tenant = await self._target(context, request.tenant)
        keys = await self._keys(context, request.keys, "PinRequest.keys", tenant)
        if request.hard and request.ttl_ms:
            await self._fail(
                context, grpc.StatusCode.INVALID_ARGUMENT, "PinRequest: a hard pin takes no ttl_ms"
            )
        charged = dict(self._kv.quotas.charges(tenant))
        sizes: dict[bytes, int] = {}
        # A query: pinning neither refreshes recency nor promotes.
        for key, size in zip(keys, await self._store.sizes(keys), strict=True):
            if size is not None:
                sizes[key] = max(charged.get(key, 0), self._kv.quotas.charge_for(size))
        present = list(sizes)
        if tenant.quota_bytes:
            already = set(self._pins.of_tenant(tenant.name))
            total = self._pins.pinned_bytes(tenant.name) + sum(
                sizes[k] for k in present if k not in already
            )
            if total > tenant.quota_bytes:
                await self._fail(
                    context,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"pin: {total} pinned bytes would exceed tenant {tenant.name}'s quota of "
                    f"{tenant.quota_bytes} bytes (pinned bytes count against the quota)",
                )
        ttl_s = 0.0 if request.hard else self._pins.ttl_for(request.ttl_ms / 1000)
        for key in present:
            # Pinned bytes stay charged (and are charged if a restart forgot them).
            self._kv.quotas.admit(tenant, key, sizes[key])
            self._pins.pin(key, tenant.name, sizes[key], hard=request.hard, ttl_s=ttl_s)
        await self._store.hold(present, True)
        return pb.PinReply(
            pinned=len(present),
            missing=len(keys) - len(present),
            pinned_bytes=self._pins.pinned_bytes(tenant.name),
            ttl_ms=int(ttl_s * 1000),
        )

    async def Unpin(
        self, request: pb.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnpinReply:
        """Drop the pins of the keys (they become evictable; Redis gets its TTL back)."""
        tenant = await self._target(context, request.tenant)
        keys = await self._keys(context, request.keys, "UnpinRequest.keys", tenant)
        gone = self._pins.unpin(keys)
        await self._store.hold(gone, False)
        return pb.UnpinReply(unpinned=len(gone))

    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainReply:
        """Refuse new Puts, turn readiness off; with ``wait``, answer once idle; then flush the
        tiers' writes (the disk tier's fsync)."""
        await self._admin_only(context, "drain")
        if not self._kv.puts.draining:
            self._kv.puts.draining = True
            await self._on_drain()
        if request.wait:
            deadline = time.monotonic() + (request.timeout_ms / 1000 if request.timeout_ms else 30)
            while self._in_flight() and time.monotonic() < deadline:
                await asyncio.sleep(_DRAIN_POLL_S)
        # Writes already accepted reach the disk (fsync) before the caller is told to go on.
        await self._store.flush()
        return pb.DrainReply(draining=True, in_flight=self._in_flight())

    async def GetQuota(
        self, request: pb.GetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> pb.QuotaReply:
        """Quota, usage and pinned bytes of the tenants the caller may see."""
        who = CURRENT_PRINCIPAL.get()
        if who.admin and not request.tenant:
            tenants: Sequence[Tenant] = list(self._tenants().values())
        else:
            tenants = [await self._target(context, request.tenant)]
        return self._quotas(tenants)

    async def SetQuota(
        self, request: pb.SetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> pb.QuotaReply:
        """Set a tenant's quota until restart (0: none); already-stored bytes stay."""
        await self._admin_only(context, "quota set")
        tenant = await self._target(context, request.tenant)
        self._gate.quota_overrides[tenant.name] = request.quota_bytes
        return self._quotas([self._gate.current(tenant)])

    def _quotas(self, tenants: Sequence[Tenant]) -> pb.QuotaReply:
        return pb.QuotaReply(
            tenants=[
                pb.TenantQuota(
                    tenant=t.name,
                    quota_bytes=t.quota_bytes,
                    used_bytes=self._kv.quotas.used_bytes(t),
                    pinned_bytes=self._pins.pinned_bytes(t.name),
                )
                for t in tenants
            ]
        )


_METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    "AdminStats": (pb.AdminStatsRequest, pb.AdminStatsReply),
    "AdminLookup": (pb.AdminLookupRequest, pb.AdminLookupReply),
    "Flush": (pb.FlushRequest, pb.FlushReply),
    "Pin": (pb.PinRequest, pb.PinReply),
    "Unpin": (pb.UnpinRequest, pb.UnpinReply),
    "Drain": (pb.DrainRequest, pb.DrainReply),
    "GetQuota": (pb.GetQuotaRequest, pb.QuotaReply),
    "SetQuota": (pb.SetQuotaRequest, pb.QuotaReply),
}


Rpc = Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]]


def _parsed(rpc: Rpc) -> Rpc:
    """``rpc`` behind a check that answers INVALID_ARGUMENT to a request that did not parse."""

    async def call(
        request: Message | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> Message:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
        return await rpc(request, context)

    return call


def add_admin_to_server(service: AdminService, server: grpc.aio.Server) -> None:
    """Register ``service`` as nopecache.v1.Admin on ``server``."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _parsed(getattr(service, name)),
            request_deserializer=lenient_parser(request),
            response_serializer=reply.SerializeToString,
        )
        for name, (request, reply) in _METHODS.items()
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(ADMIN_SERVICE_NAME, handlers),)
    )
