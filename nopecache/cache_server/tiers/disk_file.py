"""The disk tier's slab files: a few large preallocated files addressed as one page array.

Directory layout (``file:///var/cache/nopecache?capacity=64GiB`` -> files under that path)::

    lock             flock'ed while a server uses the directory (a second one is refused)
    secret           32 random bytes (0600): the key of every record header's MAC
    layout.json      page size and pages per slab; a different layout starts empty
    slab-000.bin     pages 0 .. P-1
    slab-001.bin     pages P .. 2P-1      (the last slab may hold fewer)

Page p lives in slab ``p // P`` at byte ``(p % P) * page_bytes``. A run of pages may cross
a slab boundary: I/O is split there (``segments``).

Why a few files rather than one, and never a file per block: one file per block costs an
inode, a directory entry and an open/close per read, and a million-block tier makes the
directory the bottleneck; a single file of many GiB is fine for the kernel but harder
for an operator to place and grow, so slabs are capped at ``SLAB_BYTES`` each.

I/O: ``os.preadv``/``os.pwrite`` at page offsets from page-aligned anonymous mappings, so
``O_DIRECT`` works where the filesystem allows it (the pages bypass the page cache: a
cache tier of tens of GiB must not evict the host's own page cache). Where opening with
``O_DIRECT`` fails (tmpfs, some FUSE and network filesystems: EINVAL), the files are
opened without it and one log line says so. Every method blocks: the tier calls them from
its worker threads, never on the event loop.

Thread safety: ``pread``/``pwrite`` at explicit offsets share no file position, so reads
on several threads and writes on one are safe together; which pages a thread may touch is
the tier's business (its page table and leases).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

from nopecache.cache_server.tiers.base import TierConfigError
from nopecache.cache_server.tiers.disk_record import HEAD_PROBE_BYTES

__all__ = ["ALIGN", "SLAB_BYTES", "SlabFiles", "ThreadBuffers", "aligned_buffer"]

log = logging.getLogger(__name__)

# O_DIRECT wants buffer address, offset and length aligned to the logical block size;
# 4 KiB covers every device in use (512 B and 4 KiB sectors).
ALIGN = 4096
SLAB_BYTES = 4 * 1024**3
_LAYOUT_VERSION = 1


def aligned_buffer(n_bytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned buffer of ``n_bytes`` (an anonymous mapping)."""
    return mmap.mmap(-1, max(n_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class ThreadBuffers:
    """One aligned buffer per thread, reused and grown to the largest record seen.

    A fresh mapping per I/O costs an mmap, a page fault per 4 KiB touched and an munmap:
    about as much as reading a 256 KiB block from a fast SSD. A thread's buffer is only
    ever used by that thread, between two calls of its own.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self._all: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self, n_bytes: int) -> mmap.mmap:
        """This thread's buffer, at least ``n_bytes`` long (its old contents remain)."""
        buf: mmap.mmap | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < n_bytes:
            if buf is not None:
                with self._lock:
                    self._all.remove(buf)
                buf.close()
            buf = aligned_buffer(-(-n_bytes // ALIGN) * ALIGN)
            self._local.buf = buf
            with self._lock:
                self._all.append(buf)
        return buf

    def close(self) -> None:
        """Unmap every thread's buffer (the threads are done)."""
        with self._lock:
            bufs, self._all = self._all, []
        for buf in bufs:
            buf.close()


class SlabFiles:
    """The tier directory's slab files, locked for this process, as ``n_pages`` pages."""

    def __init__(
        self, directory: Path, n_pages: int, page_bytes: int, *, files: int, direct: bool | None
    ) -> None:
        if page_bytes % ALIGN:
            raise TierConfigError(f"page: must be a multiple of {ALIGN} bytes, got {page_bytes}")
        if not 1 <= files <= n_pages:
            raise TierConfigError(f"files: must be in 1..{n_pages} (the pages), got {files}")
        self.directory = directory
        self.n_pages = n_pages
        self.page_bytes = page_bytes
        self.pages_per_file = -(-n_pages // files)
        self._lock_fd = -1
        self._fds: list[int] = []
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(directory)
            self.secret = _secret(directory)
            fresh = _layout_changed(directory, page_bytes, self._file_pages(files))
            self.direct = self._open(files, direct, fresh)
        except OSError as e:
            self.close()
            raise TierConfigError(f"{directory}: {e.strerror or e}") from e
        except BaseException:
            self.close()
            raise
        self.preallocated = self._preallocate()
        self.files = len(self._fds)

    def _file_pages(self, files: int) -> list[int]:
        ppf = self.pages_per_file
        return [min(ppf, self.n_pages - i * ppf) for i in range(files) if self.n_pages > i * ppf]

    def _open(self, files: int, direct: bool | None, fresh: bool) -> bool:
        """Open (creating) every slab; whether O_DIRECT is on."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        if fresh:
            flags |= os.O_TRUNC
        use_direct = direct is not False and hasattr(os, "O_DIRECT")
        for i, _ in enumerate(self._file_pages(files)):
            path = self.directory / f"slab-{i:03d}.bin"
            if use_direct:
                try:
                    self._fds.append(os.open(path, flags | os.O_DIRECT, 0o600))
                    continue
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    if direct:
                        raise TierConfigError(
                            f"{self.directory}: direct=yes but the filesystem refuses O_DIRECT"
                        ) from e
                    log.info(
                        "disk tier %s: the filesystem refuses O_DIRECT; reading and writing "
                        "through the page cache",
                        self.directory,
                    )
                    use_direct = False
            self._fds.append(os.open(path, flags, 0o600))
        return use_direct

    def _preallocate(self) -> bool:
        """Reserve every slab's blocks now (a full disk shows at start, not mid-write)."""
        ok = True
        for fd, pages in zip(self._fds, self._file_pages(len(self._fds)), strict=True):
            size = pages * self.page_bytes
            if os.fstat(fd).st_size >= size:
                continue
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                ok = False
                log.warning(
                    "disk tier %s: cannot preallocate %d bytes (%s); writes that find no "
                    "room will be misses and mark the tier unhealthy",
                    self.directory,
                    size,
                    e.strerror or e,
                )
                # Else the file grows as it is written, as far as the disk allows.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
        return ok

    def segments(self, runs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """(fd, file offset, bytes) per contiguous piece of ``runs``, in stream order."""
        out = []
        ppf, page = self.pages_per_file, self.page_bytes
        for start, count in runs:
            while count:
                slab, first = divmod(start, ppf)
                n = min(count, ppf - first)
                out.append((self._fds[slab], first * page, n * page))
                start += n
                count -= n
        return out

    def read_runs(self, runs: Sequence[tuple[int, int]], buf: mmap.mmap, n_bytes: int) -> bool:
        """Read the first ``n_bytes`` (rounded up to ``ALIGN``) of the pages of ``runs``
        into ``buf``; False on a short read (a slab truncated under the tier)."""
        view = memoryview(buf)
        try:
            pos, left = 0, -(-n_bytes // ALIGN) * ALIGN
            for fd, offset, n in self.segments(runs):
                n = min(n, left)
                if n <= 0:
                    break
                if os.preadv(fd, [view[pos : pos + n]], offset) != n:
                    return False
                pos += n
                left -= n
            return True
        finally:
            view.release()

    def write_runs(self, runs: Sequence[tuple[int, int]], buf: mmap.mmap, n_bytes: int) -> None:
        """Write the first ``n_bytes`` of ``buf`` (rounded up to ``ALIGN``) over the pages of
        ``runs``; OSError (ENOSPC, EIO, ...) propagates."""
        view = memoryview(buf)
        try:
            pos, left = 0, -(-n_bytes // ALIGN) * ALIGN
            for fd, offset, n in self.segments(runs):
                n = min(n, left)
                if n <= 0:
                    break
                done = 0
                while done < n:  # a short write is resumed; an error raises
                    done += os.pwrite(fd, view[pos + done : pos + n], offset + done)
                pos += n
                left -= n
        finally:
            view.release()

    def read_head(self, page: int, buf: mmap.mmap) -> int:
        """Read the first ``HEAD_PROBE_BYTES`` of ``page`` into ``buf``; the bytes read."""
        ((fd, offset, _),) = self.segments(((page, 1),))
        view = memoryview(buf)
        try:
            return os.preadv(fd, [view[:HEAD_PROBE_BYTES]], offset)
        finally:
            view.release()

    def erase_head(self, page: int, zeros: mmap.mmap) -> None:
        """Overwrite the header at ``page`` with zeros (a deleted record stays deleted)."""
        ((fd, offset, _),) = self.segments(((page, 1),))
        view = memoryview(zeros)
        try:
            os.pwrite(fd, view[:HEAD_PROBE_BYTES], offset)
        finally:
            view.release()

    def sync(self) -> None:
        """fdatasync every slab (what was written survives a power loss)."""
        for fd in self._fds:
            os.fdatasync(fd)

    def close(self) -> None:
        """Close the slabs and release the directory lock (idempotent)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = -1


def _lock(directory: Path) -> int:
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        raise TierConfigError(
            f"{directory}: in use by another server process (each needs its own directory)"
        ) from e
    return fd


def _secret(directory: Path) -> bytes:
    path = directory / "secret"
    try:
        data = path.read_bytes()
        if len(data) == 32:
            return data
    except FileNotFoundError:
        pass
    data = secrets.token_bytes(32)
    tmp = directory / "secret.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return data


def _layout_changed(directory: Path, page_bytes: int, file_pages: list[int]) -> bool:
    """Whether the slabs must start empty (no layout yet, or another page size or split);
    records the layout asked for."""
    path = directory / "layout.json"
    want = {"version": _LAYOUT_VERSION, "page_bytes": page_bytes, "file_pages": file_pages}
    try:
        have = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        have = None
    if have == want:
        return False
    if have is not None:
        log.warning(
            "disk tier %s: layout changed (%s -> %s): starting empty", directory, have, want
        )
    path.write_text(json.dumps(want))
    return True
