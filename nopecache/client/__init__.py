"""nopecache client: the SDK engines embed (store, lookup, fetch), keys, chunking, plans."""

from nopecache.client.cache_client import (
    DEFAULT_CHUNKER,
    DEFAULT_PREFIX_BLOCK_TOKENS,
    AsyncCacheClient,
    AsyncPrefetch,
    KForm,
    PreparedStore,
    StoreReport,
)
from nopecache.client.chunking import (
    Chunker,
    ChunkSpan,
    ContentChunker,
    FixedChunker,
    SegmentChunker,
    TokenIds,
    token_array,
)
from nopecache.client.config import ClientConfig, RetryPolicy
from nopecache.client.errors import (
    FingerprintMismatchError,
    InvalidArgumentError,
    NopecacheError,
)
from nopecache.client.fetching import FetchResult
from nopecache.client.fingerprint import SUPPORTED_DTYPES, ModelFingerprint, dtype_name
from nopecache.client.identity import InputFeature, InputIdentity
from nopecache.client.keys import (
    BlockKey,
    KeyedChunk,
    Namespace,
    content_chunks,
    content_key,
    prefix_chunks,
    prefix_key,
)
from nopecache.client.placement import PagedKV
from nopecache.client.plan import Hit, HitFilter, HitKind, LookupAnswer, ReusePlan, plan_reuse
from nopecache.client.sync_client import CacheClient, Prefetch

__all__ = [
    "DEFAULT_CHUNKER",
    "DEFAULT_PREFIX_BLOCK_TOKENS",
    "SUPPORTED_DTYPES",
    "AsyncCacheClient",
    "AsyncPrefetch",
    "BlockKey",
    "CacheClient",
    "ChunkSpan",
    "Chunker",
    "ClientConfig",
    "ContentChunker",
    "FetchResult",
    "FingerprintMismatchError",
    "FixedChunker",
    "Hit",
    "HitFilter",
    "HitKind",
    "InputFeature",
    "InputIdentity",
    "InvalidArgumentError",
    "KForm",
    "KeyedChunk",
    "LookupAnswer",
    "ModelFingerprint",
    "Namespace",
    "NopecacheError",
    "PagedKV",
    "Prefetch",
    "PreparedStore",
    "RetryPolicy",
    "ReusePlan",
    "SegmentChunker",
    "StoreReport",
    "TokenIds",
    "content_chunks",
    "content_key",
    "dtype_name",
    "plan_reuse",
    "prefix_chunks",
    "prefix_key",
    "token_array",
]
