"""vLLM-compatible block hashes equal vectors produced by vLLM 0.33.0's own hashing code.

The vectors in tests/client/data/vllm_block_hashes.json were derived by running
vllm/utils/hashing.py (sha256_cbor) and the functions hash_block_tokens / init_none_hash /
resolve_none_hash_seed cut unchanged out of vllm/v1/core/kv_cache_utils.py, from the
vLLM 0.33.0 wheel; the file records the procedure.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nopecache.client.errors import InvalidArgumentError
from nopecache.client.vllm_hash import (
    DEFAULT_NONE_HASH_SEED,
    VLLM_VERSION,
    ExtraKeys,
    sha256_cbor,
    vllm_block_hashes,
    vllm_extra_keys,
    vllm_int_block_hash,
    vllm_none_hash,
)

DATA = json.loads((Path(__file__).parent / "data" / "vllm_block_hashes.json").read_text())
CASES: list[dict[str, Any]] = DATA["cases"]


def _extra_keys(raw: list[list[list[object]] | None] | None) -> list[ExtraKeys | None] | None:
    """Turn the JSON lists back into vLLM's per-block tuples of tuples."""
    if raw is None:
        return None
    return [None if block is None else tuple(tuple(key) for key in block) for block in raw]


def test_vectors_come_from_the_matched_vllm_version() -> None:
    assert VLLM_VERSION == "0.33.0"
    assert DATA["source"].startswith("vLLM 0.33.0 ")
    assert DATA["default_none_hash_seed"] == DEFAULT_NONE_HASH_SEED == "vllm-none-hash"


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_block_hashes_equal_vllm_vectors(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    if case["pythonhashseed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", case["pythonhashseed"])
    assert vllm_none_hash().hex() == case["none_hash"]
    hashes = vllm_block_hashes(
        case["tokens"], block_size=case["block_size"], extra_keys=_extra_keys(case["extra_keys"])
    )
    assert [h.hex() for h in hashes] == case["block_hashes"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_explicit_seed_ignores_environment(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "not-the-seed")
    seed = vllm_none_hash(case["pythonhashseed"] or DEFAULT_NONE_HASH_SEED)
    assert seed.hex() == case["none_hash"]
    hashes = vllm_block_hashes(
        case["tokens"],
        block_size=case["block_size"],
        seed=seed,
        extra_keys=_extra_keys(case["extra_keys"]),
    )
    assert [h.hex() for h in hashes] == case["block_hashes"]


def test_first_block_hashes_these_exact_cbor_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    none_hash = vllm_none_hash()
    # Written out by hand from RFC 8949 so the test does not trust cbor2 alone:
    # array(3), bytes(32) NONE_HASH, array(16) of ints 0..15 (one byte each), null.
    expected = bytes([0x83, 0x58, 0x20]) + none_hash + bytes([0x90, *range(16), 0xF6])
    assert expected.hex() == DATA["first_block_cbor_hex"]
    assert cbor2.dumps((none_hash, tuple(range(16)), None), canonical=True) == expected
    # NONE_HASH itself is sha256 of the CBOR text string "vllm-none-hash" (0x6e = text(14)).
    assert none_hash == hashlib.sha256(b"\x6evllm-none-hash").digest()
    first = vllm_block_hashes(list(range(16)))[0]
    assert (
        first
        == hashlib.sha256(expected).digest()
        == sha256_cbor((none_hash, tuple(range(16)), None))
    )


def test_extra_keys_helper_matches_vllm_tagging() -> None:
    by_name = {c["name"]: c for c in CASES}
    assert vllm_extra_keys(3, cache_salt="tenant-a") == _extra_keys(
        by_name["cache_salt_first_block"]["extra_keys"]
    )
    assert vllm_extra_keys(2, lora=("sql-adapter", "/adapters/sql")) == _extra_keys(
        by_name["lora_every_block"]["extra_keys"]
    )
    assert vllm_extra_keys(2, cache_salt="s", lora=("a", "/p")) == [
        (("lora", "a", "/p"), ("cache_salt", "s")),
        (("lora", "a", "/p"),),
    ]
    # vLLM treats an empty salt as absent.
    assert vllm_extra_keys(2, cache_salt="") == [None, None]
    assert vllm_extra_keys(0, cache_salt="s") == []


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=200_000), min_size=0, max_size=80),
    flip=st.integers(min_value=0, max_value=79),
)
def test_chain_prefix_and_locality(tokens: list[int], flip: int) -> None:
    """A block's hash depends on its tokens and every block before it, never after."""
    seed = vllm_none_hash(DEFAULT_NONE_HASH_SEED)
    hashes = vllm_block_hashes(tokens, seed=seed)
    assert len(hashes) == len(tokens) // 16
    for k in range(len(hashes) + 1):
        assert vllm_block_hashes(tokens[: k * 16], seed=seed) == hashes[:k]
    if flip < len(tokens):
        changed = list(tokens)
        changed[flip] += 1
        other = vllm_block_hashes(changed, seed=seed)
        block = flip // 16
        assert other[:block] == hashes[:block]
        assert all(a != b for a, b in zip(other[block:], hashes[block:], strict=True))


def test_numpy_token_ids_hash_like_ints() -> None:
    case = CASES[1]
    seed = vllm_none_hash(DEFAULT_NONE_HASH_SEED)
    for dtype in (np.uint32, np.int64):
        arr = np.asarray(case["tokens"], dtype=dtype)
        assert [h.hex() for h in vllm_block_hashes(arr, seed=seed)] == case["block_hashes"]


def test_seed_changes_every_block() -> None:
    tokens = list(range(48))
    a = vllm_block_hashes(tokens, seed=vllm_none_hash("0"))
    b = vllm_block_hashes(tokens, seed=vllm_none_hash("1"))
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_int_block_hash_keeps_low_64_bits() -> None:
    h = bytes(range(32))
    assert vllm_int_block_hash(h) == int.from_bytes(bytes(range(24, 32)), "big")
    assert vllm_int_block_hash(b"\x01") == 1


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"tokens": [1] * 16, "block_size": 0}, "block_size"),
        ({"tokens": [1] * 16, "block_size": True}, "block_size"),
        ({"tokens": [1] * 16, "seed": b"short"}, "seed"),
        ({"tokens": [1] * 16, "seed": "0" * 32}, "seed"),
        ({"tokens": [1, -2] + [0] * 14}, "tokens[1]"),
        ({"tokens": [True] + [0] * 15}, "tokens[0]"),
        ({"tokens": [1.0] + [0] * 15}, "tokens[0]"),
        ({"tokens": [1] * 32, "extra_keys": [None]}, "extra_keys"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], argument: str) -> None:
    tokens = kwargs.pop("tokens")
    with pytest.raises(InvalidArgumentError) as err:
        vllm_block_hashes(tokens, **kwargs)
    assert err.value.argument == argument
    assert str(err.value).startswith(f"{argument}: ")


def test_bad_helper_arguments_are_named() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^num_blocks: "):
        vllm_extra_keys(-1)
    with pytest.raises(InvalidArgumentError, match=r"^lora: "):
        vllm_extra_keys(1, lora=("name", ""))
    with pytest.raises(InvalidArgumentError, match=r"^cache_salt: "):
        vllm_extra_keys(1, cache_salt=b"s")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"^seed: "):
        vllm_none_hash(b"0")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"^block_hash: "):
        vllm_int_block_hash(b"")
