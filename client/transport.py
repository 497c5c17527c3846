"""One cache server seen from the client: a grpc.aio channel that never raises server failures.

:class:`ServerConnection` speaks ``nopecache.v1.KVCache`` to one server. Every method is
a coroutine on the client's event loop. A failed or slow server is an expected outcome:
an RPC error (UNAVAILABLE, DEADLINE_EXCEEDED, a connection reset mid-stream, a reply
that breaks the wire contract) is logged once per outage, counted, marks the server
*down* for ``config.down_backoff_s`` and turns its keys into misses::

    lookup  -> tier code 0 for every key
    get     -> None for every block not received yet
    put     -> PutStatus.FAILED for every block not acknowledged
    delete  -> 0,  stats -> None

While down, calls answer that way at once without touching the network; the first
call after the back-off is the probe. Retries of a failed attempt are gRPC's own
(``ClientConfig.retry`` becomes the channel's service config), never a loop here.

Not outages: UNAUTHENTICATED / PERMISSION_DENIED (a wrong token: a configuration error)
is logged once at ERROR, counted, and the server's keys are misses for
``max(down_backoff_s, 30 s)`` between probes, never a retry per call; RESOURCE_EXHAUSTED
(a busy server: max_streams_per_client) makes misses of that call only.

Security. With ``config.use_tls`` the channel uses TLS; the CA, client certificate and key
are read once, when the connection is built (an unreadable file is an
InvalidArgumentError naming its field). With ``config.token`` every call, shared-memory
ones included, carries ``authorization: Bearer <token>`` as per-call metadata (gRPC's
call credentials are refused on plaintext channels, and loopback may run without TLS).

Data path. Put and Get carry the block bytes in frames of at most the server's
``max_frame_data_bytes`` (learned once from ``Stats``). Both messages are encoded and
decoded here in protobuf wire format rather than through the generated classes, as the
server does: building a ``PutFrame`` copies its data into the message and serializing
copies it again, and reading ``GetFrame.data`` copies it out of the parsed message.
Here a Put frame is one ``b"".join`` of a small head and a memoryview slice of the blob
(one copy), and a Get frame's data is a memoryview into the received message:

    one-frame block      yielded as that view (zero copies after gRPC's own)
    multi-frame block    copied once into a buffer of total_size from a BufferPool

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
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import grpc.aio

from nopecache.client.config import SERVICE, ClientConfig
from nopecache.client.cost import CostModel
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.metrics import ClientMetrics
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import KEY_BYTES
from nopecache.proto.wire import WireError, encode_varint, read_varint

__all__ = [
    "BlockSource",
    "BufferPool",
    "FastPathFactory",
    "PutResult",
    "PutStatus",
    "ServerConnection",
    "ServerInfo",
    "ServerLimits",
    "TransportError",
    "decode_get_frame",
    "encode_put_frame",
]

log = logging.getLogger(__name__)

BytesLike = bytes | bytearray | memoryview

# Failures of these codes are about one request, not about the server: they are logged and
# counted but do not mark the server down.
_REQUEST_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
# The server is alive but refuses more work from this client now: misses for that call.
_BUSY_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
# The server rejects this client's credentials: a configuration error that retrying does
# not fix, so the server is left alone for at least _REFUSED_BACKOFF_S between probes.
_REFUSED_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
_REFUSED_BACKOFF_S = 30.0
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
# Pool size classes: blocks within 1 MiB of each other share buffers.
_POOL_GRAIN = 1024 * 1024
# gRPC's reconnect back-off grows to 120 s by default: a server back after a long outage
# would stay unused for minutes. Capped here near the client's own down back-off.
_RECONNECT_INITIAL_MS = 100


class TransportError(Exception):
    """A server's reply broke the wire contract (bad frame, wrong count, bad limits).

    Raised inside the transport (and by fast-path sources) and handled like an RPC
    failure: the server is marked down and its keys become misses.
    """


# -- wire codec of the block frames ----------------------------------------------------------
def encode_put_frame(key: bytes, total_size: int, data: BytesLike) -> bytes:
    """A PutFrame in protobuf wire format (byte-identical to ``SerializeToString``); the
    data is copied once. ``key`` and ``total_size`` are set on a block's first frame only."""
    head = bytearray()
    if key:
        head += b"\x0a" + encode_varint(len(key)) + key
    if total_size:
        head += b"\x10" + encode_varint(total_size)
    n = _nbytes(data)
    if n:
        head += b"\x1a" + encode_varint(n)
    return b"".join((head, data))


