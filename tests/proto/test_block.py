"""Block format: exact wire layout, bit-exact round trips, and typed rejection of bad blobs."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from nopecache.proto.block import (
    FORMAT_VERSION,
    KEY_BYTES,
    MAX_HEADER_BYTES,
    BlockChecksumError,
    BlockError,
    BlockHeader,
    BlockHeaderError,
    BlockMismatchError,
    BlockSizeError,
    StoredForm,
    build_block,
    decode_block,
    encode_block,
    pack,
    pack_into,
    packed_size,
    parse,
    payload_offset,
    validate,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

KEY = bytes(range(16))
FP = b"model-fingerprint"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Spec:
    """Everything needed to build one test block."""

    form: StoredForm
    dtype: torch.dtype
    compression: str
    shape: tuple[int, int, int, int]
    v_head_dim: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...] | None
    seed: int


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infs included) of ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = itemsize * int(torch.Size(shape).numel())
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``, for bit-exact comparison (NaN-safe)."""
    return t.contiguous().view(torch.uint8)


@st.composite
def specs(draw: st.DrawFn, compression: str | None = None) -> Spec:
    """Small blocks of every stored form, dtype and compression."""
    form = draw(st.sampled_from(list(StoredForm)))
    tokens = draw(st.integers(1, 6))
    kv_heads = 1 if form == StoredForm.MLA else draw(st.integers(1, 3))
    shape = (draw(st.integers(1, 3)), tokens, kv_heads, draw(st.integers(1, 8)))
    ids = st.lists(st.integers(0, 2**32 - 1), min_size=tokens, max_size=tokens).map(tuple)
    return Spec(
        form=form,
        dtype=draw(st.sampled_from(DTYPES)),
        compression=compression or draw(st.sampled_from(["none", "lz4"])),
        shape=shape,
        v_head_dim=0 if form == StoredForm.MLA else draw(st.integers(1, 8)),
        token_ids=draw(ids),
        positions=draw(ids) if form == StoredForm.ROPE else None,
        seed=draw(st.integers(0, 2**31)),
    )


def make(spec: Spec) -> tuple[bytes, torch.Tensor, torch.Tensor | None]:
    """Encode ``spec``'s random K/V; return the blob and the tensors."""
    k = random_tensor(spec.shape, spec.dtype, spec.seed)
    v = None
    if spec.form != StoredForm.MLA:
        v = random_tensor((*spec.shape[:3], spec.v_head_dim), spec.dtype, spec.seed + 1)
    blob = encode_block(
        key=KEY,
        fingerprint=FP,
        form=spec.form,
        k=k,
        v=v,
        token_ids=spec.token_ids,
        source_positions=spec.positions,
        compression=spec.compression,
    )
    return blob, k, v


SMALL = Spec(StoredForm.NOPE, torch.bfloat16, "none", (2, 3, 2, 4), 4, (7, 8, 9), None, 5)


def header_fields(blob: bytes) -> dict[str, Any]:
    """The msgpack header map of ``blob``, decoded independently of the module under test."""
    (header_len,) = struct.unpack_from("<I", blob, 4)
    fields: dict[str, Any] = msgpack.unpackb(blob[16 : 16 + header_len])
    return fields


def reframe(fields: dict[str, Any], payload: bytes) -> bytes:
    """A blob with a valid prefix and header checksum around an arbitrary header map."""
    hb = msgpack.packb(fields, use_bin_type=True)
    pad = -(16 + len(hb)) % 64
    return (
        struct.pack("<4sIQ", b"NPC1", len(hb), xxhash.xxh3_64_intdigest(hb))
        + hb
        + bytes(pad)
        + payload
    )


# --- round trips -----------------------------------------------------------------------


