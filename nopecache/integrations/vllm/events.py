"""KV events for routers: what this engine put in the shared cache, and what has left it.

Routers that pick an engine by the KV it can reach (Dynamo's KV router, llm-d's scorer)
index vLLM's KV events. The connector announces the blocks it stored the way vLLM
announces its own (``BlockStored``: vLLM's block hashes, the parent hash, the tokens of
the new blocks, the block size) under a *medium* the routers map to a tier below the GPU,
and withdraws them when the cache no longer holds them::

    _save (scheduler)       stored(hashes, keys, tokens)  -> BlockStored of the new blocks
    server removal feed     on_removal(keys)              -> BlockRemoved of their hashes
      (follower thread)     on_removal(cleared)           -> AllBlocksCleared, or BlockRemoved
                                                             of every announced block when
                                                             vLLM's own cache is announced too
                            on_removal(lost)              -> BlockRemoved of every announced
    a lookup that misses    gone_hashes(hashes)           -> BlockRemoved
    reset_cache             reset()                       -> BlockRemoved of every announced

The medium. Dynamo 1.6 maps ``GPU``/``DEVICE`` to the device tier, ``CPU``/``CPU_PINNED``
to host memory, ``STORAGE``/``DISK``/``SHARED`` to its lowest tier and drops events with a
medium it does not know (``EXTERNAL`` included); llm-d weighs ``gpu`` 1.0, ``cpu`` 0.8,
``shared_storage`` 0.4 and ``storage`` 0.3 (lower-cased). ``STORAGE`` (vLLM's own
``MEDIUM_STORAGE``) is the one name every one of them knows as a tier below the GPU, so it
is the default; ``kv_event_medium`` sets another (``shared_storage`` for llm-d's shared
tier weight). An unknown medium is the failure to avoid: a router then drops the events or
treats the blocks as GPU-resident and over-routes to this engine.

A block is announced once (later stores of the same prefix announce only the blocks after
it, with the last announced one as parent, as vLLM does). Announced blocks are forgotten
when withdrawn, so storing them again announces them again.

Concurrency: the removal feed calls :meth:`AnnouncedBlocks.on_removal` on its threads while
the scheduler thread stores and takes events; one lock guards all the state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nopecache.client.removals import Removal

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import BlockHash

__all__ = ["DEFAULT_MEDIUM", "AnnouncedBlocks", "Cleared", "Event", "Removed", "StoredRun"]

DEFAULT_MEDIUM = "STORAGE"


@dataclass(frozen=True, slots=True)
class StoredRun:
    """Consecutive blocks announced in one BlockStored event."""

    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None  # the block before the first (None: the prompt's start)
    token_ids: tuple[int, ...]  # exactly len(block_hashes) * block_size tokens
    block_size: int
    # As vLLM's own events name them, so routers keep adapters and images apart: the
    # request's LoRA adapter (id, name) and each block's extra keys (None: no block has any).
    lora: tuple[int, str] | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """Announced blocks the cache no longer holds (one BlockRemoved event)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """Every block this engine announced is gone (AllBlocksCleared)."""


Event = StoredRun | Removed | Cleared


class AnnouncedBlocks:
    """The blocks this engine announced, keyed both ways (see the module docstring).

    ``clear_all``: a flush may be announced as AllBlocksCleared, which clears every block
    of the engine in a router; right only when the engine announces no blocks of its own
    (vLLM's prefix cache off), else each announced block is removed instead.
    """

    def __init__(self, clear_all: bool) -> None:
        self._clear_all = clear_all
        self._lock = threading.Lock()
        self._key_of: dict[BlockHash, bytes] = {}  # announced hash -> its cache key
        self._hash_of: dict[bytes, BlockHash] = {}
        # Events in the order they happened (a block stored and removed within one step
        # must reach the router in that order); a list of hashes is a BlockRemoved.
        self._events: list[StoredRun | list[BlockHash] | Cleared] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._key_of)

    def stored(
        self,
        hashes: Sequence[BlockHash],
        keys: Sequence[bytes],
        tokens: Sequence[int],
        block_size: int,
        lora: tuple[int, str] | None = None,
        extra_keys: Sequence[tuple[object, ...] | None] | None = None,
    ) -> None:
        """Whole blocks ``hashes`` (cache keys ``keys``, tokens from position 0) are stored;
        ``lora`` and ``extra_keys`` (one entry per hash) as vLLM's events carry them."""
        if len(keys) < len(hashes) or len(tokens) < len(hashes) * block_size:
            raise ValueError("stored: a key and block_size tokens for every hash")
        with self._lock:
            first = next((i for i, h in enumerate(hashes) if h not in self._key_of), None)
            if first is None:
                return
            for h, key in zip(hashes[first:], keys[first : len(hashes)], strict=True):
                self._key_of[h] = key
                self._hash_of[key] = h
            self._events.append(
                StoredRun(
                    tuple(hashes[first:]),
                    hashes[first - 1] if first else None,
                    tuple(tokens[first * block_size : len(hashes) * block_size]),
                    block_size,
                    lora,
                    None if extra_keys is None else tuple(extra_keys[first : len(hashes)]),
                )
            )

    def gone_hashes(self, hashes: Sequence[BlockHash]) -> None:
        """Announced blocks among ``hashes`` are no longer in the cache."""
        with self._lock:
            for h in hashes:
                self._withdraw(h)

    def on_removal(self, server: str, removal: Removal) -> None:
        """An event of a server's removal feed (called on the follower's thread)."""
        with self._lock:
            if removal.cleared and self._clear_all:
                self._key_of.clear()
                self._hash_of.clear()
                self._events.append(Cleared())
                return
            if removal.cleared or removal.lost:
                for h in list(self._key_of):
                    self._withdraw(h)
                return
            for key in removal.keys:
                h = self._hash_of.get(key)
                if h is not None:
                    self._withdraw(h)

    def reset(self) -> None:
        """Withdraw every announced block (the engine's cache was reset)."""
        with self._lock:
            for h in list(self._key_of):
                self._withdraw(h)

    def take(self) -> list[Event]:
        """The events gathered since the last call, in order."""
        with self._lock:
            events, self._events = self._events, []
        return [Removed(tuple(e)) if isinstance(e, list) else e for e in events]

    def _withdraw(self, h: BlockHash) -> None:
        key = self._key_of.pop(h, None)
        if key is None:
            return
        del self._hash_of[key]
        last = self._events[-1] if self._events else None
        if isinstance(last, list):
            last.append(h)
        else:
            self._events.append([h])
