"""One cache server seen from the client: a grpc.aio channel that never raises server failures.

:class:`ServerConnection` speaks ``nopecache.v1.KVCache`` to one server. Every method is
a coroutine on the client's event loop. A failed or slow server is an expected outcome:
an RPC error (UNAVAILABLE, DEADLINE_EXCEEDED, a connection reset mid-stream, a reply
that breaks the wire contract) is logged once per outage, counted, marks the server
*down* for ``config.down_backoff_s`` and turns its keys into misses::

    lookup  -> tier code 0 for every key
    get     -> None for every block not received yet
    put     -> StoreStatus.FAILED for every block not acknowledged
    delete  -> 0,  stats -> None

While down, calls answer that way at once without touching the network; the first
call after the back-off is the probe. Retries of a failed attempt are gRPC's own
(``ClientConfig.retry`` becomes the channel's service config), never a loop here.

Which failures mark the server down, for how long, and how they are logged: health.py.

Security. With ``config.use_tls`` the channel uses TLS; the CA, client certificate and key
are read once, when the connection is built (an unreadable file is an
InvalidArgumentError naming its field). With ``config.token`` every call, shared-memory
ones included, carries ``authorization: Bearer <token>`` as per-call metadata (gRPC's
call credentials are refused on plaintext channels, and loopback may run without TLS).

Data path. Put and Get carry the block bytes in frames of at most the server's
``max_frame_data_bytes`` (learned once from ``Stats``), encoded and decoded by the wire
contract's codecs (proto/frames.py) rather than the generated classes. A Put frame is
one ``b"".join`` of a small head and a memoryview slice of the blob (one copy); a Get
stream goes through the one :class:`~nopecache.proto.frames.GetFrameAssembler`:

    one-frame block      yielded as a view of the message (zero copies after gRPC's own)
    multi-frame block    copied once into a buffer of total_size from the BufferPool

Fast path seam. ``get`` reads blocks through one :data:`BlockSource` per connection: the
gRPC stream above by default. A same-host transport (shared memory) plugs in with the
``fast_path`` factory, which sees the server's :class:`ServerInfo` (``host_id``) and may
return another source; the failure handling and accounting here wrap whichever is used.
A source's views must stay valid until its iterator is closed; the consumer finishes
with every view before closing it.

Concurrency: a connection belongs to one event loop (grpc.aio channels are bound to the
loop that creates them, so the channel is created lazily on first use). Its state
(down-until, the cached server info) changes only between awaits: no locks.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import grpc
import grpc.aio

from nopecache.client.buffers import BufferPool
from nopecache.client.config import ClientConfig
from nopecache.client.cost import CostModel
from nopecache.client.cuda_arena import FetchedBlob
from nopecache.client.errors import InvalidArgumentError, TransportError
from nopecache.client.health import ServerHealth
from nopecache.client.metrics import ClientMetrics
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block_parts import EncodedBlock
from nopecache.proto.contract import API_VERSION, KEY_BYTES, method_path
from nopecache.proto.frames import GetFrameAssembler, WireError, encode_put_frame

__all__ = [
    "Blob",
    "BlockSink",
    "BlockSource",
    "BufferPool",
    "FastPathFactory",
    "ServerConnection",
    "ServerInfo",
    "ServerLimits",
    "StoreResult",
    "StoreStatus",
    "TransportError",
    "channel_credentials",
]

BytesLike = bytes | bytearray | memoryview
Blob = BytesLike | EncodedBlock
"""A block to store: one buffer, or encoded in parts (sent by a gathering write)."""

# Keepalive pings only while a call is active (idle pings would earn a GOAWAY from servers
# with default ping policies); they catch a peer that vanished without a reset.
_KEEPALIVE_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    # A cache on loopback or in-cluster must not go through an HTTP proxy from the env.
    ("grpc.enable_http_proxy", 0),
]
# Bytes of a PutFrame besides its data (tags, key, varints), with room to spare.
_FRAME_HEAD = 4096
# gRPC's reconnect back-off grows to 120 s by default: a server back after a long outage
# would stay unused for minutes. Capped here near the client's own down back-off.
_RECONNECT_INITIAL_MS = 100
# What a failed call may raise besides programming errors: all become misses.
_FAILURES = (grpc.aio.AioRpcError, TransportError, WireError)


# -- server description ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServerLimits:
    """The limits a server advertises (``Limits`` of its Stats reply); all positive."""

    max_message_bytes: int
    max_frame_data_bytes: int
    max_block_bytes: int
    max_request_bytes: int
    max_keys_per_request: int

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TransportError(f"Limits.{name}: must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a server says about itself: version, host, tiers, limits."""

    address: str
    version: str
    api_version: int
    host_id: str
    tier_names: tuple[str, ...]
    limits: ServerLimits

    @classmethod
    def from_reply(cls, address: str, reply: pb.StatsReply) -> ServerInfo:
        """The info of a Stats reply; TransportError if it breaks the contract."""
        server = reply.server
        limits = server.limits
        if server.api_version != API_VERSION:
            raise TransportError(
                f"ServerInfo.api_version: {server.api_version}, this client speaks {API_VERSION}"
            )
        if limits.key_bytes != KEY_BYTES:
            raise TransportError(f"Limits.key_bytes: {limits.key_bytes}, expected {KEY_BYTES}")
        return cls(
            address=address,
            version=server.version,
            api_version=server.api_version,
            host_id=server.host_id,
            tier_names=tuple(server.tier_names),
            limits=ServerLimits(
                max_message_bytes=limits.max_message_bytes,
                max_frame_data_bytes=limits.max_frame_data_bytes,
                max_block_bytes=limits.max_block_bytes,
                max_request_bytes=limits.max_request_bytes,
                max_keys_per_request=limits.max_keys_per_request,
            ),
        )


