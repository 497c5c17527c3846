"""Server side of the same-host fast path: client segments held per session, Get windows.

A client on this host creates a shared-memory segment (a file directly in /dev/shm), writes
a magic and a random nonce into its header and calls AttachShm (layout in proto/cache.proto)::

    offset 0       16      32        48           4096                         size
           | magic | nonce | session |  reserved  | windows: Get payloads ...   |

:meth:`ShmSessions.attach` opens the name, checks that it is a regular file of this
process's own uid and of the announced size, reads its header, and compares the nonce: equal bytes
prove that both processes see the same memory (same host, same /dev/shm; a server in
another container finds no such file, or another file). It then writes the session id at
offset 32 so the client can check that the server's writes reach it. The client unlinks
the name right after, so a crash of either process leaves nothing in /dev/shm; the
descriptor held here keeps the memory until the session ends.

Session table (bounded; all on the server's event loop, so no locks):

* A session ends on DetachShm, after ``idle_s`` without a Get (a client that crashed or
  went away never detaches: the expiry timer frees its memory), or when the table is
  full: a new attach evicts the least recently used sessions that have no Get in flight,
  up to ``max_sessions`` sessions and ``max_total_bytes`` mapped. A session with Gets in
  flight is unmapped when the last one ends.
* Sessions belong to the tenant that attached them: another tenant naming the id gets
  the same answer as for an unknown id.

Get windows (:class:`ShmTarget`). A Get names a window of the segment; every hit that fits
the rest of it is copied in (one gathering pwritev straight from the host tier's pages,
lent for the write by ``GetRules.lent``; 64-byte aligned so that tensors viewing it are
aligned) before its frame is sent. Two Gets whose windows overlap
are never both writing: a Get whose window overlaps one in flight on the same session
(the client reused a window while a call it cancelled is still unwinding here) writes
nothing and sends data frames instead; a cancelled call stops writing. The client reads
a window only after the frame that announces it, and verifies every block's checksums.

Safety. Only files of this process's uid are opened. The server never maps a client's
segment: a mapping of a file the client then shrinks faults with SIGBUS on the next copy,
which would kill the server. It keeps the open descriptor instead and copies with
``pwrite``, which on a shrunk file just writes (growing it back, at most to the size
attached, already counted in ``max_total_bytes``); a write that fails (a full /dev/shm)
sends that block as data frames. Copies run on the event loop, like the framing copies
of the gRPC path (a 32 MiB block is a few milliseconds).

Not implemented: the CUDA analogue (a CUDA IPC handle into the server's GPU tier); blocks
of a GPU tier are copied through host memory like any other.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from nopecache.cache_server.refusal import Refusal, RefusalKind, bad_request
from nopecache.proto.shm_layout import (
    ALIGN,
    HEADER_BYTES,
    MAGIC,
    NAME_PREFIX,
    NAME_RE,
    NONCE_AT,
    NONCE_BYTES,
    SESSION_AT,
    SESSION_BYTES,
    align,
)

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "MAGIC",
    "NAME_PREFIX",
    "SESSION_BYTES",
    "AttachOutcome",
    "ShmLimits",
    "ShmSessions",
    "ShmTarget",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# Buffers per pwritev call (POSIX guarantees at least 16; Linux takes 1024).
_IOV_MAX = 64
# The segment layout is the wire contract's (proto/shm_layout.py), shared with the client.
_NAME_RE = NAME_RE
_NONCE_AT = NONCE_AT
_SESSION_AT = SESSION_AT
_align = align


def _invalid(message: str) -> Refusal:
    return bad_request("bad_shm", message)


@dataclass(frozen=True, slots=True)
class ShmLimits:
    """Bounds of the session table (see the module docstring)."""

    idle_s: float = 120.0
    max_sessions: int = 64
    max_segment_bytes: int = 4 * 1024**3
    max_total_bytes: int = 16 * 1024**3

    def __post_init__(self) -> None:
        if isinstance(self.idle_s, bool) or not isinstance(self.idle_s, int | float):
            raise ValueError(f"idle_s: must be a number, got {self.idle_s!r}")
        if not self.idle_s > 0:
            raise ValueError(f"idle_s: must be > 0, got {self.idle_s}")
        for name in ("max_sessions", "max_segment_bytes", "max_total_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class AttachOutcome:
    """What AttachShm answers: a session id, or why the segment was refused (a value)."""

    session: bytes = b""
    refused: str = ""


class _Session:
    """One open client segment and the Get windows in flight on it."""

    __slots__ = ("active", "closing", "fd", "id", "last_used", "name", "size", "tenant")

    def __init__(self, sid: bytes, tenant: str, name: str, fd: int, size: int, now: float) -> None:
        self.id = sid
        self.tenant = tenant
        self.name = name
        self.size = size
        self.fd = fd
        self.last_used = now
        self.active: list[tuple[int, int]] = []  # [start, end) of Gets in flight
        self.closing = False

    def write(self, parts: list[memoryview], offset: int) -> bool:
        """Copy ``parts``, in order, to ``offset`` of the segment (one gathering write
        when the kernel takes it whole); False if the kernel refused."""
        parts = [p for p in parts if p.nbytes]
        try:
            while parts:
                done = os.pwritev(self.fd, parts[:_IOV_MAX], offset)
                offset += done
                while parts and done >= parts[0].nbytes:
                    done -= parts.pop(0).nbytes
                if done:
                    parts[0] = parts[0][done:]
        except OSError as e:
            log.debug("shm segment %s: write refused (%s): data frames", self.name, e.strerror)
            return False
        return True

    def unmap(self) -> None:
        """Close the segment (only once no Get writes into it)."""
        os.close(self.fd)


class ShmTarget:
    """The window one Get copies hits into; use as a context manager around the stream."""

    __slots__ = ("_cancelled", "_cursor", "_end", "_owner", "_session", "_start", "placed")

    def __init__(
        self,
        owner: ShmSessions,
        session: _Session | None,
        start: int,
        end: int,
        cancelled: Callable[[], bool],
    ) -> None:
        self._owner = owner
        self._session = session
        self._start = start
        self._end = end
        self._cursor = start
        self._cancelled = cancelled
        self.placed = 0  # bytes copied into the window

    @property
    def active(self) -> bool:
        """Whether this Get writes into a window (else every block goes as data frames)."""
        return self._session is not None

    def place(self, blob: bytes | memoryview | list[memoryview]) -> int | None:
        """Copy ``blob`` (or its parts, in order: a tier's page runs) into the rest of the
        window: its segment offset, or None when it does not fit (or the call is
        cancelled): send it as data frames then."""
        session = self._session
        if session is None:
            return None
        parts = blob if isinstance(blob, list) else [memoryview(blob).cast("B")]
        n = sum(p.nbytes for p in parts)
        start = _align(self._cursor)
        if start + n > self._end or self._cancelled():
            return None
        if not session.write(parts, start):
            return None
        self._cursor = start + n
        self.placed += n
        return start

    def close(self) -> None:
        """The Get is over: it writes nothing more (idempotent)."""
        session, self._session = self._session, None
        if session is not None:
            self._owner._end_get(session, (self._start, self._end))

    def __enter__(self) -> ShmTarget:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ShmSessions:
    """The bounded table of attached client segments (see the module docstring).

    Belongs to one event loop (the server's); ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        limits: ShmLimits | None = None,
        *,
        shm_dir: str = SHM_DIR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """An empty table; segments are looked up in ``shm_dir``."""
        self.limits = ShmLimits() if limits is None else limits
        self._dir = shm_dir
        self._clock = clock
        # Least recently used first.
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self._pending_bytes = 0  # reserved by attaches still mapping their segment
        self._pending = 0
        self._timer: asyncio.TimerHandle | None = None

    # -- table ---------------------------------------------------------------------------
    @property
    def sessions(self) -> int:
        """Sessions attached now."""
        return len(self._sessions)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of client segments held open now."""
        return sum(s.size for s in self._sessions.values())

    def _drop(self, session: _Session, why: str) -> None:
        """Remove a session from the table; unmap now, or when its last Get ends."""
        self._sessions.pop(session.id, None)
        session.closing = True
        if not session.active:
            session.unmap()
        log.debug("shm session %s (%s) dropped: %s", session.id.hex(), session.name, why)

    def expire(self) -> int:
        """Drop the sessions idle for ``idle_s`` or more; how many."""
        deadline = self._clock() - self.limits.idle_s
        idle = [s for s in self._sessions.values() if not s.active and s.last_used <= deadline]
        for session in idle:
            self._drop(session, "idle")
        return len(idle)

    def _make_room(self, size: int) -> bool:
        """Evict idle-most sessions without Gets in flight until ``size`` more bytes and one
        more session fit; False if they cannot."""
        limits = self.limits
        for session in list(self._sessions.values()):
            if (
                len(self._sessions) + self._pending < limits.max_sessions
                and self.mapped_bytes + self._pending_bytes + size <= limits.max_total_bytes
            ):
                return True
            if not session.active:
                self._drop(session, "evicted (table full)")
        return (
            len(self._sessions) + self._pending < limits.max_sessions
            and self.mapped_bytes + self._pending_bytes + size <= limits.max_total_bytes
        )

    def _schedule_expiry(self) -> None:
        if self._timer is not None or not self._sessions:
            return
        oldest = min(s.last_used for s in self._sessions.values())
        delay = max(0.05, oldest + self.limits.idle_s - self._clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.expire()
        self._schedule_expiry()

    # -- RPCs ----------------------------------------------------------------------------
    async def attach(self, tenant: str, name: str, size: int, nonce: bytes) -> AttachOutcome:
        """Map the client's segment ``name``; a session id, or why not (a value).

        Raises Refusal (BAD_REQUEST) for malformed arguments.
        """
        if not _NAME_RE.match(name):
            raise _invalid(
                f"AttachShmRequest.name: {name[:80]!r} is not {NAME_PREFIX!r} followed by "
                "1-200 of [A-Za-z0-9_.-]"
            )
        if len(nonce) != NONCE_BYTES:
            raise _invalid(f"AttachShmRequest.nonce: {len(nonce)} bytes, expected {NONCE_BYTES}")
        if size < HEADER_BYTES + ALIGN:
            raise _invalid(
                f"AttachShmRequest.size: {size} bytes, at least {HEADER_BYTES + ALIGN} needed"
            )
        if size > self.limits.max_segment_bytes:
            return AttachOutcome(
                refused=f"size: {size} bytes is over this server's max_segment_bytes "
                f"{self.limits.max_segment_bytes}"
            )
        self.expire()
        if not self._make_room(size):
            return AttachOutcome(
                refused=f"session table full ({len(self._sessions)} sessions, "
                f"{self.mapped_bytes} bytes mapped, all in use)"
            )
        sid = secrets.token_bytes(SESSION_BYTES)
        self._pending += 1
        self._pending_bytes += size
        try:
            # Opening and checking off the loop (file system calls).
            mapped = await asyncio.to_thread(
                _open_segment, os.path.join(self._dir, name), size, nonce, sid
            )
        finally:
            self._pending -= 1
            self._pending_bytes -= size
        if isinstance(mapped, str):
            log.debug("shm attach of %s refused: %s", name, mapped)
            return AttachOutcome(refused=mapped)
        self._sessions[sid] = _Session(sid, tenant, name, mapped, size, self._clock())
        self._schedule_expiry()
        log.debug("shm session %s attached %s (%d bytes)", sid.hex(), name, size)
        return AttachOutcome(session=sid)

    def detach(self, tenant: str, sid: bytes) -> bool:
        """End a session; False if there is no such session of ``tenant``."""
        session = self._sessions.get(sid)
        if session is None or session.tenant != tenant:
            return False
        self._drop(session, "detached")
        return True

    def target(
        self,
        tenant: str,
        sid: bytes,
        offset: int,
        size: int,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> ShmTarget:
        """The window of one Get (an inert one when the request names no session, window).

        Raises Refusal: BAD_REQUEST for a malformed session id or a window outside the
        segment, STALE_SESSION for an unknown or expired session.
        """
        if not sid and not offset and not size:
            return ShmTarget(self, None, 0, 0, cancelled)
        if len(sid) != SESSION_BYTES:
            raise _invalid(
                f"GetRequest.shm_session: {len(sid)} bytes, expected {SESSION_BYTES} "
                "(required with shm_offset/shm_size)"
            )
        session = self._sessions.get(sid)
        if session is None or session.tenant != tenant:
            self.expire()
            raise Refusal(
                RefusalKind.STALE_SESSION,
                "shm_session_unknown",
                f"GetRequest.shm_session: no session {sid.hex()} (expired or detached): "
                "attach again",
            )
        end = offset + size
        if size <= 0 or offset < HEADER_BYTES or end > session.size:
            raise _invalid(
                f"GetRequest.shm_offset/shm_size: window [{offset}, {end}) is not inside the "
                f"segment's windows [{HEADER_BYTES}, {session.size})"
            )
        session.last_used = self._clock()
        self._sessions.move_to_end(sid)
        if any(offset < b and a < end for a, b in session.active):
            log.debug("shm window [%d, %d) of %s busy: data frames", offset, end, sid.hex())
            return ShmTarget(self, None, offset, end, cancelled)
        session.active.append((offset, end))
        return ShmTarget(self, session, offset, end, cancelled)

    def _end_get(self, session: _Session, window: tuple[int, int]) -> None:
        session.active.remove(window)
        session.last_used = self._clock()
        if session.closing and not session.active:
            session.unmap()

    def close(self) -> None:
        """Drop every session (server shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for session in list(self._sessions.values()):
            self._drop(session, "server closing")


def _open_segment(path: str, size: int, nonce: bytes, sid: bytes) -> int | str:
    """Open a client segment and prove it is the client's memory: the open descriptor,
    or why not (a refusal the client reads)."""
    name = os.path.basename(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        return f"segment: cannot open {name} on the server's host: {e.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _closed(fd, f"segment: {name} is not a regular file")
        if st.st_uid != os.geteuid():
            return _closed(
                fd,
                f"segment: {name} belongs to uid {st.st_uid}, the server runs as {os.geteuid()}",
            )
        if st.st_size != size:
            return _closed(fd, f"segment: {name} is {st.st_size} bytes, the request says {size}")
        header = os.pread(fd, _SESSION_AT, 0)
        if header[:_NONCE_AT] != MAGIC or not hmac.compare_digest(
            header[_NONCE_AT : _NONCE_AT + NONCE_BYTES], nonce
        ):
            return _closed(
                fd,
                f"segment: {name} does not hold the client's magic and nonce (not the same memory)",
            )
        os.pwrite(fd, sid, _SESSION_AT)
    except OSError as e:
        return _closed(fd, f"segment: cannot use {name}: {e.strerror}")
    return fd


def _closed(fd: int, refusal: str) -> str:
    """Close ``fd`` and return ``refusal``."""
    os.close(fd)
    return refusal
