"""Block format shared by client and server: one contiguous blob per cached chunk.

A block is the KV of one chunk of tokens for all layers of one model, plus a header that
lets anyone holding only the bytes decide whether they are intact and what they hold::

    offset 0        4            8                    16
           +--------+------------+--------------------+-----------------+-----+-------------+
           | "NPC1" | header_len | header_xxh3_64     | msgpack header  | pad | payload     |
           | magic  | uint32 LE  | uint64 LE          | header_len B    | 0s  | stored B    |
           +--------+------------+--------------------+-----------------+-----+-------------+
                                                                              ^
                                               payload_offset: 16 + header_len rounded up to 64

The payload starts 64-byte aligned relative to the blob so that ``torch.frombuffer`` views
of it are aligned for every dtype (and for vectorised copies). The padding must be zeros.
``header_xxh3_64`` covers the msgpack bytes, so a flipped header byte is caught by
``validate`` on the server, not only by a client that knows which key and tokens to expect.

The msgpack header is a map with exactly these keys (the ``BlockHeader`` fields plus
``stored_nbytes``, the payload length as stored, so truncation is a size error even when
the payload is lz4-compressed)::

    version           int    FORMAT_VERSION
    key               bin    16 bytes (the client's BlockKey)
    fingerprint       bin    the client's ModelFingerprint.to_bytes(); opaque here
    form              int    StoredForm
    dtype             str    "bfloat16" | "float16" | "float32" | "float8_e4m3fn"
    shape             array  K shape [layers, tokens, kv_heads, head_dim]
    v_head_dim        int    last dim of V (0 for MLA: no V)
    token_ids         bin    tokens x uint32 LE (a bin, not a list: 4k ints unpack in µs)
    source_positions  bin    tokens x uint32 LE for ROPE, nil otherwise
    checksum          int    xxh3-64 of the uncompressed payload
    compression       str    "none" | "lz4" (lz4 block format, no size prefix)
    payload_nbytes    int    uncompressed payload size (K bytes + V bytes [+ scales])
    stored_nbytes     int    payload bytes in the blob (== payload_nbytes for "none")
    codec             str    version 2 only: "fp8" | "k16v8" (``kv_codec.py``)

Versions: 1 is the raw form (no ``codec`` key: codec "none"); 2 adds ``codec``, a compact
stored form whose payload layout ``kv_codec.py`` draws. Each block has one encoding (a
"none" block is always version 1), so raw blocks keep their bytes, and a reader that only
knows version 1 refuses a compact block instead of reading its bytes as the engine's dtype.

Payload (uncompressed, codec "none"): K then V, C-contiguous, the raw little-endian element bytes (as
torch holds them on every little-endian host; bf16 and fp8 are never converted)::

    K  [layers, tokens, kv_heads, head_dim]     dtype
    V  [layers, tokens, kv_heads, v_head_dim]   dtype     (absent for MLA)

MLA (DeepSeek-style latent attention) stores no V: K is the compressed latent
``[layers, tokens, 1, kv_lora_rank + rope_dim]`` whose last ``rope_dim`` channels are the
decoupled rope key, kept in nope form (un-rotated) like NOPE K; ``v_head_dim`` is 0. The
split point is a property of the model (its fingerprint and RoPE spec), not of the block.

Everything up to ``validate`` needs no torch: the server checks blocks with msgpack,
xxhash and lz4 only. ``encode_block``/``decode_block`` import torch when called.
"""

from __future__ import annotations

import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lz4.block
import msgpack
import xxhash

from nopecache.proto.block_layout import DTYPE_ITEMSIZE as DTYPE_ITEMSIZE
from nopecache.proto.block_layout import MAX_BLOCK_TOKENS as MAX_BLOCK_TOKENS
from nopecache.proto.block_layout import BlockChecksumError as BlockChecksumError
from nopecache.proto.block_layout import BlockError as BlockError
from nopecache.proto.block_layout import BlockHeaderError as BlockHeaderError
from nopecache.proto.block_layout import BlockMismatchError as BlockMismatchError
from nopecache.proto.block_layout import BlockSizeError as BlockSizeError
from nopecache.proto.block_layout import StoredForm as StoredForm
from nopecache.proto.block_layout import check_layout, is_int
from nopecache.proto.kv_codec import decode_payload, payload_layout

