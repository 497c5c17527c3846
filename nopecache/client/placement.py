"""Placing fetched blocks: K rotated to where the content lands now, V copied, one pass each.

A fetched block holds K and V ``[layers, block_tokens, kv_heads, head_dim]`` in one of
three forms (``StoredForm``). A hit uses the block's ``source`` tokens for the prompt's
``target`` tokens; the K written out is always post-RoPE at the target positions::

    stored form            K at source is                 write K by
    NOPE                   pre-RoPE                       rotating None -> target
    ROPE, same positions   already right                  a plain copy (bit exact)
    ROPE, other positions  post-RoPE at source_positions  rotating source -> target
    MLA                    latent + nope rope part        rotating None -> target (rope dims)

Every case reads each element of the block once and writes it once into its destination:
no temporary copies. Two destinations:

* :class:`PagedKV`: the engine's paged cache (per layer a ``[num_blocks, block_size,
  kv_heads, head_dim]`` tensor for K and one for V: contiguous caches, or strided views of
  an engine's own page layout off CUDA) and a slot for every prompt position, ``-1`` for
  a position not to write (one the engine holds already). Every form goes through the
  fused ``rerope_scatter_layers`` kernel API (Triton on CUDA, torch elsewhere): NOPE K is
  rotated to the target, ROPE K copied at its own positions or rotated once by the
  difference. A hit none of whose positions has a slot is not fetched at all.
* contiguous tensors ``[layers, prompt_tokens, kv_heads, head_dim]`` (``place_contiguous``):
  ``rotate`` writes into the target rows with ``out=``.

Placement functions trust their arguments to be consistent (the client checks the block
against the hit and the model before calling them); :class:`PagedKV` validates itself.

CUDA caches: device, stream, host syncs
    Placement runs on the client's worker thread, whose current device and stream are not
    the engine's. A :class:`PagedKV` captures, when it is built on the engine's thread, the
    caches' device and that thread's current stream on it (or the ``stream`` it is given);
    every copy and kernel of the fetch is issued on that device and stream. Work the
    engine enqueues on the same stream after ``fetch`` returns is ordered after the
    placement by CUDA itself; another stream must ``wait_event(result.ready)`` (the event
    ``fetch`` records after the last launch), and host code ``result.ready.synchronize()``.
    Building a PagedKV copies its slot mapping to the host once (one sync, to validate it);
    placing a block then makes no device-to-host transfer: slot runs are read from that
    host copy and the kernels skip their own value checks. Blocks travel through a
    :class:`StagingRing` of pinned buffers with ``non_blocking`` copies.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nopecache.client import pinned
from nopecache.client.chunking import TokenArray
from nopecache.client.cuda_arena import DeviceBlob, FetchedBlob, decode_device_block
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.plan import Hit
from nopecache.kernels import RopeSpec, rerope_scatter_layers
from nopecache.kernels.api import MAX_POSITION, Positions, rotate
from nopecache.proto.block import (
    BlockMismatchError,
    BytesLike,
    DecodedBlock,
    StoredForm,
    decode_block,
)

__all__ = [
    "PagedKV",
    "PagedPart",
    "StagingRing",
    "decode_for_hit",
    "paged_part",
    "place_contiguous",
    "place_paged",
    "place_parts",
    "source_positions",
]


def _check_cache(name: str, cache: object, like: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(cache, torch.Tensor):
        raise InvalidArgumentError(name, f"must be a tensor, got {type(cache).__name__}")
    if cache.dim() != 4:
        raise InvalidArgumentError(
            name,
            f"must be 4-D [num_blocks, block_size, kv_heads, head_dim], got {list(cache.shape)}",
        )
    if cache.device.type == "cuda" and not cache.is_contiguous():
        raise InvalidArgumentError(name, "must be contiguous on CUDA (the kernel's row layout)")
    if like is not None and (cache.dtype != like.dtype or cache.device != like.device):
        raise InvalidArgumentError(
            name,
            f"{cache.dtype} on {cache.device} differs from the first cache's "
            f"{like.dtype} on {like.device}",
        )
    return cache


def _check_strides(name: str, cache: torch.Tensor, like: torch.Tensor) -> None:
    # One layout for every layer: the kernel addresses all layers with one set of strides.
    if cache.stride() != like.stride():
        raise InvalidArgumentError(
            name,
            f"strides {list(cache.stride())} differ from the first cache's "
            f"{list(like.stride())} (one layout for every layer)",
        )


@dataclass(frozen=True, slots=True)
class PagedKV:
    """An engine's paged KV cache and where each prompt position goes in it.

    ``k_caches[l]`` / ``v_caches[l]``: layer ``l``'s cache ``[num_blocks, block_size,
    kv_heads, head_dim]``; slot ``s`` is ``[s // block_size, s % block_size]``. On CUDA
    each is contiguous (vLLM FlashAttention's ``cache[0]`` / ``cache[1]``); elsewhere any
    strided view of one shape and strides per layer (vLLM's CPU pages, read through
    ``nopecache.integrations.vllm.layout``). ``v_caches`` is None for MLA (the latent holds everything). ``slot_mapping``:
    int64 ``[prompt_tokens]``, the slot of every prompt position, ``-1`` to skip one.
    ``stream``: the CUDA stream placement runs on; None = the current stream of the
    caches' device on the thread that builds this PagedKV (see the module docstring).
    """

    k_caches: Sequence[torch.Tensor]
    v_caches: Sequence[torch.Tensor] | None
    slot_mapping: torch.Tensor
    stream: torch.cuda.Stream | None = None
    slots_host: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.k_caches, torch.Tensor) or not isinstance(self.k_caches, Sequence):
            raise InvalidArgumentError("k_caches", "must be a sequence of per-layer tensors")
        k_caches = tuple(self.k_caches)
        if not k_caches:
            raise InvalidArgumentError("k_caches", "must hold at least one layer")
        first = _check_cache("k_caches[0]", k_caches[0], None)
        for i, cache in enumerate(k_caches[1:], 1):
            _check_cache(f"k_caches[{i}]", cache, first)
            if cache.shape != first.shape:
                raise InvalidArgumentError(
                    f"k_caches[{i}]",
                    f"shape {list(cache.shape)} differs from k_caches[0]'s {list(first.shape)}",
                )
            _check_strides(f"k_caches[{i}]", cache, first)
        object.__setattr__(self, "k_caches", k_caches)
        if self.v_caches is not None:
            if isinstance(self.v_caches, torch.Tensor) or not isinstance(self.v_caches, Sequence):
                raise InvalidArgumentError(
                    "v_caches", "must be a sequence of per-layer tensors or None"
                )
            v_caches = tuple(self.v_caches)
            if len(v_caches) != len(k_caches):
                raise InvalidArgumentError(
                    "v_caches", f"{len(v_caches)} layers, k_caches has {len(k_caches)}"
                )
            v_first = _check_cache("v_caches[0]", v_caches[0], first)
            for i, cache in enumerate(v_caches):
                _check_cache(f"v_caches[{i}]", cache, first)
                if cache.shape != v_first.shape or cache.shape[:3] != first.shape[:3]:
                    raise InvalidArgumentError(
                        f"v_caches[{i}]",
                        f"shape {list(cache.shape)} must be [{first.shape[0]}, "
                        f"{first.shape[1]}, {first.shape[2]}, v_head_dim] like v_caches[0]",
                    )
                _check_strides(f"v_caches[{i}]", cache, v_first)
            object.__setattr__(self, "v_caches", v_caches)
        slots = self.slot_mapping
        if not isinstance(slots, torch.Tensor):
            raise InvalidArgumentError(
                "slot_mapping", f"must be a tensor, got {type(slots).__name__}"
            )
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise InvalidArgumentError(
                "slot_mapping", f"must be a 1-D int64 tensor, got {slots.dtype} {list(slots.shape)}"
            )
        if slots.device != first.device:
            raise InvalidArgumentError(
                "slot_mapping", f"on {slots.device}, the caches are on {first.device}"
            )
        # The one device-to-host copy of a fetch: validation and every per-block decision
        # read this host copy.
        host = slots.cpu().numpy()
        if host.size:
            lo, hi = int(host.min()), int(host.max())
            if lo < -1 or hi >= self.num_slots:
                raise InvalidArgumentError(
                    "slot_mapping",
                    f"values must be -1 or in [0, {self.num_slots}), got range [{lo}, {hi}]",
                )
        object.__setattr__(self, "slots_host", host)
        if first.device.type == "cuda":
            stream = self.stream
            if stream is None:
                stream = torch.cuda.current_stream(first.device)
            elif not isinstance(stream, torch.cuda.Stream) or stream.device != first.device:
                raise InvalidArgumentError(
                    "stream", f"must be a torch.cuda.Stream on {first.device}, got {stream!r}"
                )
            object.__setattr__(self, "stream", stream)
        elif self.stream is not None:
            raise InvalidArgumentError("stream", f"given for caches on {first.device}")

    @property
    def num_layers(self) -> int:
        """Layers of the cache."""
        return len(self.k_caches)

    @property
    def num_slots(self) -> int:
        """Token slots per layer (num_blocks * block_size)."""
        shape = self.k_caches[0].shape
        return int(shape[0] * shape[1])

    @property
    def num_kv_heads(self) -> int:
        """KV heads per token."""
        return int(self.k_caches[0].shape[2])

    @property
    def head_dim(self) -> int:
        """Last dim of K."""
        return int(self.k_caches[0].shape[3])

    @property
    def v_head_dim(self) -> int:
        """Last dim of V (0 without V caches)."""
        return 0 if self.v_caches is None else int(self.v_caches[0].shape[3])

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the caches."""
        return self.k_caches[0].dtype

    @property
    def device(self) -> torch.device:
        """Where the caches live."""
        return self.k_caches[0].device

    @contextlib.contextmanager
    def issuing(self) -> Iterator[None]:
        """Make the caches' device and the captured stream current (CUDA; else nothing)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def record_ready(self) -> torch.cuda.Event | None:
        """An event recorded on the stream after all work issued so far (None off CUDA)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


# Direct copies from registered memory kept in flight before the oldest is waited for.
_MAX_DIRECT = 64


class StagingRing:
    """Pinned host buffers that carry blocks to a GPU with ``non_blocking`` copies.

    A block arrives in pageable memory (its receive buffer, which goes back to a pool the
    moment placement returns). ``to_device`` copies a tensor into the next pinned buffer
    (one host copy, which also makes a sliced block contiguous: ``.to(device)`` would
    have made it contiguous in a temporary first, then copied synchronously through the
    driver's own staging), starts the DMA on the current stream and records an event;
    a buffer is written again only after its event completed, so a copy in flight never
    sees its source change. ``slots`` buffers allow that many copies in flight; each grows
    to the largest tensor it has carried. Used from one thread (the client's worker).
    """

    def __init__(self, slots: int = 4) -> None:
        """A ring of ``slots`` buffers, allocated on first use."""
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        # Direct copies in flight: each source is kept (and with it the read lease of the
        # server's pages it views) until its DMA completed; likewise blocks read straight
        # from a server's device pool (``hold``).
        self._direct: deque[tuple[torch.cuda.Event, object]] = deque()
        self.direct_copies = 0  # tensors copied straight from registered memory

    def hold(self, source: object) -> None:
        """Keep ``source`` (a DeviceBlob: its lease) until the work issued so far on the
        current stream completed (blocks read device to device from a server's pool)."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream())
        self._direct.append((done, source))
        self.release_done()

    def release_done(self, wait: bool = False) -> None:
        """Drop the sources whose copies completed (``wait``: all, waiting for them);
        bounded at ``_MAX_DIRECT`` in flight."""
        while self._direct and (wait or self._direct[0][0].query()):
            self._direct.popleft()[0].synchronize()
        while len(self._direct) > _MAX_DIRECT:
            self._direct.popleft()[0].synchronize()

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (host) as a new tensor on CUDA ``device``, copied on the current stream:
        straight from ``t`` when it lies in page-locked memory (``pinned``: the zero-copy
        mapping of the server's pool), else through the next staging buffer."""
        while self._direct and self._direct[0][0].query():
            self._direct.popleft()
        if t.is_contiguous() and pinned.holds(t.data_ptr(), t.numel() * t.element_size()):
            out = torch.empty(t.shape, dtype=t.dtype, device=device)
            out.copy_(t, non_blocking=True)  # one DMA from the registered mapping
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._direct.append((done, t))
            self.direct_copies += 1
            if len(self._direct) > _MAX_DIRECT:
                self._direct.popleft()[0].synchronize()
            return out
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the copy out of this buffer finished
        nbytes = t.numel() * t.element_size()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._buffers[i] = buffer
        staged = buffer[:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        out.copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self._events[i] = done
        return out


def decode_for_hit(
    blob: BytesLike | FetchedBlob,
    hit: Hit,
    prompt: TokenArray,
    fingerprint: ModelFingerprint,
    v_head_dim: int,
    payload_xxh3: int | None = None,
    device: torch.device | None = None,
) -> DecodedBlock:
    """Verify a fetched blob for ``hit`` of ``prompt`` and decode it (zero-copy views).

    ``payload_xxh3``: the payload's digest taken as the blob was received (the bulk
    stream's, ``buffers.payload_xxh3``): compared with the block's checksum instead of
    hashing the payload again. ``device``: where a compact block (``kv_codec``) is decoded
    (the CUDA device it is placed on: its compact bytes cross the bus, not the engine's
    dtype; None: on the host).

    The block must be intact (both checksums), carry the hit's key and the model's
    fingerprint, and hold exactly the prompt tokens its key was computed from: the hit
    uses the block's tokens ``[source.start, source.end)`` for ``target``, and the block
    starts ``source.start`` tokens before the target (a hit trimmed at the front keeps
    that context in the block). Its form and layout must be the model's. Anything else
    raises a ``BlockError`` (the caller turns it into a miss).
    """
    src, dst = hit.source, hit.target
    first = dst.start - src.start
    if first < 0:
        raise BlockMismatchError(f"hit: source {src} starts before the prompt for target {dst}")
    expect = {
        "expect_key": hit.key.value,
        "expect_fingerprint": fingerprint.to_bytes(),
        "expect_tokens": prompt[first : dst.end].tolist(),
    }
    if isinstance(blob, DeviceBlob):
        block = decode_device_block(blob, **expect)
    else:
        block = decode_block(blob, payload_xxh3=payload_xxh3, decode_on=device, **expect)
    header = block.header
    want = (fingerprint.num_layers, src.end, fingerprint.num_kv_heads, fingerprint.head_dim)
    if header.form != hit.form or header.dtype != fingerprint.dtype:
        raise BlockMismatchError(
            f"form: block holds {header.form.name} {header.dtype}, the hit expects "
            f"{hit.form.name} {fingerprint.dtype}"
        )
    if header.shape != want or header.v_head_dim != v_head_dim:
        raise BlockMismatchError(
            f"shape: block is {list(header.shape)} with v_head_dim {header.v_head_dim}, the "
            f"model needs {list(want)} with v_head_dim {v_head_dim}"
        )
    return block


def source_positions(block: DecodedBlock, hit: Hit) -> Positions | None:
    """Positions K of the hit's source tokens was rotated to (None: nope K).

    An int ``start`` when they are consecutive (the usual case: the kernels then need no
    index tensor), else an int64 tensor.
    """
    header = block.header
    if header.form != StoredForm.ROPE:
        return None
    assert header.source_positions is not None  # BlockHeader guarantees it for ROPE
    pos = np.asarray(header.source_positions[hit.source.start : hit.source.end], dtype=np.int64)
    start = int(pos[0])
    if pos.size == 1 or bool((np.diff(pos) == 1).all()):
        return start
    return torch.from_numpy(pos)


def _on(t: torch.Tensor, device: torch.device, staging: StagingRing | None) -> torch.Tensor:
    # Blocks decode on the host; a GPU cache gets them with one transfer per tensor.
    if t.device == device:
        return t
    if t.device.type == "cuda" and device.type == "cuda":
        # A server's device pool on another GPU than the cache: one peer copy, no host.
        return t.to(device, non_blocking=True)
    if staging is not None and device.type == "cuda":
        return staging.to_device(t, device)
    return t.to(device)


def _positions_on(pos: Positions | None, device: torch.device) -> Positions | None:
    if not isinstance(pos, torch.Tensor):
        return pos
    # Checked here, on the host, so that the kernel needs no device-side check (a sync).
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) > MAX_POSITION):
        raise BlockMismatchError(f"source_positions: outside [0, {MAX_POSITION}]")
    return pos.to(device)


def place_paged(
    block: DecodedBlock,
    hit: Hit,
    into: PagedKV,
    spec: RopeSpec,
    staging: StagingRing | None = None,
) -> None:
    """Write the hit's K (rotated to its target positions) and V into the paged cache.

    On CUDA every transfer and kernel is issued on ``into``'s device and stream, K and V
    through ``staging`` when given (else synchronous copies), with no device sync.
    """
    with into.issuing():
        _place_paged(block, hit, into, spec, staging)


def _place_paged(
    block: DecodedBlock,
    hit: Hit,
    into: PagedKV,
    spec: RopeSpec,
    staging: StagingRing | None,
) -> None:
    src, dst = hit.source, hit.target
    device = into.device
    host_slots = into.slots_host[dst.start : dst.end]
    keep = np.flatnonzero(host_slots >= 0)
    if keep.size == 0:
        return  # every position of the hit is skipped (the engine holds them already)
    # Only the rows that land move to the device: a hit that starts before the engine's
    # own prefix carries its skipped head no further than the host.
    lo, hi = int(keep[0]), int(keep[-1]) + 1
    k = _on(block.k[:, src.start + lo : src.start + hi], device, staging)
    v = (
        None
        if block.v is None
        else _on(block.v[:, src.start + lo : src.start + hi], device, staging)
    )
    slots = into.slot_mapping[dst.start + lo : dst.start + hi]
    from_pos = _positions_on(source_positions(block, hit), device)
    if isinstance(from_pos, int):
        from_pos += lo
    elif from_pos is not None:
        from_pos = from_pos[lo:hi]
    # Every form goes through the one fused kernel: nope K rotated to the target, ROPE K
    # copied (same positions, bit exact) or rotated once by the difference. PagedKV checked
    # the slots, the start is a host int: no value checks (no sync).
    rerope_scatter_layers(
        k,
        v,
        dst.start + lo,
        slots,
        into.k_caches,
        into.v_caches,
        spec,
        from_positions=from_pos,
        check_values=False,
    )


def place_parts(parts: Sequence[PagedPart], into: PagedKV, spec: RopeSpec) -> None:
    """Write several hits' rows (``paged_part``) into a paged cache off CUDA, together.

    Hits whose K is rotated (nope K, or post-RoPE K at other positions) are placed with
    one ``rerope_scatter_layers`` per kind of source: their K and V are joined along the
    tokens first (one copy each), so the rotation runs once over all of them and adjacent
    hits fill their slots in one run per cache block, instead of every hit paying each
    layer's rotation ops and page writes for its few dozen tokens. K copied at its own
    positions (exact-prefix blocks, already whole blocks) is placed hit by hit.
    """
    groups: dict[bool, list[PagedPart]] = {}
    for part in parts:
        if isinstance(part.source, int) and part.source == part.target:
            _scatter([part], into, spec)  # bit-exact copy at its own positions
        else:
            groups.setdefault(part.source is None, []).append(part)
    for group in groups.values():
        batch: list[PagedPart] = []
        size = 0
        for part in sorted(group, key=lambda p: p.target):
            if batch and size + part.nbytes > JOIN_BYTES:
                _scatter(batch, into, spec)
                batch, size = [], 0
            batch.append(part)
            size += part.nbytes
        _scatter(batch, into, spec)


JOIN_BYTES = 32 << 20
"""K and V bytes of the hits joined into one scatter at most: what a fetch holds besides
its blocks. Larger joins measured faster all the way to a whole 63 MB fetch
(bench/pi_placement.py: each scatter's fixed costs, and each op that drops the GIL while
the loop thread receives the next blocks); this bounds the extra memory, and keeps each
joined tensor below the allocator's mmap threshold (proto/allocator.py: reused heap, no
fresh pages to fault in)."""


@dataclass(frozen=True, slots=True)
class PagedPart:
    """The rows of one hit that land in a CPU paged cache: K and V ``[layers, n, ...]``,
    the target start, their slots and their source positions (None: nope K)."""

    k: torch.Tensor
    v: torch.Tensor | None
    target: int
    slots: torch.Tensor
    source: Positions | None

    @property
    def nbytes(self) -> int:
        """Bytes of K and V."""
        k = self.k.numel() * self.k.element_size()
        return k + (0 if self.v is None else self.v.numel() * self.v.element_size())


def paged_part(block: DecodedBlock, hit: Hit, into: PagedKV) -> PagedPart | None:
    """What of ``hit`` lands in ``into``, a cache off CUDA (None: none of its positions
    has a slot). Raises ``BlockMismatchError`` for source positions out of range."""
    src, dst = hit.source, hit.target
    keep = np.flatnonzero(into.slots_host[dst.start : dst.end] >= 0)
    if keep.size == 0:
        return None
    lo, hi = int(keep[0]), int(keep[-1]) + 1
    from_pos = _positions_on(source_positions(block, hit), into.device)
    if isinstance(from_pos, int):
        from_pos += lo
    elif from_pos is not None:
        from_pos = from_pos[lo:hi]
    return PagedPart(
        block.k[:, src.start + lo : src.start + hi],
        None if block.v is None else block.v[:, src.start + lo : src.start + hi],
        dst.start + lo,
        into.slot_mapping[dst.start + lo : dst.start + hi],
        from_pos,
    )


def _scatter(parts: Sequence[PagedPart], into: PagedKV, spec: RopeSpec) -> None:
    """One ``rerope_scatter_layers`` for ``parts`` (in target order, one kind of source)."""
    first = parts[0]
    target: Positions
    if len(parts) == 1:
        k, v, slots, target, source = first.k, first.v, first.slots, first.target, first.source
    else:
        k = torch.cat([p.k for p in parts], dim=1)
        v = None if first.v is None else torch.cat([p.v for p in parts if p.v is not None], dim=1)
        slots = torch.cat([p.slots for p in parts])
        target = _joined([p.target for p in parts], [p.k.shape[1] for p in parts])
        source = (
            None
            if first.source is None
            else _joined(
                [p.source for p in parts if p.source is not None], [p.k.shape[1] for p in parts]
            )
        )
    rerope_scatter_layers(
        k,
        v,
        target,
        slots,
        into.k_caches,
        into.v_caches,
        spec,
        from_positions=source,
        check_values=False,
    )


def _joined(starts: Sequence[Positions], lengths: Sequence[int]) -> Positions:
    """Positions of parts joined end to end: an int start when they run on consecutively."""
    tensors = [
        torch.arange(p, p + n, dtype=torch.int64) if isinstance(p, int) else p.to(torch.int64)
        for p, n in zip(starts, lengths, strict=True)
    ]
    joined = torch.cat(tensors)
    first = int(joined[0])
    if bool((joined == torch.arange(first, first + joined.numel())).all()):
        return first
    return joined


def place_contiguous(
    block: DecodedBlock,
    hit: Hit,
    k_out: torch.Tensor,
    v_out: torch.Tensor | None,
    spec: RopeSpec,
) -> None:
    """Write the hit's K (rotated to its target positions) and V into ``[layers, tokens, ...]``
    output tensors, rows ``hit.target``."""
    src, dst = hit.source, hit.target
    device = k_out.device
    k = _on(block.k[:, src.start : src.end], device, None)
    from_pos = _positions_on(source_positions(block, hit), device)
    same = isinstance(from_pos, int) and from_pos == dst.start
    if same:
        k_out[:, dst.start : dst.end].copy_(k)
    else:
        for layer in range(k.shape[0]):
            rotate(k[layer], from_pos, dst.start, spec, out=k_out[layer, dst.start : dst.end])
    if v_out is not None and block.v is not None:
        v_out[:, dst.start : dst.end].copy_(block.v[:, src.start : src.end])
