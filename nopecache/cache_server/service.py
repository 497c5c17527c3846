"""The ``nopecache.v1.KVCache`` gRPC servicer (grpc.aio) over a TieredStore.

A codec, in the shape of grpc's route_guide example: each RPC decodes its request, calls
the transfer rules (``transfer_put.py``: Put admission, staging, verification, quotas,
storing; ``transfer_get.py``: key lists and Get reads, shared with the bulk stream of
``bulk.py``) and encodes what they return. A :class:`~.refusal.Refusal` becomes the
call's status in one place, ``_abort`` (the kind's code from ``codes.STATUS``, the
message as details).

Wire rules (see proto/cache.proto):

* Keys travel packed: one ``bytes`` of concatenated 16-byte keys, split by
  ``GetRules.keys`` with one numpy call instead of a Python loop over slices. Lookup
  answers one byte per key.
* Blocks travel in frames of at most ``max_frame_data_bytes``; a frame with a key starts a
  block, frames without one continue it.
* The two block-carrying messages, PutFrame (in) and GetFrame (out), bypass the protobuf
  runtime: their codecs are the wire contract's (proto/frames.py), shared with the
  client. Everything else uses the generated code.

Put semantics (what a client may rely on):

* Every block is checked before anything is stored: ``proto.block.validate`` (structure,
  size, both checksums) and the frame's key against the header's key. A block that fails
  is answered ``REJECTED`` with ``INVALID_ARGUMENT`` and a reason naming the field; a block
  no tier can hold is ``REJECTED`` with ``RESOURCE_EXHAUSTED``. Other blocks of the same
  stream are unaffected: each block is independent (keys are content hashes, so a retry
  of the good ones is idempotent).
* Blocks are held until the stream ends cleanly and only then stored. A stream aborted
  for broken framing (``INVALID_ARGUMENT``) or a request limit (``RESOURCE_EXHAUSTED``,
  including a message over ``max_message_bytes``), cancelled by the client, or past its
  deadline, stores nothing at all. ``max_request_bytes`` bounds what one stream holds.

Tenants (see ``tenants.py``): every key a call names is mapped into the caller's
namespace before the store sees it (``Tenant.stored_key``; the identity for the anonymous
tenant of an unauthenticated server). A Put block is checked against its header with the
*client* key, then stored under the namespaced key, so blocks keep the client's key in
their header and no tenant can reach another's. Put charges each block against the
tenant's byte quota first: a block over quota is ``REJECTED`` with ``RESOURCE_EXHAUSTED``.

Same-host fast path (see ``shm.py``): AttachShm maps a client's shared-memory segment; a
Get naming the session and a window of it gets each hit that fits copied into the window
and announced by a small frame (shm_offset, shm_length) instead of data frames.

A request message that is not valid protobuf is answered ``INVALID_ARGUMENT`` (the
deserializers return :class:`MalformedRequest` instead of raising, which gRPC would turn
into ``UNKNOWN``).

Extension points: ``resolve_context`` turns each call into a :class:`RequestContext`
(peer and tenant; the tenant is set per call by ``auth.RequestGate``), and interceptors
are passed to the server by ``main.start_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import NoReturn

import grpc

from nopecache.cache_server.bulk import TICKET_TTL_S, BulkServer
from nopecache.cache_server.calls import (
    ContextResolver,
    MalformedRequest,
    RequestContext,
    default_context,
    lenient_parser,
    server_version,
)
from nopecache.cache_server.codes import STATUS, put_reply
from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.faults import FaultInjector
from nopecache.cache_server.inflight import InflightBudget, Lease
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.pins import PinTable
from nopecache.cache_server.progress import ProgressRule
from nopecache.cache_server.refusal import Refusal, bad_request
from nopecache.cache_server.removals import RemovalFeed
from nopecache.cache_server.shm import ShmSessions
from nopecache.cache_server.store import TieredStore
from nopecache.cache_server.tenants import ANONYMOUS, QuotaLedger, Tenant, own_stats
from nopecache.cache_server.tiers import redact_url
from nopecache.cache_server.transfer_get import GetRules
from nopecache.cache_server.transfer_put import FRAME_WORDING, PutIntake, PutRules, bad_framing
from nopecache.cache_server.verify import BlockVerifier
from nopecache.cache_server.zero_copy import NONCE_TTL_S, ZeroCopy
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.arena_layout import LEASE_ID_BYTES, pack_runs
from nopecache.proto.block import KEY_BYTES
from nopecache.proto.contract import API_VERSION, SERVICE_NAME
from nopecache.proto.frames import WireError, decode_put_frame, encode_get_frame
from nopecache.proto.shm_layout import host_id

__all__ = [
    "API_VERSION",
    "SERVICE_NAME",
    "ContextResolver",
    "KVCacheService",
    "MalformedRequest",
    "RequestContext",
    "add_to_server",
    "server_version",
]

log = logging.getLogger(__name__)


# -- request handling ------------------------------------------------------------------------
def _refuse_malformed(request: object) -> None:
    """Raise Refusal (BAD_REQUEST) for a request the deserializer could not parse."""
    if isinstance(request, MalformedRequest):
        raise bad_request("bad_message", request.message)


class KVCacheService:
    """Serves Lookup/Put/Get/Delete/Stats from a TieredStore, enforcing the config's limits.

    Register it with :func:`add_to_server` (Put and Get use the frame codec above, so the
    generated ``add_KVCacheServicer_to_server`` does not fit).
    """

    def __init__(
        self,
        store: TieredStore,
        config: ServerConfig,
        metrics: ServerMetrics,
        *,
        resolve_context: ContextResolver = default_context,
        quotas: QuotaLedger | None = None,
        shm: ShmSessions | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._resolve = resolve_context
        self.quotas = quotas if quotas is not None else QuotaLedger(unit_bytes=store.page_bytes)
        store.drop_listeners.append(self._on_dropped)
        # Keys that left the cache, for WatchRemovals (removals.py).
        self.removals = RemovalFeed()
        store.drop_listeners.append(self.removals.gone)
        self.verifier = BlockVerifier(config.max_block_bytes)
        self.inflight = InflightBudget(
            config.max_inflight_bytes,
            config.max_inflight_bytes_per_client,
            config.stream_idle_timeout_s,
            ProgressRule(config.min_stream_rate, config.min_rate_window_s),
        )
        # Same-host fast path: client segments attached with AttachShm (shm.py).
        self.shm = shm if shm is not None else ShmSessions()
        # Same-host zero copy (zero_copy.py): offered to the only tenant (offer_zero_copy).
        # Testing and staging only: faults on the read paths (faults.py).
        self.faults = (
            None
            if config.fault_injection is None
            else FaultInjector(config.fault_injection, metrics.fault_injected)
        )
        self.zero_copy = ZeroCopy(
            store,
            share=config.zero_copy_share,
            ttl_s=config.zero_copy_lease_ttl_s,
            faults=self.faults,
        )
        self.offer_zero_copy(() if config.auth_enabled else (ANONYMOUS.name,))
        # The bulk byte stream (bulk.py), offered by plaintext servers (offer_bulk).
        self.bulk: BulkServer | None = None
        self._tier_names = [t.name for t in store.tiers]
        self._encoded_names = [n.encode() for n in self._tier_names]
        # Code 0 is a miss; tier i answers i + 1 (index into the reply's tier_names).
        self._codes: dict[str | None, int] = {None: 0}
        self._codes.update({name: i + 1 for i, name in enumerate(self._tier_names)})
        # The transfer rules both transports speak (transfer_put.py, transfer_get.py).
        self.puts = PutRules(store, config, metrics, self.quotas, self.verifier)
        # The server's pins (Admin.Pin); a deleted block loses its pin.
        self.pins: PinTable | None = None
        self.gets = GetRules(
            store, config, metrics, self._codes, self.inflight.share_bytes, self.faults
        )
        self._info = pb.ServerInfo(
            version=server_version(),
            api_version=API_VERSION,
            host_id=host_id(),
            tier_names=self._tier_names,
            limits=pb.Limits(
                max_message_bytes=config.max_message_bytes,
                max_frame_data_bytes=config.max_frame_data_bytes,
                max_block_bytes=config.max_block_bytes,
                max_request_bytes=config.max_request_bytes,
                max_keys_per_request=config.max_keys_per_request,
                key_bytes=KEY_BYTES,
            ),
        )

    def _on_dropped(self, keys: Sequence[bytes]) -> None:
        """Blocks no tier holds any more stop counting against their tenants' quotas."""
        for name in self.quotas.forget(keys):
            self._metrics.tenant_used(name, self.quotas.used_bytes(Tenant(name)))

    @property
    def server_info(self) -> pb.ServerInfo:
        """What Stats reports about this server (version, limits, tiers)."""
        return self._info

    async def _abort(
        self, context: grpc.aio.ServicerContext, method: str, refusal: Refusal
    ) -> NoReturn:
        """Count, log and abort the RPC with the refusal's status: the one place a
        refusal becomes its gRPC form (``codes.STATUS`` and the message as details)."""
        self._metrics.rejected(method, refusal.reason)
        who = self._resolve(context)
        self._metrics.tenant_rejected(who.tenant.name, refusal.reason)
        code = STATUS[refusal.kind]
        # DEBUG, not INFO: a misbehaving client must not be able to flood the log; the
        # rejection counter is the operational signal.
        log.debug("%s from %s rejected (%s): %s", method, who.peer, code.name, refusal.message)
        await context.abort(code, refusal.message)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    # -- RPCs ----------------------------------------------------------------------------
    async def Lookup(
        self, request: pb.LookupRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupReply:
        """Which keys exist and in which tier (one byte per key)."""
        with self._metrics.latency["Lookup"].time():
            try:
                _refuse_malformed(request)
                assert isinstance(request, pb.LookupRequest)
                namespace = self._resolve(context).tenant.namespace
                keys = self.gets.keys(request.keys, "LookupRequest.keys", namespace)
            except Refusal as r:
                await self._abort(context, "Lookup", r)
            names = await self._store.lookup(keys)
            return pb.LookupReply(
                tiers=bytes(map(self._codes.__getitem__, names)), tier_names=self._tier_names
            )

    async def Put(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> pb.PutReply:
        """Receives a stream of framed blocks, validates each, stores them at stream end."""
        with self._metrics.latency["Put"].time():
            tenant = self._resolve(context).tenant
            lease = self._lease(context, tenant)
            intake: PutIntake | None = None
            try:
                intake = self.puts.intake(tenant, lease, FRAME_WORDING)
                await self._receive(request_iterator, intake, lease)
            except Refusal as r:
                # Whatever the stream holds is dropped before its room is given back
                # (close), not when the collector finds it: a cut stream's frames are
                # referenced from the refusal's traceback, and streams waiting for the
                # room would otherwise read theirs first (issue 36, finding 4).
                traceback.clear_frames(r.__traceback__)
                if intake is not None:
                    intake.drop()
                lease.close()
                await self._abort(context, "Put", r)
            # grpc.aio ends the request iterator alike for a clean close, a cancel, an
            # expired deadline and a message over the size limit (the call is then over
            # and the client has its status). Sending the initial metadata tells them
            # apart: on a call that is over it raises CancelledError, before anything is
            # stored.
            await context.send_initial_metadata(())
            return put_reply(await intake.finish())

    async def _receive(
        self, request_iterator: AsyncIterator[bytes], intake: PutIntake, lease: Lease
    ) -> None:
        """Read a Put stream's frames into ``intake``, each paced by ``lease``; raises
        Refusal."""
        most = self._config.max_message_bytes

        def credit() -> int:  # a frame of an open block comes on its reservation
            return 0 if intake.partial is not None else most

        def expect() -> int:  # the largest frame the client may be sending now
            partial = intake.partial
            if partial is None:
                return most
            return min(most, partial.total_size - partial.filled)

        frames = lease.paced(request_iterator, credit, "PutFrame: the next frame", expect)
        async for raw in frames:
            try:
                key, size, data = decode_put_frame(raw)
            except WireError as e:
                raise bad_framing(str(e)) from e
            await intake.frame(key, size, data)
        intake.end_of_frames()

    async def Get(
        self, request: pb.GetRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Streams each requested block (or a miss entry) in request order, as encoded
        GetFrames (see encode_get_frame); a reader too slow to take a frame is cut."""
        lease = self._lease(context, self._resolve(context).tenant)
        frames = self._get_frames(request, context, lease)
        # A write blocked by flow control cannot be cancelled, and the status goes out only
        # after the data the transport holds (HTTP/2 sends trailers last): on a stall the
        # window is freed at once, and the cut is answered once the write returns.
        lease.close_on_stall(frames)
        try:
            async for frame in frames:
                # gRPC shows no progress inside a frame: the reader has the frame's size at
                # the minimum rate to take it (progress.py).
                lease.begin_wait(len(frame))
                await context.write(frame)
                lease.end_wait(len(frame))
                if lease.stalled:
                    break
        except Refusal as cut:
            await self._abort(context, "Get", cut)
        if lease.stalled:
            await frames.aclose()
            lease.close()
            await self._abort(context, "Get", lease.slow_reader_cut("GetFrame"))

    def _lease(self, context: grpc.aio.ServicerContext, tenant: Tenant) -> Lease:
        """The in-flight lease of one call: its tenant's share with auth, else its
        connection's; given back when the call ends, however it ends."""
        lease = self.inflight.lease(self._owner(context, tenant))
        # The stubs type the callback as a class; any callable taking the context works.
        context.add_done_callback(lease.on_done)  # type: ignore[arg-type]
        return lease

    @staticmethod
    def _owner(context: grpc.aio.ServicerContext, tenant: Tenant) -> str:
        """Whom a call's shares are counted against: its tenant with auth, else its
        connection (a bulk connection counts against the gRPC one that asked for it)."""
        return tenant.name if tenant.namespace else context.peer()

    async def _get_frames(
        self,
        request: pb.GetRequest | MalformedRequest,
        context: grpc.aio.ServicerContext,
        lease: Lease,
    ) -> AsyncGenerator[bytes, None]:
        """The frames of a Get (``GetRules.windows`` encoded as GetFrames), or shm
        announcements of the hits copied into the request's shared-memory window."""
        with self._metrics.latency["Get"].time():
            tenant = self._resolve(context).tenant
            try:
                _refuse_malformed(request)
                assert isinstance(request, pb.GetRequest)
                keys = self.gets.keys(request.keys, "GetRequest.keys", tenant.namespace)
                target = self.shm.target(
                    tenant.name,
                    request.shm_session,
                    request.shm_offset,
                    request.shm_size,
                    context.cancelled,
                )
            except Refusal as r:
                await self._abort(context, "Get", r)
            limit = self._config.max_frame_data_bytes
            names: Sequence[bytes] = self._encoded_names
            # Into a shared-memory window, host-tier blocks are copied from their pages
            # (lent); otherwise read a window at a time.
            entries = (
                self.gets.lent(tenant, keys, lease)
                if target.active
                else self.gets.windows(tenant, keys, lease)
            )
            # aclosing: a stream cut while a window is held drops its blocks at once.
            with target:  # the shared-memory window (if any) is written only inside
                async with contextlib.aclosing(entries):
                    async for index, code, blob in entries:
                        if blob is None:
                            yield encode_get_frame(index, 0, 0, b"", names)
                            names = ()
                            continue
                        at = target.place(blob)
                        if at is not None:
                            size = (
                                sum(p.nbytes for p in blob) if isinstance(blob, list) else len(blob)
                            )
                            yield encode_get_frame(index, code, size, b"", names, (at, size))
                            names = ()
                            continue
                        if isinstance(blob, list):  # lent pages that did not fit the window
                            blob = b"".join(blob)
                        size = len(blob)
                        view = memoryview(blob)
                        yield encode_get_frame(index, code, size, view[:limit], names)
                        names = ()
                        for offset in range(limit, size, limit):
                            yield encode_get_frame(index, 0, 0, view[offset : offset + limit], ())

    async def AttachShm(
        self, request: pb.AttachShmRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttachShmReply:
        """Maps a same-host client's shared-memory segment for Get payloads (shm.py)."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
            assert isinstance(request, pb.AttachShmRequest)
            outcome = await self.shm.attach(tenant.name, request.name, request.size, request.nonce)
        except Refusal as r:
            await self._abort(context, "AttachShm", r)
        return pb.AttachShmReply(
            session=outcome.session,
            refused=outcome.refused,
            idle_timeout_ms=int(self.shm.limits.idle_s * 1000),
        )

    async def DetachShm(
        self, request: pb.DetachShmRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetachShmReply:
        """Ends a session made by AttachShm (the segment is unmapped)."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
        except Refusal as r:
            await self._abort(context, "DetachShm", r)
        assert isinstance(request, pb.DetachShmRequest)
        return pb.DetachShmReply(detached=self.shm.detach(tenant.name, request.session))

    def offer_zero_copy(self, tenants: Sequence[str]) -> None:
        """Offer the host tier's pool to same-host clients when ``tenants`` (every tenant
        calls can be tagged with) is one: one mapping shows every tenant's pages."""
        if not self._config.zero_copy:
            self.zero_copy.offer_to(None, "zero_copy is off on this server")
        elif len(tenants) != 1:
            self.zero_copy.offer_to(
                None,
                f"the pool holds the blocks of {len(tenants)} tenants (no per-tenant arenas): "
                "a mapping is offered only when the server has one tenant",
            )
        else:
            self.zero_copy.offer_to(tenants[0])

    async def OpenArena(
        self, request: pb.OpenArenaRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenArenaReply:
        """A one-use nonce for the read-only descriptor of the host tier's pool, or for the
        CUDA IPC handle of a cuda:// pool (zero_copy.py)."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
            assert isinstance(request, pb.OpenArenaRequest)
            offer = await self.zero_copy.offer(
                tenant.name, request.pid, accept_cuda_ipc=request.accept_cuda_ipc
            )
        except Refusal as r:
            await self._abort(context, "OpenArena", r)
        return pb.OpenArenaReply(
            nonce=offer.nonce,
            socket=offer.socket,
            nonce_ttl_ms=int(NONCE_TTL_S * 1000),
            arena=offer.arena,
            size=offer.size,
            refused=offer.refused,
            kind=pb.ArenaKind.ValueType(offer.kind),
            cuda_device_uuid=offer.cuda_device_uuid,
        )

    async def LeaseGet(
        self, request: pb.LeaseGetRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.LeaseGetReply:
        """Where the blocks of the keys lie in the pool, under one read lease."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
            assert isinstance(request, pb.LeaseGetRequest)
            keys = self.gets.keys(request.keys, "LeaseGetRequest.keys", tenant.namespace)
            grant = self.zero_copy.grant(tenant.name, request.arena, keys)
        except Refusal as r:
            await self._abort(context, "LeaseGet", r)
        if grant.delay_s:  # an injected fault (faults.py)
            await asyncio.sleep(grant.delay_s)
        codes = self._codes
        counts, runs = pack_runs(grant.runs)
        return pb.LeaseGetReply(
            leases=b"".join(grant.leases),
            ttl_ms=int(self.zero_copy.ttl_s * 1000),
            tiers=bytes(codes[t] if t is not None else 0 for t in grant.tiers),
            run_counts=counts,
            runs=runs,
            tried=grant.tried,
        )

    async def ReleaseLeases(
        self, request: pb.ReleaseLeasesRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseLeasesReply:
        """Ends the caller's leases among the ids (unknown ones are counted out)."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
            assert isinstance(request, pb.ReleaseLeasesRequest)
            if len(request.leases) % LEASE_ID_BYTES:
                raise bad_request(
                    "bad_leases",
                    f"ReleaseLeasesRequest.leases: {len(request.leases)} bytes is not a "
                    f"multiple of the {LEASE_ID_BYTES}-byte lease id",
                )
            self.gets.check_count(len(request.leases) // LEASE_ID_BYTES, "leases", "leases")
        except Refusal as r:
            await self._abort(context, "ReleaseLeases", r)
        ids = [
            request.leases[i : i + LEASE_ID_BYTES]
            for i in range(0, len(request.leases), LEASE_ID_BYTES)
        ]
        return pb.ReleaseLeasesReply(released=self.zero_copy.release(tenant.name, ids))

    def offer_bulk(self, host: str) -> BulkServer:
        """Serve Gets over a bulk byte stream too, bound on ``host`` (plaintext servers)."""
        self.bulk = BulkServer(
            self._metrics,
            host=host,
            inflight=self.inflight,
            puts=self.puts,
            gets=self.gets,
            config=self._config,
        )
        return self.bulk

    async def OpenBulk(
        self, request: pb.OpenBulkRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenBulkReply:
        """A one-use ticket for a bulk byte-stream connection of the caller's tenant."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
        except Refusal as r:
            await self._abort(context, "OpenBulk", r)
        if self.bulk is None:
            return pb.OpenBulkReply(refused="this server offers no bulk stream (TLS or off)")
        issued = await self.bulk.ticket(tenant, self._owner(context, tenant))
        if isinstance(issued, str):
            return pb.OpenBulkReply(refused=issued)
        port, ticket = issued
        return pb.OpenBulkReply(port=port, ticket=ticket, ticket_ttl_ms=int(TICKET_TTL_S * 1000))

    async def WatchRemovals(
        self,
        request: pb.WatchRemovalsRequest | MalformedRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.RemovalEvent]:
        """The caller's keys that leave the cache, as they go (removals.py); first an empty
        event: the watch is open."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
        except Refusal as r:
            await self._abort(context, "WatchRemovals", r)
        watcher = self.removals.watch(tenant.namespace)
        try:
            yield pb.RemovalEvent()
            while True:
                event = await watcher.next()
                yield pb.RemovalEvent(keys=event.keys, cleared=event.cleared, lost=event.lost)
        finally:
            self.removals.unwatch(watcher)

    async def Delete(
        self, request: pb.DeleteRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteReply:
        """Removes the keys from every tier."""
        with self._metrics.latency["Delete"].time():
            tenant = self._resolve(context).tenant
            try:
                _refuse_malformed(request)
                assert isinstance(request, pb.DeleteRequest)
                keys = self.gets.keys(request.keys, "DeleteRequest.keys", tenant.namespace)
            except Refusal as r:
                await self._abort(context, "Delete", r)
            deleted = await self._store.delete(keys)
            self.removals.gone(keys)
            if self.pins is not None:
                self.pins.unpin(keys)
            self.quotas.release(tenant, keys)
            if tenant.quota_bytes:
                used = self.quotas.used_bytes(tenant)
                self._metrics.tenant_usage(tenant.name, used, tenant.quota_bytes)
            return pb.DeleteReply(deleted=deleted)

    async def Stats(
        self, request: pb.StatsRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsReply:
        """Per-tier statistics plus server version and limits."""
        with self._metrics.latency["Stats"].time():
            try:
                _refuse_malformed(request)
            except Refusal as r:
                await self._abort(context, "Stats", r)
            stats = await self._store.stats()
            self._metrics.set_tier_stats(stats)
            tenant = self._resolve(context).tenant
            if tenant.namespace:
                stats = await own_stats(self.quotas, tenant, stats, self._store.lookup)
            return pb.StatsReply(
                server=self._info,
                tiers=[
                    pb.TierStats(
                        name=s.name,
                        url=redact_url(s.url),
                        used_bytes=s.used_bytes,
                        capacity_bytes=s.capacity_bytes or 0,
                        entries=s.entries,
                        healthy=s.healthy,
                    )
                    for s in stats
                ],
            )


def add_to_server(service: KVCacheService, server: grpc.aio.Server) -> None:
    """Register ``service`` as nopecache.v1.KVCache on ``server``.

    Like the generated ``add_KVCacheServicer_to_server``, except that Put receives raw
    frame bytes and Get yields encoded frames (no protobuf (de)serializer on the data path).
    """
    handlers = {
        "Lookup": grpc.unary_unary_rpc_method_handler(
            service.Lookup,
            request_deserializer=lenient_parser(pb.LookupRequest),
            response_serializer=pb.LookupReply.SerializeToString,
        ),
        "Put": grpc.stream_unary_rpc_method_handler(
            service.Put, response_serializer=pb.PutReply.SerializeToString
        ),
        "Get": grpc.unary_stream_rpc_method_handler(
            service.Get, request_deserializer=lenient_parser(pb.GetRequest)
        ),
        "Delete": grpc.unary_unary_rpc_method_handler(
            service.Delete,
            request_deserializer=lenient_parser(pb.DeleteRequest),
            response_serializer=pb.DeleteReply.SerializeToString,
        ),
        "Stats": grpc.unary_unary_rpc_method_handler(
            service.Stats,
            request_deserializer=lenient_parser(pb.StatsRequest),
            response_serializer=pb.StatsReply.SerializeToString,
        ),
        "AttachShm": grpc.unary_unary_rpc_method_handler(
            service.AttachShm,
            request_deserializer=lenient_parser(pb.AttachShmRequest),
            response_serializer=pb.AttachShmReply.SerializeToString,
        ),
        "DetachShm": grpc.unary_unary_rpc_method_handler(
            service.DetachShm,
            request_deserializer=lenient_parser(pb.DetachShmRequest),
            response_serializer=pb.DetachShmReply.SerializeToString,
        ),
        "OpenBulk": grpc.unary_unary_rpc_method_handler(
            service.OpenBulk,
            request_deserializer=lenient_parser(pb.OpenBulkRequest),
            response_serializer=pb.OpenBulkReply.SerializeToString,
        ),
        "WatchRemovals": grpc.unary_stream_rpc_method_handler(
            service.WatchRemovals,
            request_deserializer=lenient_parser(pb.WatchRemovalsRequest),
            response_serializer=pb.RemovalEvent.SerializeToString,
        ),
        "OpenArena": grpc.unary_unary_rpc_method_handler(
            service.OpenArena,
            request_deserializer=lenient_parser(pb.OpenArenaRequest),
            response_serializer=pb.OpenArenaReply.SerializeToString,
        ),
        "LeaseGet": grpc.unary_unary_rpc_method_handler(
            service.LeaseGet,
            request_deserializer=lenient_parser(pb.LeaseGetRequest),
            response_serializer=pb.LeaseGetReply.SerializeToString,
        ),
        "ReleaseLeases": grpc.unary_unary_rpc_method_handler(
            service.ReleaseLeases,
            request_deserializer=lenient_parser(pb.ReleaseLeasesRequest),
            response_serializer=pb.ReleaseLeasesReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    # Registered methods skip the generic-handler lookup per call (what generated code does).
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]
