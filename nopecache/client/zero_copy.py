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

Lease lifetime. Every view holds its lease (a finalizer per view); when the stream is
over and the last view is gone (the block was placed), the lease id is queued and sent
with ReleaseLeases, batched, off the fetch's path. The server ends a lease by itself
``ttl`` after granting it (a crashed client's pages come back); a view is yielded only
while more than ``_MARGIN`` of that is left, so a block is verified and placed long
before its pages may be reused (placing takes milliseconds, the TTL is 30 s by default).

Refusals (another host, several tenants on the server, an old server, a pinned pool)
make the connection use the fallback from then on; a server that no longer knows the
pool (restarted) is opened again on a later call.

CUDA: with ``cuda_register`` the mapping is registered as page-locked memory
(``cudaHostRegister``, read-only), so a copy from it to a GPU is one DMA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import mmap
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio
import numpy as np

from nopecache.client.errors import ArenaRefusedError, TransportError
from nopecache.client.transport import BlockSource, ServerConnection
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.arena_layout import (
    HANDOFF_OK,
    LEASE_ID_BYTES,
    MAX_ERROR_BYTES,
    unpack_runs,
)
from nopecache.proto.contract import KEY_BYTES, method_path

__all__ = ["Arena", "ZeroCopySource", "receive_arena_fd"]

log = logging.getLogger(__name__)

# A leased view is yielded only while the lease has more than this left (or a quarter of
# its TTL, if shorter): verifying and placing a block takes milliseconds.
_MARGIN_S = 2.0
_REOPEN_INTERVAL_S = 10.0
_HANDOFF_TIMEOUT_S = 5.0
# Failures that are about the server's availability: raised to the connection.
_TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
# cudaHostRegisterPortable | cudaHostRegisterReadOnly: the mapping is PROT_READ.
_CUDA_REGISTER_FLAGS = 0x01 | 0x08


def receive_arena_fd(socket_name: str, nonce: bytes, timeout: float = _HANDOFF_TIMEOUT_S) -> int:
    """Redeem ``nonce`` at the server's abstract Unix socket: the pool's read-only
    descriptor. Raises ArenaRefusedError with the server's reason, OSError when the socket
    cannot be reached."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect("\0" + socket_name)
        sock.sendall(nonce)
        msg, fds, _, _ = socket.recv_fds(sock, MAX_ERROR_BYTES + 1, 1)
        if msg[:1] == HANDOFF_OK and len(fds) == 1:
            return fds[0]
        for fd in fds:
            os.close(fd)
        rest = msg[1:]
        with contextlib.suppress(OSError):
            while len(rest) < MAX_ERROR_BYTES and (more := sock.recv(MAX_ERROR_BYTES)):
                rest += more
        raise ArenaRefusedError(
            rest.decode(errors="replace") or "the server closed the socket without an answer"
        )


def _cuda_present() -> bool:
    """Whether torch is loaded and sees a GPU (never imports torch for it)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_available())


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
        return True

    def close(self) -> None:
        """Unregister and unmap (the mapping stays while views of it live)."""
        if self.cuda_registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.cuda_registered = False
        with contextlib.suppress(BufferError):
            self.mm.close()