@given(specs())
def test_round_trip_is_bit_exact_for_every_dtype_form_and_compression(spec: Spec) -> None:
    blob, k, v = make(spec)
    out = decode_block(blob, expect_key=KEY, expect_fingerprint=FP, expect_tokens=spec.token_ids)
    h = out.header
    assert (h.version, h.key, h.fingerprint, h.form) == (FORMAT_VERSION, KEY, FP, spec.form)
    assert h.dtype == str(spec.dtype).removeprefix("torch.")
    assert (h.shape, h.v_head_dim, h.compression) == (spec.shape, spec.v_head_dim, spec.compression)
    assert (h.token_ids, h.source_positions) == (spec.token_ids, spec.positions)
    assert out.k.dtype == spec.dtype and out.k.shape == spec.shape
    assert torch.equal(bits(out.k), bits(k))
    if v is None:
        assert out.v is None
    else:
        assert out.v is not None and out.v.dtype == spec.dtype
        assert torch.equal(bits(out.v), bits(v))
    assert validate(blob) == h
    assert (
        encode_block(
            key=KEY,
            fingerprint=FP,
            form=spec.form,
            k=k,
            v=v,
            token_ids=list(spec.token_ids),
            source_positions=spec.positions,
            compression=spec.compression,
        )
        == blob
    )


def test_wire_layout_is_prefix_header_padding_payload() -> None:
    k = torch.arange(2 * 3 * 2 * 4, dtype=torch.float16).view(2, 3, 2, 4)
    v = -torch.arange(2 * 3 * 2 * 4, dtype=torch.float16).view(2, 3, 2, 4)
    blob = encode_block(
        key=KEY, fingerprint=FP, form=StoredForm.NOPE, k=k, v=v, token_ids=[7, 8, 9]
    )
    payload = k.numpy().tobytes() + v.numpy().tobytes()
    hb = msgpack.packb(
        {
            "version": 1,
            "key": KEY,
            "fingerprint": FP,
            "form": 0,
            "dtype": "float16",
            "shape": [2, 3, 2, 4],
            "v_head_dim": 4,
            "token_ids": struct.pack("<3I", 7, 8, 9),
            "source_positions": None,
            "checksum": xxhash.xxh3_64_intdigest(payload),
            "compression": "none",
            "payload_nbytes": 192,
            "stored_nbytes": 192,
        },
        use_bin_type=True,
    )
    prefix = b"NPC1" + struct.pack("<I", len(hb)) + struct.pack("<Q", xxhash.xxh3_64_intdigest(hb))
    start = payload_offset(len(hb))
    assert start % 64 == 0 and start >= 16 + len(hb)
    assert blob == prefix + hb + bytes(start - 16 - len(hb)) + payload


def test_non_contiguous_tensors_are_stored_in_logical_order() -> None:
    base = random_tensor((2, 4, 3, 5), torch.bfloat16, 1)
    k = base.transpose(0, 1)  # [4, 2, 3, 5], not contiguous
    v = base.transpose(0, 1)[..., :2]
    blob = encode_block(key=KEY, fingerprint=FP, form=StoredForm.NOPE, k=k, v=v, token_ids=[1, 2])
    out = decode_block(blob)
    assert out.v is not None
    assert torch.equal(bits(out.k), bits(k)) and torch.equal(bits(out.v), bits(v))


def test_a_token_slice_is_encoded_from_its_layers_in_place_as_its_contiguous_copy() -> None:
    """``k[:, s:e]`` of ``[layers, tokens, ...]`` (what the store pipeline encodes) is
    checksummed and copied layer by layer where it lies: the blob is byte for byte the
    blob of its contiguous copy."""
    k_all = random_tensor((3, 10, 2, 4), torch.bfloat16, 5)
    v_all = random_tensor((3, 10, 2, 4), torch.bfloat16, 6)
    k, v = k_all[:, 4:7], v_all[:, 4:7]
    assert not k.is_contiguous() and all(k[i].is_contiguous() for i in range(3))
    ids = [7, 8, 9]
    sliced = encode_block(key=KEY, fingerprint=FP, form=StoredForm.NOPE, k=k, v=v, token_ids=ids)
    copied = encode_block(
        key=KEY,
        fingerprint=FP,
        form=StoredForm.NOPE,
        k=k.contiguous(),
        v=v.contiguous(),
        token_ids=ids,
    )
    assert sliced == copied
    out = decode_block(sliced)
    assert out.v is not None
    assert torch.equal(bits(out.k), bits(k)) and torch.equal(bits(out.v), bits(v))