if TYPE_CHECKING:
    import torch


FORMAT_VERSION = 1  # the raw form (codec "none")
CODEC_FORMAT_VERSION = 2  # version 1 + the ``codec`` field (a compact stored form)
KEY_BYTES = 16
MAGIC = b"NPC1"
PREFIX = struct.Struct("<4sIQ")  # magic, header_len, header_xxh3_64
PAYLOAD_ALIGN = 64
MAX_HEADER_BYTES = 1 << 20
MAX_FINGERPRINT_BYTES = 1024
# lz4's block API refuses inputs above LZ4_MAX_INPUT_SIZE, and no lz4 stream expands by
# more than 255x: bounding payload_nbytes by both keeps a crafted header from making the
# server allocate gigabytes before the checksum could reject it.
LZ4_MAX_INPUT = 0x7E000000
LZ4_MAX_RATIO = 255

COMPRESSIONS = ("none", "lz4")

BytesLike = bytes | bytearray | memoryview

_HEADER_KEYS = (
    "version",
    "key",
    "fingerprint",
    "form",
    "dtype",
    "shape",
    "v_head_dim",
    "token_ids",
    "source_positions",
    "checksum",
    "compression",
    "payload_nbytes",
    "stored_nbytes",
)
_CODEC_HEADER_KEYS = (*_HEADER_KEYS, "codec")


def format_version(codec: str) -> int:
    """The one header version a block stored with ``codec`` has."""
    return FORMAT_VERSION if codec == "none" else CODEC_FORMAT_VERSION


def _u32_bytes(field: str, values: tuple[int, ...]) -> bytes:
    """Pack ints as little-endian uint32, raising BlockHeaderError naming ``field``."""
    try:
        return struct.pack(f"<{len(values)}I", *values)
    except struct.error as e:
        raise BlockHeaderError(f"{field}: every entry must be an int in [0, 2**32): {e}") from e


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """Everything a block says about itself; validated on construction."""

    version: int
    key: bytes
    fingerprint: bytes
    form: StoredForm
    dtype: str
    shape: tuple[int, int, int, int]
    v_head_dim: int
    token_ids: tuple[int, ...]
    source_positions: tuple[int, ...] | None
    checksum: int
    compression: str
    payload_nbytes: int
    codec: str = "none"  # a compact stored form (kv_codec.py); version 2 when not "none"

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str):
            raise BlockHeaderError(f"codec: must be a str, got {self.codec!r}")
        if not is_int(self.version) or self.version not in (FORMAT_VERSION, CODEC_FORMAT_VERSION):
            raise BlockHeaderError(
                f"version: unsupported format version {self.version!r} "
                f"(this build reads {FORMAT_VERSION} and {CODEC_FORMAT_VERSION})"
            )
        if self.version != format_version(self.codec):
            raise BlockHeaderError(
                f"version: a block with codec {self.codec!r} is version "
                f"{format_version(self.codec)}, got {self.version}"
            )
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise BlockHeaderError(f"key: must be {KEY_BYTES} bytes, got {self.key!r}")
        if not isinstance(self.fingerprint, bytes) or not (
            0 < len(self.fingerprint) <= MAX_FINGERPRINT_BYTES
        ):
            raise BlockHeaderError(
                f"fingerprint: must be 1..{MAX_FINGERPRINT_BYTES} bytes, "
                f"got {self.fingerprint!r:.80}"
            )
        if not isinstance(self.form, StoredForm):
            raise BlockHeaderError(f"form: must be a StoredForm, got {self.form!r}")
        expected = check_layout(self.form, self.dtype, self.shape, self.v_head_dim, self.codec)
        tokens = self.shape[1]
        if not isinstance(self.token_ids, tuple) or len(self.token_ids) != tokens:
            raise BlockHeaderError(
                f"token_ids: must be a tuple of {tokens} ids (shape[1]), got "
                f"{type(self.token_ids).__name__} of {len(self.token_ids)}"
            )
        _u32_bytes("token_ids", self.token_ids)
        if self.form == StoredForm.ROPE:
            pos = self.source_positions
            if not isinstance(pos, tuple) or len(pos) != tokens:
                raise BlockHeaderError(
                    f"source_positions: ROPE needs a tuple of {tokens} positions, got {pos!r:.80}"
                )
            _u32_bytes("source_positions", pos)
        elif self.source_positions is not None:
            raise BlockHeaderError(f"source_positions: must be None for {self.form.name}")
        if not is_int(self.checksum) or not 0 <= self.checksum < 1 << 64:
            raise BlockHeaderError(f"checksum: must be a uint64, got {self.checksum!r}")
        if self.compression not in COMPRESSIONS:
            raise BlockHeaderError(
                f"compression: {self.compression!r} is not one of {list(COMPRESSIONS)}"
            )
        if self.payload_nbytes != expected:
            raise BlockHeaderError(
                f"payload_nbytes: {self.payload_nbytes!r} but {self.dtype} K{list(self.shape)} "
                f"+ V head_dim {self.v_head_dim} (codec {self.codec}) needs {expected}"
            )

    @property
    def v_shape(self) -> tuple[int, int, int, int] | None:
        """Shape of V in the payload, None for MLA (and a V-less ENGINE_PAGE)."""
        if self.form == StoredForm.MLA or self.v_head_dim == 0:
            return None
        layers, tokens, kv_heads, _ = self.shape
        return (layers, tokens, kv_heads, self.v_head_dim)

    @property
    def k_nbytes(self) -> int:
        """Bytes of K at the start of the uncompressed payload (as the codec holds it)."""
        itemsize = DTYPE_ITEMSIZE[self.dtype]
        return payload_layout(self.codec, itemsize, self.shape, self.v_head_dim).k_nbytes