class _Held:
    """One lease on the client: released once the stream is over and no view lives."""

    __slots__ = ("deadline", "id", "refs")

    def __init__(self, lid: bytes, deadline: float) -> None:
        self.id = lid
        self.deadline = deadline
        self.refs = 1  # the stream; +1 per live view


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
    ) -> None:
        """A source for ``conn``; ``count(leased, nbytes)`` hears every block yielded;
        ``cuda_register`` page-locks the mapping for CUDA (None: when torch sees a GPU)."""
        self._conn = conn
        self._fallback = fallback
        self._count = count
        self._cuda_register = cuda_register
        self.arena: Arena | None = None
        self._refused = False
        self._closed = False
        self._last_open = -math.inf
        self._open_lock: asyncio.Lock | None = None
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._flushing: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.released = 0  # leases released by this client (ReleaseLeases answered)

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
    async def _ready(self) -> Arena | None:
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

    async def _open(self) -> None:
        self._last_open = time.monotonic()
        self._loop = asyncio.get_running_loop()
        call = self._call("OpenArena", pb.OpenArenaRequest, pb.OpenArenaReply)
        try:
            reply: pb.OpenArenaReply = await call(
                pb.OpenArenaRequest(pid=os.getpid()),
                timeout=self._conn.config.control_timeout_s,
                metadata=self._conn.metadata,
            )
        except grpc.aio.AioRpcError as e:
            if e.code() in _TRANSIENT:
                raise
            self._refuse(f"OpenArena failed: {e.code().name} {e.details()}")
            return
        if reply.refused or not reply.nonce:
            self._refuse(f"the server offers no pool: {reply.refused}")
            return
        try:
            fd = await asyncio.to_thread(receive_arena_fd, reply.socket, reply.nonce)
        except (ArenaRefusedError, OSError) as e:
            self._refuse(f"no descriptor of the pool: {e}")
            return
        try:
            arena = Arena(fd, reply.size, reply.arena)
        except (ArenaRefusedError, OSError, ValueError) as e:
            self._refuse(f"cannot map the pool: {e}")
            return
        finally:
            os.close(fd)
        if self._cuda_register or (self._cuda_register is None and _cuda_present()):
            arena.register_cuda()
        self.arena = arena

    # -- blocks -------------------------------------------------------------------------
    async def __call__(
        self, keys: bytes, timeout: float
    ) -> AsyncIterator[tuple[int, memoryview | None]]:
        """Stream the blocks of ``keys`` in order: leased views, the rest by the fallback."""
        n = len(keys) // KEY_BYTES
        deadline = time.monotonic() + timeout
        arena = await self._ready() if n else None
        if arena is None:
            async for item in self._through_fallback(keys, 0, n, deadline):
                yield item
            return
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
            async for item in self._through_fallback(keys, 0, n, deadline):
                yield item
            return
        runs = self._check(reply, n, arena)
        held = None
        if reply.lease:
            ttl = reply.ttl_ms / 1000
            held = _Held(reply.lease, sent + ttl - min(_MARGIN_S, ttl / 4))
        try:
            i = 0
            while i < n:
                if held is not None and runs[i] and time.monotonic() < held.deadline:
                    view = self._view(arena, held, runs[i])
                    self._count(True, view.nbytes)
                    yield i, view
                    i += 1
                    continue
                j = i + 1  # the next run of keys the lease does not serve
                while j < n and not (held is not None and runs[j]):
                    j += 1
                async for item in self._through_fallback(keys, i, j, deadline):
                    yield item
                i = j
        finally:
            if held is not None:
                self._unref(held)

    def _check(self, reply: pb.LeaseGetReply, n: int, arena: Arena) -> list[list[tuple[int, int]]]:
        if len(reply.tiers) != n:
            raise TransportError(f"LeaseGetReply.tiers: {len(reply.tiers)} codes for {n} keys")
        try:
            runs = unpack_runs(reply.run_counts, reply.runs, n)
        except ValueError as e:
            raise TransportError(f"LeaseGetReply.{e}") from e
        for code, key_runs in zip(reply.tiers, runs, strict=True):
            if bool(code) != bool(key_runs) or (key_runs and len(reply.lease) != LEASE_ID_BYTES):
                raise TransportError("LeaseGetReply: tier codes, runs and lease disagree")
            for offset, length in key_runs:
                if length <= 0 or offset + length > arena.size:
                    raise TransportError(
                        f"LeaseGetReply.runs: [{offset}, {offset + length}) outside the pool "
                        f"of {arena.size} bytes"
                    )
        return runs

    def _view(self, arena: Arena, held: _Held, runs: list[tuple[int, int]]) -> memoryview:
        """A read-only view of a leased block, holding the lease while it lives."""
        if len(runs) == 1:
            offset, length = runs[0]
            arr = arena.array[offset : offset + length]
        else:  # pages in several places: gathered (one copy more), then the lease is done
            out = self._conn.pool.take(sum(length for _, length in runs))
            at = 0
            for offset, length in runs:
                out[at : at + length] = arena.mm[offset : offset + length]
                at += length
            return out
        with self._lock:
            held.refs += 1
        weakref.finalize(arr, self._unref, held)
        return arr.data

    async def _through_fallback(
        self, keys: bytes, start: int, end: int, deadline: float
    ) -> AsyncIterator[tuple[int, memoryview | None]]:
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

    # -- releases -----------------------------------------------------------------------
    def _unref(self, held: _Held) -> None:
        """Drop one hold of ``held`` (any thread); the last one queues its release."""
        with self._lock:
            held.refs -= 1
            if held.refs:
                return
            self._pending.append(held.id)
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
                return
            self.released += reply.released

    async def settle(self) -> None:
        """Wait until every queued release is sent (tests, close)."""
        while self._flushing is not None and not self._flushing.done():
            await asyncio.shield(self._flushing)
        with self._lock:
            pending = bool(self._pending)
        if pending:
            self._schedule_flush()
            await self.settle()

    def _drop(self, arena: Arena) -> None:
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