def test_decode_of_writable_blob_aliases_it_and_payload_is_aligned() -> None:
    blob = bytearray(make(SMALL)[0])
    out = decode_block(blob)
    assert out.v is not None
    offset = len(blob) - out.header.payload_nbytes
    assert offset % 64 == 0
    out.k[0, 0, 0, 0] = 3.0
    out.v[0, 0, 0, 0] = -2.0
    v_at = offset + out.header.k_nbytes
    assert blob[offset : offset + 2] == bf16_bytes(3.0)
    assert blob[v_at : v_at + 2] == bf16_bytes(-2.0)


def bf16_bytes(x: float) -> bytes:
    """Little-endian bfloat16 bytes of ``x``: the top half of its float32 bytes."""
    return struct.pack("<f", x)[2:]


def test_pack_pack_into_and_packed_size_agree_with_encode() -> None:
    blob = make(SMALL)[0]
    header, payload = parse(blob)
    assert pack(header, payload) == blob
    assert packed_size(header, len(payload)) == len(blob)
    pool = bytearray(len(blob) + 100)
    slot = memoryview(pool)[50:]
    assert pack_into(slot, header, payload) == len(blob)
    assert bytes(pool[50 : 50 + len(blob)]) == blob and pool[:50] == bytes(50)
    with pytest.raises(BlockSizeError, match="buf:"):
        pack_into(bytearray(len(blob) - 1), header, payload)
    with pytest.raises(BlockSizeError, match="payload:"):
        pack(header, bytes(payload)[:-2])


def test_build_block_from_raw_parts_equals_encode() -> None:
    blob, k, v = make(SMALL)
    assert v is not None
    kb, vb = bits(k).numpy().tobytes(), bits(v).numpy().tobytes()
    common: dict[str, Any] = dict(
        key=KEY, fingerprint=FP, form=StoredForm.NOPE, dtype="bfloat16", shape=SMALL.shape
    )
    common.update(v_head_dim=4, token_ids=SMALL.token_ids)
    assert build_block(**common, payload=[kb, vb]) == blob
    assert build_block(**common, payload=kb + vb) == blob
    with pytest.raises(BlockSizeError, match="payload: 190 bytes but bfloat16"):
        build_block(**common, payload=(kb + vb)[:-2])


# --- corruption ------------------------------------------------------------------------


def expected_flip_error(blob: bytes, pos: int, flipped: bytes) -> type[BlockError]:
    """Which typed error a one-byte flip at ``pos`` must raise, by region of the layout."""
    (header_len,) = struct.unpack_from("<I", blob, 4)
    if pos < 4:
        return BlockHeaderError  # magic
    if pos < 8:
        (new_len,) = struct.unpack_from("<I", flipped, 4)
        if new_len > MAX_HEADER_BYTES:
            return BlockHeaderError
        return BlockSizeError if payload_offset(new_len) > len(blob) else BlockChecksumError
    if pos < 16 + header_len:
        return BlockChecksumError  # header checksum or header bytes
    if pos < payload_offset(header_len):
        return BlockHeaderError  # zero padding
    return BlockChecksumError  # payload (raw or lz4)


@given(specs(), st.integers(0, 2**20), st.integers(1, 255))
def test_any_flipped_byte_is_rejected_with_its_typed_error(spec: Spec, at: int, mask: int) -> None:
    blob = make(spec)[0]
    pos = at % len(blob)
    flipped = bytearray(blob)
    flipped[pos] ^= mask
    expected = expected_flip_error(blob, pos, bytes(flipped))
    with pytest.raises(expected):
        validate(flipped)
    with pytest.raises(expected):
        decode_block(bytes(flipped))


@given(specs(), st.integers(0, 2**20))
def test_any_truncation_is_a_size_error(spec: Spec, at: int) -> None:
    blob = make(spec)[0]
    with pytest.raises(BlockSizeError):
        validate(blob[: at % len(blob)])


