"""Redis tier: lz4-compressed blocks in Redis or Redis Cluster, degrading to misses when down.

URL forms (every query option redis-py's ``from_url`` documents is accepted as well)::

    redis://[[user]:password@]host:port/db?ttl=3600&timeout=0.25&capacity=64GiB&prefix=nc:
    rediss://...                     TLS; ssl_ca_certs=..., ssl_certfile=..., ssl_cert_reqs=...
    redis+cluster://host:port,host:port[,...]?...    (rediss+cluster:// for TLS)

Stored value, one ``SET key value NX [EX ttl]`` per block::

    key   = prefix + block key                     e.g. b"nc:" + 16 bytes
    value = lz4 frame (magic 04 22 4D 18, content checksum on) of the whole blob
            (the blob is the block: its header and payload, opaque here)

One command per block means a reader sees the whole block or none of it: Redis applies
SET atomically, and there is no second key (header) that could be missing or stale.
The lz4 content checksum turns a value damaged in Redis into a detected miss; such a
value (and an empty one, or one that is not an lz4 frame) is deleted and never returned.
Decompression is bounded by ``max_blob_bytes`` (the server passes its ``max_block_bytes``):
a frame that would expand past it (a compression bomb written into Redis) is refused
without being expanded, and deleted. The blob itself is checked by the store
(``TieredStore(verify=...)``), since this tier is not ``trusted``.

Capacity: Redis evicts by itself. Run it with ``maxmemory`` and ``maxmemory-policy
allkeys-lru`` (each cluster node), so it drops the coldest blocks when full; this tier
never evicts and ``put`` never returns evicted entries. ``capacity=`` only sets the
number reported in stats (default: the server's ``maxmemory``, None if unlimited).

Failures: socket timeouts are short (``timeout=``, seconds, default 0.25), redis-py
retries once at once (``Retry(NoBackoff(), 1)``: a pooled connection that died with a
restarted server is replaced), and any connection-level error opens a circuit breaker:
the tier turns unhealthy and, until the delay the ``backoff`` object computes for the
number of consecutive failures has passed, every operation returns its miss/no-op value
without touching the network. The next operation after that delay is the probe; its
success closes the breaker. No task sleeps and nothing loops; ``stats()`` also probes,
so a periodic health check notices recovery without traffic.

Concurrency: redis.asyncio pools connections, so many coroutines may run commands at
once; the breaker's fields change only between awaits (no lock needed). lz4 work on
values of at least 128 KiB runs in a worker thread (``asyncio.to_thread``; lz4 releases
the GIL) so the event loop keeps serving while a large block is (de)compressed.

``timeout`` bounds each reply read, so it must cover moving the largest block over the
link to Redis (8 MiB at 1 Gbit/s is ~70 ms: the default leaves headroom on a LAN; raise
it for slower links rather than letting large blocks turn into timeouts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import urlencode, urlsplit

import lz4.frame
from redis import exceptions as rex
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff, ExponentialBackoff, NoBackoff

from nopecache.cache_server.sizes import SizeError, parse_size
from nopecache.cache_server.tiers.base import (
    BlobLike,
    KeepSet,
    PutResult,
    PutStatus,
    Tier,
    TierClosedError,
    TierConfigError,
    TierName,
    TierStats,
    query_options,
    redact_url,
)

__all__ = ["DEFAULT_TIMEOUT_S", "LZ4_FRAME_MAGIC", "MAX_VALUE_BYTES", "CircuitBreaker", "RedisTier"]

log = logging.getLogger(__name__)

LZ4_FRAME_MAGIC = b"\x04\x22\x4d\x18"
DEFAULT_TIMEOUT_S = 0.25
DEFAULT_PREFIX = b"nc:"
# Redis refuses bulk strings over proto-max-bulk-len (512 MB by default); lz4 may grow
# incompressible data slightly, so leave headroom below it.
MAX_VALUE_BYTES = 500 * 1024 * 1024
THREAD_THRESHOLD_BYTES = 128 * 1024

_OWN_OPTIONS = frozenset({"ttl", "timeout", "capacity", "prefix"})
# String-valued options redis-py passes through to its (SSL) connections.
_PASSTHROUGH_OPTIONS = frozenset(
    {
        "username",
        "password",
        "client_name",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_data",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_ciphers",
    }
)
# redis-py's own "timeout" (pool wait) is shadowed by ours (socket timeouts).
_ALLOWED_OPTIONS = _OWN_OPTIONS | _PASSTHROUGH_OPTIONS | (set(URL_QUERY_ARGUMENT_PARSERS) - {"db"})

# Errors meaning "Redis is not reachable or not serving": they open the breaker.
_UNREACHABLE: tuple[type[BaseException], ...] = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterError,
    rex.RedisClusterException,
    rex.TryAgainError,
    rex.ReadOnlyError,
    OSError,  # includes the builtin TimeoutError raised by asyncio
)

T = TypeVar("T")
RedisClient = Redis | RedisCluster


class CircuitBreaker:
    """Healthy/unhealthy state plus when the next attempt is allowed (delays from a backoff)."""

    def __init__(self, backoff: AbstractBackoff, clock: Callable[[], float] = time.monotonic):
        self._backoff = backoff
        self._clock = clock
        self.healthy = True
        self.failures = 0
        self._retry_at = 0.0

    def allow(self) -> bool:
        """Whether an operation may touch the network now."""
        return self.healthy or self._clock() >= self._retry_at

    def record_success(self) -> bool:
        """Close the breaker; True if this was a recovery."""
        recovered = not self.healthy
        self.healthy, self.failures = True, 0
        return recovered

    def record_failure(self) -> bool:
        """Open (or keep open) the breaker; True if this was the first failure."""
        first = self.healthy
        self.healthy = False
        self.failures += 1
        self._retry_at = self._clock() + self._backoff.compute(self.failures)
        return first


class RedisTier(Tier):
    """Blocks in Redis or Redis Cluster: one lz4-compressed SET per block, optional TTL."""

    name: ClassVar[TierName] = "redis"
    # Other processes (replicas, anyone with the Redis password) write here.
    trusted: ClassVar[bool] = False

    def __init__(
        self,
        client: RedisClient,
        *,
        url: str,
        ttl_seconds: int | None = None,
        capacity_bytes: int | None = None,
        prefix: bytes = DEFAULT_PREFIX,
        backoff: AbstractBackoff | None = None,
        max_blob_bytes: int | None = None,
    ) -> None:
        if ttl_seconds is not None and ttl_seconds < 1:
            raise TierConfigError(f"{redact_url(url)}: ttl must be >= 1 second, got {ttl_seconds}")
        self._client = client
        self._url = redact_url(url)
        self._ttl = ttl_seconds
        # Keys stored without a TTL while it holds them (the server's pins); None: none.
        self.keep: KeepSet | None = None
        self._capacity = capacity_bytes
        self._blob_limit = MAX_VALUE_BYTES if max_blob_bytes is None else max_blob_bytes
        self._prefix = prefix
        self._breaker = CircuitBreaker(backoff or ExponentialBackoff(cap=5.0, base=0.1))
        self._closed = False
        self._last_used = 0
        self._last_entries = 0
        self._server_capacity: int | None = None
        self.corrupt_values = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        backoff: AbstractBackoff | None = None,
        max_blob_bytes: int | None = None,
    ) -> RedisTier:
        """Build from a ``redis://``, ``rediss://`` or ``redis+cluster://`` URL (see module doc)."""
        parts = urlsplit(url)
        options = query_options(parts.query, allowed=_ALLOWED_OPTIONS, url=url)
        own = {k: options.pop(k) for k in list(options) if k in _OWN_OPTIONS}
        shown = redact_url(url)
        timeout = _parse_float(own.get("timeout"), DEFAULT_TIMEOUT_S, "timeout", shown)
        ttl = _parse_int(own.get("ttl"), "ttl", shown)
        capacity = None
        if "capacity" in own:
            try:
                capacity = parse_size(own["capacity"], field=f"{shown}: capacity")
            except SizeError as exc:
                raise TierConfigError(str(exc)) from exc
        prefix = own.get("prefix", DEFAULT_PREFIX.decode()).encode()
        rest = urlencode(list(options.items()))
        # Short socket timeouts and one immediate retry: see "Failures" in the module doc.
        common: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 1),
        }
        client: RedisClient
        try:
            if parts.scheme in ("redis", "rediss"):
                single = parts._replace(query=rest).geturl()
                client = Redis.from_url(single, **common)
            elif parts.scheme in ("redis+cluster", "rediss+cluster"):
                client = _cluster_client(
                    parts.scheme, parts.netloc, parts.path, rest, common, shown
                )
            else:
                raise TierConfigError(
                    f"{shown}: scheme must be redis://, rediss://, redis+cluster:// "
                    "or rediss+cluster://"
                )
        except (ValueError, TypeError, rex.RedisClusterException) as exc:
            if isinstance(exc, TierConfigError):
                raise
            raise TierConfigError(f"{shown}: {exc}") from exc
        return cls(
            client,
            url=url,
            ttl_seconds=ttl,
            capacity_bytes=capacity,
            prefix=prefix,
            backoff=backoff,
            max_blob_bytes=max_blob_bytes,
        )

    @property
    def url(self) -> str:
        """The URL with its password replaced by ``***``."""
        return self._url

    @property
    def max_blob_bytes(self) -> int:
        """Below Redis's bulk-string limit, the blob limit given and the capacity, if any."""
        limit = min(MAX_VALUE_BYTES, self._blob_limit)
        if self._capacity is None:
            return limit
        return min(limit, self._capacity)

    @property
    def healthy(self) -> bool:
        """False from a connection failure until an operation succeeds again."""
        return self._breaker.healthy

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key a block key is stored under."""
        return self._prefix + key

    async def _guard(self, what: str, op: Callable[[], Awaitable[T]], fallback: T) -> T:
        """Run ``op`` unless the breaker is open; on failure, record it and return ``fallback``."""
        if self._closed:
            raise TierClosedError(f"{self._url}: tier is closed")
        if not self._breaker.allow():
            return fallback
        try:
            result = await op()
        except _UNREACHABLE as exc:
            if self._breaker.record_failure():
                log.warning("redis tier %s unreachable during %s: %r", self._url, what, exc)
            return fallback
        except rex.ResponseError as exc:
            # The server answered (so it is healthy) but refused, e.g. OOM under
            # maxmemory-policy noeviction: this one operation becomes a miss / no-op.
            log.warning("redis tier %s refused %s: %s", self._url, what, exc)
            return fallback
        if self._breaker.record_success():
            log.info("redis tier %s reachable again", self._url)
        return result

    async def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """EXISTS for each key in one pipeline; all False while Redis is unreachable."""
        if not keys:
            return []

        async def op() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._prefix + key)
            return [bool(n) for n in await pipe.execute()]

        return await self._guard("contains", op, [False] * len(keys))

    async def get(self, key: bytes) -> bytes | None:
        """GET and decompress; None on a miss, a damaged value or an unreachable Redis."""
        return (await self.get_many([key]))[0]

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """GET for each key in one pipeline, decompressed; None per miss."""
        if not keys:
            return []

        async def op() -> list[bytes | None]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._prefix + key)
            return list(await pipe.execute())

        misses: list[bytes | None] = [None] * len(keys)
        raws = await self._guard("get", op, misses)
        blobs = await self._decompress_all(raws)
        # An empty value is not an lz4 frame: damaged too (deleted, or Lookup finds it forever).
        bad = [
            k
            for k, raw, blob in zip(keys, raws, blobs, strict=True)
            if raw is not None and blob is None
        ]
        if bad:
            await self._drop_corrupt(bad)
        return blobs

    async def put(self, key: bytes, blob: BlobLike, *, keep_evicted: bool = True) -> PutResult:
        """Compress and SET NX (with EX ttl when configured); Redis does its own eviction."""
        if self._closed:
            raise TierClosedError(f"{self._url}: tier is closed")
        size = memoryview(blob).nbytes
        if size > self.max_blob_bytes:
            return PutResult(PutStatus.TOO_LARGE)
        if not self._breaker.allow():
            return PutResult(PutStatus.UNAVAILABLE)
        if size >= THREAD_THRESHOLD_BYTES:
            value = await asyncio.to_thread(_compress, blob)
        else:
            value = _compress(blob)

        keep = self.keep
        ttl = None if keep is not None and len(keep) and keep.holds(key) else self._ttl

        async def op() -> PutStatus:
            done = await self._client.set(self._prefix + key, value, nx=True, ex=ttl)
            return PutStatus.STORED if done else PutStatus.ALREADY_PRESENT

        return PutResult(await self._guard("put", op, PutStatus.UNAVAILABLE))

    async def delete(self, key: bytes) -> bool:
        """DEL; False when absent or unreachable."""
        return (await self.delete_many([key]))[0]

    async def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One DEL per key in a pipeline (a multi-key DEL would cross cluster slots)."""
        if not keys:
            return []

        async def op() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.delete(self._prefix + key)
            return [bool(n) for n in await pipe.execute()]

        return await self._guard("delete", op, [False] * len(keys))

    async def hold(self, keys: Sequence[bytes], held: bool) -> None:
        """PERSIST ``keys`` while pinned; EXPIRE them with the tier's TTL when released."""
        if not keys or self._ttl is None:
            return
        ttl = self._ttl

        async def op() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                if held:
                    pipe.persist(self._prefix + key)
                else:
                    pipe.expire(self._prefix + key, ttl)
            await pipe.execute()

        await self._guard("pin" if held else "unpin", op, None)

    async def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """SCAN for the stored keys starting with ``prefix`` (every cluster primary)."""
        pattern = _glob_escape(self._prefix + prefix) + b"*"
        cut = len(self._prefix)

        async def op() -> list[bytes]:
            return [k[cut:] async for k in self._client.scan_iter(match=pattern, count=1000)]

        return await self._guard("scan", op, [])

    async def stats(self) -> TierStats:
        """INFO memory and DBSIZE (summed over cluster primaries); also probes health."""
        if self._closed:
            raise TierClosedError(f"{self._url}: tier is closed")

        async def op() -> None:
            if isinstance(self._client, RedisCluster):
                target = RedisCluster.PRIMARIES
                infos = await self._client.info("memory", target_nodes=target)
                entries = await self._client.dbsize(target_nodes=target)
            else:
                infos = await self._client.info("memory")
                entries = await self._client.dbsize()
            # A cluster answers {node name: info}; a single server answers one info dict.
            per_node = list(infos.values()) if "used_memory" not in infos else [infos]
            self._last_used = sum(int(info["used_memory"]) for info in per_node)
            limits = [int(info.get("maxmemory", 0)) for info in per_node]
            self._server_capacity = sum(limits) if all(limits) else None
            self._last_entries = int(entries)

        await self._guard("stats", op, None)
        return TierStats(
            name=self.name,
            url=self._url,
            used_bytes=self._last_used,
            capacity_bytes=self._capacity if self._capacity is not None else self._server_capacity,
            entries=self._last_entries,
            healthy=self._breaker.healthy,
        )

    async def close(self) -> None:
        """Close the connection pool."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._client.aclose()
        except (rex.RedisError, OSError) as exc:
            # Closing is shutdown: a connection that cannot close in time (a write queued
            # to a Redis that reads nothing, a loop stalled past the timeout) is dropped
            # and logged, never an error that stops the rest of the shutdown.
            log.warning("redis tier %s: connections dropped on close: %r", self._url, exc)

    async def _decompress_all(self, raws: Sequence[bytes | None]) -> list[bytes | None]:
        """Decompress each value; None for a miss or a damaged frame."""
        limit = self.max_blob_bytes
        if sum(len(raw) for raw in raws if raw) >= THREAD_THRESHOLD_BYTES:
            return await asyncio.to_thread(_decompress_many, raws, limit)
        return _decompress_many(raws, limit)

    async def _drop_corrupt(self, keys: Sequence[bytes]) -> None:
        """Delete values that failed their checksum so they are never read again."""
        self.corrupt_values += len(keys)
        log.warning(
            "redis tier %s: %d damaged value(s) deleted, first key %s",
            self._url,
            len(keys),
            keys[0].hex(),
        )
        await self.delete_many(keys)


def _glob_escape(raw: bytes) -> bytes:
    """``raw`` with Redis glob metacharacters escaped (keys are binary)."""
    out = bytearray()
    for byte in raw:
        if byte in b"*?[]\\":
            out.append(0x5C)
        out.append(byte)
    return bytes(out)


def _compress(blob: BlobLike) -> bytes:
    return lz4.frame.compress(blob, content_checksum=True)


def _decompress_many(raws: Sequence[bytes | None], limit: int) -> list[bytes | None]:
    return [None if raw is None else _decompress(raw, limit) for raw in raws]


def _decompress(raw: bytes, limit: int) -> bytes | None:
    """The blob in one lz4 frame, or None when damaged, empty or larger than ``limit``."""
    if raw[:4] != LZ4_FRAME_MAGIC:
        return None
    try:
        declared = lz4.frame.get_frame_info(raw).get("content_size", 0)
        if declared > limit:
            return None
        # Bounded whatever the frame header says: at most limit + 1 bytes come out.
        decompressor = lz4.frame.LZ4FrameDecompressor()
        blob = decompressor.decompress(raw, max_length=limit + 1)
    except RuntimeError:
        # lz4 reports a bad frame or checksum as RuntimeError: the value is damaged.
        return None
    if len(blob) > limit or not decompressor.eof or decompressor.unused_data:
        return None
    return blob


def _cluster_client(
    scheme: str, netloc: str, path: str, query: str, common: dict[str, Any], shown: str
) -> RedisCluster:
    """A RedisCluster over every host:port listed in the URL (comma-separated)."""
    userinfo, _, hosts = netloc.rpartition("@")
    nodes: list[ClusterNode] = []
    for hostport in hosts.split(","):
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise TierConfigError(f"{shown}: cluster node {hostport!r} must be host:port")
        nodes.append(ClusterNode(host, int(port)))
    if path not in ("", "/", "/0"):
        raise TierConfigError(f"{shown}: Redis Cluster has only db 0, got path {path!r}")
    # Let redis-py parse credentials and typed options exactly as its from_url would.
    single = f"{scheme.removesuffix('+cluster')}://{userinfo + '@' if userinfo else ''}"
    single += f"{nodes[0].host}:{nodes[0].port}/?{query}"
    kwargs: dict[str, Any] = dict(parse_url(single))
    for name in ("host", "port", "db"):
        kwargs.pop(name, None)
    if kwargs.pop("connection_class", None) is SSLConnection:
        kwargs["ssl"] = True
    kwargs.update(common)
    return RedisCluster(startup_nodes=nodes, **kwargs)


def _parse_float(value: str | None, default: float, field: str, url: str) -> float:
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise TierConfigError(
            f"{url}: {field} must be a number of seconds, got {value!r}"
        ) from None
    if not parsed > 0:
        raise TierConfigError(f"{url}: {field} must be > 0 seconds, got {value!r}")
    return parsed


def _parse_int(value: str | None, field: str, url: str) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise TierConfigError(
            f"{url}: {field} must be a whole number of seconds >= 1, got {value!r}"
        )
    return int(value)
