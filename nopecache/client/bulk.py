"""Client side of the bulk byte stream: Get payloads received with ``recv_into`` straight
into pooled buffers, Put payloads sent from the encoded blocks with ``sendall`` (layout
in proto/bulk.py; the server side is cache_server/bulk.py).

A Python gRPC stream delivers each frame as a fresh bytes object that the client then
copies into a block buffer; a plain socket can do in one ``recv_into`` what that does in
two copies and a Python loop per frame. :class:`BulkSource` is the connection's data
source when the server offers the stream (plaintext servers): per call it takes an idle
socket (or asks ``OpenBulk`` for a ticket and connects one), sends the keys, and reads
each block with a blocking ``recv_into`` on a worker thread (one thread hop per block;
the GIL is released while the kernel copies), so block n is placed while block n+1 is
still arriving. With ``ClientConfig.bulk_streams`` > 1 a call deals its keys out over
that many sockets (key i on socket i % S), each received by its own thread one block
ahead, and yields them in key order. :meth:`BulkSource.put_blocks` sends one Put stream's blocks (the
connection has already split them by the server's limits) and reads the server's
PutReply, on a worker thread. A socket whose call did not finish cleanly is closed,
never reused.

Checks as on the gRPC path: entries in request order, tier codes the server has, sizes
within its ``max_block_bytes`` (the block's checksums are verified at placement). The
receiving thread hashes each block's payload piece by piece as it lands (``HASH_PIECE``,
still in the CPU cache) and notes the digest on the pooled buffer; verification compares
it with the header's checksum instead of reading the payload from memory again. A
broken stream or a missed deadline raises TransportError: the connection marks the
server down, its keys become misses. A server that offers no stream (TLS, an older
server, a port this host cannot reach) makes this source use gRPC, asked again after
``RETRY_S``.

Concurrency: calls run on the connection's loop; sockets are used by one call at a time
(the idle list changes only on the loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import xxhash
from google.protobuf.message import DecodeError

from nopecache.client.buffers import BufferPool, note_payload_xxh3
from nopecache.client.config import split_server
from nopecache.client.errors import TransportError
from nopecache.client.transport import Blob, ServerConnection
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import PREFIX, payload_start
from nopecache.proto.block_parts import EncodedBlock
from nopecache.proto.bulk import (
    BLOCK,
    ENTRY,
    ERROR_CODE,
    HASH_PIECE,
    MAGIC,
    PUT_REPLY_CODE,
    check_entry,
    encode_get,
    encode_put,
    hello,
)
from nopecache.proto.contract import KEY_BYTES, method_path
from nopecache.proto.wire import WireError

__all__ = ["RETRY_S", "RUN_BYTES", "BulkSource"]

log = logging.getLogger(__name__)

RETRY_S = 30.0
_MAX_IDLE = 4
# A stream's worker thread receives blocks in runs of about this many bytes (one thread
# hop per run, not per block; a block larger than it is a run of its own). Small enough
# that placement starts soon after the first bytes arrive.
RUN_BYTES = 4 * 1024 * 1024
# A PutReply holds a result (key, outcome, code, reason) per block: far below this.
_MAX_REPLY_BYTES = 16 * 1024 * 1024
# Buffers per sendmsg call (POSIX guarantees at least 16; Linux takes 1024).
_IOV_MAX = 512


class BulkSource:
    """A connection's BlockSource over the bulk byte stream (see the module docstring)."""

    def __init__(self, conn: ServerConnection) -> None:
        """The bulk source of ``conn`` (nothing is opened until the first call)."""
        self._conn = conn
        self._idle: list[socket.socket] = []
        self._max_idle = max(_MAX_IDLE, conn.config.bulk_streams)
        self._retry_at = 0.0
        self._refused_logged = False
        self.bulk_blocks = 0
        self.bulk_puts = 0
        self.grpc_calls = 0

    @property
    def available(self) -> bool:
        """Whether calls try the bulk stream now (not refused within RETRY_S)."""
        return time.monotonic() >= self._retry_at

    async def warm(self) -> None:
        """Connect one socket ahead of the first Get."""
        if not self._idle and self.available:
            sock = await self._open(time.monotonic() + self._conn.config.connect_timeout_s)
            if sock is not None:
                self._idle.append(sock)

    def _refuse(self, quiet: bool, why: str) -> None:
        if quiet:  # one more stream the server did not give: the stream itself is fine
            return
        self._retry_at = time.monotonic() + RETRY_S
        if not self._refused_logged:
            self._refused_logged = True
            log.info("nopecache %s: no bulk stream (%s); using gRPC", self._conn.address, why)

    async def _open(self, deadline: float, *, quiet: bool = False) -> socket.socket | None:
        """A connected, welcomed socket; None (and gRPC for a while, unless ``quiet``) if
        there is none."""
        conn = self._conn
        call = conn.channel.unary_unary(
            method_path("OpenBulk"),
            request_serializer=pb.OpenBulkRequest.SerializeToString,
            response_deserializer=pb.OpenBulkReply.FromString,
        )
        try:
            reply: pb.OpenBulkReply = await call(
                pb.OpenBulkRequest(), timeout=_remaining(deadline), metadata=conn.metadata
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._refuse(quiet, "the server predates OpenBulk")
                return None
            raise  # the server is failing: the connection handles it
        if reply.refused or not reply.port:
            self._refuse(quiet, reply.refused or "no port")
            return None
        host, _ = split_server(conn.address)
        try:
            return await asyncio.to_thread(_connect, host, reply.port, reply.ticket, deadline)
        except (OSError, WireError) as e:
            self._refuse(quiet, f"cannot use port {reply.port}: {e}")
            return None

    async def _socket(
        self, deadline: float, *, quiet: bool = False
    ) -> tuple[socket.socket, bool] | None:
        """(an idle or newly opened socket, whether it was idle); None when the stream is
        not available (``quiet``: a failure to open one is no reason to stop using the
        stream: an extra stream that the server's connection limits refuse)."""
        if self._idle:
            return self._idle.pop(), True
        if not self.available:
            return None
        try:
            sock = await self._open(deadline, quiet=quiet)
        except OSError as e:  # the deadline passed while connecting
            if quiet:
                return None
            raise TransportError(f"bulk stream: {e}") from e
        return None if sock is None else (sock, False)

    async def _start(
        self,
        socks: list[socket.socket],
        s: int,
        reused: bool,
        keys: bytes,
        deadline: float,
    ) -> memoryview | None:
        """Send GET ``keys`` on ``socks[s]`` and receive its first entry (key ``s`` of the
        call). An idle socket may have died with a restarted server: one fresh try then
        (it replaces ``socks[s]``). Raises TransportError."""
        info = self._conn.info
        assert info is not None
        tiers, limit = len(info.tier_names), info.limits.max_block_bytes
        while True:
            sock = socks[s]
            try:
                await asyncio.to_thread(_send, sock, encode_get(keys), deadline)
                if not keys:
                    return None  # a GET of no keys is answered by nothing
                return await asyncio.to_thread(
                    _receive, sock, self._conn.pool, tiers, limit, s, deadline
                )
            except (OSError, WireError) as e:
                _discard(sock)
                if not reused:
                    raise TransportError(f"bulk stream: {e}") from e
            try:
                fresh = await self._open(deadline, quiet=True)
            except OSError as e:
                raise TransportError(f"bulk stream: {e}") from e
            if fresh is None:
                raise TransportError("bulk stream: the server closed it and refused a new one")
            socks[s], reused = fresh, False

    async def __call__(
        self, keys: bytes, timeout: float
    ) -> AsyncIterator[tuple[int, memoryview | None]]:
        """Stream the blocks of ``keys`` (a BlockSource): bulk when available, else gRPC.

        With ``bulk_streams`` S > 1 and enough keys, S sockets each carry every S-th key
        (key i on stream i % S), received concurrently (each stream one block ahead of
        the consumer); blocks are yielded in key order all the same. A stream that
        breaks raises TransportError (the connection makes the rest misses).
        """
        deadline = time.monotonic() + timeout
        n = len(keys) // KEY_BYTES
        info = self._conn.info
        assert info is not None
        tiers, limit = len(info.tier_names), info.limits.max_block_bytes
        held: list[tuple[socket.socket, bool]] = []
        first = await self._socket(deadline)
        if first is not None:
            held.append(first)
            while len(held) < min(self._conn.config.bulk_streams, n):
                extra = await self._socket(deadline, quiet=True)
                if extra is None:
                    break
                held.append(extra)
        if not held:
            self.grpc_calls += 1
            blocks = self._conn.grpc_blocks(keys, timeout)
            try:
                async for item in blocks:
                    yield item
            finally:
                await blocks.aclose()  # type: ignore[attr-defined]  # an async generator
            return
        streams = len(held)
        socks = [sock for sock, _ in held]
        per_key = [keys[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(n)]
        starts = [
            asyncio.ensure_future(
                self._start(socks, s, reused, b"".join(per_key[s::streams]), deadline)
            )
            for s, (_, reused) in enumerate(held)
        ]
        # Per stream: blocks received and not yet yielded, and the run being received.
        ready: list[collections.deque[memoryview | None]] = [
            collections.deque() for _ in range(streams)
        ]
        pending: list[asyncio.Future[list[memoryview | None]] | None] = [None] * streams
        clean = False

        def receive_run(s: int, index: int) -> None:
            """Start receiving stream ``s``'s next run, from call key ``index`` on."""
            pending[s] = asyncio.ensure_future(
                asyncio.to_thread(
                    _receive_run,
                    socks[s],
                    self._conn.pool,
                    tiers,
                    limit,
                    range(index, n, streams),
                    deadline,
                )
            )

        try:
            firsts = await asyncio.gather(*starts)
            for s, blob in enumerate(firsts):
                ready[s].append(blob)
                if s + streams < n:
                    receive_run(s, s + streams)
            for index in range(n):
                s = index % streams
                if not ready[s]:
                    future = pending[s]
                    assert future is not None
                    run = await future
                    ready[s].extend(run)
                    after = index + len(run) * streams  # the stream's first key not in it
                    pending[s] = None
                    if after < n:  # its next run arrives while this one is placed
                        receive_run(s, after)
                blob = ready[s].popleft()
                if blob is not None:
                    self.bulk_blocks += 1
                yield index, blob
            clean = True
        except (OSError, WireError) as e:
            raise TransportError(f"bulk stream: {e}") from e
        finally:
            for sock in socks:
                if clean and len(self._idle) < self._max_idle:
                    self._idle.append(sock)
                else:
                    _discard(sock)  # wakes a thread still receiving on it
            futures: list[asyncio.Future[Any] | None] = [*starts, *pending]
            for future in futures:
                if future is None:
                    continue
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: a broken stream's error is reported once
                future.cancel()

    async def put_blocks(
        self, blobs: Sequence[tuple[bytes, Blob]], timeout: float
    ) -> pb.PutReply | None:
        """Store one Put stream's ``(key, blob)`` pairs over the bulk stream: the server's
        reply, or None when the stream is not available (the caller uses gRPC).

        Raises TransportError when the stream breaks or the server refuses the PUT.
        """
        deadline = time.monotonic() + timeout
        # An idle socket may have died with a restarted server: one fresh try then. A
        # PUT sent again is harmless (the server stores nothing before the last block,
        # and a block it has answers ALREADY_PRESENT).
        for reused in (True, False):
            sock = self._idle.pop() if reused and self._idle else None
            if sock is None:
                if not self.available:
                    return None
                try:
                    sock = await self._open(deadline)
                except OSError as e:  # the deadline passed while connecting
                    raise TransportError(f"bulk stream: {e}") from e
                if sock is None:
                    return None
                reused = False
            try:
                reply = await asyncio.to_thread(_put, sock, blobs, deadline)
            except (OSError, WireError) as e:
                _discard(sock)
                if not reused:
                    raise TransportError(f"bulk stream: {e}") from e
                continue
            if len(self._idle) < self._max_idle:
                self._idle.append(sock)
            else:
                _discard(sock)
            self.bulk_puts += 1
            return reply
        return None  # pragma: no cover - the fresh try returns or raises

    def close(self) -> None:
        """Close the idle sockets."""
        idle, self._idle = self._idle, []
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.close()


def _discard(sock: socket.socket) -> None:
    """Close a socket a call gave up on; the shutdown first wakes a worker thread still
    blocked in recv_into on it (a cancelled call does not wait for that thread)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline exceeded")
    return remaining


def _connect(host: str, port: int, ticket: bytes, deadline: float) -> socket.socket:
    """Worker thread: connect, present the ticket, wait for the welcome."""
    sock = socket.create_connection((host, port), timeout=_remaining(deadline))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(sock, hello(ticket), deadline)
        welcome = bytearray(len(MAGIC))
        _recv_into(sock, memoryview(welcome), deadline)
        if welcome != MAGIC:
            raise WireError("the bulk listener did not welcome the ticket")
    except BaseException:
        sock.close()
        raise
    return sock


def _send(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(data)


def _send_parts(sock: socket.socket, parts: list[memoryview], deadline: float) -> None:
    """Send ``parts`` in order with gathering writes (``sendmsg``): a block's head and
    bytes, and the next block's, leave in one system call as far as the socket takes
    them, with no copy into one buffer first."""
    parts = [p for p in parts if p.nbytes]
    at = 0
    while at < len(parts):
        sock.settimeout(_remaining(deadline))
        sent = sock.sendmsg(parts[at : at + _IOV_MAX])
        while sent:
            n = parts[at].nbytes
            if sent < n:
                parts[at] = parts[at][sent:]
                break
            sent -= n
            at += 1


def _recv_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock`` (blocking, within the deadline)."""
    got, n = 0, view.nbytes
    while got < n:
        sock.settimeout(_remaining(deadline))
        k = sock.recv_into(view[got:])
        if not k:
            raise WireError(f"the server closed the bulk stream after {got} of {n} bytes")
        got += k


def _entry(sock: socket.socket, request: str, deadline: float) -> tuple[int, int]:
    """The next ENTRY's (code, size); an ERROR in its place raises WireError with the
    server's message."""
    head = bytearray(ENTRY.size)
    _recv_into(sock, memoryview(head), deadline)
    code, size = ENTRY.unpack(head)
    if code == ERROR_CODE:
        message = bytearray(min(size, 4096))
        _recv_into(sock, memoryview(message), deadline)
        raise WireError(f"the server refused the {request}: {message.decode(errors='replace')}")
    return code, size


def _put(sock: socket.socket, blobs: Sequence[tuple[bytes, Blob]], deadline: float) -> pb.PutReply:
    """Worker thread: send one PUT, then read its reply."""
    parts: list[memoryview] = [memoryview(encode_put(len(blobs)))]
    for key, blob in blobs:
        if isinstance(blob, EncodedBlock):  # sent from where its parts lie
            parts.append(memoryview(BLOCK.pack(blob.nbytes, key)))
            parts += blob.views()
        else:
            view = memoryview(blob).cast("B")
            parts += (memoryview(BLOCK.pack(view.nbytes, key)), view)
    _send_parts(sock, parts, deadline)
    code, size = _entry(sock, "PUT", deadline)
    if code != PUT_REPLY_CODE:
        raise WireError(f"bulk PUT reply: code {code}, expected {PUT_REPLY_CODE}")
    if size > _MAX_REPLY_BYTES:
        raise WireError(f"bulk PUT reply: {size} bytes, over {_MAX_REPLY_BYTES}")
    data = bytearray(size)
    _recv_into(sock, memoryview(data), deadline)
    try:
        return pb.PutReply.FromString(bytes(data))
    except DecodeError as e:
        raise WireError(f"bulk PUT reply: not a PutReply: {e}") from e


def _receive_run(
    sock: socket.socket,
    pool: BufferPool,
    tiers: int,
    limit: int,
    indices: range,
    deadline: float,
) -> list[memoryview | None]:
    """Worker thread: the next blocks of ``indices`` (call key indices, in stream order)
    until ``RUN_BYTES`` are in (at least one block): one thread hop for a run of small
    blocks instead of one each."""
    run: list[memoryview | None] = []
    got = 0
    for index in indices:
        blob = _receive(sock, pool, tiers, limit, index, deadline)
        run.append(blob)
        got += 0 if blob is None else blob.nbytes
        if got >= RUN_BYTES:
            break
    return run


def _receive(
    sock: socket.socket, pool: BufferPool, tiers: int, limit: int, index: int, deadline: float
) -> memoryview | None:
    """Worker thread: one ENTRY and its block, received into a pooled buffer (its
    payload's digest noted on it, ``_recv_block``)."""
    code, size = _entry(sock, "GET", deadline)
    check_entry(code, size, tiers, limit, index)
    if not code:
        return None
    buffer = pool.take(size)
    digest = _recv_block(sock, buffer, deadline)
    if digest is not None:
        note_payload_xxh3(buffer, digest)
    return buffer


def _recv_block(sock: socket.socket, view: memoryview, deadline: float) -> int | None:
    """Fill ``view`` with a block's bytes; the xxh3-64 of its stored payload, hashed
    piece by piece as it arrived (None when the bytes do not start like a block:
    verification then reads them itself and says what is wrong)."""
    n = view.nbytes
    head = min(n, PREFIX.size)
    _recv_into(sock, view[:head], deadline)
    start = payload_start(view[:head], n)
    if start is None:
        _recv_into(sock, view[head:], deadline)
        return None
    _recv_into(sock, view[head:start], deadline)
    digest = xxhash.xxh3_64()
    for at in range(start, n, HASH_PIECE):
        piece = view[at : min(n, at + HASH_PIECE)]
        _recv_into(sock, piece, deadline)
        digest.update(piece)
    return digest.intdigest()
