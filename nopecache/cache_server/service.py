"""The ``nopecache.v1.KVCache`` gRPC servicer (grpc.aio) over a TieredStore.

Wire rules (see proto/cache.proto):

* Keys travel packed: one ``bytes`` of concatenated 16-byte keys, split here with one
  numpy call instead of a Python loop over slices. Lookup answers one byte per key.
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
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import NoReturn

import grpc
import numpy as np

from nopecache.cache_server.bulk import TICKET_TTL_S, BulkServer, Staged
from nopecache.cache_server.calls import (
    ContextResolver,
    MalformedRequest,
    RequestContext,
    default_context,
    lenient_parser,
    server_version,
)
from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.inflight import InflightBudget, Lease, StreamCut
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.shm import ShmRequestError, ShmSessions, ShmTarget
from nopecache.cache_server.store import BlobTooLargeError, PutOutcome, TieredStore
from nopecache.cache_server.tenants import QuotaLedger, Tenant, namespaced_keys, own_stats
from nopecache.cache_server.tiers import redact_url
from nopecache.cache_server.verify import BlockVerifier
from nopecache.proto import cache_pb2 as pb
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

# Keys fetched from the store per step of a Get stream: up to GET_WINDOW_KEYS (to batch a
# Redis round trip for small blocks), fewer once blocks turn out large, so that one stream
# holds about GET_WINDOW_BYTES of blocks at a time (and a block is framed while its bytes
# are still in cache, not after seven others were read).
GET_WINDOW_KEYS = 8
GET_WINDOW_BYTES = 8 * 1024 * 1024
# A Put of thousands of tiny blocks gives other calls a turn of the event loop this often.
YIELD_EVERY_BLOCKS = 64
_KEY_DTYPE = np.dtype(f"V{KEY_BYTES}")

log = logging.getLogger(__name__)


# -- request handling ------------------------------------------------------------------------
class _Rejected(Exception):
    """A request-level refusal raised inside a handler; turned into an abort."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


def _bad_framing(message: str) -> _Rejected:
    return _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "bad_framing", message)


def _refuse_malformed(request: object) -> None:
    """Raise _Rejected (INVALID_ARGUMENT) for a request the deserializer could not parse."""
    if isinstance(request, MalformedRequest):
        raise _Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            "bad_message",
            f"{request.message_type}: not a valid protobuf message ({request.error})",
        )