@pytest.mark.parametrize("compression", ["none", "lz4"])
@pytest.mark.parametrize("extra", [1, 64])
def test_trailing_bytes_are_a_size_error(compression: str, extra: int) -> None:
    blob = make(replace(SMALL, compression=compression))[0]
    with pytest.raises(BlockSizeError, match="payload: blob holds"):
        validate(blob + bytes(extra))


def test_short_blob_and_bad_magic() -> None:
    blob = make(SMALL)[0]
    with pytest.raises(BlockSizeError, match="blob: 15 bytes"):
        parse(blob[:15])
    with pytest.raises(BlockHeaderError, match="magic: expected b'NPC1', got b'NPC2'"):
        parse(b"NPC2" + blob[4:])


def test_header_length_over_the_limit_is_refused() -> None:
    blob = make(SMALL)[0]
    huge = blob[:4] + struct.pack("<I", MAX_HEADER_BYTES + 1) + blob[8:]
    with pytest.raises(BlockHeaderError, match="header_len:"):
        parse(huge)


BAD_HEADERS: list[tuple[str, Any, type[BlockError], str]] = [
    ("version", 3, BlockHeaderError, "version: unsupported format version 3"),
    ("dtype", "int8", BlockHeaderError, "dtype: 'int8'"),
    ("form", 7, BlockHeaderError, "form: unknown stored form 7"),
    ("compression", "zstd", BlockHeaderError, "compression: 'zstd'"),
    ("key", b"short", BlockHeaderError, "key: must be 16 bytes"),
    ("fingerprint", b"", BlockHeaderError, "fingerprint:"),
    ("token_ids", struct.pack("<2I", 7, 8), BlockHeaderError, "token_ids: must be 3 x uint32"),
    ("source_positions", struct.pack("<3I", 0, 1, 2), BlockHeaderError, "source_positions:"),
    ("shape", [2, 3, 2], BlockHeaderError, "shape: must be 4 ints"),
    ("v_head_dim", 0, BlockHeaderError, "v_head_dim: must be positive for NOPE"),
    ("checksum", -1, BlockHeaderError, "checksum: must be a uint64"),
    ("payload_nbytes", 95, BlockHeaderError, "payload_nbytes: 95 but bfloat16"),
    ("stored_nbytes", 95, BlockSizeError, "payload: 95 bytes but payload_nbytes is 192"),
    ("extra_field", 1, BlockHeaderError, r"unknown fields \['extra_field'\]"),
]


@pytest.mark.parametrize(("field", "value", "error", "match"), BAD_HEADERS)
def test_invalid_header_field_is_named(
    field: str, value: Any, error: type[BlockError], match: str
) -> None:
    blob = make(SMALL)[0]
    payload = parse(blob)[1]
    fields = header_fields(blob)
    fields[field] = value
    with pytest.raises(error, match=match):
        validate(reframe(fields, bytes(payload)))


def test_missing_field_and_non_map_header_are_named() -> None:
    blob = make(SMALL)[0]
    payload = bytes(parse(blob)[1])
    fields = header_fields(blob)
    del fields["checksum"]
    with pytest.raises(BlockHeaderError, match=r"missing fields \['checksum'\]"):
        validate(reframe(fields, payload))
    hb = msgpack.packb([1, 2])
    bad = struct.pack("<4sIQ", b"NPC1", len(hb), xxhash.xxh3_64_intdigest(hb)) + hb
    with pytest.raises(BlockHeaderError, match="header: must be a msgpack map"):
        parse(bad + bytes(payload_offset(len(hb)) - len(bad)))


def test_header_claiming_another_shape_is_a_size_error() -> None:
    blob = make(SMALL)[0]
    payload = bytes(parse(blob)[1])
    fields = header_fields(blob)
    fields.update(shape=[3, 3, 2, 4], payload_nbytes=288, stored_nbytes=288)
    with pytest.raises(
        BlockSizeError, match="payload: blob holds 192 payload bytes, header says 288"
    ):
        validate(reframe(fields, payload))


