"""Same-host zero copy: the host tier's pool mapped read-only by a client, read leases.

The ``cpu://`` tier keeps its pool in a sealed memfd (``tiers/cpu.py``: no client can
write to it, shrink or grow it, even through a descriptor it reopens). A client on this
host gets the pool's descriptor and maps it whole, read-only; a Get becomes LeaseGet, which
answers where each block's bytes lie (page runs) under a read lease, and the client places
straight from its mapping into the paged cache: one copy, fused with re-RoPE::

    client                              server
    OpenArena(pid) ------------------>  nonce (one use, NONCE_TTL_S), socket name
    connect(\\0socket), send nonce --->  nonce known, unused, in time; SO_PEERCRED pid ==
                                        pid: a read-only descriptor of the pool
         <--------- SCM_RIGHTS -------  (else one line saying why, no descriptor)
    mmap(PROT_READ, MAP_SHARED)
    LeaseGet(keys, arena) ----------->  per key: tier lease (PagedTier.lease), runs
    place from the mapping              pages never rewritten while leased
    ReleaseLeases(ids) -------------->  tier leases end (or the expiry timer ends them)

CUDA. Where the fastest tier is ``cuda://`` (a ``PagedTier`` whose pool is one device
tensor), the offer is of kind ``ARENA_KIND_CUDA_IPC``: the same nonce and SO_PEERCRED
handshake, but the socket answers with the pool's CUDA IPC handle (bytes, never over
gRPC) instead of a descriptor, and only to a client that said it can open one
(``OpenArenaRequest.accept_cuda_ipc``; the others are refused and take the copying paths).
LeaseGet answers page runs in the device pool exactly as in the host pool; the tier
leases pages without host views and never a block whose pages are still being written.

Tenants. One mapping shows the whole pool, and the pool holds every tenant's blocks, so
the pool is offered only where the server has one tenant: auth off (the anonymous tenant)
or a token table naming a single tenant. With several tenants OpenArena answers
``refused`` and every tenant's clients take the copying paths: a client can never map
another tenant's pages. The nonce only travels over the caller's authenticated gRPC
call, is bound to its tenant and pid, is used once and expires; the descriptor goes
only to the process that asked (SO_PEERCRED), so another process on the host that
learns a nonce, or connects to the (abstract, per network namespace) socket, gets
nothing.

Leases. A lease is the tier read lease of one block, with an id and an expiry (``zero_copy_lease_ttl_s``): released by ReleaseLeases, or by its timer (a
client that crashed never releases; its pages come back when the timer fires). While
leased a block may be evicted or deleted (it leaves the index at once) but its pages stay
out of the free stack (``PageTable.release``), so they are never rewritten under a reader.
Client leases hold at most ``zero_copy_share`` of the pool (besides the tier's own
``lease_share`` for all leases): keys past it are answered "not leased" and the client
fetches them with Get (the copying paths). All on the server's event loop: no locks.

Fault injection (``faults.py``, testing and staging only): the client reads the stored
pages themselves, which must never be written, so a drawn ``delay`` delays the LeaseGet
answer (``Grant.delay_s``) and every other kind answers that key "not leased"
(``refuse_lease``): the client takes a copying path for it, where it may draw a fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nopecache.cache_server.faults import REFUSE_LEASE, FaultInjector, FaultKind
from nopecache.cache_server.refusal import Refusal, RefusalKind
from nopecache.cache_server.store import TieredStore
from nopecache.cache_server.tiers.cpu import CpuTier, PagedTier, TierLease
from nopecache.proto.arena_layout import (
    CUDA_IPC_NOT_ACCEPTED,
    HANDOFF_ERROR,
    HANDOFF_OK,
    HANDOFF_TIMEOUT_S,
    LEASE_ID_BYTES,
    MAX_ERROR_BYTES,
    NONCE_BYTES,
    ArenaKind,
)

__all__ = ["NONCE_TTL_S", "ArenaOffer", "Grant", "ZeroCopy"]

log = logging.getLogger(__name__)

NONCE_TTL_S = 10.0
# Nonces not redeemed yet, at most: a client asks once per connection.
_MAX_NONCES = 1024
_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True, slots=True)
class ArenaOffer:
    """What OpenArena answers: a nonce and where to redeem it, or why not."""

    nonce: bytes = b""
    socket: str = ""
    arena: bytes = b""
    size: int = 0
    refused: str = ""
    kind: ArenaKind = ArenaKind.HOST_MEMFD
    cuda_device_uuid: str = ""


@dataclass(frozen=True, slots=True)
class Grant:
    """What LeaseGet answers: per key its lease id (b"": not leased), the tier name (None:
    not leased) and its (offset, length) runs in the pool; ``tried``: how many keys, from
    the first, were tried before the share was reached; ``delay_s``: how long to hold the
    answer back (an injected fault; 0 otherwise)."""

    leases: list[bytes]
    tiers: list[str | None]
    runs: list[list[tuple[int, int]]]
    tried: int
    delay_s: float = 0.0


class _Lease:
    """One block's client lease: its tier lease, the pool bytes it counts, its timer."""

    __slots__ = ("held", "id", "tenant", "tier_lease", "timer")

    def __init__(self, lid: bytes, tenant: str, tier_lease: TierLease, held: int) -> None:
        self.id = lid
        self.tenant = tenant
        self.tier_lease = tier_lease
        self.held = held
        self.timer: asyncio.TimerHandle | None = None


