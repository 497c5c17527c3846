"""Client side of the same-host fast path: Get payloads through a shared-memory segment.

:class:`ShmFastPath` is a :data:`~nopecache.client.transport.FastPathFactory`. For a server
on this host (its ``ServerInfo.host_id`` equals :func:`host_id`, or always with
``mode="on"``) it gives the connection a :class:`ShmSource`, which on first use:

1. creates a segment: ``/dev/shm/nopecache-<pid>-<random>``, O_CREAT|O_EXCL, mode 0600,
   ``posix_fallocate``-d (a full /dev/shm fails here, never as a SIGBUS on a later
   write), mapped, with a magic and a random nonce in its header (layout in
   proto/cache.proto);
2. calls AttachShm with the name, size and nonce; the server maps the segment, checks the
   nonce (the same memory, so the same host and /dev/shm) and writes the session id into
   the header, which is checked here (its writes reach us);
3. unlinks the name at once, whatever the answer: nothing stays in /dev/shm, even if
   this process is SIGKILLed later. Both processes keep their mappings; the kernel frees
   the memory when both have unmapped (the server drops the session on DetachShm, sent
   by ``close()``, or after its idle timeout). The only leak window is a crash during the
   AttachShm call itself: :func:`sweep_orphans` removes such names (older than a minute)
   when the next segment is created.

The first Get of a connection waits for this (mostly the kernel zeroing the segment's
pages: tens of milliseconds per 100 MiB); connections that never Get make no segment.
Any refusal (another host or container, an old server, a full /dev/shm) makes that
connection use gRPC from then on (remembered, logged once). A session the server has
dropped (idle expiry, server restart) is attached again on the next call.

Windows. Every Get reserves a window of the segment (first-fit over a free list) sized
for the blocks it asks for; the server copies each hit that fits into it and sends a small
frame (offset, length); a hit that does not fit comes as ordinary data frames. Blocks are
yielded as zero-copy views into the mapping, and the window is released when the stream
is over *and* the last view of its blocks is gone (each view is a numpy array viewing the
mapping, with a finalizer): the fetch pipeline drops a block after placing it, so windows
recycle as placement proceeds. Sizing::

    block estimate  the largest of the last 32 blocks (unknown at first: 1 key per Get)
    window          up to half the segment, as many whole blocks as fit
    no room         wait (up to space_wait_s) for placed blocks to free a window;
                    then the remaining keys of the call go over gRPC

A window whose stream did not end cleanly (cancelled, failed) is quarantined for
QUARANTINE_S before reuse, and the server never lets two Gets write overlapping windows
(shm.py there), so a cancelled call still unwinding there cannot write into a window
given to the next one. Blocks are verified (checksums) by the fetch as always.

Concurrency: a source belongs to its connection's event loop. Views die on any thread
(the placement worker), so the window allocator takes a lock (a few instructions, never
across an await) and wakes the loop with ``call_soon_threadsafe``. Not fork-safe, like
the rest of the client.

Not implemented: CUDA IPC handles from a server GPU tier (no GPU here); such blocks come
through host shared memory like any other.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import logging
import math
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import numpy as np

from nopecache.client.config import ShmMode
from nopecache.client.cuda_arena import FetchedBlob
from nopecache.client.errors import InvalidArgumentError, TransportError
from nopecache.client.transport import BlockSource, ServerConnection, ServerInfo
from nopecache.client.zero_copy import ZeroCopySource
from nopecache.proto import cache_pb2 as pb
from nopecache.proto.contract import KEY_BYTES, method_path
from nopecache.proto.frames import GetFrameAssembler
from nopecache.proto.shm_layout import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    NAME_PREFIX,
    NONCE_AT,
    NONCE_BYTES,
    SESSION_AT,
    SESSION_BYTES,
    align,
    host_id,
)

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "SEGMENT_PREFIX",
    "Segment",
    "ShmFastPath",
    "ShmSource",
    "ShmStats",
    "host_id",
    "sweep_orphans",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = NAME_PREFIX
_PREFIX_RE = re.compile(r"^nopecache-[A-Za-z0-9_.-]{0,120}$")
DEFAULT_SEGMENT_BYTES = 128 * 1024**2
# A /dev/shm too small for the requested size (Docker's default is 64 MiB) gets a segment
# halved down to this; below it the fast path is not worth a session.
MIN_SEGMENT_BYTES = 8 * 1024**2
# The header layout is the wire contract's (proto/shm_layout.py).
ORPHAN_AGE_S = 60.0
QUARANTINE_S = 2.0
# A new session after a lost one only this often: more clients than the server's session
# table would otherwise evict each other on every call.
_REATTACH_INTERVAL_S = 10.0
# The smallest window worth asking for while block sizes are unknown.
_FIRST_WINDOW = 1024 * 1024
_ESTIMATE_WINDOW = 32
# Failures of AttachShm that are about the server's availability, not about shared memory:
# raised to the connection (the server is marked down, the next call attaches again).
_TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
_align = align


def sweep_orphans(
    prefix: str = SEGMENT_PREFIX, *, shm_dir: str = SHM_DIR, max_age_s: float = ORPHAN_AGE_S
) -> list[str]:
    """Unlink segment names older than ``max_age_s`` (left by a crash during AttachShm; a
    live client unlinks its name within one call); the names removed."""
    removed: list[str] = []
    cutoff = time.time() - max_age_s
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                removed.append(entry.name)
    return removed


@dataclass(frozen=True, slots=True)
class ShmStats:
    """Block bytes and counts by path, over the connections a ShmFastPath serves."""

    shm_bytes: int = 0
    grpc_bytes: int = 0  # received as data frames (no session, no room, did not fit)
    shm_blocks: int = 0
    grpc_blocks: int = 0
    sessions: int = 0  # attached now
    refused: int = 0  # connections that fell back to gRPC for good
    lost: int = 0  # sessions the server dropped (expiry, restart) while in use
    leased_bytes: int = 0  # placed straight from the server's pool (zero_copy.py)
    leased_blocks: int = 0
    copied_bytes: int = 0  # by the copying paths on a zero-copy connection (not leased)
    copied_blocks: int = 0
    # Connections whose server offered its pool over CUDA IPC and this process could not
    # open it (no CUDA, another GPU, cudaIpcOpenMemHandle failed): copying paths instead.
    cuda_ipc_fallbacks: int = 0


class Segment:
    """One client segment: a mapped /dev/shm file whose name lives only until attach."""

    def __init__(self, path: str, mm: mmap.mmap, nonce: bytes) -> None:
        """Wrap a created segment (use :meth:`create`)."""
        self.path = path
        self.name = os.path.basename(path)
        self.size = len(mm)
        self.mm: mmap.mmap | None = mm
        self.nonce = nonce

    @classmethod
    def create(cls, size: int, *, prefix: str = SEGMENT_PREFIX, shm_dir: str = SHM_DIR) -> Segment:
        """A new segment of ``size`` bytes (halved down to MIN_SEGMENT_BYTES while /dev/shm
        lacks room); raises OSError when none can be made."""
        sweep_orphans(prefix, shm_dir=shm_dir)
        while True:
            try:
                return cls._create(size, prefix, shm_dir)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.ENOMEM) or size // 2 < MIN_SEGMENT_BYTES:
                    raise
                size //= 2

    @classmethod
    def _create(cls, size: int, prefix: str, shm_dir: str) -> Segment:
        path = os.path.join(shm_dir, f"{prefix}{os.getpid()}-{secrets.token_hex(8)}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            # Reserve the pages now: writing to a sparse file on a full tmpfs is a SIGBUS.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(
                fd,
                size,
                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        nonce = secrets.token_bytes(NONCE_BYTES)
        mm[0:NONCE_AT] = MAGIC
        mm[NONCE_AT : NONCE_AT + NONCE_BYTES] = nonce
        return cls(path, mm, nonce)

    def unlink(self) -> None:
        """Remove the name from /dev/shm (idempotent; the mappings stay)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def session_ack(self) -> bytes:
        """The session id the server wrote into the header."""
        assert self.mm is not None
        return self.mm[SESSION_AT : SESSION_AT + SESSION_BYTES]

    def close(self) -> None:
        """Unlink and unmap; while block views are alive the mapping stays until the last
        one is gone (each view holds it)."""
        self.unlink()
        mm, self.mm = self.mm, None
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()