def test_lz4_header_cannot_claim_an_impossible_expansion() -> None:
    fields = header_fields(make(SMALL)[0])
    fields.update(shape=[1, 3, 1, 1 << 20], v_head_dim=1 << 20, compression="lz4", stored_nbytes=10)
    fields["payload_nbytes"] = 2 * 3 * (1 << 21)
    with pytest.raises(BlockSizeError, match="payload_nbytes: 12582912 cannot come from 10"):
        validate(reframe(fields, bytes(10)))


def test_corrupt_lz4_stream_is_a_checksum_error() -> None:
    blob = make(replace(SMALL, compression="lz4"))[0]
    header, stored = parse(blob)
    with pytest.raises(BlockChecksumError, match="payload: corrupt lz4 stream"):
        validate(pack(header, bytes(len(stored))))


# --- the wrong block -------------------------------------------------------------------


def test_wrong_key_fingerprint_or_tokens_never_decode() -> None:
    blob = make(SMALL)[0]
    with pytest.raises(BlockMismatchError, match="key: block holds 000102"):
        decode_block(blob, expect_key=bytes(16))
    with pytest.raises(BlockMismatchError, match="fingerprint:"):
        decode_block(blob, expect_fingerprint=b"other-model")
    with pytest.raises(BlockMismatchError, match="token_ids: first difference at index 1"):
        decode_block(blob, expect_tokens=[7, 0, 9])
    with pytest.raises(BlockMismatchError, match="token_ids: block holds 3 tokens, expected 4"):
        decode_block(blob, expect_tokens=[7, 8, 9, 10])


# --- constructing headers and encoding -------------------------------------------------