# ---------------------------------------------------------------------------------------
# Framing: bytes in, bytes out, no torch.


def _encode_header(header: BlockHeader, stored_nbytes: int) -> bytes:
    """Msgpack bytes of ``header``; the key order is fixed so equal blocks are equal bytes."""
    pos = header.source_positions
    codec = {} if header.codec == "none" else {"codec": header.codec}
    return msgpack.packb(
        {
            "version": header.version,
            "key": header.key,
            "fingerprint": header.fingerprint,
            "form": int(header.form),
            "dtype": header.dtype,
            "shape": list(header.shape),
            "v_head_dim": header.v_head_dim,
            "token_ids": _u32_bytes("token_ids", header.token_ids),
            "source_positions": None if pos is None else _u32_bytes("source_positions", pos),
            "checksum": header.checksum,
            "compression": header.compression,
            "payload_nbytes": header.payload_nbytes,
            "stored_nbytes": stored_nbytes,
            **codec,
        },
        use_bin_type=True,
    )


def _u32_tuple(field: str, raw: object, tokens: int) -> tuple[int, ...]:
    if not isinstance(raw, bytes) or len(raw) != 4 * tokens:
        raise BlockHeaderError(f"{field}: must be {tokens} x uint32 LE bytes, got {raw!r:.80}")
    return struct.unpack(f"<{tokens}I", raw)


