"""vLLM-compatible prefix-cache block hashes (``sha256_cbor``), for KV-aware routers.

nopecache's own keys (``nopecache.client.keys``) are 128-bit digests that also cover the
model fingerprint and tenant. Routers such as llm-d or Dynamo instead index the block
hashes that vLLM publishes in its KV events; this module computes exactly those bytes
from token ids so that a router, or nopecache itself, can talk about the same blocks.

Matched version: vLLM 0.33.0 (wheel ``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64``,
commit g4ba787ec9), files

- ``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``init_none_hash``,
  ``resolve_none_hash_seed``, ``get_request_block_hasher``, ``generate_block_hash_extra_keys``
- ``vllm/utils/hashing.py``: ``sha256_cbor``

What vLLM hashes, per full block of ``block_size`` tokens (a trailing partial block gets
no hash)::

    block_hash[i] = sha256( cbor2.dumps((parent, tuple(tokens_i), extra_keys_i),
                                        canonical=True) )
    parent        = block_hash[i - 1], or NONE_HASH for i == 0

The CBOR item is a 3-element array: a 32-byte byte string, an array of unsigned ints
(each in its shortest form), and ``null`` or an array of tagged tuples. For a text-only
request ``extra_keys_i`` is ``None`` unless the request carries a LoRA adapter
(``("lora", name, path)`` on every block) or a ``cache_salt`` (``("cache_salt", salt)``
on block 0 only); see :func:`vllm_extra_keys`.

NONE_HASH, the seed of every chain, is ``sha256_cbor(seed_string)``. vLLM 0.33.0 takes
``seed_string`` from the ``PYTHONHASHSEED`` environment variable when it is set and
otherwise uses the fixed string ``"vllm-none-hash"`` for cryptographic hashes, so two
vLLM processes agree without configuration.

Older releases, checked against vLLM 0.11.0's source: the hashed tuple and the CBOR bytes
are the same and NONE_HASH is ``sha256_cbor(PYTHONHASHSEED)`` when that variable is set,
but it is random per process when unset (run such servers with ``PYTHONHASHSEED`` and pass
the value to :func:`vllm_none_hash`), and their extra keys are untagged (the bare LoRA
name, the bare salt), so only requests without LoRA and salt match there.
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections.abc import Iterable, Sequence
from typing import NewType, SupportsIndex

import cbor2

from nopecache.client.errors import InvalidArgumentError

VLLM_VERSION = "0.33.0"
"""The vLLM release whose hashing this module reproduces byte for byte."""

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's seed string for NONE_HASH when ``PYTHONHASHSEED`` is unset (sha256 hashes)."""

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default KV block size in tokens."""

SHA256_BYTES = 32

VllmBlockHash = NewType("VllmBlockHash", bytes)
"""A 32-byte vLLM block hash (sha256 of the CBOR-encoded block tuple)."""

ExtraKeys = tuple[object, ...]
"""One block's extra keys: a tuple of tagged tuples such as ``("lora", name, path)``."""


def sha256_cbor(obj: object) -> bytes:
    """Return sha256 over the canonical CBOR encoding of ``obj`` (vLLM's ``sha256_cbor``)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def vllm_none_hash(seed: str | None = None) -> VllmBlockHash:
    """Return vLLM's NONE_HASH (the parent hash of every chain's first block).

    ``seed`` is the seed string; None resolves it as vLLM 0.33.0 does: the value of
    ``PYTHONHASHSEED`` in this process's environment if set, else
    :data:`DEFAULT_NONE_HASH_SEED`. Pass it explicitly when this process does not share
    the vLLM server's environment.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    elif not isinstance(seed, str):
        raise InvalidArgumentError(
            "seed", f"must be a str (the PYTHONHASHSEED value), got {type(seed).__name__}"
        )
    return VllmBlockHash(sha256_cbor(seed))