class StoreStatus(enum.Enum):
    """What became of one block sent with :meth:`ServerConnection.put` (the client's layer;
    the server's own outcome is ``pb.PutOutcome`` on the wire)."""

    STORED = "stored"
    ALREADY_PRESENT = "already_present"
    REJECTED = "rejected"  # the server (or the client, before sending) refused it
    FAILED = "failed"  # the server failed or was down: nothing is known to be stored


@dataclass(frozen=True, slots=True)
class StoreResult:
    """The outcome of one block of a put; ``reason`` says why for REJECTED and FAILED."""

    key: bytes
    status: StoreStatus
    reason: str = ""

    @property
    def ok(self) -> bool:
        """Whether the block is on the server now."""
        return self.status in (StoreStatus.STORED, StoreStatus.ALREADY_PRESENT)


class BlockSource(Protocol):
    """Streams the blocks of packed ``keys``: ``(index, blob view or None)`` in key order.

    Raises ``grpc.RpcError`` or :class:`TransportError` on failure (the connection turns
    that into misses). Views stay valid until the iterator is closed.
    """

    def __call__(
        self, keys: bytes, timeout: float
    ) -> AsyncIterator[tuple[int, FetchedBlob | None]]: ...


@runtime_checkable
class BlockSink(Protocol):
    """A data path that also stores: one Put stream's ``(key, blob)`` pairs, the server's
    reply, or None when it cannot take them now (the connection uses gRPC). Raises
    :class:`TransportError` on failure."""

    async def put_blocks(
        self, blobs: Sequence[tuple[bytes, Blob]], timeout: float
    ) -> pb.PutReply | None: ...


FastPathFactory = Callable[["ServerConnection", ServerInfo], BlockSource | None]
"""Given a connection and its server's info, a faster BlockSource or None (use gRPC)."""

