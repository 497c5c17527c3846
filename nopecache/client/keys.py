"""BlockKey: the 128-bit name of a block, and how it is derived from tokens.

A key is xxh3-128 over one canonical byte string (all integers little-endian):

    content key (position independent)      prefix key (exact prefix chain)
    +------------------------------+        +------------------------------+
    | b"nopecache.key\\0"  14 bytes |        | b"nopecache.key\\0"  14 bytes |
    | version u8 = 1               |        | version u8 = 1               |
    | kind    u8 = 1 (content)     |        | kind    u8 = 2 (prefix)      |
    | fingerprint digest  16 bytes |        | fingerprint digest  16 bytes |
    | namespace  u32 len + bytes   |        | namespace  u32 len + bytes   |
    |                              |        | has_parent u8 (0 or 1)       |
    |                              |        | parent key 16 bytes (if 1)   |
    | token count u32              |        | token count u32              |
    | token ids   u32 each         |        | token ids   u32 each         |
    +------------------------------+        +------------------------------+

A block whose KV depends on more than its tokens (an adapter, a cache salt, an image
behind placeholder tokens: ``identity.py``) is keyed under kind 4 (content) or 5
(prefix): the same bytes with ``InputIdentity.span_bytes`` of the block's span after the
token ids. A block with nothing beside its tokens keeps kind 1 or 2, so plain-text keys
do not change; a prefix chain past an identified block differs through its parent key.

A third kind (3, *engine page*) names a page an engine already keyed itself (SGLang's
chained page hash): the header, then the engine's hash as u32 length + bytes in place of
the token ids; its fingerprint names the engine's page layout.

The ``kind`` byte separates the domains, so a content key never equals a prefix key
of the same tokens. A prefix key chains its parent's key, exactly as prefix caches
(vLLM APC) chain block hashes: equal prefix keys imply equal tokens from position 0
(up to a 2**-128 collision, which the block's stored token ids then catch). The
namespace (tenant salt) is a str (hashed as UTF-8) or bytes; ``""`` is the default.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import xxhash

from nopecache.client.chunking import ChunkSpan, TokenArray, TokenIds, token_array
from nopecache.client.errors import InvalidArgumentError
from nopecache.client.fingerprint import ModelFingerprint
from nopecache.client.identity import InputIdentity

KEY_SIZE = 16
Namespace = str | bytes

_MAGIC = b"nopecache.key\x00"
_VERSION = 1
_KIND_CONTENT = 1
_KIND_PREFIX = 2
_KIND_ENGINE_PAGE = 3
_KIND_CONTENT_IDENTIFIED = 4
_KIND_PREFIX_IDENTIFIED = 5
_U32 = struct.Struct("<I")
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


@dataclass(frozen=True, slots=True, order=True)
class BlockKey:
    """A 16-byte block key; hashable, ordered, ``bytes(key)`` / ``key.hex()`` round trip."""

    value: bytes

    def __post_init__(self) -> None:
        if isinstance(self.value, bytearray | memoryview):
            object.__setattr__(self, "value", bytes(self.value))
        if not isinstance(self.value, bytes):
            raise InvalidArgumentError(
                "BlockKey.value", f"must be bytes, got {type(self.value).__name__}"
            )
        if len(self.value) != KEY_SIZE:
            raise InvalidArgumentError(
                "BlockKey.value", f"must be {KEY_SIZE} bytes, got {len(self.value)}"
            )

    def __bytes__(self) -> bytes:
        return self.value

    def __repr__(self) -> str:
        return f"BlockKey({self.value.hex()})"

    def hex(self) -> str:
        """32 lowercase hex digits."""
        return self.value.hex()

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        """Parse 32 hex digits (as printed by :meth:`hex`)."""
        if not isinstance(text, str) or len(text) != 2 * KEY_SIZE:
            raise InvalidArgumentError("text", f"must be {2 * KEY_SIZE} hex digits, got {text!r}")
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise InvalidArgumentError("text", f"is not hex: {text!r}") from None


@dataclass(frozen=True, slots=True)
class KeyedChunk:
    """A chunk of a prompt and its key: the unit of lookup, store and fetch."""

    span: ChunkSpan
    key: BlockKey


def _namespace_bytes(namespace: Namespace) -> bytes:
    if isinstance(namespace, str):
        return namespace.encode("utf-8")
    if isinstance(namespace, bytes):
        return namespace
    raise InvalidArgumentError("namespace", f"must be str or bytes, got {type(namespace).__name__}")


@lru_cache(maxsize=256)
def _header(fingerprint: ModelFingerprint, namespace: bytes, kind: int) -> bytes:
    # The bytes shared by every key of one (model, tenant, kind); cached because a long
    # prompt hashes thousands of chunks under the same header.
    return b"".join(
        (
            _MAGIC,
            bytes((_VERSION, kind)),
            fingerprint.digest(),
            _U32.pack(len(namespace)),
            namespace,
        )
    )


def _check_fingerprint(fingerprint: ModelFingerprint) -> None:
    if not isinstance(fingerprint, ModelFingerprint):
        raise InvalidArgumentError(
            "fingerprint", f"must be a ModelFingerprint, got {type(fingerprint).__name__}"
        )


def _digest(header: bytes, link: bytes, tokens: TokenArray, extra: bytes = b"") -> BlockKey:
    return BlockKey(
        xxhash.xxh3_128_digest(
            b"".join((header, link, _U32.pack(len(tokens)), tokens.tobytes(), extra))
        )
    )


class _Headers:
    """The plain and the identified header of one key kind, each built once."""

    def __init__(self, fingerprint: ModelFingerprint, namespace: Namespace, kinds: tuple[int, int]):
        ns = _namespace_bytes(namespace)
        self.plain = _header(fingerprint, ns, kinds[0])
        self.identified = _header(fingerprint, ns, kinds[1])

    def pick(self, identity: InputIdentity | None, span: ChunkSpan) -> tuple[bytes, bytes]:
        """The header and identity bytes of a block over ``span``."""
        extra = b"" if identity is None else identity.span_bytes(span.start, span.end)
        return (self.identified if extra else self.plain), extra


def _check_identity(identity: InputIdentity | None) -> None:
    if identity is not None and not isinstance(identity, InputIdentity):
        raise InvalidArgumentError(
            "identity", f"must be an InputIdentity or None, got {type(identity).__name__}"
        )


def _link(parent: BlockKey | None) -> bytes:
    if parent is None:
        return _NO_PARENT
    if not isinstance(parent, BlockKey):
        raise InvalidArgumentError(
            "parent", f"must be a BlockKey or None, got {type(parent).__name__}"
        )
    return _HAS_PARENT + parent.value


def _check_spans(spans: Sequence[ChunkSpan], num_tokens: int) -> None:
    for span in spans:
        if not isinstance(span, ChunkSpan):
            raise InvalidArgumentError("spans", f"must be ChunkSpans, got {type(span).__name__}")
        if span.end > num_tokens:
            raise InvalidArgumentError("spans", f"{span} ends past the {num_tokens} tokens given")


def content_key(fingerprint: ModelFingerprint, namespace: Namespace, tokens: TokenIds) -> BlockKey:
    """Position-independent key of one chunk: same tokens, same key, at any offset."""
    _check_fingerprint(fingerprint)
    arr = token_array(tokens)
    if arr.size == 0:
        raise InvalidArgumentError("tokens", "a chunk needs at least one token")
    header = _header(fingerprint, _namespace_bytes(namespace), _KIND_CONTENT)
    return _digest(header, b"", arr)


def prefix_key(
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    tokens: TokenIds,
    parent: BlockKey | None,
) -> BlockKey:
    """Exact-prefix key of one chunk: chains ``parent`` (None for the first chunk)."""
    _check_fingerprint(fingerprint)
    arr = token_array(tokens)
    if arr.size == 0:
        raise InvalidArgumentError("tokens", "a chunk needs at least one token")
    header = _header(fingerprint, _namespace_bytes(namespace), _KIND_PREFIX)
    return _digest(header, _link(parent), arr)


def content_chunks(
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    tokens: TokenIds,
    spans: Sequence[ChunkSpan],
    identity: InputIdentity | None = None,
) -> list[KeyedChunk]:
    """Content keys of every span of a prompt (spans from any chunker); ``identity``:
    what beside the tokens shapes the prompt's KV (each span keyed by its part of it)."""
    _check_fingerprint(fingerprint)
    _check_identity(identity)
    arr = token_array(tokens)
    _check_spans(spans, len(arr))
    headers = _Headers(fingerprint, namespace, (_KIND_CONTENT, _KIND_CONTENT_IDENTIFIED))
    out: list[KeyedChunk] = []
    for span in spans:
        header, extra = headers.pick(identity, span)
        out.append(KeyedChunk(span, _digest(header, b"", arr[span.start : span.end], extra)))
    return out


