"""nopecache client: keys, chunking and reuse plans (the SDK engines embed)."""

from nopecache.client.chunking import (
    Chunker,
    ChunkSpan,
    ContentChunker,
    FixedChunker,
    SegmentChunker,
    TokenIds,
    token_array,
)
from nopecache.client.errors import (
    FingerprintMismatchError,
    InvalidArgumentError,
    NopecacheError,
)
from nopecache.client.fingerprint import SUPPORTED_DTYPES, ModelFingerprint, dtype_name
from nopecache.client.keys import (
    BlockKey,
    KeyedChunk,
    Namespace,
    content_chunks,
    content_key,
    prefix_chunks,
    prefix_key,
)
from nopecache.client.plan import Hit, HitFilter, HitKind, LookupAnswer, ReusePlan, plan_reuse

__all__ = [
    "SUPPORTED_DTYPES",
    "BlockKey",
    "ChunkSpan",
    "Chunker",
    "ContentChunker",
    "FingerprintMismatchError",
    "FixedChunker",
    "Hit",
    "HitFilter",
    "HitKind",
    "InvalidArgumentError",
    "KeyedChunk",
    "LookupAnswer",
    "ModelFingerprint",
    "Namespace",
    "NopecacheError",
    "ReusePlan",
    "SegmentChunker",
    "TokenIds",
    "content_chunks",
    "content_key",
    "dtype_name",
    "plan_reuse",
    "prefix_chunks",
    "prefix_key",
    "token_array",
]
