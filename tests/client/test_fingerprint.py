"""ModelFingerprint: canonical bytes, a stable digest, and strict validation."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from nopecache.client import SUPPORTED_DTYPES, InvalidArgumentError, ModelFingerprint, dtype_name
from nopecache.kernels import RopeSpec
from nopecache.proto.block import StoredForm

# An explicit RoPE digest keeps these vectors independent of RopeSpec's own encoding.
FP = ModelFingerprint(
    model="HuggingFaceTB/SmolLM2-135M",
    revision="main",
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
    dtype="bfloat16",
    form=StoredForm.NOPE,
    rope_digest=bytes(range(16)),
)


def test_to_bytes_follows_the_documented_layout() -> None:
    def blob(b: bytes) -> bytes:
        return len(b).to_bytes(4, "little") + b

    expected = (
        b"NCFP"
        + bytes([1, 0])  # version, form
        + (30).to_bytes(4, "little")
        + (3).to_bytes(4, "little")
        + (64).to_bytes(4, "little")
        + blob(b"bfloat16")
        + blob(b"HuggingFaceTB/SmolLM2-135M")
        + blob(b"main")
        + blob(bytes(range(16)))
    )
    assert FP.to_bytes() == expected
    assert FP.digest() == xxhash.xxh3_128_digest(expected)


def test_digest_is_pinned() -> None:
    # Checked in: a change here orphans every stored block, so it must be deliberate.
    assert FP.digest().hex() == "18886a6bd57a879d9cf37e305064824d"


def fingerprints() -> st.SearchStrategy[ModelFingerprint]:
    text = st.text(max_size=40)
    count = st.integers(1, 2**32 - 1)
    return st.builds(
        ModelFingerprint,
        model=text.filter(bool),
        revision=text,
        num_layers=count,
        num_kv_heads=count,
        head_dim=count,
        dtype=st.sampled_from(sorted(SUPPORTED_DTYPES)),
        form=st.sampled_from(list(StoredForm)),
        rope_digest=st.binary(min_size=16, max_size=16),
        quantization=st.text(max_size=12),
        config_digest=st.sampled_from([b"", bytes(range(16))]),
        weights_digest=st.sampled_from([b"", bytes(range(3, 19))]),
        rope_max_len=st.sampled_from([0, 1, 4096, 2**32 - 1]),
    )


@given(fp=fingerprints(), group=st.booleans())
def test_bytes_round_trip(fp: ModelFingerprint, group: bool) -> None:
    if group and fp.num_kv_heads > 1:
        fp = fp.head_group(1, fp.num_kv_heads - 1)
    assert ModelFingerprint.from_bytes(fp.to_bytes()) == fp
    assert pickle.loads(pickle.dumps(fp)) == fp
    assert len(fp.digest()) == 16
    assert fp.to_bytes()[4] == 1 + fp.is_head_group + 2 * fp.has_source


@pytest.mark.parametrize(
    "change",
    [
        {"model": "HuggingFaceTB/SmolLM2-360M"},
        {"revision": "v2"},
        {"num_layers": 31},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"dtype": "float16"},
        {"form": StoredForm.ROPE},
        {"form": StoredForm.MLA},
        {"rope_digest": bytes(range(1, 17))},
        {"quantization": "fp8"},
        {"config_digest": bytes(range(16))},
        {"weights_digest": bytes(range(16))},
        {"rope_max_len": 8192},
    ],
)
def test_every_field_changes_the_digest(change: dict[str, object]) -> None:
    other = dataclasses.replace(FP, **change)  # type: ignore[arg-type]
    assert other != FP
    assert other.digest() != FP.digest()
    assert other.to_bytes() != FP.to_bytes()


def test_field_boundaries_cannot_be_shifted_between_strings() -> None:
    # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    a = dataclasses.replace(FP, model="ab", revision="c")
    b = dataclasses.replace(FP, model="a", revision="bc")
    assert a.digest() != b.digest()


def test_from_rope_spec_takes_head_dim_and_digest_from_the_spec() -> None:
    rope = RopeSpec.default(64, theta=100000.0)
    fp = ModelFingerprint.from_rope_spec(
        model="m",
        revision="r",
        num_layers=2,
        num_kv_heads=1,
        dtype=torch.bfloat16,
        form=StoredForm.NOPE,
        rope=rope,
    )
    assert fp.head_dim == 64
    assert fp.dtype == "bfloat16"
    assert fp.torch_dtype is torch.bfloat16
    assert fp.rope_digest == rope.digest()
    other = dataclasses.replace(fp, rope_digest=RopeSpec.default(64, theta=10000.0).digest())
    assert other.digest() != fp.digest()


def test_form_is_coerced_to_stored_form() -> None:
    fp = dataclasses.replace(FP, form=1)  # type: ignore[arg-type]
    assert fp.form is StoredForm.ROPE


def test_dtype_name_canonicalises_torch_dtypes() -> None:
    assert dtype_name(torch.float16) == "float16"
    assert dtype_name("float8_e4m3fn") == "float8_e4m3fn"
    with pytest.raises(InvalidArgumentError, match=r"^dtype: 'int8' is not a supported"):
        dtype_name(torch.int8)


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"revision": None}, "revision"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 2**32}, "head_dim"),
        ({"head_dim": 64.0}, "head_dim"),
        ({"num_layers": True}, "num_layers"),
        ({"dtype": "fp16"}, "dtype"),
        ({"dtype": torch.float16}, "dtype"),
        ({"form": 9}, "form"),
        ({"rope_digest": b"short"}, "rope_digest"),
        ({"rope_digest": "0" * 16}, "rope_digest"),
        ({"quantization": None}, "quantization"),
        ({"config_digest": b"short"}, "config_digest"),
        ({"config_digest": "0" * 16}, "config_digest"),
        ({"weights_digest": bytes(17)}, "weights_digest"),
        ({"rope_max_len": -1}, "rope_max_len"),
        ({"rope_max_len": 2**32}, "rope_max_len"),
        ({"rope_max_len": True}, "rope_max_len"),
    ],
)
def test_bad_fields_raise_naming_the_field(change: dict[str, object], argument: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"^{argument}: ") as err:
        dataclasses.replace(FP, **change)  # type: ignore[arg-type]
    assert err.value.argument == argument
    assert isinstance(err.value, ValueError)


def test_invalid_argument_error_survives_pickling() -> None:
    err = InvalidArgumentError("num_layers", "must be positive")
    back = pickle.loads(pickle.dumps(err))
    assert (back.argument, back.reason, str(back)) == (
        "num_layers",
        "must be positive",
        "num_layers: must be positive",
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"NCF", "shorter than the header"),
        (b"XXXX" + FP.to_bytes()[4:], "bad magic"),
        (FP.to_bytes()[:4] + b"\x09" + FP.to_bytes()[5:], "unknown fingerprint encoding v9"),
        (FP.to_bytes()[:4] + b"\x05" + FP.to_bytes()[5:], "truncated before the codec"),
        # A version-3 header over version-1 bytes: the source fields are missing.
        (FP.to_bytes()[:4] + b"\x03" + FP.to_bytes()[5:], "truncated before the quantization"),
        (FP.to_bytes()[:-3], "truncated inside rope_digest"),
        (FP.to_bytes()[:24], "truncated inside dtype"),
        (FP.to_bytes()[:32], "truncated before the model length"),
        (FP.to_bytes() + b"\x00", "1 trailing bytes"),
        (FP.to_bytes()[:5] + b"\x07" + FP.to_bytes()[6:], "^form: "),
    ],
)
def test_from_bytes_rejects_malformed_input(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ModelFingerprint.from_bytes(data)


# The model source of an engine (quantization, config, weights, RoPE length): version 3.
SOURCED = dataclasses.replace(
    FP,
    quantization="fp8",
    config_digest=bytes(range(16, 32)),
    weights_digest=bytes(range(32, 48)),
    rope_max_len=4096,
)


def test_a_model_source_follows_the_documented_layout() -> None:
    def blob(b: bytes) -> bytes:
        return len(b).to_bytes(4, "little") + b

    tail = blob(b"fp8") + blob(bytes(range(16, 32))) + blob(bytes(range(32, 48)))
    tail += (4096).to_bytes(4, "little")
    assert SOURCED.to_bytes() == b"NCFP" + bytes([3]) + FP.to_bytes()[5:] + tail
    assert SOURCED.digest().hex() == xxhash.xxh3_128_hexdigest(SOURCED.to_bytes())
    # Checked in, like FP's: a change orphans every block an engine stored.
    assert SOURCED.digest().hex() == "809b131c41119ab479519ef0f050cec2"


def test_a_head_group_of_a_sourced_fingerprint_is_version_4() -> None:
    group = SOURCED.head_group(1, 2)
    data = group.to_bytes()
    assert data[4] == 4
    assert (
        data[:4] + bytes([3]) + data[5:-8]
        == dataclasses.replace(SOURCED, num_kv_heads=2).to_bytes()
    )
    assert data[-8:] == (1).to_bytes(4, "little") + (3).to_bytes(4, "little")
    assert ModelFingerprint.from_bytes(data) == group


def test_an_empty_source_keeps_the_version_1_bytes() -> None:
    empty = dataclasses.replace(SOURCED, quantization="", config_digest=b"", weights_digest=b"")
    assert empty.has_source and empty.to_bytes()[4] == 3  # rope_max_len alone is a source
    none = dataclasses.replace(empty, rope_max_len=0)
    assert not none.has_source and none.to_bytes() == FP.to_bytes()


def test_from_bytes_refuses_a_second_encoding_of_an_empty_source() -> None:
    data = b"NCFP" + bytes([3]) + FP.to_bytes()[5:] + bytes(4) * 4
    with pytest.raises(InvalidArgumentError, match="a version-3 fingerprint with no source"):
        ModelFingerprint.from_bytes(data)
