"""Plain-torch RoPE kernels: the reference the Triton kernels are tested against, and the
implementation ``nopecache.kernels.api`` runs for CPU tensors.

Arguments are assumed valid (``api`` validates before calling in here); the semantics,
including how the attention scaling factor is applied, are documented in ``api``.

Speed on the CPU comes from these choices:

* cos/sin are computed once per call, in fp32, for the token positions only, and shared
  by every head and every layer (a broadcast, not a copy per head);
* tokens are processed in chunks whose fp32 scratch (2 x 2 MiB) stays in the CPU caches, so
  the elementwise passes over a chunk read cache, not DRAM, and no temporary is allocated
  per chunk;
* neox K is rotated as ``(x1, x2) * c`` (one op, ``c`` broadcast over heads and both
  halves) plus ``-x2 * s`` and ``x1 * s`` added to each half (views, no swapped copy of
  the row, no duplicated tables); gptj K, whose pairs are adjacent, is one in-place
  complex multiplication of the scratch viewed as complex64;
* rotated rows reach scattered cache slots a whole block at a time where the slot
  mapping allows, through numpy's row-wise fancy assignment (see ``_SlotWriter``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from nopecache.kernels.rope_spec import RopeSpec

if TYPE_CHECKING:
    from nopecache.kernels.api import Positions

CHUNK_ELEMENTS = 1 << 19
"""Rotated elements per chunk of tokens (2 MiB of fp32 per scratch buffer: cache-resident,
and few enough ops per call that per-op overhead and thread wake-ups stay small)."""


def rotation_scale(from_pos: Positions | None, to_pos: Positions | None, spec: RopeSpec) -> float:
    """Factor K is multiplied by: the attention scaling once into post-RoPE form, out of it once."""
    if from_pos is None:
        return spec.attention_scaling
    if to_pos is None:
        return 1.0 / spec.attention_scaling
    return 1.0


def position_delta(
    from_pos: Positions | None, to_pos: Positions | None, tokens: int, device: torch.device
) -> torch.Tensor:
    """``to - from`` per token as int64 ``[tokens]``, or ``[1]`` when equal for every token."""
    if isinstance(from_pos, int) and isinstance(to_pos, int):
        return torch.tensor([to_pos - from_pos], dtype=torch.int64, device=device)
    src = _as_positions(from_pos, tokens, device)
    dst = _as_positions(to_pos, tokens, device)
    if src is None:
        assert dst is not None
        return dst
    if dst is None:
        return -src
    return dst - src


def cos_sin(
    delta: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and ``sin`` ``[n, rotary_dim // 2]`` of ``delta * inv_freq``, times ``scale``."""
    # Same operation order as Hugging Face: position as fp32, times fp32 inv_freq, then
    # cos/sin, then the attention scaling.
    angle = delta.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos(), angle.sin_()
    if scale != 1.0:
        cos.mul_(scale)
        sin.mul_(scale)
    return cos, sin


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def rope_tolerance(
    expected: torch.Tensor, spec: RopeSpec, dtype: torch.dtype, ulps: float = 1.0
) -> torch.Tensor:
    """Per-element error bound: ``ulps`` ulps of ``dtype`` at each rotated pair's norm, 0 elsewhere.

    The accuracy contract of the kernels. A rotation mixes the two elements of a pair, so
    its rounding error scales with the pair's norm rather than with each element (an
    element near zero may still carry an ulp of its partner); dims that only pass through
    must be bit-exact. ``expected`` is ``[..., head_dim]``.
    """
    x = expected.to(torch.float64)
    lo, half = spec.rotary_offset, spec.rotary_dim // 2
    rot = x[..., lo : lo + spec.rotary_dim]
    if spec.layout == "neox":
        norm = torch.hypot(rot[..., :half], rot[..., half:])
        norm = torch.cat((norm, norm), dim=-1)
    else:
        pairs = rot.unflatten(-1, (half, 2))
        norm = torch.hypot(pairs[..., 0], pairs[..., 1]).repeat_interleave(2, dim=-1)
    exponent = torch.frexp(norm).exponent
    ulp = torch.ldexp(torch.ones_like(norm), exponent - 1 - _MANTISSA_BITS[dtype])
    tol = torch.zeros_like(x)
    tol[..., lo : lo + spec.rotary_dim] = ulps * ulp
    return tol


