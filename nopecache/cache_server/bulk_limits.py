"""The bulk listener held to the server's own limits: tickets, connections, buffers, and
sends timed by their progress (bulk.py is the codec; this is who may hold what).

Principals are the gRPC ones (principals.py): the tenant with auth, else the gRPC
connection that asked for the ticket, so that bulk sockets cannot multiply a client's
shares. What one listener allows::

    tickets      live (unredeemed, unexpired) tickets: per principal at most
                 ``per_principal``, all together at most ``max_connections``; more are
                 refused in the OpenBulk reply (``refused``), redeeming one is a dict
                 lookup of its digest (no scan: 10k tickets cost a bogus HELLO nothing)
    pending      sockets that have not said HELLO: at most ``max_pending``; one more
                 evicts the oldest (a client says HELLO within a round trip, a squatter
                 never), each closed after ``hello_timeout_s`` anyway
    welcomed     at most ``max_connections`` in all (``--max-connections``) and
                 ``per_principal`` for one principal; past either, an ERROR naming the
                 option, then close
    buffers      a connection borrows a send buffer for one GET and gives it back when
                 the GET is sent; the pool keeps at most ``pool_bytes`` of idle buffers,
                 so an idle connection holds none (it kept its largest block's size);
                 a PUT's blocks arrive in receive buffers taken from ``ReceiveBuffers``
                 and given back once the PUT is stored (at most ``pool_bytes`` idle)

Concurrency: the server's event loop only.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import socket
import struct
import termios
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nopecache.cache_server.inflight import Lease
from nopecache.cache_server.tenants import Tenant
from nopecache.cache_server.transfer_get import SendBuffer

__all__ = [
    "ACK_POLL_S",
    "BufferPool",
    "BulkAdmission",
    "ReceiveBuffers",
    "Redeemed",
    "send_progressing",
    "unacked_bytes",
]

# How often a send blocked on a full buffer reads what the reader acknowledged.
ACK_POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class Redeemed:
    """What a valid ticket stands for: its tenant and the principal that asked for it."""

    tenant: Tenant
    owner: str


class BulkAdmission:
    """Tickets and connection slots of one bulk listener (see the module docstring)."""

    def __init__(
        self,
        *,
        max_connections: int,
        per_principal: int,
        max_pending: int,
        ticket_ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.max_connections = max_connections
        self.per_principal = per_principal
        self.max_pending = max_pending
        self._ttl = ticket_ttl_s
        self._clock = clock
        # digest(ticket) -> (what it stands for, expiry); insertion order is expiry order.
        self._tickets: OrderedDict[bytes, tuple[Redeemed, float]] = OrderedDict()
        self._tickets_of: dict[str, int] = {}
        self._pending: OrderedDict[asyncio.Task[None], None] = OrderedDict()
        self._welcomed: dict[str, int] = {}

    # -- tickets -------------------------------------------------------------------------
    def issue(self, ticket: bytes, tenant: Tenant, owner: str) -> str | None:
        """Record ``ticket`` for ``owner``; None, or why it is refused (a full table)."""
        self._expire()
        if self._tickets_of.get(owner, 0) >= self.per_principal:
            return (
                f"bulk tickets: this client holds {self.per_principal} unused tickets "
                "(one per connection it may open); use or let them expire first"
            )
        if len(self._tickets) >= self.max_connections:
            return f"bulk tickets: {len(self._tickets)} unused tickets (max_connections)"
        self._tickets[_digest(ticket)] = (Redeemed(tenant, owner), self._clock() + self._ttl)
        self._tickets_of[owner] = self._tickets_of.get(owner, 0) + 1
        return None

    def redeem(self, ticket: bytes) -> Redeemed | None:
        """What a presented ticket stands for, once (None: unknown or expired)."""
        found = self._tickets.pop(_digest(ticket), None)
        if found is None:
            return None
        redeemed, until = found
        self._drop_ticket_of(redeemed.owner)
        return redeemed if until > self._clock() else None

    def live_tickets(self) -> int:
        """Tickets issued and not yet redeemed or expired."""
        self._expire()
        return len(self._tickets)

    def _expire(self) -> None:
        now = self._clock()
        while self._tickets:
            digest, (redeemed, until) = next(iter(self._tickets.items()))
            if until > now:
                return
            del self._tickets[digest]
            self._drop_ticket_of(redeemed.owner)

    def _drop_ticket_of(self, owner: str) -> None:
        n = self._tickets_of[owner] - 1
        if n:
            self._tickets_of[owner] = n
        else:
            del self._tickets_of[owner]

    # -- connections ---------------------------------------------------------------------
    def arrived(self, task: asyncio.Task[None]) -> None:
        """A socket that has not said HELLO yet; evicts the oldest such past the cap."""
        while len(self._pending) >= self.max_pending:
            oldest, _ = self._pending.popitem(last=False)
            oldest.cancel()
        self._pending[task] = None

    def left_pending(self, task: asyncio.Task[None]) -> None:
        """The socket said HELLO (or went away)."""
        self._pending.pop(task, None)

    def pending(self) -> int:
        """Sockets that have not said HELLO."""
        return len(self._pending)

    def welcome(self, owner: str) -> str | None:
        """Take a connection slot for ``owner``; None, or why not (naming the option)."""
        if sum(self._welcomed.values()) >= self.max_connections:
            return f"max_connections: the bulk listener holds {self.max_connections} connections"
        if self._welcomed.get(owner, 0) >= self.per_principal:
            return (
                f"max_connections: this client holds {self.per_principal} bulk connections, "
                "its share of the listener"
            )
        self._welcomed[owner] = self._welcomed.get(owner, 0) + 1
        return None

    def leave(self, owner: str) -> None:
        """Give back a slot taken by ``welcome``."""
        n = self._welcomed[owner] - 1
        if n:
            self._welcomed[owner] = n
        else:
            del self._welcomed[owner]

    def welcomed(self, owner: str | None = None) -> int:
        """Connections past their HELLO (of ``owner``, or all)."""
        if owner is None:
            return sum(self._welcomed.values())
        return self._welcomed.get(owner, 0)


class BufferPool:
    """Send buffers lent to connections for one GET each; at most ``pool_bytes`` idle."""

    def __init__(self, pool_bytes: int) -> None:
        self.pool_bytes = pool_bytes
        self._idle: list[SendBuffer] = []
        self.lent = 0

    @property
    def idle_bytes(self) -> int:
        """Bytes the pool keeps for the next GETs."""
        return sum(len(b.data) for b in self._idle)

    def borrow(self) -> SendBuffer:
        """The largest idle buffer, or a new empty one."""
        self.lent += 1
        return self._idle.pop() if self._idle else SendBuffer()

    def give_back(self, buffer: SendBuffer) -> None:
        """Keep ``buffer`` for reuse if the pool has room, else let it go."""
        self.lent -= 1
        if self.idle_bytes + len(buffer.data) <= self.pool_bytes:
            self._idle.append(buffer)
            self._idle.sort(key=lambda b: len(b.data))


# Receive buffers come in size classes of this grain (blocks within it share buffers).
_RECEIVE_GRAIN = 1024 * 1024


class ReceiveBuffers:
    """Receive buffers of PUT blocks, reused instead of freed; at most ``pool_bytes`` idle.

    Why: a block-sized buffer past glibc's 32 MiB mmap threshold is a fresh mapping each
    time, which the kernel zero-fills page by page as the socket writes into it and
    unmaps afterwards: a hidden extra pass over every byte (a 32 MiB block of Llama-3-8B
    KV is just over it). A reused buffer has its pages already. New buffers are
    uninitialised (``np.empty``: the socket writes every byte before anything reads).
    """

    def __init__(self, pool_bytes: int) -> None:
        self.pool_bytes = pool_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self.idle_bytes = 0

    def take(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes (contents undefined)."""
        grain = -(-size // _RECEIVE_GRAIN) * _RECEIVE_GRAIN
        idle = self._idle.get(grain)
        if idle:
            self.idle_bytes -= grain
            buffer = idle.pop()
        else:
            buffer = np.empty(grain, dtype=np.uint8)
        return buffer.data[:size]

    def give_back(self, view: memoryview) -> None:
        """Keep the buffer behind ``view`` (from ``take``, no longer read) if there is room."""
        buffer = view.obj
        if not isinstance(buffer, np.ndarray):
            return
        grain = buffer.nbytes
        if self.idle_bytes + grain <= self.pool_bytes:
            self._idle.setdefault(grain, []).append(buffer)
            self.idle_bytes += grain


async def send_progressing(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes | memoryview, lease: Lease
) -> None:
    """Send all of ``data``, the reader's progress reported to the lease as the bytes it
    acknowledges (``unacked_bytes`` falling), polled every ``ACK_POLL_S`` while the send
    buffer is full: a reader that keeps reading at or above the minimum rate is not cut
    mid-block, however the buffer drains (the kernel wakes a writer only once a third of
    it is free, seconds apart for a slow reader); one that stops reading is."""
    view = memoryview(data).cast("B")
    sent, n = 0, view.nbytes
    unacked = unacked_bytes(conn)  # None: not Linux; bytes the kernel takes count instead
    while sent < n:
        k = _send_some(conn, view[sent:])
        if k:
            sent += k
            if unacked is not None:
                unacked += k
            continue
        lease.begin_wait()
        taken = 0
        try:
            while True:
                writable = await _writable(loop, conn, ACK_POLL_S)
                if unacked is not None:
                    now_unacked = unacked_bytes(conn)
                    if now_unacked is not None:
                        lease.progress(unacked - now_unacked)
                        unacked = now_unacked
                if not writable:
                    continue
                k = _send_some(conn, view[sent:])
                if k:
                    sent += k
                    if unacked is not None:
                        unacked += k
                    else:
                        taken = k
                    break
        finally:
            lease.end_wait(taken)


def unacked_bytes(conn: socket.socket) -> int | None:
    """Bytes of ``conn``'s send queue its peer has not acknowledged (Linux ``SIOCOUTQ``),
    or None where the kernel does not say."""
    try:
        raw = fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, AttributeError):
        return None
    value: int = struct.unpack("i", raw)[0]
    return value


def _send_some(conn: socket.socket, view: memoryview) -> int:
    """What of ``view`` the kernel takes now (0: its send buffer is full)."""
    try:
        return conn.send(view)
    except (BlockingIOError, InterruptedError):
        return 0


async def _writable(loop: asyncio.AbstractEventLoop, conn: socket.socket, most_s: float) -> bool:
    """Wait until ``conn`` can take more bytes (True), or ``most_s`` (False)."""
    ready: asyncio.Future[bool] = loop.create_future()
    fd = conn.fileno()

    def wake(value: bool) -> None:
        if not ready.done():
            ready.set_result(value)

    loop.add_writer(fd, wake, True)
    timer = loop.call_later(most_s, wake, False)
    try:
        return await ready
    finally:
        timer.cancel()
        loop.remove_writer(fd)


def _digest(ticket: bytes) -> bytes:
    # Keyed by a digest, not the ticket: a dict lookup's timing then says nothing about
    # how much of a guessed ticket is right.
    return hashlib.sha256(ticket).digest()