_PUT_OUTCOMES = {
    pb.PUT_OUTCOME_STORED: StoreStatus.STORED,
    pb.PUT_OUTCOME_ALREADY_PRESENT: StoreStatus.ALREADY_PRESENT,
    pb.PUT_OUTCOME_REJECTED: StoreStatus.REJECTED,
}
_method = method_path


def _batches(n: int, size: int) -> list[range]:
    return [range(a, min(a + size, n)) for a in range(0, n, size)]


class ServerConnection:
    """The client's view of one server: lookup/get/put/delete/stats, failures as misses."""

    def __init__(
        self,
        address: str,
        config: ClientConfig,
        *,
        metrics: ClientMetrics | None = None,
        cost: CostModel | None = None,
        fast_path: FastPathFactory | None = None,
        pool: BufferPool | None = None,
        data_path: Callable[[ServerConnection], BlockSource] | None = None,
    ) -> None:
        """A connection to ``address`` (``host:port``); nothing is opened until first use.

        ``pool`` supplies the reassembly buffers of multi-frame blocks (a private one if
        None); give a view back to it once done with a block to have its memory reused.
        ``data_path`` makes the source of blocks that take no fast path (the bulk byte
        stream, client/bulk.py); None: the gRPC stream.
        """
        self.address = address
        self.pool = BufferPool() if pool is None else pool
        self.config = config
        self._metrics = metrics
        self._cost = cost
        self._fast_path = fast_path
        self._channel: grpc.aio.Channel | None = None
        self._info: ServerInfo | None = None
        self._source: BlockSource | None = None
        self._data: BlockSource | None = data_path(self) if data_path is not None else None
        self.health = ServerHealth(address, config.down_backoff_s, metrics)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {config.token}"),) if config.token else ()
        )
        # Read now, once: a missing file is a configuration error the caller sees at once,
        # not a server that seems down at the first call.
        self._credentials = _channel_credentials(config) if config.use_tls else None

    # -- channel and state ----------------------------------------------------------------
    @property
    def channel(self) -> grpc.aio.Channel:
        """The gRPC channel (created on first use, on the running loop)."""
        if self._channel is None:
            reconnect_max_ms = max(1000, int(self.config.down_backoff_s * 1000))
            options = [
                *self.config.channel_options(),
                *_KEEPALIVE_OPTIONS,
                ("grpc.initial_reconnect_backoff_ms", _RECONNECT_INITIAL_MS),
                ("grpc.min_reconnect_backoff_ms", _RECONNECT_INITIAL_MS),
                ("grpc.max_reconnect_backoff_ms", reconnect_max_ms),
            ]
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(
                    self.address, self._credentials, options=options
                )
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=options)
        return self._channel

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata every RPC carries (the bearer token, if any)."""
        return self._metadata

    @property
    def info(self) -> ServerInfo | None:
        """The server's info once a Stats call succeeded, else None."""
        return self._info

    def is_down(self) -> bool:
        """Whether the server failed (or refused our token) recently: its keys are misses."""
        return self.health.is_down()

    @property
    def down_until(self) -> float:
        """``time.monotonic()`` at which a down server is tried again (past when it is up)."""
        return self.health.down_until

    def _failed(self, method: str, error: BaseException) -> None:
        self.health.failed(method, error)

    def _unreachable(self, keys: int) -> None:
        self.health.unreachable(keys)

    def _succeeded(self) -> None:
        self.health.succeeded()

    @property
    def data_blocks(self) -> BlockSource:
        """The source of blocks that take no fast path: bulk stream if any, else gRPC."""
        return self._data if self._data is not None else self.grpc_blocks

    async def warm(self) -> bool:
        """Open the channel, learn the server's info and prepare its block sources now (shm
        session, bulk socket), so the first fetch does not pay for them; whether the
        server answered."""
        # A failed warm-up is a failed call like any other: counted, logged once, and the
        # server backs off (a server refusing our token is not asked again per call).
        info = await self.ensure_info()
        if info is None:
            return False
        sources = [self._source, self._data] if self._data is not self._source else [self._data]
        try:
            for source in sources:
                warm = getattr(source, "warm", None)
                if warm is not None:
                    await warm()
        except _FAILURES as e:
            self._failed("warm-up", e)
            return False
        return True

    async def ensure_info(self) -> ServerInfo | None:
        """The server's info, asking with Stats the first time; None while it is down (every
        call starts here, so a down server gets no calls until its back-off ends)."""
        if self.is_down():
            return None
        if self._info is not None:
            return self._info
        timeout = min(self.config.connect_timeout_s, self.config.control_timeout_s)
        try:
            reply = await self._stats_call(timeout)
            info = ServerInfo.from_reply(self.address, reply)
        except _FAILURES as e:
            self._failed("Stats", e)
            return None
        if self._info is None:  # another coroutine may have asked meanwhile: keep one
            self._info = info
            source = self._fast_path(self, info) if self._fast_path is not None else None
            self._source = source if source is not None else self.data_blocks
        self._succeeded()
        return self._info

    async def _stats_call(self, timeout: float) -> pb.StatsReply:
        call = self.channel.unary_unary(
            _method("Stats"),
            request_serializer=pb.StatsRequest.SerializeToString,
            response_deserializer=pb.StatsReply.FromString,
        )
        reply: pb.StatsReply = await call(
            pb.StatsRequest(), timeout=timeout, metadata=self._metadata
        )
        return reply

    # -- RPCs ---------------------------------------------------------------------------
    async def lookup(self, keys: bytes) -> bytes:
        """One tier code per packed key (0 = miss, including every key of a failed server)."""
        n = _count(keys)
        info = await self.ensure_info() if n else None
        if info is None:
            self._unreachable(n)
            return bytes(n)
        call = self.channel.unary_unary(
            _method("Lookup"),
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupReply.FromString,
        )
        out = bytearray()
        try:
            for batch in _batches(n, info.limits.max_keys_per_request):
                start = time.perf_counter()
                reply = await call(
                    pb.LookupRequest(keys=keys[batch.start * KEY_BYTES : batch.stop * KEY_BYTES]),
                    timeout=self.config.lookup_timeout_s,
                    metadata=self._metadata,
                )
                if len(reply.tiers) != len(batch):
                    raise TransportError(
                        f"LookupReply.tiers: {len(reply.tiers)} codes for {len(batch)} keys"
                    )
                if self._cost is not None:
                    self._cost.observe_rtt(self.address, time.perf_counter() - start)
                out += reply.tiers
        except _FAILURES as e:
            self._failed("Lookup", e)
            self._unreachable(n)
            return bytes(n)
        self._succeeded()
        return bytes(out)

    async def get(self, keys: bytes) -> AsyncIterator[tuple[int, FetchedBlob | None]]:
        """Yield ``(index, blob)`` for every packed key in order; None for a miss.

        A failure mid-stream yields None for every key not received yet (a block half
        received is dropped). The yielded views stay valid until this iterator is closed.
        """
        n = _count(keys)
        info = await self.ensure_info() if n else None
        done = 0  # keys [0, done) have been yielded
        if info is not None:
            assert self._source is not None
            received = 0  # bytes of blocks yielded, for the cost model
            start = time.perf_counter()
            iterators: list[AsyncIterator[tuple[int, FetchedBlob | None]]] = []
            try:
                for batch in _batches(n, info.limits.max_keys_per_request):
                    it = self._source(
                        keys[batch.start * KEY_BYTES : batch.stop * KEY_BYTES],
                        self.config.get_timeout_s,
                    )
                    iterators.append(it)
                    while True:
                        try:
                            index, blob = await anext(it)
                        except StopAsyncIteration:
                            break
                        except _FAILURES as e:
                            self._failed("Get", e)
                            break
                        index += batch.start
                        if index != done:
                            self._failed(
                                "Get",
                                TransportError(f"GetFrame.index: got {index}, expected {done}"),
                            )
                            break
                        if blob is not None:
                            received += blob.nbytes
                        done += 1
                        yield index, blob
                    if done < batch.stop:
                        break
                else:
                    self._succeeded()
                    seconds = time.perf_counter() - start
                    if self._cost is not None and received:
                        self._cost.observe_fetch(self.address, received, seconds)
            finally:
                for it in iterators:
                    await it.aclose()  # type: ignore[attr-defined]
        self._unreachable(n - done)
        for index in range(done, n):
            yield index, None

    async def grpc_blocks(
        self, keys: bytes, timeout: float
    ) -> AsyncIterator[tuple[int, memoryview | None]]:
        """The gRPC Get stream of ``keys``, reassembled (see the module docstring): the
        default BlockSource, and the fallback of a fast path that cannot serve a call."""
        call = self.channel.unary_stream(
            _method("Get"),
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None,  # raw frames: decoded here (decode_get_frame)
        )(pb.GetRequest(keys=keys), timeout=timeout, metadata=self._metadata)
        frames = GetFrameAssembler(_count(keys), self.pool.take)
        try:
            async for raw in call:
                assert isinstance(raw, bytes)
                entry = frames.feed(raw)
                if entry is None:
                    continue
                if entry.shm_length:
                    raise TransportError(
                        f"GetFrame.shm_length: block {entry.index} announced in shared memory "
                        "on a call that named no window"
                    )
                yield entry.index, entry.blob
            frames.finish()
        finally:
            call.cancel()

    async def put(self, blobs: Sequence[tuple[bytes, Blob]]) -> list[StoreResult]:
        """Store ``(key, blob)`` pairs; one result per pair, in order. Never raises for the
        server: a failure reports every block not acknowledged as FAILED."""
        results: list[StoreResult | None] = [None] * len(blobs)
        info = await self.ensure_info() if blobs else None
        if info is None:
            self._unreachable(len(blobs))
            return [StoreResult(key, StoreStatus.FAILED, "server down") for key, _ in blobs]
        limits = info.limits
        # The client's own send limit also bounds a frame (minus room for the frame's head).
        frame = min(limits.max_frame_data_bytes, self.config.max_message_bytes - _FRAME_HEAD)
        streams: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for i, (key, blob) in enumerate(blobs):
            size = _nbytes(blob)
            if size > limits.max_block_bytes:
                results[i] = StoreResult(
                    key,
                    StoreStatus.REJECTED,
                    f"{size} bytes is over the server's max_block_bytes {limits.max_block_bytes}",
                )
                continue
            if current and (
                current_bytes + size > limits.max_request_bytes
                or len(current) >= limits.max_keys_per_request
            ):
                streams.append(current)
                current, current_bytes = [], 0
            current.append(i)
            current_bytes += size
        if current:
            streams.append(current)
        call = self.channel.stream_unary(
            _method("Put"),
            request_serializer=None,  # frames are encoded here (encode_put_frame)
            response_deserializer=pb.PutReply.FromString,
        )
        sink = self._data if isinstance(self._data, BlockSink) else None
        failed: BaseException | None = None
        for stream in streams:
            if failed is None:
                try:
                    part = [blobs[i] for i in stream]
                    timeout = self.config.put_timeout_s
                    reply = None if sink is None else await sink.put_blocks(part, timeout)
                    if reply is None:
                        reply = await call(
                            _frames(part, frame), timeout=timeout, metadata=self._metadata
                        )
                    if len(reply.results) != len(stream):
                        raise TransportError(
                            f"PutReply.results: {len(reply.results)} for {len(stream)} blocks"
                        )
                except _FAILURES as e:
                    self._failed("Put", e)
                    failed = e
                else:
                    for i, r in zip(stream, reply.results, strict=True):
                        status = _PUT_OUTCOMES.get(r.outcome, StoreStatus.REJECTED)
                        results[i] = StoreResult(blobs[i][0], status, r.reason)
                    continue
            self._unreachable(len(stream))
            for i in stream:
                results[i] = StoreResult(
                    blobs[i][0], StoreStatus.FAILED, f"server failed: {failed}"
                )
        if failed is None:
            self._succeeded()
        return [r for r in results if r is not None]

    async def delete(self, keys: bytes) -> int:
        """Remove packed keys from every tier; how many were stored (0 if the server failed)."""
        n = _count(keys)
        info = await self.ensure_info() if n else None
        if info is None:
            return 0
        call = self.channel.unary_unary(
            _method("Delete"),
            request_serializer=pb.DeleteRequest.SerializeToString,
            response_deserializer=pb.DeleteReply.FromString,
        )
        deleted = 0
        try:
            for batch in _batches(n, info.limits.max_keys_per_request):
                reply = await call(
                    pb.DeleteRequest(keys=keys[batch.start * KEY_BYTES : batch.stop * KEY_BYTES]),
                    timeout=self.config.control_timeout_s,
                    metadata=self._metadata,
                )
                deleted += reply.deleted
        except grpc.aio.AioRpcError as e:
            self._failed("Delete", e)
        else:
            self._succeeded()
        return deleted

    async def stats(self) -> pb.StatsReply | None:
        """The server's Stats reply (tiers, limits), or None when it is down."""
        if await self.ensure_info() is None:
            return None
        try:
            reply = await self._stats_call(self.config.control_timeout_s)
        except grpc.aio.AioRpcError as e:
            self._failed("Stats", e)
            return None
        self._succeeded()
        return reply

    async def close(self) -> None:
        """Close the channel (in-flight calls are cancelled) and the data source's sockets."""
        close = getattr(self._data, "close", None)
        if close is not None:
            close()
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None