class _PartialBlock:
    """A block whose frames are still arriving: views of the frame messages, joined once
    the last one is in (one copy, and no zero-filled buffer written first)."""

    __slots__ = ("filled", "key", "parts", "position", "total_size")

    def __init__(self, key: bytes, total_size: int, first: memoryview, position: int) -> None:
        self.key = key
        self.position = position
        self.total_size = total_size
        self.parts = [first]
        self.filled = len(first)

    def add(self, data: memoryview) -> bool:
        """Append one frame's data; True once the block is complete."""
        end = self.filled + len(data)
        if end > self.total_size:
            raise _bad_framing(
                f"PutFrame.data: block #{self.position} got {end} bytes, more than its "
                f"total_size {self.total_size}"
            )
        self.parts.append(data)
        self.filled = end
        return end == self.total_size

    def blob(self) -> bytes:
        """The complete block."""
        return b"".join(self.parts)


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
        self.verifier = BlockVerifier(config.max_block_bytes)
        self.inflight = InflightBudget(
            config.max_inflight_bytes,
            config.max_inflight_bytes_per_client,
            config.stream_idle_timeout_s,
        )
        # Same-host fast path: client segments attached with AttachShm (shm.py).
        self.shm = shm if shm is not None else ShmSessions()
        # The bulk byte stream (bulk.py), offered by plaintext servers (offer_bulk).
        self.bulk: BulkServer | None = None
        self._tier_names = [t.name for t in store.tiers]
        self._encoded_names = [n.encode() for n in self._tier_names]
        # Code 0 is a miss; tier i answers i + 1 (index into the reply's tier_names).
        self._codes: dict[str | None, int] = {None: 0}
        self._codes.update({name: i + 1 for i, name in enumerate(self._tier_names)})
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

    def _split_keys(self, packed: bytes, field: str, namespace: bytes = b"") -> list[bytes]:
        """The keys of a packed key field as stored (prefixed with ``namespace``); raises
        _Rejected when malformed or too many."""
        if len(packed) % KEY_BYTES:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                "bad_keys",
                f"{field}: {len(packed)} bytes is not a multiple of the {KEY_BYTES}-byte key",
            )
        count = len(packed) // KEY_BYTES
        if count > self._config.max_keys_per_request:
            raise _Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "too_many_keys",
                f"{field}: {count} keys exceeds max_keys_per_request "
                f"{self._config.max_keys_per_request}",
            )
        if namespace:
            return namespaced_keys(namespace, packed)
        keys: list[bytes] = np.frombuffer(packed, dtype=_KEY_DTYPE).tolist()
        return keys

    async def _abort(
        self, context: grpc.aio.ServicerContext, method: str, rejected: _Rejected | StreamCut
    ) -> NoReturn:
        """Count, log and abort the RPC with the rejection's status."""
        self._metrics.rejected(method, rejected.reason)
        who = self._resolve(context)
        self._metrics.tenant_rejected(who.tenant.name, rejected.reason)
        peer = who.peer
        # DEBUG, not INFO: a misbehaving client must not be able to flood the log; the
        # rejection counter is the operational signal.
        log.debug(
            "%s from %s rejected (%s): %s", method, peer, rejected.code.name, rejected.message
        )
        await context.abort(rejected.code, rejected.message)
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
                keys = self._split_keys(request.keys, "LookupRequest.keys", namespace)
            except _Rejected as r:
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
            try:
                results, staged = await self._receive(lease.paced(request_iterator), lease)
            except (_Rejected, StreamCut) as r:
                await self._abort(context, "Put", r)
            # grpc.aio ends the request iterator alike for a clean close, a cancel, an
            # expired deadline and a message over the size limit (the call is then over
            # and the client has its status). Sending the initial metadata tells them
            # apart: on a call that is over it raises CancelledError, before anything is
            # stored.
            await context.send_initial_metadata(())
            return await self.store_staged(tenant, results, staged)

    async def store_staged(
        self, tenant: Tenant, results: list[pb.PutResult], staged: Staged
    ) -> pb.PutReply:
        """Store the validated blocks of one Put (gRPC or bulk) for ``tenant``, each charged
        to its quota; ``results`` (one slot per block, rejections filled) completed."""
        invalid = len(results) - len(staged)
        if invalid:
            self._metrics.tenant_rejected(tenant.name, "invalid_block", invalid)
        stored_bytes = 0
        reconciled = False
        for n, (position, key, blob) in enumerate(staged, 1):
            if n % YIELD_EVERY_BLOCKS == 0:
                await asyncio.sleep(0)
            stored_key = tenant.stored_key(key)
            admitted = self.quotas.admit(tenant, stored_key, len(blob))
            if not admitted and not reconciled:
                # The ledger over-counts what tiers evicted meanwhile: recount, once.
                reconciled = True
                await self.quotas.reconcile(tenant, self._store.lookup)
                admitted = self.quotas.admit(tenant, stored_key, len(blob))
            if not admitted:
                results[position] = self._over_quota(tenant, key, position, len(blob))
                continue
            results[position] = await self._store_block(key, stored_key, blob, tenant)
            stored_bytes += len(blob)
        if self.quotas.sweep_due(tenant):
            await self.quotas.sweep(tenant, self._store.lookup)
        self._metrics.put_bytes(stored_bytes)
        self._metrics.tenant_put_bytes(tenant.name, stored_bytes)
        if tenant.quota_bytes:
            used = self.quotas.used_bytes(tenant)
            self._metrics.tenant_usage(tenant.name, used, tenant.quota_bytes)
        return pb.PutReply(results=results)

    def _over_quota(self, tenant: Tenant, key: bytes, position: int, size: int) -> pb.PutResult:
        """The result of a block refused because its tenant's quota is full."""
        self._metrics.rejected("Put", "over_quota")
        self._metrics.tenant_rejected(tenant.name, "over_quota")
        used = self.quotas.used_bytes(tenant)
        return self._rejection(
            key,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"block #{position}: quota: tenant {tenant.name} holds {used} of its "
            f"{tenant.quota_bytes}-byte quota; this block needs {self.quotas.charge_for(size)} "
            f"more ({size} bytes in {self.quotas.unit_bytes}-byte pages)",
        )

    async def _receive(
        self, frames: AsyncIterator[bytes], lease: Lease
    ) -> tuple[list[pb.PutResult], Staged]:
        """Reassemble and validate the blocks of a Put stream, each block's bytes reserved
        in ``lease`` (waiting for room) when its first frame arrives.

        Returns one result slot per block (filled for rejected blocks, placeholders for the
        valid ones) and the valid blocks as (position, key, blob), none of them stored yet.
        """
        config = self._config
        results: list[pb.PutResult] = []
        staged: Staged = []
        partial: _PartialBlock | None = None
        request_bytes = 0
        async for raw in frames:
            try:
                key, size, data = decode_put_frame(raw)
            except WireError as e:
                raise _bad_framing(str(e)) from e
            if not key:
                if partial is None:
                    raise _bad_framing(
                        "PutFrame.key: the first frame of a block must carry its key"
                    )
                if partial.add(data):
                    await self.check_block(partial.key, memoryview(partial.blob()), results, staged)
                    partial = None
                continue
            position = len(results)
            if partial is not None:
                raise _bad_framing(
                    f"PutFrame.key: block #{position} started before block #{partial.position} "
                    f"was complete ({partial.filled} of {partial.total_size} bytes)"
                )
            if len(key) != KEY_BYTES:
                raise _bad_framing(
                    f"PutFrame.key: block #{position} key is {len(key)} bytes, not {KEY_BYTES}"
                )
            if position >= config.max_keys_per_request:
                raise _Rejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "too_many_keys",
                    f"PutFrame.key: more than max_keys_per_request "
                    f"{config.max_keys_per_request} blocks in one Put",
                )
            if size == 0:
                raise _bad_framing(
                    f"PutFrame.total_size: block #{position} must give its size (> 0)"
                )
            if size > config.max_block_bytes:
                raise _Rejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "block_too_large",
                    f"PutFrame.total_size: block #{position} is {size} bytes, over "
                    f"max_block_bytes {config.max_block_bytes}",
                )
            request_bytes += size
            if request_bytes > config.max_request_bytes:
                raise _Rejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "request_too_large",
                    f"PutFrame.total_size: the stream's blocks add up to {request_bytes} bytes, "
                    f"over max_request_bytes {config.max_request_bytes}",
                )
            # Whole blocks, not frames: streams holding parts of blocks could fill the
            # budget with none of them able to finish one.
            await lease.reserve(size, f"PutFrame: block #{position}")
            results.append(pb.PutResult(key=key))
            if position % YIELD_EVERY_BLOCKS == YIELD_EVERY_BLOCKS - 1:
                await asyncio.sleep(0)  # many tiny blocks must not hold the loop
            if len(data) == size:
                # The common case, a block in one frame: kept as a view of the message.
                await self.check_block(key, data, results, staged)
            elif len(data) > size:
                raise _bad_framing(
                    f"PutFrame.data: block #{position} got {len(data)} bytes, more than its "
                    f"total_size {size}"
                )
            else:
                partial = _PartialBlock(key, size, data, position)
        if partial is not None:
            raise _bad_framing(
                f"PutFrame.data: the stream ended inside block #{partial.position} "
                f"({partial.filled} of {partial.total_size} bytes)"
            )
        return results, staged

    async def check_block(
        self, key: bytes, blob: memoryview, results: list[pb.PutResult], staged: Staged
    ) -> None:
        """Validate one complete block (the last of ``results``): stage it, or fill its
        result with the rejection."""
        position = len(results) - 1
        problem = await self.verifier.check_async(key, blob)
        if problem is None:
            staged.append((position, key, blob))
            return
        self._metrics.rejected("Put", "invalid_block")
        results[position] = self._rejection(
            key, grpc.StatusCode.INVALID_ARGUMENT, f"block #{position}: {problem}"
        )

    def _rejection(self, key: bytes, code: grpc.StatusCode, reason: str) -> pb.PutResult:
        """The result of a rejected block (counted by outcome)."""
        self._metrics.put_outcome("rejected")
        return pb.PutResult(
            key=key, outcome=pb.PUT_OUTCOME_REJECTED, code=code.value[0], reason=reason
        )

    async def _store_block(
        self, key: bytes, stored_key: bytes, blob: memoryview | bytes, tenant: Tenant
    ) -> pb.PutResult:
        """Store one validated block (client ``key``) under ``stored_key``; the outcome.

        The block's quota charge (taken by the caller) is given back when it was not stored.
        """
        try:
            outcome = await self._store.put(stored_key, blob)
        except BlobTooLargeError as e:
            self.quotas.release(tenant, (stored_key,))
            self._metrics.rejected("Put", "no_tier_fits")
            self._metrics.tenant_rejected(tenant.name, "no_tier_fits")
            return self._rejection(key, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if outcome is PutOutcome.STORED:
            self._metrics.put_outcome("stored")
            return pb.PutResult(key=key, outcome=pb.PUT_OUTCOME_STORED)
        if outcome is PutOutcome.ALREADY_PRESENT:
            self._metrics.put_outcome("already_present")
            return pb.PutResult(key=key, outcome=pb.PUT_OUTCOME_ALREADY_PRESENT)
        self.quotas.release(tenant, (stored_key,))
        self._metrics.rejected("Put", "tier_unavailable")
        self._metrics.tenant_rejected(tenant.name, "tier_unavailable")
        return self._rejection(
            key,
            grpc.StatusCode.UNAVAILABLE,
            "tiers: every tier that can hold this block is unreachable",
        )

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
                lease.begin_wait()
                await context.write(frame)
                lease.end_wait()
                if lease.stalled:
                    break
        except StreamCut as cut:
            await self._abort(context, "Get", cut)
        if lease.stalled:
            await frames.aclose()
            lease.close()
            await self._abort(context, "Get", lease.slow_reader_cut("GetFrame"))

    def _lease(self, context: grpc.aio.ServicerContext, tenant: Tenant) -> Lease:
        """The in-flight lease of one call: its tenant's share with auth, else its
        connection's; given back when the call ends, however it ends."""
        lease = self.inflight.lease(tenant.name if tenant.namespace else context.peer())
        # The stubs type the callback as a class; any callable taking the context works.
        context.add_done_callback(lease.on_done)  # type: ignore[arg-type]
        return lease

    async def _get_frames(
        self,
        request: pb.GetRequest | MalformedRequest,
        context: grpc.aio.ServicerContext,
        lease: Lease,
    ) -> AsyncGenerator[bytes, None]:
        """The frames of a Get, each window of blocks reserved in ``lease`` while sent."""
        with self._metrics.latency["Get"].time():
            tenant = self._resolve(context).tenant
            try:
                _refuse_malformed(request)
                assert isinstance(request, pb.GetRequest)
                keys = self._split_keys(request.keys, "GetRequest.keys", tenant.namespace)
                target = self._shm_target(request, tenant, context)
            except _Rejected as r:
                await self._abort(context, "Get", r)
            limit = self._config.max_frame_data_bytes
            codes = self._codes
            names: Sequence[bytes] = self._encoded_names
            sent = hits = 0
            # A window of the largest blocks must fit the client's in-flight share.
            most = max(
                1, min(GET_WINDOW_KEYS, self.inflight.share_bytes // self._config.max_block_bytes)
            )
            start, window = 0, most
            with target:  # the shared-memory window (if any) is written only inside
                while start < len(keys):
                    lease.release()  # the previous window is sent
                    found = await self._store.get_many(keys[start : start + window])
                    await lease.reserve(sum(len(f[0]) for f in found if f), "GetFrame")
                    for index, item in enumerate(found, start):
                        if item is None:
                            yield encode_get_frame(index, 0, 0, b"", names)
                            names = ()
                            continue
                        blob, tier = item
                        size = len(blob)
                        sent += size
                        hits += 1
                        at = target.place(blob)
                        if at is not None:
                            yield encode_get_frame(index, codes[tier], size, b"", names, (at, size))
                            names = ()
                            continue
                        view = memoryview(blob)
                        yield encode_get_frame(index, codes[tier], size, view[:limit], names)
                        names = ()
                        for offset in range(limit, size, limit):
                            yield encode_get_frame(index, 0, 0, view[offset : offset + limit], ())
                    start += len(found)
                    if sent:
                        window = max(1, min(most, GET_WINDOW_BYTES * hits // sent))
            self._metrics.get_bytes(sent)
            self._metrics.tenant_get_bytes(tenant.name, sent)

    def _shm_target(
        self, request: pb.GetRequest, tenant: Tenant, context: grpc.aio.ServicerContext
    ) -> ShmTarget:
        """The shared-memory window a Get names (inert without one); raises _Rejected."""
        try:
            return self.shm.target(
                tenant.name,
                request.shm_session,
                request.shm_offset,
                request.shm_size,
                context.cancelled,
            )
        except ShmRequestError as e:
            raise _Rejected(e.code, e.reason, str(e)) from e

    async def AttachShm(
        self, request: pb.AttachShmRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttachShmReply:
        """Maps a same-host client's shared-memory segment for Get payloads (shm.py)."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
            assert isinstance(request, pb.AttachShmRequest)
            outcome = await self.shm.attach(tenant.name, request.name, request.size, request.nonce)
        except ShmRequestError as e:
            await self._abort(context, "AttachShm", _Rejected(e.code, e.reason, str(e)))
        except _Rejected as r:
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
        except _Rejected as r:
            await self._abort(context, "DetachShm", r)
        assert isinstance(request, pb.DetachShmRequest)
        return pb.DetachShmReply(detached=self.shm.detach(tenant.name, request.session))

    def offer_bulk(self, host: str) -> BulkServer:
        """Serve Gets over a bulk byte stream too, bound on ``host`` (plaintext servers)."""
        self.bulk = BulkServer(
            self._store,
            self._metrics,
            host=host,
            config=self._config,
            codes=self._codes,
            inflight=self.inflight,
            intake=self,
        )
        return self.bulk

    async def OpenBulk(
        self, request: pb.OpenBulkRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenBulkReply:
        """A one-use ticket for a bulk byte-stream connection of the caller's tenant."""
        tenant = self._resolve(context).tenant
        try:
            _refuse_malformed(request)
        except _Rejected as r:
            await self._abort(context, "OpenBulk", r)
        if self.bulk is None:
            return pb.OpenBulkReply(refused="this server offers no bulk stream (TLS or off)")
        port, ticket = await self.bulk.ticket(tenant)
        return pb.OpenBulkReply(port=port, ticket=ticket, ticket_ttl_ms=int(TICKET_TTL_S * 1000))

    async def Delete(
        self, request: pb.DeleteRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteReply:
        """Removes the keys from every tier."""
        with self._metrics.latency["Delete"].time():
            tenant = self._resolve(context).tenant
            try:
                _refuse_malformed(request)
                assert isinstance(request, pb.DeleteRequest)
                keys = self._split_keys(request.keys, "DeleteRequest.keys", tenant.namespace)
            except _Rejected as r:
                await self._abort(context, "Delete", r)
            deleted = await self._store.delete(keys)
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
            except _Rejected as r:
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
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    # Registered methods skip the generic-handler lookup per call (what generated code does).
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # type: ignore[attr-defined]