class _Window:
    """A range of the segment reserved for one Get, and what still uses it."""

    __slots__ = ("clean", "offset", "refs", "size")

    def __init__(self, offset: int, size: int) -> None:
        self.offset = offset
        self.size = size
        self.refs = 1  # the stream; +1 per live block view
        self.clean = False


class _Windows:
    """First-fit allocator of windows over a segment's data area, with coalescing frees.

    ``_lock`` guards the free list and the quarantine (views are released on any thread).
    """

    def __init__(self, segment: Segment, loop: asyncio.AbstractEventLoop) -> None:
        assert segment.mm is not None
        self._mm = segment.mm
        self._loop = loop
        self.start = HEADER_BYTES
        self.end = segment.size // ALIGN * ALIGN
        self._free: list[tuple[int, int]] = [(self.start, self.end)]  # sorted [start, end)
        self._quarantine: list[tuple[float, int, int]] = []  # (until, start, end)
        self._in_use = 0  # windows not released yet
        self._lock = threading.Lock()
        self.freed = asyncio.Event()

    @property
    def capacity(self) -> int:
        """Bytes of the data area."""
        return self.end - self.start

    def _add_free(self, start: int, end: int) -> None:
        """Insert [start, end) into the free list, merged with its neighbours (lock held)."""
        if start >= end:
            return
        free = self._free
        i = bisect.bisect_left(free, (start, end))
        if i < len(free) and free[i][0] == end:
            end = free.pop(i)[1]
        if i > 0 and free[i - 1][1] == start:
            start = free.pop(i - 1)[0]
            i -= 1
        free.insert(i, (start, end))

    def _reclaim(self, now: float) -> None:
        keep = []
        for until, start, end in self._quarantine:
            if until <= now:
                self._add_free(start, end)
            else:
                keep.append((until, start, end))
        self._quarantine = keep

    def reserve(self, want: int, need: int) -> _Window | None:
        """A window of ``want`` bytes, else of the largest free range if it holds ``need``."""
        want, need = _align(want), _align(need)
        with self._lock:
            self._reclaim(time.monotonic())
            best, best_len = -1, need - 1
            for i, (start, end) in enumerate(self._free):
                if end - start >= want:
                    best = i
                    break
                if end - start > best_len:
                    best, best_len = i, end - start
            if best < 0:
                return None
            start, end = self._free[best]
            size = min(want, end - start)
            if start + size == end:
                self._free.pop(best)
            else:
                self._free[best] = (start + size, end)
            self._in_use += 1
            return _Window(start, size)

    def busy(self) -> bool:
        """Whether windows are in use or quarantined (space will come back)."""
        return bool(self._in_use or self._quarantine)

    def next_reclaim(self) -> float | None:
        """Seconds until the next quarantined window is free, if any."""
        with self._lock:
            if not self._quarantine:
                return None
            return max(0.0, min(q[0] for q in self._quarantine) - time.monotonic())

    def view(self, window: _Window, offset: int, length: int) -> memoryview:
        """A writable view of a block in ``window``; the window stays reserved while it lives."""
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=length, offset=offset)
        with self._lock:
            window.refs += 1
        weakref.finalize(arr, self._unref, window)
        return arr.data  # a memoryview whose .obj is arr: alive as long as any view

    def finish(self, window: _Window, clean: bool, used_end: int) -> None:
        """The window's stream is over; a clean one gives back its unused tail at once."""
        with self._lock:
            if clean:
                window.clean = True
                keep = _align(used_end) - window.offset
                self._add_free(window.offset + keep, window.offset + window.size)
                window.size = keep
        self._unref(window)

    def _unref(self, window: _Window) -> None:
        with self._lock:
            window.refs -= 1
            if window.refs:
                return
            self._in_use -= 1
            start, end = window.offset, window.offset + window.size
            if window.clean:
                self._add_free(start, end)
            else:
                self._quarantine.append((time.monotonic() + QUARANTINE_S, start, end))
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self.freed.set)