def _read(raw: bytes, pos: int) -> tuple[int, int]:
    try:
        return read_varint(raw, pos, "GetFrame")
    except WireError as e:
        raise TransportError(str(e)) from e


def decode_get_frame(raw: bytes) -> tuple[int, int, int, memoryview]:
    """(index, tier, total_size, data) of a GetFrame in wire format; ``data`` views ``raw``.

    Protobuf rules: the last occurrence of a field wins; unknown fields (the reserved
    8-15, ``tier_names``) are skipped. Raises TransportError for malformed input.
    """
    view = memoryview(raw)
    index = tier = total_size = 0
    data = view[0:0]
    pos, end = 0, len(raw)
    while pos < end:
        tag, pos = _read(raw, pos)
        field, wire = tag >> 3, tag & 7
        if field == 0:
            raise TransportError("GetFrame: field number 0 is invalid")
        if wire == 0:
            value, pos = _read(raw, pos)
            if field == 1:
                index = value
            elif field == 2:
                tier = value
            elif field == 3:
                total_size = value
            elif field in (4, 5):
                raise TransportError(f"GetFrame field {field}: expected bytes, got a varint")
        elif wire == 2:
            length, pos = _read(raw, pos)
            stop = pos + length
            if stop > end:
                raise TransportError(f"GetFrame field {field}: length runs past the message")
            if field == 4:
                data = view[pos:stop]
            elif field in (1, 2, 3):
                raise TransportError(f"GetFrame field {field}: expected a varint, got bytes")
            pos = stop
        elif wire in (1, 5) and field > 5:
            pos += 8 if wire == 1 else 4
        else:
            raise TransportError(f"GetFrame field {field}: unsupported wire type {wire}")
    if pos != end:
        raise TransportError("GetFrame: the last field runs past the end of the message")
    return index, tier, total_size, data


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
        if server.api_version != 1:
            raise TransportError(
                f"ServerInfo.api_version: {server.api_version}, this client speaks 1"
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


class PutStatus(enum.Enum):
    """What became of one block sent with :meth:`ServerConnection.put`."""

    STORED = "stored"
    ALREADY_PRESENT = "already_present"
    REJECTED = "rejected"  # the server (or the client, before sending) refused it
    FAILED = "failed"  # the server failed or was down: nothing is known to be stored


@dataclass(frozen=True, slots=True)
class PutResult:
    """The outcome of one block of a put; ``reason`` says why for REJECTED and FAILED."""

    key: bytes
    status: PutStatus
    reason: str = ""

    @property
    def ok(self) -> bool:
        """Whether the block is on the server now."""
        return self.status in (PutStatus.STORED, PutStatus.ALREADY_PRESENT)


class _Buffer(bytearray):
    """A reassembly buffer a :class:`BufferPool` handed out (the type marks it as poolable)."""


class BufferPool:
    """Reassembly buffers of multi-frame blocks, reused instead of freed.

    Why: a buffer of tens of MiB comes from mmap and page-faults its way in on first write,
    every time (measured here: 55 ms to allocate and fill 33 MiB, 6 ms to refill a reused
    one). A consumer done with a block gives its view back (``give``) and the next block of
    a similar size reuses the memory; a consumer that keeps the block simply does not.
    Buffers are pooled by size rounded up to 1 MiB, up to ``max_bytes`` in all.

    Thread-safe: ``take`` runs on the loop, ``give`` on whichever thread finished with the
    block. The lock guards the free lists for a few instructions, never across an await.
    """

    def __init__(self, max_bytes: int = 512 * 1024**2) -> None:
        """An empty pool that keeps at most ``max_bytes`` of free buffers."""
        self.max_bytes = max_bytes
        self._free: dict[int, list[_Buffer]] = {}
        self._pooled = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(size: int) -> int:
        return -(-size // _POOL_GRAIN) * _POOL_GRAIN

    def take(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes (contents undefined)."""
        cls = self._size_class(size)
        with self._lock:
            free = self._free.get(cls)
            buf = free.pop() if free else None
            if buf is not None:
                self._pooled -= cls
        if buf is None:
            buf = _Buffer(cls)
        return memoryview(buf)[:size]

    def give(self, view: memoryview) -> None:
        """Return the buffer behind ``view`` (from ``take``) once nothing reads it any more;
        views of anything else are ignored."""
        buf = view.obj
        if type(buf) is not _Buffer:
            return
        cls = len(buf)
        with self._lock:
            if self._pooled + cls <= self.max_bytes:
                self._free.setdefault(cls, []).append(buf)
                self._pooled += cls

    @property
    def pooled_bytes(self) -> int:
        """Bytes of free buffers held."""
        return self._pooled


class BlockSource(Protocol):
    """Streams the blocks of packed ``keys``: ``(index, blob view or None)`` in key order.

    Raises ``grpc.RpcError`` or :class:`TransportError` on failure (the connection turns
    that into misses). Views stay valid until the iterator is closed.
    """

    def __call__(
        self, keys: bytes, timeout: float
    ) -> AsyncIterator[tuple[int, memoryview | None]]: ...


FastPathFactory = Callable[["ServerConnection", ServerInfo], BlockSource | None]
"""Given a connection and its server's info, a faster BlockSource or None (use gRPC)."""

_PUT_OUTCOMES = {
    pb.PUT_OUTCOME_STORED: PutStatus.STORED,
    pb.PUT_OUTCOME_ALREADY_PRESENT: PutStatus.ALREADY_PRESENT,
    pb.PUT_OUTCOME_REJECTED: PutStatus.REJECTED,
}


def _method(name: str) -> str:
    return f"/{SERVICE}/{name}"


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
    ) -> None:
        """A connection to ``address`` (``host:port``); nothing is opened until first use.

        ``pool`` supplies the reassembly buffers of multi-frame blocks (a private one if
        None); give a view back to it once done with a block to have its memory reused.
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
        self._down_until = 0.0
        self._down = False
        self._refused = False  # the server rejected our credentials and has not accepted since
        self._busy = False  # a call was refused RESOURCE_EXHAUSTED and none succeeded since
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
        return time.monotonic() < self._down_until

    @property
    def down_until(self) -> float:
        """``time.monotonic()`` at which a down server is tried again (past when it is up)."""
        return self._down_until

    def _failed(self, method: str, error: BaseException) -> None:
        """Log (once per outage), count, and mark the server down unless the request was bad
        or the server only busy; a credentials refusal backs off longer (module docstring)."""
        # A reply that breaks the wire contract counts as INTERNAL (the server misbehaved).
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        code_name = code.name if code is not None else grpc.StatusCode.INTERNAL.name
        if self._metrics is not None:
            self._metrics.record_server_error(self.address, code_name)
        detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
        if code in _REQUEST_CODES:
            log.error(
                "nopecache %s %s refused the request (%s): %s",
                self.address,
                method,
                code_name,
                detail,
            )
            return
        if code in _BUSY_CODES:
            if not self._busy:
                self._busy = True
                log.warning(
                    "nopecache server %s is busy in %s (%s: %s); this call's keys are misses",
                    *(self.address, method, code_name, detail),
                )
            return
        if code in _REFUSED_CODES:
            backoff = max(self.config.down_backoff_s, _REFUSED_BACKOFF_S)
            self._down_until = time.monotonic() + backoff
            if not self._refused:
                self._refused = True
                log.error(
                    "nopecache server %s refused this client's credentials in %s (%s: %s): "
                    "check ClientConfig.token (?token=) against the server's auth tokens; "
                    "its keys are misses, asked again every %.0fs",
                    *(self.address, method, code_name, detail, backoff),
                )
            return
        self._down_until = time.monotonic() + self.config.down_backoff_s
        if not self._down:
            self._down = True
            log.warning(
                "nopecache server %s failed in %s (%s: %s); its keys are misses for %.1fs",
                self.address,
                method,
                code_name,
                detail,
                self.config.down_backoff_s,
            )

    def _unreachable(self, keys: int) -> None:
        if self._metrics is not None and keys:
            self._metrics.record_unreachable(self.address, keys)

    def _succeeded(self) -> None:
        self._busy = False
        if self._refused:
            self._refused = False
            log.info("nopecache server %s accepts this client's credentials now", self.address)
        if self._down:
            self._down = False
            log.info("nopecache server %s is answering again", self.address)

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
        except (grpc.aio.AioRpcError, TransportError) as e:
            self._failed("Stats", e)
            return None
        if self._info is None:  # another coroutine may have asked meanwhile: keep one
            self._info = info
            source = self._fast_path(self, info) if self._fast_path is not None else None
            self._source = source if source is not None else self.grpc_blocks
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
        except (grpc.aio.AioRpcError, TransportError) as e:
            self._failed("Lookup", e)
            self._unreachable(n)
            return bytes(n)
        self._succeeded()
        return bytes(out)

    async def get(self, keys: bytes) -> AsyncIterator[tuple[int, memoryview | None]]:
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
            iterators: list[AsyncIterator[tuple[int, memoryview | None]]] = []
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
                        except (grpc.aio.AioRpcError, TransportError) as e:
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
        n = _count(keys)
        expect = 0  # index of the next key whose first frame is due
        buffer: memoryview | None = None
        filled = 0
        try:
            async for raw in call:
                assert isinstance(raw, bytes)
                index, tier, total, data = decode_get_frame(raw)
                if buffer is not None:
                    # A block is being reassembled: this must be its next frame.
                    end = filled + data.nbytes
                    if index != expect or tier or total or end > buffer.nbytes or not data.nbytes:
                        raise TransportError(
                            f"GetFrame: expected more of block {expect}, got index {index}"
                        )
                    buffer[filled:end] = data
                    filled = end
                    if filled == buffer.nbytes:
                        block, buffer = buffer, None
                        expect += 1
                        yield expect - 1, block
                    continue
                if index != expect or index >= n:
                    raise TransportError(f"GetFrame.index: got {index}, expected {expect}")
                if not tier:
                    if data.nbytes or total:
                        raise TransportError(f"GetFrame: miss of key {index} carries data")
                    expect += 1
                    yield index, None
                    continue
                if total <= 0 or data.nbytes > total:
                    raise TransportError(
                        f"GetFrame.total_size: {total} for a first frame of {data.nbytes} bytes"
                    )
                if data.nbytes == total:
                    expect += 1
                    yield index, data
                    continue
                buffer = self.pool.take(total)
                buffer[: data.nbytes] = data
                filled = data.nbytes
            if expect != n:
                raise TransportError(f"Get stream ended after {expect} of {n} keys")
        finally:
            call.cancel()

    async def put(self, blobs: Sequence[tuple[bytes, BytesLike]]) -> list[PutResult]:
        """Store ``(key, blob)`` pairs; one result per pair, in order. Never raises for the
        server: a failure reports every block not acknowledged as FAILED."""
        results: list[PutResult | None] = [None] * len(blobs)
        info = await self.ensure_info() if blobs else None
        if info is None:
            self._unreachable(len(blobs))
            return [PutResult(key, PutStatus.FAILED, "server down") for key, _ in blobs]
        limits = info.limits
        # The client's own send limit also bounds a frame (minus room for the frame's head).
        frame = min(limits.max_frame_data_bytes, self.config.max_message_bytes - _FRAME_HEAD)
        streams: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        for i, (key, blob) in enumerate(blobs):
            size = _nbytes(blob)
            if size > limits.max_block_bytes:
                results[i] = PutResult(
                    key,
                    PutStatus.REJECTED,
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
        failed: BaseException | None = None
        for stream in streams:
            if failed is None:
                try:
                    reply = await call(
                        _frames([blobs[i] for i in stream], frame),
                        timeout=self.config.put_timeout_s,
                        metadata=self._metadata,
                    )
                    if len(reply.results) != len(stream):
                        raise TransportError(
                            f"PutReply.results: {len(reply.results)} for {len(stream)} blocks"
                        )
                except (grpc.aio.AioRpcError, TransportError) as e:
                    self._failed("Put", e)
                    failed = e
                else:
                    for i, r in zip(stream, reply.results, strict=True):
                        status = _PUT_OUTCOMES.get(r.outcome, PutStatus.REJECTED)
                        results[i] = PutResult(blobs[i][0], status, r.reason)
                    continue
            self._unreachable(len(stream))
            for i in stream:
                results[i] = PutResult(blobs[i][0], PutStatus.FAILED, f"server failed: {failed}")
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
        """Close the channel (in-flight calls are cancelled)."""
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None


async def _frames(blobs: Sequence[tuple[bytes, BytesLike]], frame: int) -> AsyncIterator[bytes]:
    """The PutFrames of ``blobs``, each split into data frames of at most ``frame`` bytes."""
    for key, blob in blobs:
        view = memoryview(blob).cast("B")
        size = view.nbytes
        yield encode_put_frame(key, size, view[:frame])
        for offset in range(frame, size, frame):
            yield encode_put_frame(b"", 0, view[offset : offset + frame])


def _nbytes(blob: BytesLike) -> int:
    return blob.nbytes if isinstance(blob, memoryview) else len(blob)


def _count(keys: bytes) -> int:
    if not isinstance(keys, bytes) or len(keys) % KEY_BYTES:
        raise InvalidArgumentError(
            "keys",
            f"must be packed {KEY_BYTES}-byte keys, got {type(keys).__name__} of {len(keys)} bytes",
        )
    return len(keys) // KEY_BYTES


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
