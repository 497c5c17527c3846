"""Layer-wise loads and saves: the KV moves layer by layer beside vLLM's forward.

vLLM calls ``wait_for_layer_load(layer)`` before each attention layer runs and
``save_kv_layer(layer)`` right after it wrote the layer's new K/V (the
``maybe_transfer_kv_layer`` wrapper around its attention op). With ``layerwise=true``
(config.py) the worker uses both:

Loads (the step's synchronous, non-blend loads; a background load, ``load_async``, keeps
its request out of the forward until it ends, and a blend claim's layer loop needs every
layer before it runs)::

    start_load_kv        submit the step's fetches to the loads' thread, return at once
    loads' thread        fetch every load's blocks (verified, rotated) into a host
                         staging page set (LoadStaging)
    wait_for_layer_load  (layer 0: wait for the fetches) write that layer of every load
                         into vLLM's pages, on the forward's thread: on CUDA the copy
                         and scatter are queued on the forward's stream ahead of the
                         layer's attention, so nothing else orders them

    So the forward's embedding and first projections run while the fetch is on the
    wire, and each layer's write costs only that layer's bytes, when it is needed.

Saves::

    save_kv_layer        copy that layer's blocks of every save of the step to host
                         memory (LayerSaves), right after the layer's attention wrote
                         them (on CUDA queued on the forward's stream)
    wait_for_save        store what the layers copied: no gather of the whole prompt
                         at the step's end (a save some layer never reached falls back
                         to that gather)

Failures: a load that fails to fetch, or whose write of any layer raises, fails its
request's claimed blocks (vLLM recomputes them; it discards that step's output for the
request). A layer is never written in part for a request whose fetch failed: what the
fetch did not place is never staged (``LoadStaging.rows``), and after a failed write
the request's later layers are skipped. A fetch that raises leaves nothing to write:
the forward never waits on a dead load.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from nopecache.client.placement import PagedKV
from nopecache.integrations.vllm.layout import KVLayout

__all__ = ["LayerLoads", "LayerSaves", "LoadStaging"]

T = TypeVar("T")


@dataclass(slots=True)
class LoadStaging:
    """Host pages a load is fetched into before its layers are written into vLLM's.

    ``k``/``v``: ``[layers, blocks, block_size, kv_heads, head_dim]``; claimed position
    ``p`` of ``[start, end)`` is staging row ``p - start``. ``rows``: how many rows from
    the first landed (set once the fetch is checked; 0: nothing to write). ``slots``:
    vLLM's slot of each claimed position.
    """

    k: torch.Tensor
    v: torch.Tensor
    start: int
    slots: torch.Tensor
    rows: int = 0
    failed: bool = False

    @classmethod
    def for_claim(
        cls, layout: KVLayout, num_layers: int, dtype: torch.dtype, start: int, slots: torch.Tensor
    ) -> LoadStaging:
        """Staging for the claimed positions ``[start, start + len(slots))``."""
        n = len(slots)
        blocks = -(-n // layout.block_size)
        shape = (num_layers, blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        return cls(
            torch.empty(shape, dtype=dtype),
            torch.empty(shape, dtype=dtype),
            start,
            slots,
        )

    def paged(self, num_tokens: int, heads: slice | None = None) -> PagedKV:
        """The client's paged target over the staging: claimed position ``p`` at slot
        ``p - start``, every other position of the ``num_tokens`` prompt skipped."""
        mapping = torch.full((num_tokens,), -1, dtype=torch.int64)
        n = len(self.slots)
        mapping[self.start : self.start + n] = torch.arange(n, dtype=torch.int64)
        sel = slice(None) if heads is None else heads
        return PagedKV(
            [layer[:, :, sel] for layer in self.k], [layer[:, :, sel] for layer in self.v], mapping
        )

    def write_layer(self, layout: KVLayout, cache: torch.Tensor, layer: int) -> None:
        """Write the landed rows of ``layer`` into vLLM's page of that layer."""
        if self.failed or self.rows == 0:
            return
        heads, dim = layout.num_kv_heads, layout.head_dim
        k = self.k[layer].view(-1, heads, dim)[: self.rows]
        v = self.v[layer].view(-1, heads, dim)[: self.rows]
        device = cache.device
        layout.write(
            cache,
            self.slots[: self.rows],
            k.to(device, non_blocking=True),
            v.to(device, non_blocking=True),
        )


