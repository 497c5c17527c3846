"""The bulk byte stream: Get and Put payloads over a plain TCP connection (layout in
proto/bulk.py).

Why: a Python gRPC stream moves MiB-sized frames at a fraction of what a plain socket
moves (every frame is a fresh bytes object copied through gRPC's core, and per-message
work runs in Python). Here a block goes from the tier's bytes to the kernel with
``sock_sendall`` of a memoryview (no copy in this process), and the client receives it
with ``recv_into`` straight into a pooled buffer. A PUT's blocks arrive with
``sock_recv_into`` into one buffer each, with no frames to decode and join.

Control stays on gRPC: ``OpenBulk`` (authenticated like every call, so it knows the
tenant) issues a one-use ticket valid for ``TICKET_TTL_S``; the connection presents it
first and serves that tenant's keys from then on, one request at a time, with the same
rules as the gRPC calls, because it is a codec over the same transfer rules: a GET is
``GetRules.into`` (transfer_get.py; sizes are the tier's own, blocks of untrusted tiers
verified by the store), a PUT a ``PutIntake`` (transfer_put.py: block count, sizes and
total, verification, quotas, metrics). A request-level :class:`~.refusal.Refusal` is
answered with an ERROR naming the field (in ``_serve``, the one place), then the
connection closes.
Only plaintext servers offer it (with TLS the bytes would leave the encrypted channel);
the listener binds the gRPC host on an ephemeral port (or ``bulk_listen``) and starts on the
first OpenBulk, which announces its port (or ``bulk_advertise_port``: a front proxy's).
Who may hold how many tickets, sockets and send buffers is bulk_limits.py's: the
server's ``max_connections``, a share of it per principal, a HELLO within
``handshake_timeout_s``, an idle connection closed after ``connection_idle_timeout_s``.

Bounded like the gRPC Get (inflight.py): each connection holds a lease of the server's
in-flight budget under the same owner a gRPC call of its client has (the tenant with
auth, else the connection), and reserves the block it sends until it is sent (a PUT:
each block as its head arrives, until the PUT is stored); a full budget that stays full
for ``stream_idle_timeout_s`` answers an ERROR naming it. While it holds budget the
connection keeps the minimum rate (progress.py: ``min_stream_rate`` over
``min_rate_window_s``, every byte counted: bytes received, and for sends the bytes the
peer acknowledged, not the send buffer's bursts); a peer below it is sent an ERROR
naming the rate if its socket takes one, and closed.

Concurrency: everything runs on the server's event loop (sockets non-blocking, loop
``sock_*`` calls); the ticket table and connection set change only between awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable

import xxhash

from nopecache.cache_server.bulk_limits import (
    BufferPool,
    BulkAdmission,
    ReceiveBuffers,
    send_progressing,
)
from nopecache.cache_server.codes import put_reply
from nopecache.cache_server.config import ServerConfig, split_listen
from nopecache.cache_server.inflight import InflightBudget, Lease
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.refusal import Refusal
from nopecache.cache_server.tenants import Tenant
from nopecache.cache_server.transfer_get import GetRules, SendBuffer
from nopecache.cache_server.transfer_put import BULK_WORDING, PutRules
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.block import PREFIX, payload_start
from nopecache.proto.bulk import (
    BLOCK,
    COUNT,
    ENTRY,
    ERROR_CODE,
    HASH_PIECE,
    MAGIC,
    PUT_FLAG,
    PUT_REPLY_CODE,
    TICKET_BYTES,
)
from nopecache.proto.contract import KEY_BYTES

__all__ = ["PENDING_SHARE", "PRINCIPAL_SHARE", "TICKET_TTL_S", "BulkServer"]

log = logging.getLogger(__name__)

TICKET_TTL_S = 30.0
# One principal may hold max_connections // PRINCIPAL_SHARE bulk connections (and as many
# unused tickets), sockets without a HELLO max_connections // PENDING_SHARE.
PRINCIPAL_SHARE = 4
PENDING_SHARE = 16


class BulkServer:
    """The bulk listener of one server (see the module docstring)."""

    def __init__(
        self,
        metrics: ServerMetrics,
        *,
        host: str,
        inflight: InflightBudget,
        puts: PutRules,
        gets: GetRules,
        config: ServerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A listener (not started) on ``host`` speaking the transfer rules ``puts`` and
        ``gets`` (the service's), its block bytes in flight bounded by ``inflight`` (the
        service's budget)."""
        self._metrics = metrics
        self._inflight = inflight
        self._puts = puts
        self._gets = gets
        self._host = host
        # A fixed listener and the port announced instead of its own (a front proxy's).
        self._listen = config.bulk_listen
        self._advertise_port = config.bulk_advertise_port
        self._clock = clock
        self._hello_timeout_s = config.handshake_timeout_s
        self._idle_timeout_s = config.connection_idle_timeout_s
        self.admission = BulkAdmission(
            max_connections=config.max_connections,
            per_principal=max(1, config.max_connections // PRINCIPAL_SHARE),
            max_pending=max(1, config.max_connections // PENDING_SHARE),
            ticket_ttl_s=TICKET_TTL_S,
            clock=clock,
        )
        # Idle send buffers kept for reuse: two of the largest blocks.
        self.buffers = BufferPool(2 * config.max_block_bytes)
        # Idle receive buffers of PUT blocks kept for reuse: two of the largest blocks.
        self.receive_buffers = ReceiveBuffers(2 * config.max_block_bytes)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port = 0

    async def ticket(self, tenant: Tenant, owner: str) -> tuple[int, bytes] | str:
        """(port, ticket) for one connection of ``tenant`` asked for by principal
        ``owner``, or why not (its tickets are too many); starts the listener if needed."""
        if self._listener is None:
            self._start()
        ticket = secrets.token_bytes(TICKET_BYTES)
        refused = self.admission.issue(ticket, tenant, owner)
        if refused is not None:
            self._metrics.rejected("OpenBulk", "too_many_tickets")
            return refused
        return self._advertise_port or self.port, ticket

    def listen(self) -> None:
        """Start the listener now, not at the first OpenBulk (a fixed ``bulk_listen`` port
        is claimed at start-up, before an ephemeral port of some client can take it)."""
        if self._listener is None:
            self._start()

    def _start(self) -> None:
        host, port = self._host.strip("[]"), 0
        if self._listen:  # a fixed port, for a front proxy (deploy/haproxy)
            host, port = split_listen(self._listen, "bulk_listen")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept(listener))
        log.info("bulk byte stream listening on %s:%d", host, self.port)

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
            self.admission.arrived(task)  # evicts the oldest socket without a HELLO

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        welcomed: str | None = None
        try:
            try:
                hello = await asyncio.wait_for(
                    _recv_exact(loop, conn, len(MAGIC) + TICKET_BYTES), self._hello_timeout_s
                )
            finally:
                self.admission.left_pending(task)
            redeemed = (
                self.admission.redeem(hello[len(MAGIC) :]) if hello[: len(MAGIC)] == MAGIC else None
            )
            if redeemed is None:
                self._metrics.rejected("Bulk", "bad_ticket")
                return
            refused = self.admission.welcome(redeemed.owner)
            if refused is not None:
                self._metrics.rejected("Bulk", "too_many_connections")
                await _send_error(loop, conn, refused)
                return
            welcomed = redeemed.owner
            await loop.sock_sendall(conn, MAGIC)
            tenant = redeemed.tenant
            with self._inflight.lease(redeemed.owner) as lease:
                await self._requests(loop, conn, tenant, lease)
        except Refusal as refused:  # its bulk form: an ERROR carrying the message
            self._metrics.rejected("Bulk", refused.reason)
            with contextlib.suppress(OSError):
                await _send_error(loop, conn, refused.message)
        except (OSError, TimeoutError, EOFError) as e:
            log.debug("bulk connection ended: %s", e)
        finally:
            if welcomed is not None:
                self.admission.leave(welcomed)
            conn.close()

    async def _requests(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, tenant: Tenant, lease: Lease
    ) -> None:
        """Serve the GETs and PUTs of one welcomed connection until it closes (or is cut)."""
        task = asyncio.current_task()
        assert task is not None

        def cut() -> None:  # a send or receive the peer does not serve in time ends the task
            task.cancel()

        lease.watch(cut)
        while True:
            # Between requests a connection is idle: closed after connection_idle_timeout_s.
            head = await asyncio.wait_for(
                _recv_exact(loop, conn, COUNT.size, eof_ok=True), self._idle_timeout_s
            )
            if not head:
                return
            (word,) = COUNT.unpack(head)
            put, count = bool(word & PUT_FLAG), word & ~PUT_FLAG
            if put:
                self._gets.check_count(count, "PUT block count", "blocks")
            else:
                self._gets.check_count(count, "GET key count")
            try:
                if put:
                    reply = await self._put(loop, conn, tenant, count, lease)
                    data = reply.SerializeToString()
                    await self._send(loop, conn, lease, ENTRY.pack(PUT_REPLY_CODE, len(data)))
                    await self._send(loop, conn, lease, data)
                else:
                    # The keys come within the idle timeout, like every byte of a request.
                    packed = await self._recv(loop, conn, lease, count * KEY_BYTES)
                    # A send buffer for this GET only: a block the host tier cannot lend
                    # (GetRules.into) is copied into it (get_into, no blob allocated per
                    # block) and sent before the next is read; it goes back to the pool
                    # when the GET is sent.
                    buffer = self.buffers.borrow()
                    try:
                        await self._get(loop, conn, tenant, packed, buffer, lease)
                    finally:
                        self.buffers.give_back(buffer)
            except asyncio.CancelledError:
                if not lease.stalled:
                    raise
                task.uncancel()
                cut_by = lease.idle_cut("PUT") if put else lease.slow_reader_cut("GET")
                self._metrics.rejected("Bulk", cut_by.reason)
                log.info("bulk connection of %s cut: %s", tenant.name, cut_by.message)
                _try_send_error(conn, cut_by.message)
                return
            finally:
                lease.release()

    async def _put(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        tenant: Tenant,
        count: int,
        lease: Lease,
    ) -> pb.PutReply:
        """Receive one PUT's ``count`` blocks, each checked as it completes, then store
        them (nothing is stored before the last block is in)."""
        intake = self._puts.intake(tenant, lease, BULK_WORDING)
        # Each block is verified (a checksum pass, off the loop) while the next one is
        # received; its buffer comes from the receive pool (pages already mapped, no
        # zero-fill) and goes back once the PUT is stored (the tiers copy what they keep)
        # or given up.
        checks: list[asyncio.Task[None]] = []
        blobs: list[memoryview] = []
        try:
            with self._metrics.latency["Put"].time():
                for _ in range(count):
                    size, key = BLOCK.unpack(await self._recv(loop, conn, lease, BLOCK.size))
                    position = await intake.open_block(key, size)
                    blob = self.receive_buffers.take(size)
                    blobs.append(blob)
                    digest = await self._recv_block(loop, conn, lease, blob)
                    checks.append(loop.create_task(intake.complete(key, blob, position, digest)))
                await asyncio.gather(*checks)
                return put_reply(await intake.finish())
        finally:
            for check in checks:
                check.cancel()
            # A cancelled check's thread may still be reading its blob: harmless, it only
            # reads, and nothing uses its answer.
            for blob in blobs:
                self.receive_buffers.give_back(blob)

    async def _get(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        tenant: Tenant,
        packed: bytes,
        buffer: SendBuffer,
        lease: Lease,
    ) -> None:
        """Answer one GET: an ENTRY and the bytes of each key, in order (``GetRules.into``:
        each block reserved in ``lease`` while it is sent, copied into ``buffer``)."""
        keys = self._gets.keys(packed, "GET keys", tenant.namespace)
        entries = self._gets.into(tenant, keys, lease, buffer)
        with self._metrics.latency["Get"].time():
            async with contextlib.aclosing(entries):
                async for code, size in entries:
                    await self._send(loop, conn, lease, ENTRY.pack(code, size))
                    for part in buffer.parts:
                        await self._send(loop, conn, lease, part)

    @staticmethod
    async def _recv(
        loop: asyncio.AbstractEventLoop, conn: socket.socket, lease: Lease, n: int
    ) -> bytes:
        """``n`` bytes of a request, watched by the lease's idle timer."""
        buf = bytearray(n)
        await BulkServer._recv_into(loop, conn, lease, memoryview(buf))
        return bytes(buf)

    @staticmethod
    async def _recv_block(
        loop: asyncio.AbstractEventLoop, conn: socket.socket, lease: Lease, blob: memoryview
    ) -> int | None:
        """Fill ``blob`` with a PUT block (an open block: its bound runs, progress.py);
        the xxh3-64 of its stored payload, hashed ``HASH_PIECE`` bytes
        at a time as they land, still in the CPU cache (None when the bytes do not start
        like a block: verification says what is wrong)."""
        n = blob.nbytes
        head = min(n, PREFIX.size)
        await BulkServer._recv_into(loop, conn, lease, blob[:head])
        start = payload_start(blob[:head], n)
        if start is None:
            await BulkServer._recv_into(loop, conn, lease, blob[head:])
            lease.end_block()
            return None
        await BulkServer._recv_into(loop, conn, lease, blob[head:start])
        digest = xxhash.xxh3_64()
        for at in range(start, n, HASH_PIECE):
            piece = blob[at : min(n, at + HASH_PIECE)]
            await BulkServer._recv_into(loop, conn, lease, piece)
            digest.update(piece)
        lease.end_block()
        return digest.intdigest()

    @staticmethod
    async def _recv_into(
        loop: asyncio.AbstractEventLoop,
        conn: socket.socket,
        lease: Lease,
        view: memoryview,
    ) -> None:
        """Fill ``view`` from the peer, watched by the lease (a sender below the minimum
        rate while the connection holds budget, or silent for ``stream_idle_timeout_s``
        while it holds none, gets the task cancelled)."""
        got, n = 0, view.nbytes
        while got < n:
            lease.begin_wait()
            k = 0
            try:
                k = await loop.sock_recv_into(conn, view[got:])
            finally:
                lease.end_wait(k)
            if not k:
                raise EOFError(f"connection closed after {got} of {n} bytes")
            got += k

    @staticmethod
    async def _send(
        loop: asyncio.AbstractEventLoop, conn: socket.socket, lease: Lease, data: bytes | memoryview
    ) -> None:
        """Send ``data``, the reader's progress measured by the bytes it acknowledges (a
        reader below the minimum rate gets the task cancelled; a slow one above it that
        keeps reading is not, however the send buffer drains)."""
        await send_progressing(loop, conn, data, lease)

    async def close(self) -> None:
        """Stop listening and end every connection."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _peer(conn: socket.socket) -> str:
    """The connection's peer, written as gRPC writes a peer (``ipv4:host:port``)."""
    try:
        address = conn.getpeername()
    except OSError:
        return "bulk:unknown"
    if conn.family == socket.AF_INET6:
        return f"ipv6:[{address[0]}]:{address[1]}"
    return f"ipv4:{address[0]}:{address[1]}"


async def _recv_exact(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int, *, eof_ok: bool = False
) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(conn, view[got:])
        if not k:
            if eof_ok and not got:
                return b""
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _try_send_error(conn: socket.socket, message: str) -> None:
    """An ERROR for a peer that is being cut, if its socket takes it now (never waits:
    the peer may be one that reads nothing)."""
    data = message.encode()
    with contextlib.suppress(OSError):
        conn.send(ENTRY.pack(ERROR_CODE, len(data)) + data)


async def _send_error(loop: asyncio.AbstractEventLoop, conn: socket.socket, message: str) -> None:
    data = message.encode()
    await loop.sock_sendall(conn, ENTRY.pack(ERROR_CODE, len(data)) + data)