class ZeroCopy:
    """The pool's offer and the client leases of one server (module docstring)."""

    def __init__(
        self,
        store: TieredStore,
        *,
        share: float = 0.25,
        ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        faults: FaultInjector | None = None,
    ) -> None:
        """The offer of ``store``'s top tier, when it is a ``cpu://`` pool in a memfd; made
        to nobody until :meth:`offer_to`. ``faults``: injected faults (testing only)."""
        top = store.tiers[0] if store.tiers else None
        self._store = store
        self._faults = faults
        self._tier: PagedTier | None = None
        self.kind = ArenaKind.HOST_MEMFD
        if isinstance(top, PagedTier) and top.cuda_device_uuid is not None:
            self._tier, self.kind = top, ArenaKind.CUDA_IPC
        elif isinstance(top, CpuTier) and top.arena_fd is not None:
            self._tier = top
        self.owner: str | None = None
        self.why_not = "zero copy is not offered"
        self.share = share
        self.ttl_s = ttl_s
        self._clock = clock
        self.arena = secrets.token_bytes(16)
        self._nonces: dict[bytes, tuple[str, int, float]] = {}
        self._leases: dict[bytes, _Lease] = {}
        self.held_bytes = 0
        self._sock: socket.socket | None = None
        self._name = f"nopecache-arena-{os.getpid()}-{secrets.token_hex(8)}"
        self._serving: asyncio.Task[None] | None = None
        self._handoffs: set[asyncio.Task[None]] = set()

    def offer_to(self, owner: str | None, why_not: str = "") -> None:
        """Offer the pool to tenant ``owner`` only (None: to nobody, ``why_not`` says why)."""
        if self._tier is None and owner is not None:
            owner, why_not = (
                None,
                "the fastest tier is neither an unpinned cpu:// nor a cuda:// pool",
            )
        self.owner = owner
        self.why_not = why_not or "zero copy is not offered"

    @property
    def leases(self) -> int:
        """Client leases held now."""
        return len(self._leases)

    @property
    def limit_bytes(self) -> int:
        """The most bytes client leases may hold."""
        return 0 if self._tier is None else int(self.share * self._tier.capacity_bytes)

    # -- the offer -----------------------------------------------------------------------
    async def offer(self, tenant: str, pid: int, *, accept_cuda_ipc: bool = False) -> ArenaOffer:
        """A one-use nonce for ``tenant``'s process ``pid``, or why not (a pool on a GPU
        only for a client that ``accept_cuda_ipc``)."""
        if self._tier is None or tenant != self.owner:
            why = self.why_not if self.owner is None else "the pool belongs to another tenant"
            return ArenaOffer(refused=why, kind=self.kind)
        if self.kind is ArenaKind.CUDA_IPC and not accept_cuda_ipc:
            return ArenaOffer(refused=CUDA_IPC_NOT_ACCEPTED, kind=self.kind)
        if pid <= 0:
            raise Refusal(
                RefusalKind.BAD_REQUEST, "bad_pid", f"OpenArenaRequest.pid: must be > 0, got {pid}"
            )
        self._listen()
        now = self._clock()
        for nonce, (_, _, until) in list(self._nonces.items()):
            if until <= now:
                del self._nonces[nonce]
        if len(self._nonces) >= _MAX_NONCES:
            return ArenaOffer(refused=f"{_MAX_NONCES} nonces outstanding; try again later")
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._nonces[nonce] = (tenant, pid, now + NONCE_TTL_S)
        return ArenaOffer(
            nonce,
            self._name,
            self.arena,
            self._tier.capacity_bytes,
            kind=self.kind,
            cuda_device_uuid=self._tier.cuda_device_uuid or "",
        )

    def _listen(self) -> None:
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.bind("\0" + self._name)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        self._serving = asyncio.get_running_loop().create_task(self._accept(sock))

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:  # out of descriptors: the next call tries again
                log.warning("arena socket: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._handoff(conn))
            self._handoffs.add(task)
            task.add_done_callback(self._handoffs.discard)

    async def _handoff(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            try:
                nonce = await asyncio.wait_for(_recv_exactly(conn, NONCE_BYTES), HANDOFF_TIMEOUT_S)
                pid, _, _ = _PEERCRED.unpack(
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
                )
                why = self._redeem(nonce, pid)
                if why:
                    await loop.sock_sendall(conn, HANDOFF_ERROR + why.encode()[:MAX_ERROR_BYTES])
                    return
                if self.kind is ArenaKind.CUDA_IPC:
                    assert self._tier is not None
                    # The handle, like the descriptor, only to the process that proved it
                    # is the pid the nonce was issued to.
                    await loop.sock_sendall(conn, self._tier.cuda_ipc_handle().pack())
                    return
                assert isinstance(self._tier, CpuTier) and self._tier.arena_fd is not None
                fd = os.open(f"/proc/self/fd/{self._tier.arena_fd}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    conn.setblocking(True)  # one byte and a descriptor: never blocks
                    socket.send_fds(conn, [HANDOFF_OK], [fd])
                finally:
                    os.close(fd)
            except (TimeoutError, OSError, ConnectionError) as e:
                log.debug("arena handoff failed: %s", e)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # no IPC handle
                log.warning("arena handoff: the pool's CUDA IPC handle failed: %s", e)
                with contextlib.suppress(OSError):
                    msg = f"the server could not share its CUDA pool: {e}"
                    await loop.sock_sendall(conn, HANDOFF_ERROR + msg.encode()[:MAX_ERROR_BYTES])

    def _redeem(self, nonce: bytes, pid: int) -> str:
        """Why ``nonce`` presented by process ``pid`` gets no descriptor ("" if it does)."""
        found = None
        for known in self._nonces:
            if hmac.compare_digest(known, nonce):
                found = known
        entry = self._nonces.pop(found) if found is not None else None
        if entry is None or entry[2] <= self._clock():
            return "nonce: unknown, already used or expired; call OpenArena again"
        tenant, want, _ = entry
        if pid != want or tenant != self.owner:
            return f"nonce: issued to pid {want}, presented by pid {pid}"
        return ""

    # -- leases --------------------------------------------------------------------------
    def grant(self, tenant: str, arena: bytes, keys: Sequence[bytes]) -> Grant:
        """Lease each block of ``keys`` (stored keys) the pool holds, in order, until the
        share is reached. Raises Refusal (STALE_SESSION) unless ``arena`` is this pool and
        ``tenant`` its owner."""
        tier = self._tier
        if tier is None or tenant != self.owner or not hmac.compare_digest(arena, self.arena):
            raise Refusal(
                RefusalKind.STALE_SESSION,
                "arena_unknown",
                "LeaseGetRequest.arena: not this server's pool for this tenant (restarted, "
                "or never opened): call OpenArena again",
            )
        page = tier.page_bytes
        limit = self.limit_bytes
        loop = asyncio.get_running_loop()
        ids: list[bytes] = []
        tiers: list[str | None] = []
        runs: list[list[tuple[int, int]]] = []
        delay_s = 0.0
        for key in keys:
            lent = self._store.lease(key, host_views=self.kind is ArenaKind.HOST_MEMFD)
            fault = None if lent is None or self._faults is None else self._faults.draw("zero_copy")
            if fault is not None and self._faults is not None:
                if fault.kind is FaultKind.DELAY:
                    self._faults.counted(fault.kind.value, "zero_copy")
                    delay_s = self._faults.delay_s
                else:  # the pages are the store's: never damaged, the lease refused
                    self._faults.counted(REFUSE_LEASE, "zero_copy")
                    assert lent is not None
                    lent[0].release()
                    lent = None
            if lent is None:
                ids.append(b"")
                tiers.append(None)
                runs.append([])
                continue
            tier_lease, name = lent
            cost = -(-tier_lease.size // page) * page
            if self.held_bytes + cost > limit:
                tier_lease.release()
                break  # the share is full: the rest are not tried
            lease = _Lease(secrets.token_bytes(LEASE_ID_BYTES), tenant, tier_lease, cost)
            lease.timer = loop.call_later(self.ttl_s, self._expire, lease.id)
            self._leases[lease.id] = lease
            self.held_bytes += cost
            ids.append(lease.id)
            tiers.append(name)
            runs.append(_byte_runs(tier_lease, page))
        return Grant(ids, tiers, runs, len(ids), delay_s)

    def release(self, tenant: str, ids: Sequence[bytes]) -> int:
        """End ``tenant``'s leases among ``ids``; how many were held."""
        released = 0
        for lid in ids:
            lease = self._leases.get(lid)
            if lease is not None and lease.tenant == tenant:
                self._end(lease)
                released += 1
        return released

    def _expire(self, lid: bytes) -> None:
        lease = self._leases.get(lid)
        if lease is not None:
            log.debug("client lease %s expired", lid.hex())
            self._end(lease)

    def _end(self, lease: _Lease) -> None:
        del self._leases[lease.id]
        if lease.timer is not None:
            lease.timer.cancel()
        self.held_bytes -= lease.held
        lease.tier_lease.release()

    async def close(self) -> None:
        """End every lease, stop serving the socket (server shutdown)."""
        for lease in list(self._leases.values()):
            self._end(lease)
        for task in (self._serving, *self._handoffs):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _byte_runs(lease: TierLease, page: int) -> list[tuple[int, int]]:
    """A leased block's (offset, length) runs in the pool, in order."""
    out, left = [], lease.size
    for start, count in lease.placement.runs:
        n = min(count * page, left)
        out.append((start * page, n))
        left -= n
    return out


async def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < n:
        chunk = await loop.sock_recv(conn, n - len(data))
        if not chunk:
            raise ConnectionError("closed before the nonce")
        data += chunk
    return data