def vllm_extra_keys(
    num_blocks: int,
    *,
    cache_salt: str | None = None,
    lora: tuple[str, str] | None = None,
) -> list[ExtraKeys | None]:
    """Return the per-block extra keys vLLM derives for a text-only request.

    ``lora`` is ``(lora_name, lora_path)``. Mirrors ``generate_block_hash_extra_keys``:
    LoRA keys first, then the cache salt on block 0 only; a block with neither gets None.
    Multimodal and prompt-embedding keys are out of scope (token ids only).
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise InvalidArgumentError("num_blocks", f"must be an int >= 0, got {num_blocks!r}")
    if lora is not None and (
        len(lora) != 2 or not all(isinstance(part, str) and part for part in lora)
    ):
        raise InvalidArgumentError(
            "lora", f"must be (lora_name, lora_path), non-empty strings, got {lora!r}"
        )
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidArgumentError("cache_salt", f"must be a str, got {type(cache_salt).__name__}")
    lora_keys: list[object] = [("lora", lora[0], lora[1])] if lora is not None else []
    out: list[ExtraKeys | None] = []
    for block in range(num_blocks):
        # vLLM treats an empty salt as no salt (`if ... and request.cache_salt`).
        salt_keys: list[object] = [("cache_salt", cache_salt)] if block == 0 and cache_salt else []
        keys = lora_keys + salt_keys
        out.append(tuple(keys) if keys else None)
    return out


def _token_ids(tokens: Iterable[SupportsIndex]) -> tuple[int, ...]:
    """Token ids as plain Python ints (numpy integers accepted), validated."""
    out: list[int] = []
    for i, tok in enumerate(tokens):
        # bool is an int subclass but CBOR encodes it as true/false: a silent mismatch.
        if isinstance(tok, bool) or not isinstance(tok, SupportsIndex) or operator.index(tok) < 0:
            raise InvalidArgumentError(
                f"tokens[{i}]", f"must be a non-negative int token id, got {tok!r}"
            )
        out.append(operator.index(tok))
    return tuple(out)


def vllm_block_hashes(
    tokens: Iterable[SupportsIndex],
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: bytes | None = None,
    extra_keys: Sequence[ExtraKeys | None] | None = None,
) -> list[VllmBlockHash]:
    """Return vLLM's chained block hashes for the full blocks of ``tokens``.

    ``seed`` is the 32-byte NONE_HASH that parents block 0 (None: :func:`vllm_none_hash`
    resolved from the environment, as vLLM does). ``extra_keys`` holds one entry per full
    block (see :func:`vllm_extra_keys`), or None when the request has none.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError("block_size", f"must be a positive int, got {block_size!r}")
    if seed is None:
        seed = vllm_none_hash()
    elif not isinstance(seed, bytes) or len(seed) != SHA256_BYTES:
        raise InvalidArgumentError(
            "seed", f"must be the {SHA256_BYTES}-byte NONE_HASH (see vllm_none_hash), got {seed!r}"
        )
    ids = _token_ids(tokens)
    num_full = len(ids) // block_size
    if extra_keys is not None and len(extra_keys) != num_full:
        raise InvalidArgumentError(
            "extra_keys",
            f"must have one entry per full block ({num_full}), got {len(extra_keys)}",
        )
    hashes: list[VllmBlockHash] = []
    parent = seed
    for block in range(num_full):
        block_tokens = ids[block * block_size : (block + 1) * block_size]
        block_extra = extra_keys[block] if extra_keys is not None else None
        parent = sha256_cbor((parent, block_tokens, block_extra))
        hashes.append(VllmBlockHash(parent))
    return hashes


def vllm_int_block_hash(block_hash: bytes) -> int:
    """Return the 64-bit int form vLLM publishes in KV events with int block hashes on.

    vLLM's ``maybe_convert_block_hash`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) keeps the
    low 64 bits of the big-endian integer value of the hash.
    """
    if not isinstance(block_hash, bytes) or not block_hash:
        raise InvalidArgumentError("block_hash", f"must be non-empty bytes, got {block_hash!r}")
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)
