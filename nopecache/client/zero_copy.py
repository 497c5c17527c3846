"""Client side of same-host zero copy: the server's pool mapped read-only, read leases.

For a server on this host (chosen as for shared memory, ``shm=auto``), the connection's
:class:`ZeroCopySource` opens the server's host-tier pool once (OpenArena, then the
descriptor over the server's Unix socket: ``nopecache/cache_server/zero_copy.py`` has the
handshake) and maps it whole, ``PROT_READ``. A Get becomes LeaseGet: the server answers
where each block lies in the pool under one read lease, and each block is yielded as a
read-only view of the mapping, so the placement path (checksums verified, then the fused
re-RoPE scatter) reads the tier's own pages: one copy in all, into the paged cache.

    leased, one page run        a view of the mapping (no copy)
    leased, several runs        gathered into a pooled buffer (one copy more)
    not leased                  the copying paths (``fallback``: the shm segment, the bulk
                                stream, gRPC), in key order with the rest

Lease lifetime. Every leased block has its own lease, held by its view (a finalizer):
once the view is gone (the block was placed) the lease id is queued and sent with
ReleaseLeases, batched. Views that die inside a
:func:`release_batch` (a placement job) are queued together when it ends: one wake of
the loop and one ReleaseLeases for them all. (Queued one by one from the placement's
thread, each view woke the loop, whose flush took the GIL for its call before the
placement thread went on: a fetch ended in serial calls, up to one per block, where it
now makes one per placement job.) The server leases a call's keys in order
until its share (``zero_copy_share``) is held and says how many it tried; the rest are
asked for again as soon as some of ours are released (placement frees them block by
block), or, when none comes within ``space_wait_s``, fetched by the fallback. The server
ends a lease by itself
``ttl`` after granting it (a crashed client's pages come back); a view is yielded only
while more than ``_MARGIN`` of that is left, so a block is verified and placed long
before its pages may be reused (placing takes milliseconds, the TTL is 30 s by default).

Refusals (another host, several tenants on the server, an old server, a pinned pool)
make the connection use the fallback from then on; a server that no longer knows the
pool (restarted) is opened again on a later call.

CUDA: with ``cuda_register`` the mapping is registered as page-locked memory
(``cudaHostRegister``, read-only), so a copy from it to a GPU is one DMA. A server whose
pool is on a GPU (``cuda://``) offers it over CUDA IPC instead (``cuda_arena.py``): the
same handshake hands over the pool's IPC handle, leased blocks are yielded as
:class:`DeviceBlob` views of the device pool and placed device to device. A process that
cannot open it (``cuda_ipc`` off, no CUDA, another GPU) logs why once, counts it
(``cuda_ipc_fallbacks``) and takes the copying paths: never an error to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import grpc
import grpc.aio
import numpy as np

from nopecache.client import pinned
from nopecache.client.cuda_arena import CudaArena, DeviceBlob, FetchedBlob, cuda_ipc_possible
from nopecache.client.errors import ArenaRefusedError, TransportError
from nopecache.client.transport import BlockSource, ServerConnection
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.arena_layout import (
    CUDA_IPC_LENGTH,
    CUDA_IPC_NOT_ACCEPTED,
    HANDOFF_CUDA_IPC,
    HANDOFF_OK,
    HANDOFF_TIMEOUT_S,
    LEASE_ID_BYTES,
    MAX_CUDA_IPC_BYTES,
    MAX_ERROR_BYTES,
    ArenaKind,
    CudaIpcHandle,
    unpack_runs,
)
from nopecache.proto.contract import KEY_BYTES, method_path

__all__ = [
    "Arena",
    "ZeroCopySource",
    "in_release_batch",
    "lapsed",
    "receive_arena",
    "receive_arena_fd",
    "release_batch",
]

log = logging.getLogger(__name__)

# A leased view is yielded only while the lease has more than this left (or a quarter of
# its TTL, if shorter): verifying and placing a block takes milliseconds.
_MARGIN_S = 2.0
_REOPEN_INTERVAL_S = 10.0
# Failures that are about the server's availability: raised to the connection.
_TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# cudaHostRegisterPortable | cudaHostRegisterReadOnly: the mapping is PROT_READ.
_CUDA_REGISTER_FLAGS = 0x01 | 0x08

P = ParamSpec("P")
T = TypeVar("T")

_batch = threading.local()  # .held: {source: [lease ids]} of this thread's open batch


@contextlib.contextmanager
def release_batch() -> Iterator[None]:
    """Hold back the releases of leased views that die on this thread inside the block;
    when it ends, queue them together (one wake of each source's loop, one ReleaseLeases
    call per source). Nested batches release with the outermost."""
    if getattr(_batch, "held", None) is not None:
        yield
        return
    held: dict[ZeroCopySource, list[bytes]] = {}
    _batch.held = held
    try:
        yield
    finally:
        _batch.held = None
        for source, lids in held.items():
            source._queue_many(lids)


def in_release_batch(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` inside a :func:`release_batch` (a job for a worker thread:
    what the call lets go of is released once it returns)."""
    with release_batch():
        return fn(*args, **kwargs)