def good_header(**changes: Any) -> BlockHeader:
    """A valid header for SMALL with ``changes`` applied."""
    fields: dict[str, Any] = dict(
        version=FORMAT_VERSION,
        key=KEY,
        fingerprint=FP,
        form=StoredForm.NOPE,
        dtype="bfloat16",
        shape=(2, 3, 2, 4),
        v_head_dim=4,
        token_ids=(7, 8, 9),
        source_positions=None,
        checksum=0,
        compression="none",
        payload_nbytes=192,
    )
    fields.update(changes)
    return BlockHeader(**fields)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(key=b"x" * (KEY_BYTES + 1)), "key:"),
        (dict(form=1), "form: must be a StoredForm"),
        (dict(shape=(2, 0, 2, 4), token_ids=()), "shape: every dimension must be positive"),
        (dict(token_ids=(7, 8, -1)), "token_ids: every entry must be an int"),
        (dict(token_ids=(7, 8, 2**32)), "token_ids: every entry must be an int"),
        (dict(token_ids=[7, 8, 9]), "token_ids: must be a tuple of 3"),
        (dict(form=StoredForm.ROPE), "source_positions: ROPE needs a tuple of 3"),
        (dict(source_positions=(1, 2, 3)), "source_positions: must be None for NOPE"),
        (dict(form=StoredForm.MLA), "v_head_dim: must be 0 for MLA"),
        (dict(form=StoredForm.MLA, v_head_dim=0, payload_nbytes=96), "shape: MLA latent"),
        (dict(checksum=2**64), "checksum: must be a uint64"),
        (dict(version=True), "version:"),
    ],
)
def test_block_header_validates_every_field(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(BlockHeaderError, match=match):
        good_header(**changes)


def test_header_shapes_of_k_and_v() -> None:
    nope = good_header()
    assert (nope.v_shape, nope.k_nbytes) == ((2, 3, 2, 4), 96)
    h = good_header(form=StoredForm.MLA, shape=(2, 3, 1, 6), v_head_dim=0, payload_nbytes=72)
    assert h.v_shape is None and h.k_nbytes == 72


def test_encode_rejects_inconsistent_tensors() -> None:
    k = torch.zeros(2, 3, 1, 4, dtype=torch.bfloat16)
    args: dict[str, Any] = dict(key=KEY, fingerprint=FP, token_ids=[1, 2, 3])
    with pytest.raises(BlockHeaderError, match="v: must be None for MLA"):
        encode_block(**args, form=StoredForm.MLA, k=k, v=k)
    with pytest.raises(BlockHeaderError, match="v: required for NOPE"):
        encode_block(**args, form=StoredForm.NOPE, k=k, v=None)
    with pytest.raises(BlockHeaderError, match=r"v: dtype torch\.float16 differs"):
        encode_block(**args, form=StoredForm.NOPE, k=k, v=k.half())
    with pytest.raises(BlockHeaderError, match=r"v: shape \[2, 3, 2, 4\] must be"):
        encode_block(**args, form=StoredForm.NOPE, k=k, v=torch.zeros(2, 3, 2, 4).bfloat16())
    with pytest.raises(BlockHeaderError, match="dtype: 'int8'"):
        encode_block(**args, form=StoredForm.MLA, k=k.to(torch.int8), v=None)
    with pytest.raises(BlockHeaderError, match="k: must be 4-D"):
        encode_block(**args, form=StoredForm.MLA, k=k[0], v=None)
    with pytest.raises(BlockHeaderError, match="token_ids: 2 ids for 3 tokens in k"):
        encode_block(**{**args, "token_ids": [1, 2]}, form=StoredForm.MLA, k=k, v=None)


# --- process boundaries ----------------------------------------------------------------


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with warnings as errors."""
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_validate_needs_no_torch(tmp_path: Path) -> None:
    blob = make(replace(SMALL, compression="lz4"))[0]
    (tmp_path / "good").write_bytes(blob)
    (tmp_path / "bad").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    proc = run_python(
        """
        import sys
        from pathlib import Path
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from nopecache.proto.block import BlockChecksumError, validate
        header = validate(Path(sys.argv[1]).read_bytes())
        try:
            validate(Path(sys.argv[2]).read_bytes())
        except BlockChecksumError as e:
            print(header.token_ids, header.compression, str(e).split(":")[0])
        """,
        str(tmp_path / "good"),
        str(tmp_path / "bad"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "(7, 8, 9) lz4 checksum\n"


def test_decode_of_read_only_bytes_emits_no_warning(tmp_path: Path) -> None:
    (tmp_path / "blob").write_bytes(make(SMALL)[0])
    proc = run_python(
        """
        import sys
        from pathlib import Path
        from nopecache.proto.block import decode_block
        out = decode_block(Path(sys.argv[1]).read_bytes(), expect_tokens=[7, 8, 9])
        print(out.k.shape, out.v.shape)
        """,
        str(tmp_path / "blob"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "torch.Size([2, 3, 2, 4]) torch.Size([2, 3, 2, 4])\n"


def test_build_block_into_writes_build_blocks_bytes_into_the_given_buffer() -> None:
    """The engine-page form: opaque bytes, no V (v_head_dim 0), token ids unknown (zeros)."""
    from nopecache.proto.block import build_block, build_block_into

    k = bytes(range(256)) * 6  # 2 layers x 4 tokens x 3 heads x 32 dims x 2 bytes
    args: dict[str, Any] = dict(
        key=b"k" * 16,
        fingerprint=b"fp",
        form=StoredForm.ENGINE_PAGE,
        dtype="bfloat16",
        shape=(2, 4, 3, 32),
        v_head_dim=0,
        token_ids=(0, 0, 0, 0),
        payload=[k[:700], k[700:]],
    )
    taken: list[int] = []
    arena = bytearray(8192)

    def take(size: int) -> memoryview:
        taken.append(size)
        return memoryview(arena)[:size]

    blob = build_block_into(take, **args)
    assert bytes(blob) == build_block(**args)
    assert taken == [blob.nbytes]
    header = validate(blob)
    assert header.form is StoredForm.ENGINE_PAGE and header.v_shape is None
    with pytest.raises(BlockHeaderError, match="v_head_dim"):
        build_block(**{**args, "v_head_dim": -1})