def prefix_chunks(
    fingerprint: ModelFingerprint,
    namespace: Namespace,
    tokens: TokenIds,
    spans: Sequence[ChunkSpan],
    identity: InputIdentity | None = None,
) -> list[KeyedChunk]:
    """The prefix-key chain over ``spans``, which must tile the prompt from position 0;
    ``identity`` as in :func:`content_chunks`."""
    _check_fingerprint(fingerprint)
    _check_identity(identity)
    arr = token_array(tokens)
    _check_spans(spans, len(arr))
    headers = _Headers(fingerprint, namespace, (_KIND_PREFIX, _KIND_PREFIX_IDENTIFIED))
    out: list[KeyedChunk] = []
    link, expected_start = _NO_PARENT, 0
    for span in spans:
        if span.start != expected_start:
            raise InvalidArgumentError(
                "spans",
                f"a prefix chain must be contiguous from 0; {span} follows "
                f"position {expected_start}",
            )
        header, extra = headers.pick(identity, span)
        key = _digest(header, link, arr[span.start : span.end], extra)
        out.append(KeyedChunk(span, key))
        link, expected_start = _HAS_PARENT + key.value, span.end
    return out


def engine_page_key(
    fingerprint: ModelFingerprint, namespace: Namespace, page_hash: str | bytes
) -> BlockKey:
    """Key of an engine page the engine hashed itself (its chained page hash, exact prefix)."""
    _check_fingerprint(fingerprint)
    raw = page_hash.encode("utf-8") if isinstance(page_hash, str) else page_hash
    if not isinstance(raw, bytes) or not raw:
        raise InvalidArgumentError(
            "page_hash", f"must be a non-empty str or bytes, got {page_hash!r}"
        )
    header = _header(fingerprint, _namespace_bytes(namespace), _KIND_ENGINE_PAGE)
    return BlockKey(xxhash.xxh3_128_digest(b"".join((header, _U32.pack(len(raw)), raw))))