def receive_arena_fd(socket_name: str, nonce: bytes, timeout: float = HANDOFF_TIMEOUT_S) -> int:
    """Redeem ``nonce`` at the server's abstract Unix socket: the pool's read-only
    descriptor. Raises ArenaRefusedError with the server's reason (or when the server
    answers with a CUDA IPC handle), OSError when the socket cannot be reached."""
    got = receive_arena(socket_name, nonce, timeout)
    if isinstance(got, CudaIpcHandle):
        raise ArenaRefusedError("the server answered with a CUDA IPC handle, not a descriptor")
    return got


def _recv_exactly(sock: socket.socket, data: bytes, n: int) -> bytes:
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ArenaRefusedError("the server closed the socket in the middle of the handle")
        data += more
    return data


def receive_arena(
    socket_name: str, nonce: bytes, timeout: float = HANDOFF_TIMEOUT_S
) -> int | CudaIpcHandle:
    """Redeem ``nonce`` at the server's abstract Unix socket: the pool's read-only
    descriptor (a host pool) or its CUDA IPC handle (a pool on a GPU). Raises
    ArenaRefusedError with the server's reason, OSError when the socket cannot be
    reached."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect("\0" + socket_name)
        sock.sendall(nonce)
        msg, fds, _, _ = socket.recv_fds(sock, MAX_ERROR_BYTES + 1, 1)
        if msg[:1] == HANDOFF_OK and len(fds) == 1:
            return fds[0]
        for fd in fds:
            os.close(fd)
        if msg[:1] == HANDOFF_CUDA_IPC and not fds:
            head = _recv_exactly(sock, msg, 1 + CUDA_IPC_LENGTH.size)
            (length,) = CUDA_IPC_LENGTH.unpack_from(head, 1)
            if length > MAX_CUDA_IPC_BYTES:
                raise ArenaRefusedError(f"CUDA IPC handle: {length} bytes, over the limit")
            body = _recv_exactly(sock, head, 1 + CUDA_IPC_LENGTH.size + length)
            try:
                return CudaIpcHandle.unpack(body[1 + CUDA_IPC_LENGTH.size :])
            except ValueError as e:
                raise ArenaRefusedError(str(e)) from e
        rest = msg[1:]
        with contextlib.suppress(OSError):
            while len(rest) < MAX_ERROR_BYTES and (more := sock.recv(MAX_ERROR_BYTES)):
                rest += more
        raise ArenaRefusedError(
            rest.decode(errors="replace") or "the server closed the socket without an answer"
        )


class _LeasedBytes(np.ndarray):
    """The bytes of a leased block in the mapping, with the time (``time.monotonic``) until
    which they may be read."""

    lease_deadline: float = math.inf


def lapsed(blob: FetchedBlob) -> bool:
    """Whether ``blob`` is a leased view whose lease may have ended: what was placed from
    it must not be trusted (placement marks the hit failed; the engine recomputes it)."""
    if isinstance(blob, DeviceBlob):
        return time.monotonic() >= blob.lease_deadline
    obj = blob.obj
    return isinstance(obj, _LeasedBytes) and time.monotonic() >= obj.lease_deadline


class Arena:
    """The server's pool, mapped read-only; ``arena`` is its id (OpenArenaReply.arena)."""

    def __init__(self, fd: int, size: int, arena: bytes) -> None:
        """Map ``size`` bytes of ``fd`` (not closed here). Raises ArenaRefusedError when the
        descriptor is not a pool of that size, or could be written through."""
        st = os.fstat(fd)
        if st.st_size != size:
            raise ArenaRefusedError(f"arena: descriptor of {st.st_size} bytes, reply says {size}")
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.size = size
        self.arena = arena
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.cuda_registered = False

    def register_cuda(self) -> bool:
        """Page-lock the mapping for CUDA (one DMA per copy to a GPU); whether it worked.
        Only where torch sees a GPU."""
        import torch  # deferred: only a CUDA paged cache needs it

        if not torch.cuda.is_available() or self.cuda_registered:
            return self.cuda_registered
        cudart = torch.cuda.cudart()
        ptr = self.array.ctypes.data
        err = cudart.cudaHostRegister(ptr, self.size, _CUDA_REGISTER_FLAGS)
        code = int(getattr(err, "value", err))
        if code:
            log.info("cudaHostRegister of the pool mapping failed (error %d): pageable", code)
            return False
        self.cuda_registered = True
        pinned.add(ptr, self.size)
        return True

    def close(self) -> None:
        """Unregister and unmap (the mapping stays while views of it live)."""
        if self.cuda_registered:
            import torch

            pinned.remove(self.array.ctypes.data)
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.cuda_registered = False
        with contextlib.suppress(BufferError):
            self.mm.close()


