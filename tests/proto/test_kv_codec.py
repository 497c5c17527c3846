"""Compact stored forms (proto/kv_codec.py) in blocks: exact bytes, exact rounding, sizes,
versions, and the server's byte-agnostic checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nopecache.proto.block import (
    CODEC_FORMAT_VERSION,
    FORMAT_VERSION,
    BlockChecksumError,
    BlockHeaderError,
    StoredForm,
    decode_block,
    encode_block,
    parse,
    validate,
)
from nopecache.proto.kv_codec import E4M3_MAX, decode_payload, encode_tensors, payload_layout

L, T, H, D = 2, 5, 3, 8
KEY, FP = b"k" * 16, b"fingerprint"


def known_kv(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V whose every (layer, head) has its own amplitude; K's head 1 of layer 1 is 0."""
    ramp = torch.linspace(-1.0, 1.0, T * D).view(T, D)
    k = torch.empty(L, T, H, D)
    v = torch.empty(L, T, H, D)
    for layer in range(L):
        for head in range(H):
            k[layer, :, head] = ramp * (head + 1) * 10 ** (layer - 1)
            v[layer, :, head] = ramp.flip(1) * (3 - head) * 0.5
    k[1, :, 1] = 0
    return k.to(dtype), v.to(dtype)


def blob(
    codec: str, k: torch.Tensor, v: torch.Tensor | None, form: StoredForm = StoredForm.NOPE
) -> bytes:
    return encode_block(
        key=KEY, fingerprint=FP, form=form, k=k, v=v, token_ids=range(k.shape[1]), codec=codec
    )


def expected_q(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's math spelled out: scale = amax / 448 per layer and head (1 for a zero
    head), and torch's own e4m3 cast of x / scale."""
    xf = x.float()
    scale = torch.ones(L, H)
    for layer in range(L):
        for head in range(H):
            amax = float(xf[layer, :, head].abs().max())
            if amax > 0:
                scale[layer, head] = amax / E4M3_MAX
    q = (xf / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q, scale


def payload_bytes(b: bytes) -> bytes:
    return bytes(parse(b)[1])


def test_fp8_payload_holds_torchs_own_e4m3_cast_and_the_per_head_scales() -> None:
    k, v = known_kv()
    kq, ks = expected_q(k)
    vq, vs = expected_q(v)
    want = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (kq, vq, ks, vs))
    assert payload_bytes(blob("fp8", k, v)) == want
    assert ks[1, 1] == 1.0  # an all-zero head keeps scale 1
    # The largest value of every head lands on e4m3's largest finite value exactly.
    assert float(kq.float().abs().amax(dim=(1, 3))[0, 0]) == E4M3_MAX


def test_fp8_decodes_to_q_times_scale_in_the_engine_dtype_within_e4m3_rounding() -> None:
    k, v = known_kv()
    block = decode_block(blob("fp8", k, v))
    assert block.k.dtype == torch.bfloat16 and block.v is not None
    for x, got in ((k, block.k), (v, block.v)):
        q, scale = expected_q(x)
        assert torch.equal(got, (q.float() * scale[:, None, :, None]).to(torch.bfloat16))
        # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative) for normals, 2^-10 x scale
        # absolute below them; then bf16's own rounding of the result (2^-8 relative).
        err = (got.float() - x.float()).abs()
        bound = torch.maximum(x.float().abs() * 2**-4, scale[:, None, :, None] * 2**-10)
        assert bool((err <= bound * (1 + 2**-7) + got.float().abs() * 2**-8).all())
    assert torch.equal(block.k[1, :, 1], torch.zeros(T, D, dtype=torch.bfloat16))


def test_k16v8_keeps_k_bit_exact_and_rounds_v_only() -> None:
    k, v = known_kv()
    block = decode_block(blob("k16v8", k, v))
    assert torch.equal(block.k, k)
    vq, vs = expected_q(v)
    assert block.v is not None
    assert torch.equal(block.v, (vq.float() * vs[:, None, :, None]).to(torch.bfloat16))
    want = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (k, vq, vs))
    assert payload_bytes(blob("k16v8", k, v)) == want


