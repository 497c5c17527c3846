"""Receive buffers of multi-frame blocks, reused instead of freed (one pool per client).

Why: a buffer of tens of MiB comes from mmap and page-faults its way in on first write,
every time (measured here: 55 ms to allocate and fill 33 MiB, 6 ms to refill a reused
one). A consumer done with a block gives its view back (``give``) and the next block of
a similar size reuses the memory; a consumer that keeps the block simply does not.
Buffers are pooled by size rounded up to 1 MiB, up to ``max_bytes`` in all. ``warm``
allocates and touches buffers ahead of the first fetch, so that fetch does not pay the
page faults (the client calls it at construction).

A buffer also carries the xxh3-64 of the block payload received into it when the bulk
stream hashed the bytes as they arrived (``note_payload_xxh3``, read back with
``payload_xxh3``): verification then compares that digest instead of reading the payload
a second time. It is forgotten whenever the buffer is taken again or given back, so a
digest never outlives the bytes it was taken from.
"""

from __future__ import annotations

import threading

__all__ = ["BufferPool", "note_payload_xxh3", "payload_xxh3"]

# Pool size classes: blocks within 1 MiB of each other share buffers.
_POOL_GRAIN = 1024 * 1024
_PAGE = 4096


class _Buffer(bytearray):
    """A reassembly buffer a :class:`BufferPool` handed out (the type marks it as poolable).

    ``digest``: (bytes received, xxh3-64 of their block payload) for the view ``take``
    handed out (which starts at the buffer's first byte), or None."""

    __slots__ = ("digest",)

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.digest: tuple[int, int] | None = None


def note_payload_xxh3(view: memoryview, digest: int) -> None:
    """Record that ``view`` (from ``BufferPool.take``, now filled) holds a block whose
    stored payload hashed to ``digest`` as it arrived; views of anything else are ignored."""
    buf = view.obj
    if type(buf) is _Buffer:
        buf.digest = (view.nbytes, digest)


def payload_xxh3(view: memoryview) -> int | None:
    """The digest ``note_payload_xxh3`` recorded for ``view``, or None (not a pooled view,
    none recorded, or a view of another length than the one received)."""
    buf = view.obj
    if type(buf) is not _Buffer or buf.digest is None:
        return None
    nbytes, digest = buf.digest
    return digest if nbytes == view.nbytes else None


class BufferPool:
    """Reassembly buffers of multi-frame blocks, reused instead of freed (module docstring).

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
        buf.digest = None
        return memoryview(buf)[:size]

    def give(self, view: memoryview) -> None:
        """Return the buffer behind ``view`` (from ``take``) once nothing reads it any more;
        views of anything else are ignored."""
        buf = view.obj
        if type(buf) is not _Buffer:
            return
        cls = len(buf)
        buf.digest = None
        with self._lock:
            if self._pooled + cls <= self.max_bytes:
                self._free.setdefault(cls, []).append(buf)
                self._pooled += cls

    def warm(self, size: int, count: int) -> int:
        """Pool ``count`` touched buffers of ``size`` bytes' class (page faults paid now,
        not by the first fetch); how many were added (stops at ``max_bytes``)."""
        cls = self._size_class(size)
        added = 0
        for _ in range(count):
            with self._lock:
                if self._pooled + cls > self.max_bytes:
                    break
            buf = _Buffer(cls)
            buf[::_PAGE] = b"\x01" * len(range(0, cls, _PAGE))  # touch every page
            with self._lock:
                self._free.setdefault(cls, []).append(buf)
                self._pooled += cls
            added += 1
        return added

    @property
    def pooled_bytes(self) -> int:
        """Bytes of free buffers held."""
        return self._pooled