def _decode_header(raw: memoryview) -> tuple[BlockHeader, int]:
    """Parse msgpack header bytes into a validated header and the stored payload size."""
    try:
        fields = msgpack.unpackb(raw, raw=False, use_list=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise BlockHeaderError(f"header: not a valid msgpack map: {e}") from e
    if not isinstance(fields, dict):
        raise BlockHeaderError(f"header: must be a msgpack map, got {type(fields).__name__}")
    # Version first: another version may have other fields, and that is the real reason.
    version = fields.get("version")
    if not is_int(version) or version not in (FORMAT_VERSION, CODEC_FORMAT_VERSION):
        raise BlockHeaderError(
            f"version: unsupported format version {version!r} "
            f"(this build reads {FORMAT_VERSION} and {CODEC_FORMAT_VERSION})"
        )
    keys = _HEADER_KEYS if version == FORMAT_VERSION else _CODEC_HEADER_KEYS
    if set(fields) != set(keys):
        missing = sorted(set(keys) - set(fields))
        unknown = sorted(set(fields) - set(keys))
        raise BlockHeaderError(f"header: missing fields {missing}, unknown fields {unknown}")
    try:
        form = StoredForm(fields["form"])
    except (ValueError, TypeError) as e:
        raise BlockHeaderError(f"form: unknown stored form {fields['form']!r}") from e
    shape = fields["shape"]
    # The token count sizes the uint32 fields below; BlockHeader checks the rest.
    if not isinstance(shape, tuple) or len(shape) != 4 or not is_int(shape[1]):
        raise BlockHeaderError(f"shape: must be 4 ints, got {shape!r}")
    tokens = shape[1]
    if not 0 < tokens <= MAX_BLOCK_TOKENS:
        raise BlockHeaderError(f"shape: tokens must be in 1..{MAX_BLOCK_TOKENS}, got {tokens}")
    raw_pos = fields["source_positions"]
    header = BlockHeader(
        version=fields["version"],
        key=fields["key"],
        fingerprint=fields["fingerprint"],
        form=form,
        dtype=fields["dtype"],
        shape=shape,
        v_head_dim=fields["v_head_dim"],
        token_ids=_u32_tuple("token_ids", fields["token_ids"], tokens),
        source_positions=None
        if raw_pos is None
        else _u32_tuple("source_positions", raw_pos, tokens),
        checksum=fields["checksum"],
        compression=fields["compression"],
        payload_nbytes=fields["payload_nbytes"],
        codec=fields.get("codec", "none"),
    )
    stored = fields["stored_nbytes"]
    if not is_int(stored) or stored < 0:
        raise BlockHeaderError(f"stored_nbytes: must be a non-negative int, got {stored!r}")
    _check_stored(header, stored)
    return header, stored


def _check_stored(header: BlockHeader, stored_nbytes: int) -> None:
    """Check the stored payload length is possible for the header's compression."""
    if header.compression == "none":
        if stored_nbytes != header.payload_nbytes:
            raise BlockSizeError(
                f"payload: {stored_nbytes} bytes but payload_nbytes is {header.payload_nbytes}"
            )
    elif header.payload_nbytes > min(LZ4_MAX_INPUT, LZ4_MAX_RATIO * stored_nbytes + 16):
        raise BlockSizeError(
            f"payload_nbytes: {header.payload_nbytes} cannot come from {stored_nbytes} "
            "lz4-compressed bytes"
        )


def payload_offset(header_len: int) -> int:
    """Offset of the payload in a blob whose msgpack header is ``header_len`` bytes."""
    end = PREFIX.size + header_len
    return -(-end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def payload_start(prefix: BytesLike, nbytes: int) -> int | None:
    """Where the payload of an ``nbytes`` blob starting with ``prefix`` begins, for a
    receiver hashing it as it lands; None for bytes that are no fitting block prefix."""
    if len(prefix) < PREFIX.size:
        return None
    magic, header_len, _ = PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC or header_len > MAX_HEADER_BYTES:
        return None
    start = payload_offset(header_len)
    return start if start <= nbytes else None


def packed_size(header: BlockHeader, payload_len: int) -> int:
    """Size of the blob ``pack(header, payload)`` returns for a ``payload_len``-byte payload."""
    return payload_offset(len(_encode_header(header, payload_len))) + payload_len


def pack_into(buf: bytearray | memoryview, header: BlockHeader, payload: BytesLike) -> int:
    """Write the blob of ``header`` and stored ``payload`` at the start of ``buf``; return its size.

    ``payload`` is the payload as stored: already lz4-compressed when ``header.compression``
    is "lz4". The checksum is not recomputed (``validate`` is the check); use
    ``build_block`` or ``encode_block`` to make a header from data.
    """
    mv = memoryview(payload).cast("B")
    _check_stored(header, mv.nbytes)
    hb = _encode_header(header, mv.nbytes)
    start = payload_offset(len(hb))
    total = start + mv.nbytes
    out = memoryview(buf).cast("B")
    if out.nbytes < total:
        raise BlockSizeError(f"buf: {out.nbytes} bytes, the blob needs {total}")
    PREFIX.pack_into(out, 0, MAGIC, len(hb), xxhash.xxh3_64_intdigest(hb))
    out[PREFIX.size : PREFIX.size + len(hb)] = hb
    out[PREFIX.size + len(hb) : start] = bytes(start - PREFIX.size - len(hb))
    out[start:total] = mv
    return total


def pack(header: BlockHeader, payload: BytesLike) -> bytes:
    """The blob for ``header`` and stored ``payload`` (see ``pack_into``)."""
    mv = memoryview(payload).cast("B")
    _check_stored(header, mv.nbytes)
    return _frame(header, [mv], mv.nbytes)


def frame_head(header: BlockHeader, stored_nbytes: int) -> bytes:
    """A blob's bytes before its payload: prefix, msgpack header and padding."""
    hb = _encode_header(header, stored_nbytes)
    pad = payload_offset(len(hb)) - PREFIX.size - len(hb)
    return PREFIX.pack(MAGIC, len(hb), xxhash.xxh3_64_intdigest(hb)) + hb + bytes(pad)


def _frame(header: BlockHeader, parts: Sequence[BytesLike], stored_nbytes: int) -> bytes:
    """Join prefix, header, padding and payload parts with one copy of the payload."""
    return b"".join([frame_head(header, stored_nbytes), *parts])


def parse(blob: BytesLike) -> tuple[BlockHeader, memoryview]:
    """Split a blob into its validated header and a zero-copy view of the stored payload.

    Checks structure only (magic, lengths, header checksum, header fields); the payload
    checksum is ``validate``'s job. Raises BlockHeaderError, BlockSizeError or
    BlockChecksumError (header bytes corrupted).
    """
    mv = memoryview(blob)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    header, start = parse_head(mv, mv.nbytes)
    return header, mv[start:]


def head_nbytes(prefix: BytesLike, total_nbytes: int) -> int:
    """How many bytes from the start of a blob of ``total_nbytes`` its header takes (the
    payload offset), read from the blob's first ``PREFIX.size`` bytes or more."""
    mv = memoryview(prefix)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if total_nbytes < PREFIX.size or mv.nbytes < PREFIX.size:
        got = min(total_nbytes, mv.nbytes)
        raise BlockSizeError(f"blob: {got} bytes, shorter than the {PREFIX.size}-byte prefix")
    magic, header_len, _ = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BlockHeaderError(f"magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if header_len > MAX_HEADER_BYTES:
        raise BlockHeaderError(f"header_len: {header_len} exceeds {MAX_HEADER_BYTES}")
    start = payload_offset(header_len)
    if start > total_nbytes:
        raise BlockSizeError(
            f"header_len: {header_len} needs a blob of at least {start} bytes, got {total_nbytes}"
        )
    return start


def parse_head(head: BytesLike, total_nbytes: int) -> tuple[BlockHeader, int]:
    """``parse`` of a blob of ``total_nbytes`` given its first bytes only (at least
    ``head_nbytes``: the payload may lie where the caller cannot hash it, a GPU): the
    validated header and the payload offset."""
    mv = memoryview(head)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    start = head_nbytes(mv, total_nbytes)
    if mv.nbytes < start:
        raise BlockSizeError(f"head: {mv.nbytes} bytes given, the header takes {start}")
    _, header_len, header_sum = PREFIX.unpack_from(mv, 0)
    raw = mv[PREFIX.size : PREFIX.size + header_len]
    if xxhash.xxh3_64_intdigest(raw) != header_sum:
        raise BlockChecksumError("header_checksum: header bytes do not match their xxh3-64")
    if any(mv[PREFIX.size + header_len : start]):
        raise BlockHeaderError("padding: bytes between header and payload must be zero")
    header, stored = _decode_header(raw)
    if total_nbytes - start != stored:
        raise BlockSizeError(
            f"payload: blob holds {total_nbytes - start} payload bytes, header says {stored}"
        )
    return header, start


def _checked_payload(
    header: BlockHeader, stored: memoryview, stored_xxh3: int | None = None
) -> memoryview | bytes:
    """The uncompressed payload of a parsed block, once its checksum matches.

    ``stored_xxh3``: the xxh3-64 of ``stored`` taken by the caller as the bytes arrived;
    an uncompressed payload is then not read again (the digests are compared)."""
    payload: memoryview | bytes = stored
    if stored_xxh3 is not None and header.compression == "none":
        if stored_xxh3 != header.checksum:
            raise BlockChecksumError("checksum: payload bytes do not match their xxh3-64")
        return payload
    if header.compression == "lz4":
        try:
            payload = lz4.block.decompress(stored, uncompressed_size=header.payload_nbytes)
        except lz4.block.LZ4BlockError as e:
            raise BlockChecksumError(f"payload: corrupt lz4 stream: {e}") from e
        if len(payload) != header.payload_nbytes:
            raise BlockChecksumError(
                f"payload: lz4 stream holds {len(payload)} bytes, header says "
                f"{header.payload_nbytes}"
            )
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise BlockChecksumError("checksum: payload bytes do not match their xxh3-64")
    return payload


def check_payload_limit(header: BlockHeader, max_payload_bytes: int) -> None:
    """Raise BlockSizeError when the header declares a payload over ``max_payload_bytes``.

    The declared size is what decompression would allocate: checking it first keeps a
    small lz4 payload that claims to expand to hundreds of MiB (a compression bomb) from
    ever being decompressed.
    """
    if header.payload_nbytes > max_payload_bytes:
        raise BlockSizeError(
            f"payload_nbytes: {header.payload_nbytes} bytes uncompressed, over the limit "
            f"of {max_payload_bytes} (max_block_bytes)"
        )


def validate(
    blob: BytesLike, *, max_payload_bytes: int | None = None, payload_xxh3: int | None = None
) -> BlockHeader:
    """Check a blob completely (structure, sizes, both checksums) and return its header.

    With ``max_payload_bytes``, a block whose uncompressed payload is declared larger is
    refused (BlockSizeError) before anything is decompressed. ``payload_xxh3``: as in
    ``decode_block`` (the stored payload's digest taken as it was received).
    """
    header, stored = parse(blob)
    if max_payload_bytes is not None:
        check_payload_limit(header, max_payload_bytes)
    _checked_payload(header, stored, payload_xxh3)
    return header


def header_of(
    *,
    key: bytes,
    fingerprint: bytes,
    form: StoredForm,
    dtype: str,
    shape: tuple[int, int, int, int],
    v_head_dim: int,
    token_ids: Sequence[int],
    payload: BytesLike | Sequence[BytesLike],
    source_positions: Sequence[int] | None,
    compression: str,
    codec: str = "none",
) -> tuple[BlockHeader, list[memoryview], int]:
    """The validated header of a payload given in parts, the parts as byte views, and
    the payload size (checksummed where the parts lie)."""
    if isinstance(payload, bytes | bytearray | memoryview):
        payload = [payload]
    parts = [memoryview(p).cast("B") for p in payload]
    shape = tuple(shape)  # type: ignore[assignment]  # _check_layout checks the arity
    expected = check_layout(form, dtype, shape, v_head_dim, codec)
    nbytes = sum(p.nbytes for p in parts)
    if nbytes != expected:
        raise BlockSizeError(
            f"payload: {nbytes} bytes but {dtype} {list(shape)} (codec {codec}) needs {expected}"
        )
    digest = xxhash.xxh3_64()
    for p in parts:
        digest.update(p)
    header = BlockHeader(
        version=format_version(codec),
        key=key,
        fingerprint=fingerprint,
        form=form,
        dtype=dtype,
        shape=shape,
        v_head_dim=v_head_dim,
        token_ids=tuple(token_ids),
        source_positions=None if source_positions is None else tuple(source_positions),
        checksum=digest.intdigest(),
        compression=compression,
        payload_nbytes=nbytes,
        codec=codec,
    )
    return header, parts, nbytes


def build_block(
    *,
    key: bytes,
    fingerprint: bytes,
    form: StoredForm,
    dtype: str,
    shape: tuple[int, int, int, int],
    v_head_dim: int,
    token_ids: Sequence[int],
    payload: BytesLike | Sequence[BytesLike],
    source_positions: Sequence[int] | None = None,
    compression: str = "none",
) -> bytes:
    """A blob from the raw uncompressed payload (K then V), computing checksum and sizes.

    ``payload`` may be given in parts (K bytes, V bytes): they are checksummed where they
    lie and copied once, into the blob.
    """
    header, parts, nbytes = header_of(
        key=key,
        fingerprint=fingerprint,
        form=form,
        dtype=dtype,
        shape=shape,
        v_head_dim=v_head_dim,
        token_ids=token_ids,
        payload=payload,
        source_positions=source_positions,
        compression=compression,
    )
    if compression == "lz4":
        if nbytes > LZ4_MAX_INPUT:
            raise BlockSizeError(f"payload: {nbytes} bytes is over lz4's {LZ4_MAX_INPUT} limit")
        whole = parts[0] if len(parts) == 1 else b"".join(parts)
        packed = lz4.block.compress(whole, store_size=False)
        return _frame(header, [packed], len(packed))
    return _frame(header, parts, nbytes)


def build_block_into(
    take: Callable[[int], memoryview],
    *,
    key: bytes,
    fingerprint: bytes,
    form: StoredForm,
    dtype: str,
    shape: tuple[int, int, int, int],
    v_head_dim: int,
    token_ids: Sequence[int],
    payload: BytesLike | Sequence[BytesLike],
    source_positions: Sequence[int] | None = None,
) -> memoryview:
    """``build_block``'s uncompressed blob, written into ``take(size)`` (a view of exactly
    ``size`` writable bytes): the payload is copied once, into memory the caller reuses,
    so a hot path pays no page faults for a fresh blob. Returns that view, filled."""
    header, parts, nbytes = header_of(
        key=key,
        fingerprint=fingerprint,
        form=form,
        dtype=dtype,
        shape=shape,
        v_head_dim=v_head_dim,
        token_ids=token_ids,
        payload=payload,
        source_positions=source_positions,
        compression="none",
    )
    hb = _encode_header(header, nbytes)
    start = payload_offset(len(hb))
    out = take(start + nbytes)
    if out.nbytes != start + nbytes:
        raise BlockSizeError(f"take: gave {out.nbytes} bytes, the blob needs {start + nbytes}")
    PREFIX.pack_into(out, 0, MAGIC, len(hb), xxhash.xxh3_64_intdigest(hb))
    out[PREFIX.size : PREFIX.size + len(hb)] = hb
    out[PREFIX.size + len(hb) : start] = bytes(start - PREFIX.size - len(hb))
    offset = start
    for part in parts:
        out[offset : offset + part.nbytes] = part
        offset += part.nbytes
    return out


# ---------------------------------------------------------------------------------------
# Tensors: torch is imported here only, so the server can validate without it.


@dataclass(frozen=True, slots=True)
class DecodedBlock:
    """A verified block: its header, K, and V (None for MLA)."""

    header: BlockHeader
    k: torch.Tensor
    v: torch.Tensor | None


def encode_block(
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
) -> bytes:
    """A blob holding K (and V) ``[layers, tokens, kv_heads, head_dim]`` for ``token_ids``
    (``block_parts.encode_block_parts`` joined: the payload copied once, into the blob)."""
    from nopecache.proto.block_parts import encode_block_parts

    return encode_block_parts(
        key=key,
        fingerprint=fingerprint,
        form=form,
        k=k,
        v=v,
        token_ids=token_ids,
        source_positions=source_positions,
        compression=compression,
        codec=codec,
    ).join()


# torch.frombuffer warns (once per process) when the buffer is read-only, e.g. bytes from
# gRPC. The views are documented read-only, so the warning is noise; the lock keeps two
# threads' catch_warnings from restoring each other's filter lists out of order.
_READONLY_LOCK = threading.Lock()


def _frombuffer(buf: memoryview | bytes, dtype: Any, count: int, offset: int) -> torch.Tensor:
    import torch

    if not memoryview(buf).readonly:
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    with _READONLY_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _first_difference(got: tuple[int, ...], want: tuple[int, ...]) -> str:
    if len(got) != len(want):
        return f"block holds {len(got)} tokens, expected {len(want)}"
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    return f"first difference at index {i}: block holds {got[i]}, expected {want[i]}"


def check_expected(
    header: BlockHeader,
    expect_key: bytes | None = None,
    expect_fingerprint: bytes | None = None,
    expect_tokens: Sequence[int] | None = None,
) -> None:
    """Raise BlockMismatchError unless an intact block's header is the expected one."""
    if expect_key is not None and header.key != expect_key:
        raise BlockMismatchError(
            f"key: block holds {header.key.hex()}, expected {expect_key.hex()}"
        )
    if expect_fingerprint is not None and header.fingerprint != expect_fingerprint:
        raise BlockMismatchError(
            f"fingerprint: block holds {header.fingerprint.hex():.64}, "
            f"expected {expect_fingerprint.hex():.64}"
        )
    if expect_tokens is not None:
        want = tuple(expect_tokens)
        if header.token_ids != want:
            raise BlockMismatchError(f"token_ids: {_first_difference(header.token_ids, want)}")


def decode_block(
    blob: BytesLike,
    *,
    expect_key: bytes | None = None,
    expect_fingerprint: bytes | None = None,
    expect_tokens: Sequence[int] | None = None,
    payload_xxh3: int | None = None,
    decode_on: Any = None,
) -> DecodedBlock:
    """Verify a blob against what the caller expects and return K/V tensors viewing it.

    ``payload_xxh3``: the stored payload's xxh3-64 taken by the receiver as it arrived:
    an uncompressed payload is then not read again (None: hashed here).

    Raises BlockMismatchError when an intact block is not the expected one (a key
    collision or a mix-up), and the other BlockError types when it is corrupt: a block
    never turns into tensors unless every check passed.

    Uncompressed blocks decode zero-copy: ``k`` and ``v`` are ``torch.frombuffer`` views
    that keep ``blob`` alive. They are writable (and writes land in ``blob``) when ``blob``
    is writable (bytearray, a writable memoryview such as shared memory); for a read-only
    ``blob`` (bytes) they are read-only by contract, as torch cannot flag them: copy
    before writing. lz4 blocks decode into a fresh read-only buffer. A compact block
    (``codec`` not "none") decodes into fresh tensors of its ``dtype`` (``kv_codec.py``),
    on ``decode_on`` when given (a torch device: its compact bytes are copied there and
    decoded there, e.g. on the GPU that places them, on its current stream).
    """
    import torch

    header, stored = parse(blob)
    check_expected(header, expect_key, expect_fingerprint, expect_tokens)
    payload = _checked_payload(header, stored, payload_xxh3)
    dtype = getattr(torch, header.dtype)
    if header.codec != "none":
        raw = _frombuffer(payload, torch.uint8, header.payload_nbytes, 0)
        if decode_on is not None:
            raw = raw.to(decode_on)
        k, v = decode_payload(header.codec, raw, dtype, header.shape, header.v_head_dim)
        return DecodedBlock(header=header, k=k, v=v)
    itemsize = DTYPE_ITEMSIZE[header.dtype]
    k_count = header.k_nbytes // itemsize
    k = _frombuffer(payload, dtype, k_count, 0).view(header.shape)
    v_shape = header.v_shape
    v = None
    if v_shape is not None:
        v_count = (header.payload_nbytes - header.k_nbytes) // itemsize
        v = _frombuffer(payload, dtype, v_count, header.k_nbytes).view(v_shape)
    return DecodedBlock(header=header, k=k, v=v)
