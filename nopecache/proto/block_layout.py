"""What a block's header may say: stored forms, dtypes, the payload size a layout needs, and
the errors a block raises (``block.py`` re-exports each; import them from there)."""

from __future__ import annotations

import enum

from nopecache.proto.kv_codec import CodecError, payload_layout

MAX_BLOCK_TOKENS = 1 << 16


class StoredForm(enum.IntEnum):
    """How K is held in a block.

    NOPE: K before RoPE (position independent), V as computed.
    ROPE: K after RoPE at the block's ``source_positions``; re-rotated by a delta on fetch.
    MLA:  DeepSeek-style latent ``[kv_lora_rank | rope part]`` with the rope part in nope
          form; no separate V.
    ENGINE_PAGE: one page of an engine's own KV pool, bytes in the engine's layout (which
          the fingerprint names), K post-RoPE at positions only the engine's page hash
          implies; token ids unknown (zeros). Reused only under the same engine key, never
          rotated or placed by the client (SGLang's HiCache pages). ``v_head_dim`` 0: no V.
    """

    NOPE = 0
    ROPE = 1
    MLA = 2
    ENGINE_PAGE = 3


DTYPE_ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
}


class BlockError(ValueError):
    """A block is malformed, corrupted, or not the one the caller asked for."""


class BlockHeaderError(BlockError):
    """The header is structurally invalid (magic, version, a field's type or value)."""


class BlockSizeError(BlockError):
    """The blob's length disagrees with what its header says (truncated, trailing bytes)."""


class BlockChecksumError(BlockError):
    """The header or payload bytes do not match their xxh3-64 checksum."""


class BlockMismatchError(BlockError):
    """An intact block whose key, fingerprint or token ids are not what the caller expected."""


def is_int(x: object) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_layout(
    form: StoredForm, dtype: str, shape: tuple[int, ...], v_head_dim: int, codec: str = "none"
) -> int:
    """Validate dtype/shape/v_head_dim for ``form`` and ``codec``; return the uncompressed
    payload size."""
    if dtype not in DTYPE_ITEMSIZE:
        raise BlockHeaderError(f"dtype: {dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
    if not isinstance(shape, tuple) or len(shape) != 4 or not all(is_int(d) for d in shape):
        raise BlockHeaderError(
            f"shape: must be a tuple of 4 ints (layers, tokens, kv_heads, head_dim), got {shape!r}"
        )
    if min(shape) <= 0:
        raise BlockHeaderError(f"shape: every dimension must be positive, got {shape}")
    _, tokens, kv_heads, _ = shape
    if tokens > MAX_BLOCK_TOKENS:
        raise BlockHeaderError(
            f"shape: {tokens} tokens exceeds MAX_BLOCK_TOKENS={MAX_BLOCK_TOKENS}"
        )
    if not is_int(v_head_dim):
        raise BlockHeaderError(f"v_head_dim: must be an int, got {v_head_dim!r}")
    if form == StoredForm.MLA:
        if v_head_dim != 0:
            raise BlockHeaderError(f"v_head_dim: must be 0 for MLA (no V), got {v_head_dim}")
        if kv_heads != 1:
            raise BlockHeaderError(f"shape: MLA latent has kv_heads 1, got {kv_heads}")
    elif form == StoredForm.ENGINE_PAGE:
        if v_head_dim < 0:
            raise BlockHeaderError(f"v_head_dim: must be >= 0 for ENGINE_PAGE, got {v_head_dim}")
    elif v_head_dim <= 0:
        raise BlockHeaderError(f"v_head_dim: must be positive for {form.name}, got {v_head_dim}")
    if codec != "none" and form == StoredForm.ENGINE_PAGE:
        raise BlockHeaderError(f"codec: {codec!r} does not apply to ENGINE_PAGE (engine bytes)")
    try:
        return payload_layout(codec, DTYPE_ITEMSIZE[dtype], shape, v_head_dim).nbytes
    except CodecError as e:
        raise BlockHeaderError(str(e)) from e