async def _frames(blobs: Sequence[tuple[bytes, Blob]], frame: int) -> AsyncIterator[bytes]:
    """The PutFrames of ``blobs``, each split into data frames of at most ``frame`` bytes
    (a block in parts is joined first: gRPC copies each frame anyway)."""
    for key, blob in blobs:
        view = memoryview(blob.join() if isinstance(blob, EncodedBlock) else blob).cast("B")
        size = view.nbytes
        yield encode_put_frame(key, size, view[:frame])
        for offset in range(frame, size, frame):
            yield encode_put_frame(b"", 0, view[offset : offset + frame])


def _nbytes(blob: Blob) -> int:
    return blob.nbytes if isinstance(blob, memoryview | EncodedBlock) else len(blob)


def _count(keys: bytes) -> int:
    if not isinstance(keys, bytes) or len(keys) % KEY_BYTES:
        raise InvalidArgumentError(
            "keys",
            f"must be packed {KEY_BYTES}-byte keys, got {type(keys).__name__} of {len(keys)} bytes",
        )
    return len(keys) // KEY_BYTES


def channel_credentials(config: ClientConfig) -> grpc.ChannelCredentials:
    """TLS credentials of ``config`` (what every connection of a client uses)."""
    return _channel_credentials(config)


def _channel_credentials(config: ClientConfig) -> grpc.ChannelCredentials:
    """TLS credentials from the config's files (the system roots when no CA is given)."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read_file("tls_ca_file", config.tls_ca_file),
        private_key=_read_file("tls_key_file", config.tls_key_file),
        certificate_chain=_read_file("tls_cert_file", config.tls_cert_file),
    )


def _read_file(field: str, path: str | None) -> bytes | None:
    """The bytes of the file a config ``field`` names; InvalidArgumentError if unreadable."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise InvalidArgumentError(field, f"cannot read {path!r}: {e.strerror or e}") from e
    if not data:
        raise InvalidArgumentError(field, f"{path!r} is empty")
    return data