@pytest.mark.parametrize(
    ("codec", "nbytes"),
    [
        ("none", 2 * L * T * H * 2 * D),
        ("fp8", L * T * H * 2 * D + 2 * 4 * L * H),
        ("k16v8", 2 * L * T * H * D + L * T * H * D + 4 * L * H),
    ],
)
def test_payload_sizes_and_header_versions(codec: str, nbytes: int) -> None:
    k, v = known_kv()
    header = validate(blob(codec, k, v))
    assert header.payload_nbytes == nbytes
    assert header.codec == codec
    assert header.dtype == "bfloat16"  # the dtype the payload decodes to
    assert header.version == (FORMAT_VERSION if codec == "none" else CODEC_FORMAT_VERSION)
    assert payload_layout(codec, 2, (L, T, H, D), D).nbytes == nbytes


def test_raw_blocks_keep_their_version_1_bytes() -> None:
    k, v = known_kv()
    assert blob("none", k, v) == encode_block(
        key=KEY, fingerprint=FP, form=StoredForm.NOPE, k=k, v=v, token_ids=range(T)
    )
    assert b"codec" not in blob("none", k, v)


def test_fp8_mla_holds_k_and_its_scale_only() -> None:
    latent = torch.randn(L, T, 1, 12, dtype=torch.float16)
    block = decode_block(blob("fp8", latent, None, StoredForm.MLA))
    assert block.v is None and block.header.payload_nbytes == L * T * 12 + 4 * L
    assert float((block.k.float() - latent.float()).abs().max()) <= float(latent.abs().max()) / 16


@pytest.mark.parametrize(
    ("codec", "k_dtype", "form", "match"),
    [
        ("int4", torch.bfloat16, StoredForm.NOPE, "codec: 'int4' is not one of"),
        ("fp8", torch.float8_e4m3fn, StoredForm.NOPE, "needs a 2- or 4-byte dtype"),
        ("k16v8", torch.bfloat16, StoredForm.MLA, "k16v8 needs V"),
        ("fp8", torch.bfloat16, StoredForm.ENGINE_PAGE, "does not apply to ENGINE_PAGE"),
    ],
)
def test_a_codec_that_does_not_apply_is_refused_by_name(
    codec: str, k_dtype: torch.dtype, form: StoredForm, match: str
) -> None:
    heads = 1 if form == StoredForm.MLA else H
    k = torch.zeros(L, T, heads, D).to(k_dtype)
    v = None if form == StoredForm.MLA else torch.zeros(L, T, heads, D).to(k_dtype)
    with pytest.raises(BlockHeaderError, match=match):
        blob(codec, k, v, form)


def test_the_header_version_and_codec_must_agree() -> None:
    # One encoding per block: "none" is version 1 (no codec key), a codec is version 2.
    raw = validate(blob("none", *known_kv()))
    with pytest.raises(BlockHeaderError, match="codec 'none' is version 1, got 2"):
        replace(raw, version=CODEC_FORMAT_VERSION)
    compact = validate(blob("fp8", *known_kv()))
    with pytest.raises(BlockHeaderError, match="codec 'fp8' is version 2, got 1"):
        replace(compact, version=FORMAT_VERSION)
    # A compact header's payload size is the codec's: the raw size is refused.
    with pytest.raises(BlockHeaderError, match=r"\(codec fp8\) needs"):
        replace(compact, payload_nbytes=raw.payload_nbytes)


def test_a_flipped_byte_of_a_compact_payload_fails_the_servers_check() -> None:
    # The server checks compact blocks as any other: structure, sizes, xxh3 of the bytes.
    b = bytearray(blob("fp8", *known_kv()))
    b[-3] ^= 0x40  # inside v_scale
    with pytest.raises(BlockChecksumError):
        validate(bytes(b))


def test_encode_and_decode_parts_on_their_own() -> None:
    k, v = known_kv(torch.float32)
    given = k.clone()
    parts = encode_tensors("fp8", k, v)
    assert torch.equal(k, given)  # fp32 K is not scaled in place
    assert [p.dtype for p in parts] == [torch.float8_e4m3fn] * 2 + [torch.float32] * 2
    raw = torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])
    dk, dv = decode_payload("fp8", raw, torch.float32, (L, T, H, D), D)
    q, scale = expected_q(k)
    assert torch.equal(dk, q.float() * scale[:, None, :, None])
    assert dv is not None and dv.dtype == torch.float32


def test_a_compact_block_decodes_on_the_device_it_is_placed_on() -> None:
    # The fetch path passes the GPU it places on; "meta" stands in for it here: the
    # compact bytes go there and the arithmetic runs there, not on the host.
    block = decode_block(blob("fp8", *known_kv()), decode_on="meta")
    assert block.k.device.type == "meta" and block.v is not None
    assert block.v.device.type == "meta"
    assert block.k.dtype == torch.bfloat16 and tuple(block.k.shape) == (L, T, H, D)