def rotate_reference(
    k: torch.Tensor,
    from_pos: Positions | None,
    to_pos: Positions | None,
    spec: RopeSpec,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate K ``[tokens, heads, head_dim]`` from ``from_pos`` to ``to_pos`` (see ``api``)."""
    tokens, heads, _ = k.shape
    if out is None:
        out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return out
    in_place = out.data_ptr() == k.data_ptr()
    delta = position_delta(from_pos, to_pos, tokens, k.device)
    chunk = _chunk_tokens(spec, heads, tokens)
    rotator = _Rotator(spec, delta, rotation_scale(from_pos, to_pos, spec), 1, heads, chunk)
    for a in range(0, tokens, rotator.chunk):
        b = min(a + rotator.chunk, tokens)
        rotator.apply(k[None, a:b], out[None, a:b], a, copy_pass=not in_place)
    return out


def rerope_scatter_reference(
    k_nope: torch.Tensor,
    v: torch.Tensor | None,
    positions: Positions,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    spec: RopeSpec,
) -> None:
    """Rotate nope K to ``positions``; write K and V into the paged cache at ``slot_mapping``."""
    rerope_scatter_layers_reference(
        k_nope[None],
        None if v is None else v[None],
        positions,
        slot_mapping,
        [k_cache],
        None if v_cache is None else [v_cache],
        spec,
    )


def rerope_scatter_layers_reference(
    k_nope: torch.Tensor,
    v: torch.Tensor | None,
    positions: Positions,
    slot_mapping: torch.Tensor,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor] | None,
    spec: RopeSpec,
    *,
    from_positions: Positions | None = None,
) -> None:
    """``rerope_scatter_reference`` for ``[layers, tokens, heads, dim]`` into per-layer caches.

    ``from_positions``: K is post-RoPE there (None: nope K); equal int starts copy K.
    """
    layers, tokens, heads, head_dim = k_nope.shape
    if tokens == 0:
        return
    slots = slot_mapping
    pos: Positions = positions
    src: Positions | None = from_positions
    keep = slots >= 0
    if not bool(keep.all()):
        # Skipped slots (padding, positions an engine holds already): drop those tokens
        # once, for all layers.
        idx = keep.nonzero().squeeze(1)
        tokens = idx.numel()
        if tokens == 0:
            return
        k_nope = k_nope.index_select(1, idx)
        v = None if v is None else v.index_select(1, idx)
        copy = isinstance(src, int) and src == positions
        pos = _positions_tensor(positions, slot_mapping.numel(), slots.device).index_select(0, idx)
        if src is not None:
            src = pos if copy else _positions_tensor(src, slot_mapping.numel(), slots.device)[idx]
        slots = slots.index_select(0, idx)
    device = k_nope.device
    cache_dtype = k_caches[0].dtype
    # Same positions (a post-RoPE block used where it was computed): a plain copy, bit exact.
    copy_k = src is not None and (src is pos or (isinstance(src, int) and src == pos))
    writer = _SlotWriter(slots, block_size=k_caches[0].shape[1], strided=k_caches[0])
    if copy_k:
        for layer in range(layers):
            rows = k_nope[layer]
            writer.write_all(
                k_caches[layer], rows if rows.dtype == cache_dtype else rows.to(cache_dtype)
            )
    else:
        # Every layer of a chunk of tokens is rotated at once (one pass of each elementwise
        # op over [layers, chunk, heads, rotary_dim], not one per layer: a block of a few
        # dozen tokens is too small for per-op overheads to amortise), then written out
        # layer by layer.
        chunks = writer.chunks(_chunk_tokens(spec, layers * heads, tokens), tokens)
        chunk = max(b - a for a, b in chunks)
        delta = position_delta(src, pos, tokens, device)
        rotator = _Rotator(spec, delta, rotation_scale(src, pos, spec), layers, heads, chunk)
        buffer = None
        if writer.run_start is None:
            buffer = torch.empty((layers, chunk, heads, head_dim), dtype=cache_dtype, device=device)
        for a, b in chunks:
            if buffer is None:  # consecutive slots: rotate straight into the cache
                direct = [writer.slice(k_caches[layer], a, b) for layer in range(layers)]
                rotator.apply_into(k_nope[:, a:b], [d for d in direct if d is not None], a)
                continue
            rows = buffer[:, : b - a]
            rotator.apply(k_nope[:, a:b], rows, a, copy_pass=True)
            for layer in range(layers):
                writer.write(k_caches[layer], a, rows[layer])
    if v is not None and v_caches is not None:
        for layer in range(layers):
            writer.write_all(v_caches[layer], v[layer].to(v_caches[layer].dtype))


class _Rotator:
    """Rotates chunks of ``[layers, n, heads, head_dim]`` rows with cos/sin tables built once.

    Elementwise, each output element is the same fp32 expression of its input whatever
    the number of layers (or tokens) a call covers: batching layers changes how many
    elements one op sweeps, never what an element is computed from.
    """

    def __init__(
        self, spec: RopeSpec, delta: torch.Tensor, scale: float, layers: int, heads: int, chunk: int
    ) -> None:
        self.spec = spec
        self.half = spec.rotary_dim // 2
        self.lo = spec.rotary_offset
        self.hi = spec.rotary_offset + spec.rotary_dim
        self.broadcast = delta.numel() == 1
        device = delta.device
        cos, sin = cos_sin(delta, spec.inv_freq_tensor(device), scale)
        rd = spec.rotary_dim
        if spec.layout == "neox":
            # [n, 1, 1, R/2]: broadcast over layers, heads and the two halves of a row.
            self.cos, self.sin = cos[:, None, None, :], sin[:, None, None, :]
        else:
            self.phase = torch.complex(cos, sin)[:, None, :]
        self.chunk = chunk
        self.heads = heads
        # Flat: a chunk of n < chunk tokens is viewed as a dense [layers, n, heads, R].
        size = layers * chunk * heads * rd
        self.scratch = torch.empty(size, dtype=torch.float32, device=device)
        self.rotated = (
            torch.empty(size, dtype=torch.float32, device=device)
            if spec.layout == "neox"
            else self.scratch
        )

    def _rotate(self, src: torch.Tensor, start: int) -> torch.Tensor:
        """fp32 rotated dims ``[layers, n, heads, R]`` of ``src`` (tokens ``start..``)."""
        layers, n = src.shape[0], src.shape[1]
        heads, half = self.heads, self.half
        shape = (layers, n, heads, 2 * half)
        rows = slice(0, 1) if self.broadcast else slice(start, start + n)
        x = self.scratch[: layers * n * heads * 2 * half].view(shape)
        x.copy_(src[..., self.lo : self.hi])
        if self.spec.layout == "neox":
            # (x1, x2) * c + (-x2 * s, x1 * s): the products and sums of HF's
            # k * cos + rotate_half(k) * sin, in fp32.
            cos, sin = self.cos[rows], self.sin[rows]
            halves = x.view(layers, n, heads, 2, half)
            out = self.rotated[: x.numel()].view(shape)
            out_halves = torch.mul(halves, cos, out=out.view(layers, n, heads, 2, half))
            out_halves[..., 0, :].addcmul_(halves[..., 1, :], sin[..., 0, :], value=-1.0)
            out_halves[..., 1, :].addcmul_(halves[..., 0, :], sin[..., 0, :])
            return out
        pairs = torch.view_as_complex(x.view(layers, n, heads, half, 2))
        pairs.mul_(self.phase[rows])
        return x

    def apply(self, src: torch.Tensor, dst: torch.Tensor, start: int, copy_pass: bool) -> None:
        """Rotate ``src`` ``[layers, n, heads, dim]`` (tokens ``start..``) into ``dst``
        (same shape; may be ``src``)."""
        lo, hi = self.lo, self.hi
        out = self._rotate(src, start)
        dst[..., lo:hi].copy_(out)
        if copy_pass:
            if lo > 0:
                dst[..., :lo].copy_(src[..., :lo])
            if hi < src.shape[-1]:
                dst[..., hi:].copy_(src[..., hi:])

    def apply_into(self, src: torch.Tensor, dsts: Sequence[torch.Tensor], start: int) -> None:
        """Rotate ``src`` ``[layers, n, heads, dim]`` into one ``[n, heads, dim]`` per layer."""
        lo, hi = self.lo, self.hi
        out = self._rotate(src, start)
        for layer, dst in enumerate(dsts):
            dst[..., lo:hi].copy_(out[layer])
            if lo > 0:
                dst[..., :lo].copy_(src[layer, ..., :lo])
            if hi < src.shape[-1]:
                dst[..., hi:].copy_(src[layer, ..., hi:])


class _SlotWriter:
    """Writes rows of tokens into a paged cache ``[blocks, block_size, heads, dim]`` at their
    slots, the cheapest way the slot mapping allows (decided once per call):

    * one run of consecutive slots: plain slices of the cache;
    * whole blocks (every ``block_size`` tokens fill one block, in any block order, as an
      engine's block allocator hands them out): one row per block, ``block_size`` times
      fewer and longer rows to move;
    * anything else: one row per token.

    On the CPU rows move through numpy's fancy assignment on a view of their bytes as
    integer words (bit-exact, a vectorised copy per row, the GIL released); torch's
    ``index_copy_`` goes element by element and takes several times as long. Other
    devices use ``index_copy_``.

    A cache that is a strided view (not contiguous: an engine's own page layout, such as
    vLLM's CPU pages with K transposed) is written through the view itself: one slice copy
    ``cache[block, offset:offset + n] = rows`` per run of consecutive slots inside a block
    (a hit of a few dozen tokens is one or two runs, a whole block one), or, where runs
    are shorter than ``_MIN_RUN`` tokens on average, one indexed assignment
    ``cache[blocks, offsets] = rows`` (an index_put: tens of microseconds even for a few
    rows, where a slice copy takes a few).
    """

    def __init__(self, slots: torch.Tensor, block_size: int, strided: torch.Tensor) -> None:
        self.slots = slots
        self.block_size = block_size
        self.indexed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.runs: list[tuple[int, int, int, int]] | None = None
        self._clipped: tuple[tuple[int, int], list[tuple[int, int, int, int]]] | None = None
        if not strided.is_contiguous():
            self.run_start: int | None = None
            self.blocks: torch.Tensor | None = None
            self.runs = _block_runs(slots, block_size)
            if self.runs is None:
                self.indexed = (slots // block_size, slots % block_size)
        else:
            self.run_start = _single_run(slots)
            self.blocks = None if self.run_start is not None else _whole_blocks(slots, block_size)
        self.on_cpu = slots.device.type == "cpu"

    def chunks(self, chunk: int, tokens: int) -> list[tuple[int, int]]:
        """Token ranges ``[a, b)`` of about ``chunk`` tokens covering ``tokens``, cut where
        writes split anyway: block mode at whole blocks, runs at run ends (a chunk takes
        whole runs, at least one: a run never spans two chunks, so it stays one copy)."""
        if self.runs is not None:
            cuts, a = [], 0
            for start, end, _, _ in self.runs:
                if end - a > chunk and start > a:
                    cuts.append((a, start))
                    a = start
            cuts.append((a, tokens))
            return cuts
        if self.blocks is not None:
            chunk = max(self.block_size, chunk // self.block_size * self.block_size)
        return [(a, min(a + chunk, tokens)) for a in range(0, tokens, chunk)]

    def slice(self, cache: torch.Tensor, a: int, b: int) -> torch.Tensor | None:
        """The cache rows of tokens ``a..b`` as a view, when they are consecutive."""
        if self.run_start is None:
            return None
        return cache.view(-1, *cache.shape[2:])[self.run_start + a : self.run_start + b]

    def _runs_in(self, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """Runs within tokens ``[a, b)``: rows ``lo..hi`` of a chunk starting at ``a`` go to
        ``block``, offsets ``at..`` (kept for the next call: every layer asks the same)."""
        if self._clipped is not None and self._clipped[0] == (a, b):
            return self._clipped[1]
        assert self.runs is not None
        out = []
        for start, end, block, offset in self.runs:
            lo, hi = max(start, a), min(end, b)
            if lo < hi:
                out.append((lo - a, hi - a, block, offset + lo - start))
        self._clipped = ((a, b), out)
        return out

    def write_all(self, cache: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` (every token, cache dtype) to their slots."""
        target = self.slice(cache, 0, rows.shape[0])
        if target is not None:
            target.copy_(rows)
        else:
            self.write(cache, 0, rows)

    def write(self, cache: torch.Tensor, a: int, rows: torch.Tensor) -> None:
        """Write ``rows`` (tokens ``a..``, contiguous, cache dtype) to their slots."""
        b = a + rows.shape[0]
        if self.runs is not None:
            for lo, hi, block, at in self._runs_in(a, b):
                cache[block, at : at + hi - lo].copy_(rows[lo:hi])
            return
        if self.indexed is not None:
            blocks, offsets = self.indexed
            cache[blocks[a:b], offsets[a:b]] = rows
            return
        target = self.slice(cache, a, b)
        if target is not None:
            target.copy_(rows)
        elif self.blocks is not None:
            per_block = cache.view(cache.shape[0], -1)
            index = self.blocks[a // self.block_size : b // self.block_size]
            _assign_rows(per_block, index, rows.reshape(index.numel(), -1), self.on_cpu)
        else:
            _assign_rows(
                cache.view(-1, rows[0].numel()),
                self.slots[a:b],
                rows.reshape(b - a, -1),
                self.on_cpu,
            )


def _assign_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor, on_cpu: bool) -> None:
    """``dst[index] = src`` for 2-D contiguous tensors of one dtype."""
    if not on_cpu:
        dst.index_copy_(0, index, src)
        return
    # Rows as integer words, the widest that divides a row (8 bytes for every real
    # layout): numpy moves each row with the GIL released. A row-sized void dtype moves
    # the same bytes as fast but holds the GIL for the whole assignment (milliseconds
    # for a block), stalling every other Python thread of the engine meanwhile, among
    # them the bulk stream's receiver with the next block.
    word = _WORDS[(dst.shape[1] * dst.element_size()) & 7]
    dst_np = dst.view(torch.uint8).numpy().view(word)
    src_np = src.contiguous().view(torch.uint8).numpy().view(word)
    dst_np[index.numpy()] = src_np


# The widest unsigned word dividing a row, by the row's size modulo 8.
_WORDS = [
    np.dtype(f"<u{8 if r == 0 else 4 if r % 4 == 0 else 2 if r % 2 == 0 else 1}") for r in range(8)
]


_MIN_RUN = 4
"""Shortest average run (tokens) a strided cache is written in slice copies rather than by
one indexed assignment."""


def _block_runs(slots: torch.Tensor, block_size: int) -> list[tuple[int, int, int, int]] | None:
    """``(token_start, token_end, block, offset)`` of every run of consecutive slots inside a
    block, or ``None`` when runs average fewer than ``_MIN_RUN`` tokens (or off the CPU)."""
    if slots.device.type != "cpu":
        return None
    host = slots.numpy()
    n = host.size
    # A run breaks where the next slot is not the next one, or starts a new block.
    breaks = np.flatnonzero((np.diff(host) != 1) | (host[1:] % block_size == 0)) + 1
    if (breaks.size + 1) * _MIN_RUN > n:
        return None
    starts = np.concatenate(([0], breaks)).tolist()
    ends = [*starts[1:], n]
    first = host[starts].tolist()
    return [
        (a, b, s // block_size, s % block_size) for a, b, s in zip(starts, ends, first, strict=True)
    ]


def _whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """Block ids if tokens fill whole blocks in order (``block_size`` consecutive slots from a
    block start per group), else ``None``."""
    if slots.numel() % block_size:
        return None
    groups = slots.view(-1, block_size)
    starts = groups[:, 0]
    offsets = torch.arange(block_size, device=slots.device)
    if bool((starts % block_size == 0).all()) and bool((groups == starts[:, None] + offsets).all()):
        return starts // block_size
    return None


def _chunk_tokens(spec: RopeSpec, heads: int, tokens: int) -> int:
    """Tokens per chunk: ``CHUNK_ELEMENTS`` rotated elements, at most all of them."""
    return max(1, min(CHUNK_ELEMENTS // (heads * spec.rotary_dim), tokens))


def _as_positions(pos: Positions | None, tokens: int, device: torch.device) -> torch.Tensor | None:
    if pos is None:
        return None
    return _positions_tensor(pos, tokens, device)


def _positions_tensor(pos: Positions, tokens: int, device: torch.device) -> torch.Tensor:
    if isinstance(pos, int):
        return torch.arange(pos, pos + tokens, dtype=torch.int64, device=device)
    return pos.to(torch.int64)


def _single_run(slots: torch.Tensor) -> int | None:
    """First slot if ``slots`` are consecutive (``s, s+1, ...``), else ``None``."""
    first = int(slots[0])
    if slots.numel() == 1 or (
        int(slots[-1]) - first == slots.numel() - 1 and bool((slots.diff() == 1).all())
    ):
        return first
    return None
