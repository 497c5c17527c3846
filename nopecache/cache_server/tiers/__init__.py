"""Storage tiers (GPU memory, host memory, local disk, Redis) and the URL factory that builds them.

=====================================================  ==================================
URL                                                    tier
=====================================================  ==================================
``cuda://0?capacity=8GiB[&page=64KiB]``                :class:`~.cuda.CudaTier`
``cpu://?capacity=8GiB[&page=64KiB][&pinned=no]``      :class:`~.cpu.CpuTier`
``file:///dir?capacity=64GiB[&page=256KiB]``            :class:`~.disk.DiskTier` (kept on restart)
``redis://[:password@]host:port/db?ttl=&timeout=``     :class:`~.redis.RedisTier`
``rediss://...`` (TLS, redis-py's ``ssl_*`` options)   :class:`~.redis.RedisTier`
``redis+cluster://host:port,host:port?...``            :class:`~.redis.RedisTier` (Cluster)
=====================================================  ==================================

Sizes accept ``8GiB``, ``512MiB``, ``10MB`` or plain bytes (:mod:`..sizes`).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from nopecache.cache_server.tiers.base import (
    Evicted,
    PutResult,
    PutStatus,
    Tier,
    TierClosedError,
    TierConfigError,
    TierError,
    TierName,
    TierStats,
    redact_url,
)

__all__ = [
    "Evicted",
    "PutResult",
    "PutStatus",
    "Tier",
    "TierClosedError",
    "TierConfigError",
    "TierError",
    "TierName",
    "TierStats",
    "redact_url",
    "tier_from_url",
]


def tier_from_url(url: str, *, max_blob_bytes: int | None = None) -> Tier:
    """Build the tier a URL names (see the table in this module's docstring).

    ``max_blob_bytes`` bounds what a tier that others can write (Redis) decompresses per
    value; the memory tiers only ever hold blobs this process checked.
    """
    if not isinstance(url, str) or not url:
        raise TierConfigError(f"tier url: expected a non-empty string, got {url!r}")
    scheme = urlsplit(url).scheme
    # Each tier module is imported on demand: redis-py and torch load only when used.
    if scheme == "cpu":
        from nopecache.cache_server.tiers.cpu import CpuTier

        return CpuTier.from_url(url)
    if scheme == "cuda":
        from nopecache.cache_server.tiers.cuda import CudaTier

        return CudaTier.from_url(url)
    if scheme == "file":
        from nopecache.cache_server.tiers.disk import DiskTier

        return DiskTier.from_url(url)
    if scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        from nopecache.cache_server.tiers.redis import RedisTier

        return RedisTier.from_url(url, max_blob_bytes=max_blob_bytes)
    raise TierConfigError(
        f"{redact_url(url)}: unknown tier scheme {scheme!r} "
        "(use cpu://, cuda://, file://, redis://, rediss://, redis+cluster://)"
    )