class LayerLoads(Generic[T]):
    """One step's layer-wise loads (see the module docstring).

    ``start(stage, write, finish)``: ``stage()`` runs on the loads' own thread, fetches
    every load and returns what to write; ``write(item, layer)`` writes one layer of one
    item, on the thread that waits for that layer (the forward's: on CUDA its writes are
    queued on the forward's own stream, ahead of the layer's attention); ``finish(item)``
    runs once every layer is written. ``stage`` and ``write`` handle their own failures
    (a failed load is the caller's to report); an exception out of ``stage`` is raised
    by ``finish()``, and no layer waits on it.
    """

    def __init__(self, num_layers: int) -> None:
        """Loads for a model of ``num_layers`` layers."""
        self.num_layers = num_layers
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="nopecache-layers"
        )
        self._job: concurrent.futures.Future[Sequence[T]] | None = None
        self._items: Sequence[T] = ()
        self._write: Callable[[T, int], None] | None = None
        self._finish: Callable[[T], None] | None = None
        self._next = num_layers  # the first layer not written yet (all: nothing in flight)
        self.waited = 0.0  # seconds the forward was held this step: the fetch, the writes
        self.seconds = 0.0  # seconds the step's loads took: the fetch and every write

    @property
    def active(self) -> bool:
        """Whether a step's loads are in flight."""
        return self._job is not None

    def start(
        self,
        stage: Callable[[], Sequence[T]],
        write: Callable[[T, int], None],
        finish: Callable[[T], None],
    ) -> None:
        """Start the step's fetches (the previous step's loads must be finished)."""
        assert self._job is None, "the previous step's layer loads were not finished"
        self._items, self._write, self._finish = (), write, finish
        self._next = 0
        self.waited = self.seconds = 0.0
        self._job = self._thread.submit(self._timed, stage)

    def _timed(self, stage: Callable[[], Sequence[T]]) -> Sequence[T]:
        started = time.perf_counter()
        items = stage()
        self.seconds += time.perf_counter() - started
        return items

    def wait(self, layer: int) -> None:
        """Write ``layer`` (and any layer before it not written yet) for every load of
        the step, once their fetches are done; at once when none is in flight."""
        job = self._job
        if job is None or layer < self._next:
            return
        held = time.perf_counter()
        if self._next == 0:
            concurrent.futures.wait([job])
            self._items = () if job.exception() is not None else job.result()
        writing = time.perf_counter()
        assert self._write is not None
        for each in range(self._next, min(layer + 1, self.num_layers)):
            for item in self._items:
                self._write(item, each)
        self._next = max(self._next, layer + 1)
        done = time.perf_counter()
        self.seconds += done - writing
        self.waited += done - held

    def finish(self) -> float:
        """Write the layers no wait asked for, end the step's loads; their seconds
        (0.0: none ran). Re-raises what escaped ``stage``."""
        job = self._job
        if job is None:
            return 0.0
        try:
            self.wait(self.num_layers - 1)
            items = job.result()  # raises what escaped stage
            assert self._finish is not None
            for item in items:
                self._finish(item)
        finally:
            self._job, self._items, self._next = None, (), self.num_layers
        return self.seconds

    def close(self) -> None:
        """Finish any loads in flight and stop the thread."""
        try:
            self.finish()
        finally:
            self._thread.shutdown(wait=True)


@dataclass(slots=True)
class _Copy:
    block_ids: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layers: set[int] = field(default_factory=set)


class LayerSaves:
    """A step's saves copied to host memory layer by layer (see the module docstring).

    ``prepare(key, block_ids)`` before the forward; ``copy_layer`` from each
    ``save_kv_layer``; ``take(key)`` at the step's end gives K and V ``[layers, blocks *
    block_size, kv_heads, head_dim]`` when every layer was copied (else None: gather
    the whole request then).
    """

    def __init__(self, layout: KVLayout, caches: Sequence[torch.Tensor]) -> None:
        """Saves from ``caches`` (every layer, in order) laid out as ``layout``."""
        self.layout = layout
        self.caches = tuple(caches)
        self._copies: dict[str, _Copy] = {}

    def prepare(self, key: str, block_ids: Sequence[int]) -> None:
        """Host buffers for the blocks of save ``key`` (pinned when the caches are on CUDA)."""
        device = self.caches[0].device
        rows = len(block_ids) * self.layout.block_size
        shape = (len(self.caches), rows, self.layout.num_kv_heads, self.layout.head_dim)
        pin = device.type == "cuda"
        dtype = self.caches[0].dtype
        self._copies[key] = _Copy(
            torch.tensor(list(block_ids), dtype=torch.int64, device=device),
            torch.empty(shape, dtype=dtype, pin_memory=pin),
            torch.empty(shape, dtype=dtype, pin_memory=pin),
        )

    def copy_layer(self, layer: int) -> None:
        """Copy ``layer``'s blocks of every prepared save out of the cache."""
        cache = self.caches[layer]
        for copy in self._copies.values():
            self.layout.layer_to_host(cache, copy.block_ids, copy.k[layer], copy.v[layer])
            copy.layers.add(layer)

    def take(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Save ``key``'s K and V if every layer was copied (None otherwise, or unknown)."""
        copy = self._copies.pop(key, None)
        if copy is None or len(copy.layers) != len(self.caches):
            return None
        if self.caches[0].device.type == "cuda":
            torch.cuda.current_stream(self.caches[0].device).synchronize()
        return copy.k, copy.v

    def clear(self) -> None:
        """Drop what was not taken."""
        self._copies.clear()