class ZeroCopySource:
    """The BlockSource of one same-host connection: leased views of the mapped pool, the
    ``fallback`` source for whatever is not leased (module docstring)."""

    def __init__(
        self,
        conn: ServerConnection,
        fallback: BlockSource,
        *,
        count: Callable[[bool, int], None] = lambda leased, nbytes: None,
        cuda_register: bool | None = None,
        cuda_ipc: bool | None = None,
        space_wait_s: float = 2.0,
    ) -> None:
        """A source for ``conn``; ``count(leased, nbytes)`` hears every block yielded;
        ``cuda_register`` page-locks the mapping for CUDA (None: when torch sees a GPU);
        ``cuda_ipc`` opens a pool on a GPU over CUDA IPC (None: when torch sees a GPU);
        past the server's share, wait up to ``space_wait_s`` for our leases to end."""
        self._conn = conn
        self._fallback = fallback
        self._count = count
        self._cuda_register = cuda_register
        self._cuda_ipc = cuda_ipc
        self.cuda_ipc_fallbacks = 0  # offers of a GPU pool this process could not open
        self.arena: Arena | CudaArena | None = None
        self._refused = False
        self._closed = False
        self._last_open = -math.inf
        self._open_lock: asyncio.Lock | None = None
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._held = 0  # leases granted to us and not released yet
        self._freed = asyncio.Event()
        self._releases = 0  # ReleaseLeases calls answered (or failed) so far
        self._space_wait_s = space_wait_s
        self._flushing: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.released = 0  # leases the server confirmed released

    @property
    def release_calls(self) -> int:
        """ReleaseLeases calls answered (or failed) so far."""
        return self._releases

    @property
    def refused(self) -> bool:
        """Whether the server refused zero copy for good (the fallback serves)."""
        return self._refused

    async def warm(self) -> None:
        """Open the pool (and the fallback's session) now instead of on the first Get."""
        await self._ready()
        warm = getattr(self._fallback, "warm", None)
        if warm is not None:
            await warm()

    def _call(self, name: str, req: Any, rep: Any) -> grpc.aio.UnaryUnaryMultiCallable:
        return self._conn.channel.unary_unary(
            method_path(name),
            request_serializer=req.SerializeToString,
            response_deserializer=rep.FromString,
        )

    # -- the mapping --------------------------------------------------------------------
    async def _ready(self) -> Arena | CudaArena | None:
        if self.arena is not None or self._refused or self._closed:
            return self.arena
        if time.monotonic() - self._last_open < _REOPEN_INTERVAL_S:
            return None
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self.arena is None and not self._refused and not self._closed:
                await self._open()
        return self.arena

    def _refuse(self, why: str) -> None:
        self._refused = True
        log.info("nopecache %s: no zero copy (%s); copying paths", self._conn.address, why)

    def _cuda_fallback(self, why: str) -> None:
        """The server's pool is on a GPU and this process cannot open it: copying paths."""
        self._refused = True
        self.cuda_ipc_fallbacks += 1
        log.warning(
            "nopecache %s: the server's pool is on a GPU and this process cannot open it over "
            "CUDA IPC (%s); fetching through the copying paths",
            self._conn.address,
            why,
        )

    async def _open(self) -> None:
        self._last_open = time.monotonic()
        self._loop = asyncio.get_running_loop()
        call = self._call("OpenArena", pb.OpenArenaRequest, pb.OpenArenaReply)
        accept_cuda_ipc = cuda_ipc_possible() if self._cuda_ipc is None else self._cuda_ipc
        try:
            reply: pb.OpenArenaReply = await call(
                pb.OpenArenaRequest(pid=os.getpid(), accept_cuda_ipc=accept_cuda_ipc),
                timeout=self._conn.config.control_timeout_s,
                metadata=self._conn.metadata,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() in _TRANSIENT:
                raise
            self._refuse(f"OpenArena failed: {e.code().name} {e.details()}")
            return
        cuda = reply.kind == ArenaKind.CUDA_IPC
        if reply.refused or not reply.nonce:
            if cuda and reply.refused == CUDA_IPC_NOT_ACCEPTED:
                self._cuda_fallback(reply.refused)
            else:
                self._refuse(f"the server offers no pool: {reply.refused}")
            return
        try:
            got = await asyncio.to_thread(receive_arena, reply.socket, reply.nonce)
        except (ArenaRefusedError, OSError) as e:
            self._refuse(f"no {'handle' if cuda else 'descriptor'} of the pool: {e}")
            return
        if isinstance(got, CudaIpcHandle) or cuda:
            if not isinstance(got, CudaIpcHandle) or not cuda:
                if isinstance(got, int):
                    os.close(got)
                self._refuse(f"OpenArenaReply.kind {reply.kind} and the socket's answer disagree")
                return
            try:
                # Opening maps the pool into this process's GPU address space: off the loop.
                self.arena = await asyncio.to_thread(
                    CudaArena, got, reply.cuda_device_uuid, reply.size, reply.arena
                )
            except ArenaRefusedError as e:
                self._cuda_fallback(str(e))
            return
        fd = got
        try:
            arena = Arena(fd, reply.size, reply.arena)
        except (ArenaRefusedError, OSError, ValueError) as e:
            self._refuse(f"cannot map the pool: {e}")
            return
        finally:
            os.close(fd)
        if self._cuda_register or (self._cuda_register is None and cuda_ipc_possible()):
            arena.register_cuda()
        self.arena = arena

    # -- blocks -------------------------------------------------------------------------
    async def __call__(
        self, keys: bytes, timeout: float
    ) -> AsyncIterator[tuple[int, FetchedBlob | None]]:
        """Stream the blocks of ``keys`` in order: leased views, the rest by the fallback.

        Leases come in rounds: the server leases keys in order until its share is held;
        the rest are asked for again once blocks of ours were placed and released (within
        ``space_wait_s``), else taken by the fallback."""
        n = len(keys) // KEY_BYTES
        deadline = time.monotonic() + timeout
        arena = await self._ready() if n else None
        i = 0
        while arena is not None and arena is self.arena and i < n:
            since = self._releases
            reply = await self._lease(arena, keys[i * KEY_BYTES :], deadline)
            if reply is None:
                break
            leased, runs, lease_deadline = reply
            tried = len(leased)
            at = 0  # leases [at, tried) are not handed out yet
            try:
                while at < tried:
                    if leased[at] and time.monotonic() < lease_deadline:
                        view = self._view(arena, leased[at], runs[at], lease_deadline)
                        at += 1  # the view holds it now
                        self._count(True, view.nbytes)
                        yield i + at - 1, view
                        del view  # the consumer's reference is the one that holds the lease
                        continue
                    if leased[at]:  # too close to its expiry to be placed from: released
                        self._queue(leased[at])
                    end = at + 1  # the next keys the leases do not serve
                    while end < tried and not leased[end]:
                        end += 1
                    start, at = at, end
                    async for item in self._through_fallback(keys, i + start, i + end, deadline):
                        yield item
            finally:
                # A stream closed early: the leases it did not hand out end now.
                for lid in leased[at:]:
                    if lid:
                        self._queue(lid)
            i += tried
            if i < n and not await self._released_some(since, deadline):
                break
        if i < n:
            async for item in self._through_fallback(keys, i, n, deadline):
                yield item

    async def _lease(
        self, arena: Arena | CudaArena, keys: bytes, deadline: float
    ) -> tuple[list[bytes], list[list[tuple[int, int]]], float] | None:
        """One LeaseGet: each tried key's lease id (b"": not leased), runs, and the time
        (local clock) until which the leases may be read from; None: use the fallback."""
        call = self._call("LeaseGet", pb.LeaseGetRequest, pb.LeaseGetReply)
        sent = time.monotonic()
        try:
            reply: pb.LeaseGetReply = await call(
                pb.LeaseGetRequest(keys=keys, arena=arena.arena),
                timeout=max(0.001, deadline - sent),
                metadata=self._conn.metadata,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() in _TRANSIENT:
                raise
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._drop(arena)  # the server restarted: open it again later
            else:
                self._refuse(f"LeaseGet failed: {e.code().name} {e.details()}")
            return None
        leased, runs = self._check(reply, len(keys) // KEY_BYTES, arena)
        with self._lock:
            self._held += sum(1 for lid in leased if lid)
        ttl = reply.ttl_ms / 1000
        return leased, runs, sent + ttl - min(_MARGIN_S, ttl / 4)

    def _check(
        self, reply: pb.LeaseGetReply, n: int, arena: Arena | CudaArena
    ) -> tuple[list[bytes], list[list[tuple[int, int]]]]:
        tried = reply.tried
        if tried > n or len(reply.tiers) != tried:
            raise TransportError(
                f"LeaseGetReply.tiers/tried: {len(reply.tiers)} codes, {tried} tried, {n} keys"
            )
        try:
            runs = unpack_runs(reply.run_counts, reply.runs, tried)
        except ValueError as e:
            raise TransportError(f"LeaseGetReply.{e}") from e
        codes = bytes(reply.tiers)
        if len(reply.leases) != LEASE_ID_BYTES * sum(1 for c in codes if c):
            raise TransportError("LeaseGetReply.leases: not one id per leased key")
        ids = iter(
            reply.leases[j : j + LEASE_ID_BYTES]
            for j in range(0, len(reply.leases), LEASE_ID_BYTES)
        )
        leased = []
        for code, key_runs in zip(codes, runs, strict=True):
            if bool(code) != bool(key_runs):
                raise TransportError("LeaseGetReply: tier codes and runs disagree")
            for offset, length in key_runs:
                if length <= 0 or offset + length > arena.size:
                    raise TransportError(
                        f"LeaseGetReply.runs: [{offset}, {offset + length}) outside the pool "
                        f"of {arena.size} bytes"
                    )
            leased.append(next(ids) if code else b"")
        return leased, runs

    def _view(
        self, arena: Arena | CudaArena, lid: bytes, runs: list[tuple[int, int]], deadline: float
    ) -> FetchedBlob:
        """A read-only view of a leased block, holding its lease while it lives; it can be
        read from until ``deadline`` (``lapsed``). On a GPU pool every block, of one run or
        several, is a DeviceBlob of views (joined where it is placed, on its stream)."""
        if isinstance(arena, CudaArena):
            blob = DeviceBlob(arena.runs(runs), deadline)
            weakref.finalize(blob, self._queue, lid)
            return blob
        if len(runs) > 1:  # pages in several places: gathered (one copy more), released
            out = self._conn.pool.take(sum(length for _, length in runs))
            at = 0
            for offset, length in runs:
                out[at : at + length] = arena.mm[offset : offset + length]
                at += length
            self._queue(lid)
            return out
        offset, length = runs[0]
        arr = arena.array[offset : offset + length].view(_LeasedBytes)
        arr.lease_deadline = deadline
        weakref.finalize(arr, self._queue, lid)
        return arr.data

    async def _through_fallback(
        self, keys: bytes, start: int, end: int, deadline: float
    ) -> AsyncIterator[tuple[int, FetchedBlob | None]]:
        it = self._fallback(
            keys[start * KEY_BYTES : end * KEY_BYTES], max(0.001, deadline - time.monotonic())
        )
        try:
            async for index, blob in it:
                if blob is not None:
                    self._count(False, blob.nbytes)
                yield start + index, blob
        finally:
            await it.aclose()  # type: ignore[attr-defined]  # an async generator

    async def _released_some(self, since: int, deadline: float) -> bool:
        """Whether a lease of ours was released after ``since`` (a count of releases),
        waiting up to ``space_wait_s`` for one (False at once when we hold none: others
        hold the share)."""
        limit = min(deadline, time.monotonic() + self._space_wait_s)
        while self._releases == since:
            with self._lock:
                held = self._held
            remaining = limit - time.monotonic()
            if not held or remaining <= 0:
                return False
            self._freed.clear()
            if self._releases != since:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)
        return True

    # -- releases -----------------------------------------------------------------------
    def _queue(self, lid: bytes) -> None:
        """Queue the release of lease ``lid`` (any thread: a view died after placement;
        inside a ``release_batch``, when the batch ends)."""
        held = getattr(_batch, "held", None)
        if held is not None:
            held.setdefault(self, []).append(lid)
            return
        self._queue_many([lid])

    def _queue_many(self, lids: list[bytes]) -> None:
        with self._lock:
            self._pending.extend(lids)
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the TTL ends it
                loop.call_soon_threadsafe(self._schedule_flush)

    def _schedule_flush(self) -> None:
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        call = self._call("ReleaseLeases", pb.ReleaseLeasesRequest, pb.ReleaseLeasesReply)
        while True:
            with self._lock:
                ids, self._pending = self._pending, []
            if not ids:
                return
            try:
                reply: pb.ReleaseLeasesReply = await call(
                    pb.ReleaseLeasesRequest(leases=b"".join(ids)),
                    timeout=self._conn.config.control_timeout_s,
                    metadata=self._conn.metadata,
                )
            except grpc.aio.AioRpcError as e:
                # Not fatal: the server ends them at their TTL.
                log.debug("ReleaseLeases failed (%s): the leases expire", e.code().name)
                reply = pb.ReleaseLeasesReply()
            with self._lock:
                self._held -= len(ids)
            self.released += reply.released
            self._releases += 1
            self._freed.set()

    async def settle(self) -> None:
        """Wait until every queued release is sent (tests, close)."""
        while self._flushing is not None and not self._flushing.done():
            await asyncio.shield(self._flushing)
        with self._lock:
            pending = bool(self._pending)
        if pending:
            self._schedule_flush()
            await self.settle()

    def _drop(self, arena: Arena | CudaArena) -> None:
        if self.arena is arena:
            self.arena = None
        arena.close()

    async def close(self) -> None:
        """Send queued releases, unmap the pool, close the fallback."""
        self._closed = True
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.settle()
        if self.arena is not None:
            self._drop(self.arena)
        close = getattr(self._fallback, "close", None)
        if close is not None:
            await close()
