"""nopecache as SGLang's HiCache L3 storage: :class:`NopecacheStorage` (a ``HiCacheStorage``).

SGLang loads it without patches::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "nopecache",
          "module_path": "nopecache.integrations.sglang.backend",
          "class_name": "NopecacheStorage", "interface_v1": 1,
          "url": "nopecache://cache:50551", "namespace": "team-a"}'

Its factory builds ``NopecacheStorage(storage_config, kwargs)`` and hands over the host
pool with ``register_mem_pool_host``. Then the cache controller's threads call::

    batch_exists(keys)                  one Lookup per server: how many pages from the start
    batch_set_v1(keys, host_indices)    pages straight from the host pool into blocks, Put
    batch_get_v1(keys, host_indices)    Get streams, each payload copied once into the pool
    get / set / batch_get / batch_set / exists     the legacy interface (flat page tensors)

``keys`` are SGLang's chained page hashes (hex strings); each names the whole prefix up to
its page, so this is exact-prefix reuse of opaque page bytes (post-RoPE K, never rotated).
A block key is ``engine_page_key(fingerprint, namespace, page hash)`` with the pool's
fingerprint (``identity.py``). SGLang's page hash already names the request's LoRA adapter,
cache salt, extra key and images (``tests/integrations/sglang/test_page_identity.py``);
when SGLang loads adapters at start-up, whose ids name no content, the hash is scoped by
their files first (``adapters.py``). Pages move in the pool's own byte order (``pages.py``).

Failures are misses: a down, slow or hung server, a block that fails verification, a
malformed argument. The batch calls return a bool per page (never None: SGLang's backup
thread dies on None) and never raise. MLA: only TP rank 0 writes (the latent is the same on
every rank); every rank reads. Configuration errors raise at construction, naming the key.

Concurrency: SGLang calls from its prefetch and backup threads at once; the client is
thread-safe and the stats lists are guarded by ``_stats_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from nopecache.client.buffers import BufferPool
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.keyed_blocks import KeyedBlockClient, StoreStatus
from nopecache.client.keys import engine_page_key
from nopecache.client.model_source import ModelSource
from nopecache.integrations.sglang import compat
from nopecache.integrations.sglang.adapters import adapter_scope, scoped_page_hash
from nopecache.integrations.sglang.config import BackendConfig
from nopecache.integrations.sglang.identity import page_fingerprint
from nopecache.integrations.sglang.pages import PageOrder, PagePool, PoolGeometry
from nopecache.proto.block import BlockError, StoredForm, build_block_into, validate

__all__ = ["NopecacheStorage"]

log = logging.getLogger(__name__)

# clear() removes the pages this process stored: their keys are remembered, up to this
# many (16 bytes each); beyond it the oldest are forgotten (and stay until evicted).
_MAX_REMEMBERED_KEYS = 1 << 20
_STORED = (StoreStatus.STORED, StoreStatus.ALREADY_PRESENT)


class NopecacheStorage(HiCacheStorage):
    """SGLang HiCache storage over nopecache servers (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        """Validate SGLang's extra config and create the client (no server is contacted)."""
        self.settings = BackendConfig.from_extra_config(storage_config.extra_config)
        self.identity = compat.page_identity(storage_config)
        # What SGLang loaded, from its own model config: never the name alone.
        model_config = compat.model_config(kwargs)
        self.source: ModelSource = compat.model_source(model_config, self.settings.model)
        self._model_dtype = compat.model_dtype(model_config)
        # Read once: SGLang loads its start-up adapters before it builds this backend.
        self.adapter_scope = adapter_scope(compat.startup_adapters())
        self.client = KeyedBlockClient(self.settings.client)
        self.pages: PagePool | None = None
        self._fingerprints: dict[PageOrder, ModelFingerprint] = {}
        self._metrics_on = bool(storage_config.enable_storage_metrics)
        self._stats_lock = threading.Lock()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_gbps: list[float] = []
        self._backup_gbps: list[float] = []
        self._stored_keys: dict[bytes, None] = {}  # insertion-ordered: oldest first
        # Blobs are encoded into reused buffers: a fresh one per page would fault its
        # pages in on every store (the copy into it ran at a quarter of memcpy's speed).
        self._blobs = BufferPool()

    # -- set-up -----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: its pages are what this backend stores and fills."""
        super().register_mem_pool_host(mem_pool_host)
        geometry = compat.pool_geometry(mem_pool_host)
        self.pages = PagePool(geometry)
        self._fingerprints = {
            order: page_fingerprint(self.source, self._model_dtype, geometry, self.identity, order)
            for order in ("token_major", "layer_major")
        }

    @property
    def geometry(self) -> PoolGeometry:
        """The registered pool's geometry (ValueError before registration)."""
        if self.pages is None:
            raise ValueError("no host pool registered (register_mem_pool_host)")
        return self.pages.geometry

    def fingerprint(self, order: PageOrder) -> ModelFingerprint:
        """The fingerprint of this pool's pages in byte ``order``."""
        if not self._fingerprints:
            raise ValueError("no host pool registered (register_mem_pool_host)")
        return self._fingerprints[order]

    def _keys(self, keys: Sequence[str], order: PageOrder) -> list[bytes]:
        fp = self.fingerprint(order)
        ns = self.settings.namespace
        scope = self.adapter_scope
        if scope is None:
            return [engine_page_key(fp, ns, k).value for k in keys]
        return [engine_page_key(fp, ns, scoped_page_hash(scope, k)).value for k in keys]

    @property
    def _lookup_order(self) -> PageOrder:
        # batch_exists answers for the interface SGLang reads with: v1 moves the pool's own
        # order, the legacy interface flat (layer-major) pages.
        return self.geometry.order if self.settings.interface_v1 else "layer_major"

    # -- exists -----------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages from the start are stored (one Lookup per server)."""
        try:
            present = self.client.exists(self._keys(keys, self._lookup_order))
        except Exception as err:
            log.warning("nopecache: batch_exists failed, answering 0 pages: %s", err)
            return 0
        return present.index(False) if False in present else len(present)

    def exists(self, key: str) -> bool:
        """Whether the page of ``key`` is stored."""
        return self.batch_exists([key]) == 1

    # -- store ------------------------------------------------------------------------
    def _encode(self, key: bytes, order: PageOrder, parts: Sequence[torch.Tensor]) -> memoryview:
        g = self.geometry
        fp = self.fingerprint(order)
        return build_block_into(
            self._blobs.take,
            key=key,
            fingerprint=fp.to_bytes(),
            form=StoredForm.ENGINE_PAGE,
            dtype=fp.dtype,
            shape=(g.num_layers, g.page_size, g.num_heads, g.head_dim),
            v_head_dim=g.v_head_dim,
            token_ids=(0,) * g.page_size,
            payload=[_bytes_view(p) for p in parts],
        )

    def _put(
        self,
        keys: Sequence[str],
        order: PageOrder,
        parts: Callable[[list[int]], list[list[torch.Tensor]]],
    ) -> list[bool]:
        """Store the pages of ``keys`` not stored yet; ``parts(indices)`` gives their bytes."""
        if not self.identity.writes:
            return [True] * len(keys)  # MLA: rank 0 writes the replicated latent
        start = time.perf_counter()
        block_keys = self._keys(keys, order)
        present = self.client.exists(block_keys)
        missing = [i for i, p in enumerate(present) if not p]
        ok = list(present)
        if missing:
            blobs = [
                (block_keys[i], self._encode(block_keys[i], order, page))
                for i, page in zip(missing, parts(missing), strict=True)
            ]
            try:
                results = self.client.put(blobs)
            finally:
                for _, blob in blobs:
                    self._blobs.give(blob)
            for i, result in zip(missing, results, strict=True):
                ok[i] = result.status in _STORED
            self._remember([block_keys[i] for i in missing if ok[i]])
        self._record(self._backup_pages, self._backup_gbps, len(keys), start)
        return ok

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Store pages straight from the host pool; a bool per page, never raises."""
        try:
            pages = self._page_ids(host_indices, len(keys))
            if pages is None:
                return [False] * len(keys)
            pool = self.pages
            assert pool is not None
            return self._put(
                keys, self.geometry.order, lambda idx: pool.read([pages[i] for i in idx])
            )
        except Exception as err:
            log.warning("nopecache: batch_set_v1 of %d pages failed: %s", len(keys), err)
            return [False] * len(keys)

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat pages (legacy interface); whether every page is stored."""
        try:
            flat = [_flat_bytes(v, self.geometry) for v in values]
            return all(self._put(keys, "layer_major", lambda idx: [[flat[i]] for i in idx]))
        except Exception as err:
            log.warning("nopecache: batch_set of %d pages failed: %s", len(keys), err)
            return False

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store one flat page (legacy interface)."""
        return self.batch_set([key], [value])

    # -- fetch ------------------------------------------------------------------------
    def _page_ids(self, host_indices: torch.Tensor, n: int) -> list[int] | None:
        if self.pages is None:
            raise ValueError("no host pool registered (register_mem_pool_host)")
        return self.pages.page_ids(host_indices, n)

    def _get(
        self, keys: Sequence[str], order: PageOrder, land: Callable[[int, memoryview], bool]
    ) -> list[bool]:
        """Fetch the pages of ``keys``; ``land(i, payload)`` copies a verified payload."""
        start = time.perf_counter()
        block_keys = self._keys(keys, order)
        fp_bytes = self.fingerprint(order).to_bytes()
        size = self.geometry.page_bytes

        def sink(i: int, blob: memoryview) -> bool:
            try:
                header = validate(blob)
            except BlockError as err:
                log.warning("nopecache: page %s failed verification: %s", keys[i], err)
                return False
            if (
                header.key != block_keys[i]
                or header.fingerprint != fp_bytes
                or header.compression != "none"
                or header.payload_nbytes != size
            ):
                return False
            return land(i, blob[blob.nbytes - size :])

        taken = self.client.get(block_keys, sink)
        self._record(self._prefetch_pages, self._prefetch_gbps, sum(taken), start)
        return taken

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Fetch pages straight into the host pool; a bool per page, never raises."""
        try:
            pages = self._page_ids(host_indices, len(keys))
            if pages is None:
                return [False] * len(keys)
            assert self.pages is not None
            writer = self.pages.writer(pages)
            taken = self._get(keys, self.geometry.order, writer.put)
            writer.finish(taken)
            return taken
        except Exception as err:
            log.warning("nopecache: batch_get_v1 of %d pages failed: %s", len(keys), err)
            return [False] * len(keys)

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Fetch flat pages (legacy interface) into ``target_locations`` (or new tensors)."""
        try:
            g = self.geometry
            targets = (
                list(target_locations)
                if target_locations is not None
                else [torch.empty(g.page_bytes // g.dtype.itemsize, dtype=g.dtype) for _ in keys]
            )
            dests = [_flat_bytes(t, g) for t in targets]

            def land(i: int, payload: memoryview) -> bool:
                dests[i].copy_(torch.frombuffer(payload, dtype=torch.uint8))
                return True

            taken = self._get(keys, "layer_major", land)
            return [t if ok else None for t, ok in zip(targets, taken, strict=True)]
        except Exception as err:
            log.warning("nopecache: batch_get of %d pages failed: %s", len(keys), err)
            return [None] * len(keys)

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        """Fetch one flat page (legacy interface); None on a miss."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # -- housekeeping -----------------------------------------------------------------
    def _remember(self, keys: list[bytes]) -> None:
        with self._stats_lock:
            for k in keys:
                self._stored_keys[k] = None
            while len(self._stored_keys) > _MAX_REMEMBERED_KEYS:
                del self._stored_keys[next(iter(self._stored_keys))]

    def clear(self) -> None:
        """Remove the pages this process stored (pages other SGLang servers stored in the
        shared cache stay: they are theirs)."""
        with self._stats_lock:
            keys = list(self._stored_keys)
            self._stored_keys.clear()
        try:
            self.client.delete(keys)
        except Exception as err:
            log.warning("nopecache: clear failed: %s", err)

    def _record(self, pages: list[int], gbps: list[float], n: int, start: float) -> None:
        if not self._metrics_on or self.pages is None:
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        with self._stats_lock:
            pages.append(n)
            gbps.append(n * self.geometry.page_bytes / seconds / 1e9)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (None when metrics are off)."""
        if not self._metrics_on:
            return None
        with self._stats_lock:
            out = (
                list(self._prefetch_pages),
                list(self._backup_pages),
                list(self._prefetch_gbps),
                list(self._backup_gbps),
            )
            for x in (self._prefetch_pages, self._backup_pages):
                x.clear()
            for y in (self._prefetch_gbps, self._backup_gbps):
                y.clear()
        return compat.storage_metrics(*out)

    def close(self) -> None:
        """Close the client (its connections and thread)."""
        self.client.close()


def _flat_bytes(page: torch.Tensor, geometry: PoolGeometry) -> torch.Tensor:
    """A flat page tensor (SGLang's legacy ``get_data_page``) as uint8, checked (no copy)."""
    if (
        not isinstance(page, torch.Tensor)
        or page.dtype != geometry.dtype
        or not page.is_contiguous()
    ):
        raise ValueError("a flat page must be a contiguous tensor of the pool's dtype")
    raw = page.reshape(-1).view(torch.uint8)
    if raw.numel() != geometry.page_bytes:
        raise ValueError(f"a flat page has {raw.numel()} bytes, the pool's {geometry.page_bytes}")
    return raw


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous uint8 CPU tensor."""
    view: memoryview = memoryview(t.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
    return view
