"""A block encoded in parts: its head (prefix, msgpack header, padding) and its payload
as views of the K and V tensors where they lie, never joined into one buffer.

Why: joining a block copies its whole payload into a fresh blob (for 256 tokens of
Llama-3-8B, 32 MiB that also page-faults in on every store). A transport that can
gather (the bulk stream's ``sendmsg``) sends the parts as they are: the kernel's copy
into the socket is the only one. ``join`` makes the classic blob for paths that need one
buffer (gRPC frames, a test); the bytes are the same either way::

    EncodedBlock.head                 EncodedBlock.payload
    | prefix | msgpack header | pad | K layer 0 | K layer 1 | ... | V layer 0 | ... |

The payload views alias the tensors given to :func:`encode_block_parts`: they must not
change until the block is sent (the checksum in the head was taken from them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lz4.block

from nopecache.proto.block import (
    DTYPE_ITEMSIZE,
    LZ4_MAX_INPUT,
    BlockHeaderError,
    BlockSizeError,
    StoredForm,
    frame_head,
    header_of,
)
from nopecache.proto.kv_codec import CodecError, encode_tensors

if TYPE_CHECKING:
    import torch

__all__ = ["EncodedBlock", "encode_block_parts"]


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """A block's bytes in parts (module docstring): ``head`` then each of ``payload``."""

    head: bytes
    payload: tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        """The blob's size."""
        return len(self.head) + sum(p.nbytes for p in self.payload)

    def __len__(self) -> int:
        return self.nbytes

    def views(self) -> list[memoryview]:
        """Byte views of the blob's parts, in order (for a gathering write)."""
        return [memoryview(self.head), *self.payload]

    def join(self) -> bytes:
        """The blob as one buffer (one copy of the payload)."""
        return b"".join(self.views())


def _host_bytes(t: torch.Tensor) -> list[memoryview]:
    """Raw bytes of ``t`` in C order on the host, in parts: zero-copy for a contiguous CPU
    tensor, and for a CPU tensor whose every ``t[i]`` is contiguous (a ``[:, s:e]`` token
    slice of a ``[layers, tokens, ...]`` tensor): one view per layer, which the checksum
    reads where they lie, instead of a layout copy first."""
    import torch

    t = t.detach()
    if t.device.type == "cpu" and not t.is_contiguous() and t.dim() > 1:
        layers = [t[i] for i in range(t.shape[0])]
        if all(layer.is_contiguous() for layer in layers):
            return [layer.view(torch.uint8).reshape(-1).numpy().data for layer in layers]
    # Layout copy on the tensor's own device first (cheap on a GPU), then one transfer.
    host = t.contiguous().cpu()
    return [host.view(torch.uint8).reshape(-1).numpy().data]


def encode_block_parts(
    *,
    key: bytes,
    fingerprint: bytes,
    form: StoredForm,
    k: torch.Tensor,
    v: torch.Tensor | None,
    token_ids: Sequence[int],
    source_positions: Sequence[int] | None = None,
    compression: str = "none",
    codec: str = "none",
) -> EncodedBlock:
    """A block holding K (and V) ``[layers, tokens, kv_heads, head_dim]`` for
    ``token_ids``, in parts.

    K and V may live on any device and in any layout; their bytes are taken exactly (no
    float conversion) and checksummed in place; the payload views alias them (one
    device-to-host or layout copy when a tensor is not a contiguous CPU tensor or a
    token slice of one; lz4 compresses into one part). A ``codec`` (``kv_codec.py``)
    encodes on the tensors' own device first: the parts are then its compact tensors.
    """
    # Every check runs before the first byte is copied off the device.
    dtype = str(k.dtype).removeprefix("torch.")
    if dtype not in DTYPE_ITEMSIZE:
        raise BlockHeaderError(f"dtype: {dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
    if k.dim() != 4:
        raise BlockHeaderError(
            f"k: must be 4-D [layers, tokens, kv_heads, head_dim], got {list(k.shape)}"
        )
    shape = (k.shape[0], k.shape[1], k.shape[2], k.shape[3])
    tensors = [k]
    if form == StoredForm.MLA:
        if v is not None:
            raise BlockHeaderError("v: must be None for MLA (the latent K holds everything)")
        v_head_dim = 0
    else:
        if v is None:
            raise BlockHeaderError(f"v: required for {StoredForm(form).name}")
        if v.dtype != k.dtype:
            raise BlockHeaderError(f"v: dtype {v.dtype} differs from k's {k.dtype}")
        if v.dim() != 4 or tuple(v.shape[:3]) != shape[:3]:
            raise BlockHeaderError(
                f"v: shape {list(v.shape)} must be [{shape[0]}, {shape[1]}, {shape[2]}, v_head_dim]"
            )
        v_head_dim = v.shape[3]
        tensors.append(v)
    if len(token_ids) != shape[1]:
        raise BlockHeaderError(f"token_ids: {len(token_ids)} ids for {shape[1]} tokens in k")
    if codec != "none":
        if form == StoredForm.ENGINE_PAGE:
            raise BlockHeaderError(f"codec: {codec!r} does not apply to ENGINE_PAGE")
        try:
            tensors = encode_tensors(codec, k, None if form == StoredForm.MLA else v)
        except CodecError as e:
            raise BlockHeaderError(str(e)) from e
    header, parts, nbytes = header_of(
        key=key,
        fingerprint=fingerprint,
        form=form,
        dtype=dtype,
        shape=shape,
        v_head_dim=v_head_dim,
        token_ids=token_ids,
        payload=[part for t in tensors for part in _host_bytes(t)],
        source_positions=source_positions,
        compression=compression,
        codec=codec,
    )
    if compression == "lz4":
        if nbytes > LZ4_MAX_INPUT:
            raise BlockSizeError(f"payload: {nbytes} bytes is over lz4's {LZ4_MAX_INPUT} limit")
        whole = parts[0] if len(parts) == 1 else b"".join(parts)
        packed = memoryview(lz4.block.compress(whole, store_size=False))
        return EncodedBlock(frame_head(header, packed.nbytes), (packed,))
    return EncodedBlock(frame_head(header, nbytes), tuple(parts))