class _SessionLost(Exception):
    """The server no longer knows the session (FAILED_PRECONDITION before any block)."""


@dataclass(frozen=True, slots=True)
class _Attached:
    """A live session: its id, the segment, the window allocator over it."""

    session: bytes
    segment: Segment
    windows: _Windows


class ShmSource:
    """The BlockSource of one connection: shared memory when attached, else gRPC."""

    def __init__(self, conn: ServerConnection, owner: ShmFastPath) -> None:
        """A source for ``conn`` that attaches on first use."""
        self._conn = conn
        self._owner = owner
        self._att: _Attached | None = None
        self._refused = False
        self._closed = False
        self._last_attach = -math.inf
        self._attach_lock: asyncio.Lock | None = None
        self._sizes: deque[int] = deque(maxlen=_ESTIMATE_WINDOW)

    @property
    def attached(self) -> bool:
        """Whether a session is held now."""
        return self._att is not None

    @staticmethod
    def _method(name: str) -> str:
        return method_path(name)

    async def warm(self) -> None:
        """Attach now (segment created and mapped, session made) instead of on first Get."""
        await self._ready()

    # -- session ----------------------------------------------------------------------
    async def _ready(self) -> _Attached | None:
        """The session, attaching now if due; None: use gRPC for this call."""
        if self._att is not None or self._refused or self._closed:
            return self._att
        if time.monotonic() - self._last_attach < _REATTACH_INTERVAL_S:
            return None
        if self._attach_lock is None:
            self._attach_lock = asyncio.Lock()
        async with self._attach_lock:
            if self._att is None and not self._refused and not self._closed:
                await self._attach()
        return self._att

    def _refuse(self, why: str) -> None:
        self._refused = True
        self._owner._refused += 1
        level = logging.WARNING if self._owner.mode == "on" else logging.INFO
        log.log(level, "nopecache %s: no shared memory (%s); using gRPC", self._conn.address, why)

    async def _attach(self) -> None:
        self._last_attach = time.monotonic()
        owner = self._owner
        try:
            segment = await asyncio.to_thread(
                Segment.create, owner.segment_bytes, prefix=owner.name_prefix, shm_dir=owner.shm_dir
            )
        except OSError as e:
            self._refuse(f"cannot create a segment in {owner.shm_dir}: {e}")
            return
        call = self._conn.channel.unary_unary(
            self._method("AttachShm"),
            request_serializer=pb.AttachShmRequest.SerializeToString,
            response_deserializer=pb.AttachShmReply.FromString,
        )
        request = pb.AttachShmRequest(name=segment.name, size=segment.size, nonce=segment.nonce)
        try:
            reply: pb.AttachShmReply = await call(
                request, timeout=self._conn.config.control_timeout_s, metadata=self._conn.metadata
            )
        except grpc.aio.AioRpcError as e:
            segment.close()
            if e.code() in _TRANSIENT:
                raise
            self._refuse(f"AttachShm failed: {e.code().name} {e.details()}")
            return
        except BaseException:
            segment.close()
            raise
        finally:
            segment.unlink()  # attached or not, the name is not needed any more
        if not reply.session:
            segment.close()
            self._refuse(f"the server refused the segment: {reply.refused}")
            return
        if segment.session_ack() != reply.session:
            segment.close()
            await self._detach(reply.session)
            self._refuse("the server's writes do not reach this segment")
            return
        windows = _Windows(segment, asyncio.get_running_loop())
        self._att = _Attached(reply.session, segment, windows)

    def _drop_session(self, att: _Attached) -> None:
        """Forget ``att`` (if still current). Its segment is unmapped now when no window is
        in use; otherwise by the last Get stream or block view letting go of it (they hold
        the mapping), never under a stream that may still receive frames."""
        if self._att is att:
            self._att = None
        if att.windows.busy():
            att.segment.unlink()
        else:
            att.segment.close()

    async def _detach(self, session: bytes) -> None:
        call = self._conn.channel.unary_unary(
            self._method("DetachShm"),
            request_serializer=pb.DetachShmRequest.SerializeToString,
            response_deserializer=pb.DetachShmReply.FromString,
        )
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call(
                pb.DetachShmRequest(session=session),
                timeout=self._conn.config.control_timeout_s,
                metadata=self._conn.metadata,
            )

    async def close(self) -> None:
        """Detach (best effort: an unreachable server expires the session) and unmap; the
        connection uses gRPC from then on."""
        self._closed = True
        att = self._att
        if att is not None:
            self._drop_session(att)
            await self._detach(att.session)

    # -- blocks -----------------------------------------------------------------------
    async def __call__(
        self, keys: bytes, timeout: float
    ) -> AsyncIterator[tuple[int, FetchedBlob | None]]:
        """Stream the blocks of ``keys`` (a BlockSource): through windows while attached and
        room comes free, the rest over gRPC."""
        deadline = time.monotonic() + timeout
        n = len(keys) // KEY_BYTES
        start = 0
        att = await self._ready() if n else None
        # Stop using a session another call lost or close() dropped meanwhile.
        while att is not None and att is self._att and start < n:
            plan = await self._plan(att.windows, n - start, deadline)
            if plan is None:
                break
            window, count = plan
            batch = keys[start * KEY_BYTES : (start + count) * KEY_BYTES]
            try:
                async with contextlib.aclosing(self._shm_get(att, batch, window, deadline)) as it:
                    async for index, blob in it:
                        yield start + index, blob
            except _SessionLost:
                self._owner._lost += 1
                log.info("nopecache %s: shared-memory session lost", self._conn.address)
                self._drop_session(att)
                break
            start += count
        if start < n:
            rest = keys[start * KEY_BYTES :]
            blocks = self._conn.data_blocks(rest, _remaining(deadline))
            try:
                async for index, fetched in blocks:
                    if fetched is not None:
                        self._owner._count(False, fetched.nbytes)
                    yield start + index, fetched
            finally:
                await blocks.aclose()  # type: ignore[attr-defined]  # an async generator

    def _estimate(self) -> int | None:
        return max(self._sizes) if self._sizes else None

    async def _plan(
        self, windows: _Windows, keys: int, deadline: float
    ) -> tuple[_Window, int] | None:
        """A window and how many keys to ask into it; None: use gRPC for the rest."""
        capacity = windows.capacity
        estimate = self._estimate()
        per = None if estimate is None else _align(estimate)
        if per is not None and per > capacity:
            return None  # blocks larger than the whole segment
        # Half the segment per window keeps one filling while another is being placed.
        cap = capacity // 2 if per is None or per <= capacity // 2 else capacity
        if per is None:
            want, need = cap, min(cap, _FIRST_WINDOW)
        else:
            want, need = min(keys, max(1, cap // per)) * per, per
        limit = min(deadline, time.monotonic() + self._owner.space_wait_s)
        while True:
            windows.freed.clear()
            window = windows.reserve(want, need)
            if window is not None:
                count = 1 if per is None else min(keys, max(1, window.size // per))
                return window, count
            remaining = limit - time.monotonic()
            if remaining <= 0 or not windows.busy():
                return None
            reclaim = windows.next_reclaim()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    windows.freed.wait(),
                    remaining if reclaim is None else min(remaining, reclaim + 0.001),
                )

    async def _shm_get(
        self, att: _Attached, keys: bytes, window: _Window, deadline: float
    ) -> AsyncGenerator[tuple[int, memoryview | None], None]:
        """One Get into ``window``: shm frames become views, data frames are reassembled."""
        windows = att.windows
        owner = self._owner
        request = pb.GetRequest(
            keys=keys, shm_session=att.session, shm_offset=window.offset, shm_size=window.size
        )
        call = self._conn.channel.unary_stream(
            self._method("Get"),
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None,
        )(request, timeout=_remaining(deadline), metadata=self._conn.metadata)
        frames = GetFrameAssembler(len(keys) // KEY_BYTES, self._conn.pool.take)
        lo, hi = window.offset, window.offset + window.size
        used_end = lo
        clean = False
        try:
            async for raw in call:
                assert isinstance(raw, bytes)
                entry = frames.feed(raw)
                if entry is None:
                    continue
                index, blob = entry.index, entry.blob
                if entry.shm_length:
                    at, length = entry.shm_offset, entry.shm_length
                    if at < lo or at + length > hi:
                        raise TransportError(
                            f"GetFrame.shm_offset/shm_length: [{at}, {at + length}) for a "
                            f"block of {length} bytes, outside the window [{lo}, {hi})"
                        )
                    used_end = max(used_end, at + length)
                    self._sizes.append(length)
                    owner._count(True, length)
                    yield index, windows.view(window, at, length)
                    continue
                if blob is not None:
                    self._sizes.append(blob.nbytes)
                    owner._count(False, blob.nbytes)
                yield index, blob
            frames.finish()
            clean = True
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and frames.expect == 0:
                raise _SessionLost(e.details()) from e
            raise
        finally:
            call.cancel()
            # A clean end means the server's handler has returned (the status follows it):
            # nothing writes into the window any more.
            windows.finish(window, clean, used_end)


def _remaining(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


class ShmFastPath:
    """The shared-memory FastPathFactory: pass as ``fast_path=`` (the client does when
    ``ClientConfig.shm`` is not "off"); ``close()`` detaches every session.

    ``mode``: "auto" tries servers whose host_id is this host's, "on" tries every server
    (the nonce check decides; refusals are logged as warnings), "off" never.
    """

    def __init__(
        self,
        mode: ShmMode = "auto",
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        name_prefix: str = SEGMENT_PREFIX,
        shm_dir: str = SHM_DIR,
        space_wait_s: float = 2.0,
        zero_copy: bool = True,
        cuda_register: bool | None = None,
        cuda_ipc: bool | None = None,
    ) -> None:
        """A factory making one segment of ``segment_bytes`` per same-host server; with
        ``zero_copy`` blocks come straight from the server's pool mapped read-only where it
        offers it (``zero_copy.py``; ``cuda_register``: page-locked for CUDA copies;
        ``cuda_ipc``: open a pool on a GPU over CUDA IPC, None = when torch sees a GPU),
        the segment serving the rest."""
        if mode not in ("auto", "on", "off"):
            raise InvalidArgumentError("mode", f"must be 'auto', 'on' or 'off', got {mode!r}")
        if (
            isinstance(segment_bytes, bool)
            or not isinstance(segment_bytes, int)
            or not MIN_SEGMENT_BYTES <= segment_bytes <= 1 << 40
        ):
            raise InvalidArgumentError(
                "segment_bytes",
                f"must be an int in [{MIN_SEGMENT_BYTES}, 2**40], got {segment_bytes!r}",
            )
        if not isinstance(name_prefix, str) or not _PREFIX_RE.match(name_prefix):
            raise InvalidArgumentError(
                "name_prefix", f"must be 'nopecache-' then [A-Za-z0-9_.-], got {name_prefix!r}"
            )
        if (
            isinstance(space_wait_s, bool)
            or not isinstance(space_wait_s, int | float)
            or space_wait_s < 0
        ):
            raise InvalidArgumentError("space_wait_s", f"must be >= 0, got {space_wait_s!r}")
        self.mode: ShmMode = mode
        self.segment_bytes = segment_bytes
        self.name_prefix = name_prefix
        self.shm_dir = shm_dir
        self.space_wait_s = float(space_wait_s)
        self.host_id = host_id()
        self._sources: list[ShmSource] = []
        self._bytes = [0, 0]  # gRPC, shm
        self._blocks = [0, 0]
        self._refused = 0
        self._lost = 0
        self.zero_copy = zero_copy
        self.cuda_register = cuda_register
        self.cuda_ipc = cuda_ipc
        self._leased = [0, 0, 0, 0]  # leased bytes, blocks, copied bytes, blocks
        self.zero_copy_sources: list[ZeroCopySource] = []

    def __call__(self, conn: ServerConnection, info: ServerInfo) -> BlockSource | None:
        """A source for a server on this host (zero copy over the segment, or the segment
        alone), else None (the connection uses gRPC)."""
        if self.mode == "off" or (self.mode == "auto" and info.host_id != self.host_id):
            return None
        source = ShmSource(conn, self)
        self._sources.append(source)
        if not self.zero_copy:
            return source
        zero = ZeroCopySource(
            conn,
            source,
            count=self._count_leased,
            cuda_register=self.cuda_register,
            cuda_ipc=self.cuda_ipc,
            space_wait_s=self.space_wait_s,
        )
        self.zero_copy_sources.append(zero)
        return zero

    def _count_leased(self, leased: bool, nbytes: int) -> None:
        at = 0 if leased else 2
        self._leased[at] += nbytes
        self._leased[at + 1] += 1

    def _count(self, shm: bool, nbytes: int) -> None:
        self._bytes[shm] += nbytes
        self._blocks[shm] += 1

    def stats(self) -> ShmStats:
        """Bytes and blocks by path so far, sessions held, refusals."""
        return ShmStats(
            shm_bytes=self._bytes[1],
            grpc_bytes=self._bytes[0],
            shm_blocks=self._blocks[1],
            grpc_blocks=self._blocks[0],
            sessions=sum(s.attached for s in self._sources),
            refused=self._refused,
            lost=self._lost,
            leased_bytes=self._leased[0],
            leased_blocks=self._leased[1],
            copied_bytes=self._leased[2],
            copied_blocks=self._leased[3],
            cuda_ipc_fallbacks=sum(z.cuda_ipc_fallbacks for z in self.zero_copy_sources),
        )

    async def close(self) -> None:
        """Detach every session and unmap the segments (before the channels close)."""
        zero, self.zero_copy_sources = self.zero_copy_sources, []
        await asyncio.gather(*(z.close() for z in zero))  # each closes its ShmSource too
        sources, self._sources = self._sources, []
        await asyncio.gather(*(s.close() for s in sources))
