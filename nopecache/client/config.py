"""The client's one typed configuration object, and the URL that spells it.

A client is configured by a :class:`ClientConfig`, built in code or from a URL::

    nopecache://host1:50551,host2:50551?lookup_timeout=200ms&shm=off
    nopecaches://cache.example:50551?tls_ca_file=/etc/ca.pem&token=...   (TLS)
    nopecache://[::1]:50551,cache-0.cache-headless                      (default port)
    nopecache://nopecache-headless.ns.svc.cluster.local:50551?discover=dns (every replica)

Discovery. A server entry is one server unless the URL says ``discover=dns``: then every
entry is a DNS name (a Kubernetes headless Service) standing for all the addresses it
resolves to, each with the entry's port, re-resolved every ``dns_refresh`` and soon after
a server fails (see ``nopecache.client.discovery``). The flag is explicit because a name
cannot be told apart from a server by its spelling: ``nopecache-0.nopecache-headless`` is
one pod, kept as a name so its ring identity survives a restart with a new IP, while
``nopecache-headless`` is all of them.

Keys. ``prefix_block_tokens`` and ``chunk_{min,avg,max}_tokens`` decide where prompts are
cut, hence the block keys: a client that stores and one that looks up must agree on them,
and putting them in the shared URL is how they do.

Every field has exactly one query parameter (see :data:`URL_PARAMS`): the field name,
with ``_s`` dropped from durations, and ``retry_`` / ``cost_`` before the fields of the
nested :class:`RetryPolicy` and :class:`~nopecache.client.cost.CostConfig` (one
shortening: ``retry_codes`` sets ``retry.retryable_codes``). Values:

    durations   0.2 | 0.2s | 200ms              (seconds when bare)
    sizes       67108864 | 64MiB | 64MB         (KiB/MiB/GiB = 1024^n, KB/MB/GB = 1000^n)
    booleans    true/false, 1/0, yes/no, on/off
    lists       comma separated: retry_codes=UNAVAILABLE,RESOURCE_EXHAUSTED
    text        percent-encoded as in any URL query

An unknown or repeated parameter is an error naming it. ``nopecaches://`` is the TLS
scheme (as ``rediss://`` is for Redis) and implies ``tls=true``.

Precedence, highest first: values set in code (``dataclasses.replace(config, ...)``, which
validates again) > the URL's query parameters (``from_url``; ``from_env`` reads the URL
from ``NOPECACHE_CLIENT_URL``) > the defaults below.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal
from urllib.parse import parse_qsl, quote, urlencode

import grpc

from nopecache.client.chunking import ContentChunker
from nopecache.client.cost import CostConfig
from nopecache.client.errors import InvalidArgumentError
from nopecache.proto.contract import DEFAULT_PORT, METHODS, SERVICE_NAME
from nopecache.proto.kv_codec import CODECS
from nopecache.proto.sizes import SizeError, parse_size

__all__ = [
    "BULK_STREAMS_MAX",
    "DEFAULT_CHUNKER",
    "DEFAULT_CHUNK_AVG_TOKENS",
    "DEFAULT_CHUNK_MAX_TOKENS",
    "DEFAULT_CHUNK_MIN_TOKENS",
    "DEFAULT_PORT",
    "DEFAULT_PREFIX_BLOCK_TOKENS",
    "ENV_URL",
    "METHODS",
    "SERVICE",
    "URL_PARAMS",
    "BulkMode",
    "ClientConfig",
    "DiscoverMode",
    "DnsFamily",
    "KvCodec",
    "RetryPolicy",
    "ShmMode",
    "normalize_server",
    "split_server",
]

ENV_URL = "NOPECACHE_CLIENT_URL"
# The service's name, methods and default port come from the wire contract (proto/).
SERVICE = SERVICE_NAME
SCHEME = "nopecache"
TLS_SCHEME = "nopecaches"
# The server's max_message_bytes defaults to 4 MiB and its max_block_bytes to 64 MiB. The
# client's receive limit must be at least the server's message size, so 64 MiB also works
# with a server raised to carry a whole block per frame; sends are framed by the limits the
# server advertises (ServerInfo.limits), never by this number alone.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024**2
# Bulk connections per Get to one server at most (each is a socket and a thread).
BULK_STREAMS_MAX = 16
_MIN_MESSAGE_BYTES = 64 * 1024
_GRPC_MAX_MESSAGE = (1 << 31) - 1
# gRPC caps maxAttempts at 5 whatever the config says; refusing more keeps the config honest.
_GRPC_MAX_ATTEMPTS = 5

# Exact-prefix blocks of 256 tokens: big enough that a block is worth a round trip, small
# enough that a prompt sharing a prefix reuses most of it.
DEFAULT_PREFIX_BLOCK_TOKENS = 256
# Content chunks of ~64 tokens: a reused document loses about lookback + avg tokens at its
# start (see ContentChunker), and a block stays a few MiB even for 8B-class models.
DEFAULT_CHUNK_MIN_TOKENS = 16
DEFAULT_CHUNK_AVG_TOKENS = 64
DEFAULT_CHUNK_MAX_TOKENS = 256
DEFAULT_CHUNKER = ContentChunker(
    min_size=DEFAULT_CHUNK_MIN_TOKENS,
    avg_size=DEFAULT_CHUNK_AVG_TOKENS,
    max_size=DEFAULT_CHUNK_MAX_TOKENS,
)
_MAX_BLOCK_TOKENS = 1 << 20

ShmMode = Literal["auto", "on", "off"]
KvCodec = Literal["none", "fp8", "k16v8"]
BulkMode = Literal["auto", "off"]
_SHM_MODES: tuple[str, ...] = ("auto", "on", "off")
DiscoverMode = Literal["off", "dns"]
"""``off``: each server entry is one server; ``dns``: each is a name for all it resolves to."""
_DISCOVER_MODES: tuple[str, ...] = ("off", "dns")
DnsFamily = Literal["any", "ipv4", "ipv6"]
"""Which address records discovery uses: A and AAAA, A only, AAAA only."""
_DNS_FAMILIES: tuple[str, ...] = ("any", "ipv4", "ipv6")
_STATUS_NAMES = frozenset(code.name for code in grpc.StatusCode)
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(name, f"must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidArgumentError(name, f"must be finite, got {number}")
    if number < 0 or (number == 0 and not allow_zero):
        raise InvalidArgumentError(name, f"must be {'>=' if allow_zero else '>'} 0, got {value}")
    return number


# Sane ranges of the time settings: a deadline under a millisecond misses every call, one
# over a day never ends a hung call, and a value past these overflows the clocks and
# timers it is added to (``time.monotonic() + 1e300`` is a server down forever).
TIMEOUT_RANGE_S = (1e-3, 86400.0)
BACKOFF_RANGE_S = (1e-6, 3600.0)
DOWN_BACKOFF_RANGE_S = (0.0, 3600.0)
DNS_INTERVAL_RANGE_S = (0.0, 86400.0)
BACKOFF_MULTIPLIER_RANGE = (1e-3, 100.0)
THROTTLE_RATIO_RANGE = (1e-3, 1000.0)


def _number_in(name: str, value: object, bounds: tuple[float, float]) -> float:
    """``value`` as a float inside ``bounds`` (inclusive), else InvalidArgumentError naming
    ``name``; 0 is allowed only when the lower bound is 0."""
    number = _positive(name, value, allow_zero=bounds[0] == 0)
    low, high = bounds
    if not low <= number <= high:
        raise InvalidArgumentError(name, f"must be in [{low:g}, {high:g}], got {value}")
    return number


def _int_in(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, f"must be an int, got {value!r}")
    if not low <= value <= high:
        raise InvalidArgumentError(name, f"must be in [{low}, {high}], got {value}")
    return value


def _duration(seconds: float) -> str:
    """A proto3 JSON Duration (``"0.05s"``): decimal seconds, at most 9 fraction digits."""
    text = f"{seconds:.9f}".rstrip("0").rstrip(".")
    return f"{text}s"


def split_server(address: str) -> tuple[str, int]:
    """``(host, port)`` of a normalized ``host:port``; an IPv6 host loses its brackets."""
    host, _, port = normalize_server(address).rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def normalize_server(address: str, *, default_port: int = DEFAULT_PORT) -> str:
    """``"host:port"`` form of a server address; IPv6 in brackets, hostnames lowercased.

    Accepts ``host``, ``host:port``, ``1.2.3.4:port``, ``[::1]`` and ``[::1]:port``; the
    result is the server's identity for sharding, so spellings of one server agree.
    """
    if not isinstance(address, str) or not address.strip():
        raise InvalidArgumentError(
            "servers", f"an address must be a non-empty str, got {address!r}"
        )
    text = address.strip()
    port_text: str | None
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise InvalidArgumentError("servers", f"{address!r}: unclosed '[' in IPv6 address")
        host, rest = text[1:close], text[close + 1 :]
        try:
            host = str(ipaddress.IPv6Address(host))
        except ValueError:
            raise InvalidArgumentError("servers", f"{address!r}: bad IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise InvalidArgumentError("servers", f"{address!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else None
        host = f"[{host}]"
    else:
        if text.count(":") > 1:
            raise InvalidArgumentError(
                "servers", f"{address!r}: write an IPv6 address in brackets: [addr]:port"
            )
        host, colon, port_text = text.partition(":")
        if not _HOST_RE.match(host):
            raise InvalidArgumentError("servers", f"{address!r}: bad host name {host!r}")
        host = host.lower()
        if not colon:
            port_text = None
    if port_text is None:
        port = default_port
    elif port_text.isdigit():
        port = int(port_text)
    else:
        raise InvalidArgumentError("servers", f"{address!r}: port {port_text!r} is not a number")
    if not 1 <= port <= 65535:
        raise InvalidArgumentError("servers", f"{address!r}: port must be in [1, 65535]")
    return f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """gRPC's own retry policy for every call (not a hand-written loop).

    gRPC retries a call that failed with one of ``retryable_codes`` up to
    ``max_attempts`` attempts in all, sleeping a random time up to
    ``min(initial_backoff_s * backoff_multiplier**(n-1), max_backoff_s)`` before
    attempt n+1. A streaming call is retried only until its first reply arrives (Get) or
    while its sent frames still fit gRPC's retry buffer (Put). ``max_attempts=1`` turns
    retries off. Retry throttling (per server) stops retries once ``throttle_max_tokens``
    worth of failures pile up, so a dead server does not triple its load.
    """

    max_attempts: int = 3
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 0.5
    backoff_multiplier: float = 2.0
    retryable_codes: tuple[str, ...] = ("UNAVAILABLE",)
    throttle_max_tokens: int = 10
    throttle_token_ratio: float = 0.1

    def __post_init__(self) -> None:
        _int_in("retry.max_attempts", self.max_attempts, 1, _GRPC_MAX_ATTEMPTS)
        for name, bounds in (
            ("initial_backoff_s", BACKOFF_RANGE_S),
            ("max_backoff_s", BACKOFF_RANGE_S),
            ("backoff_multiplier", BACKOFF_MULTIPLIER_RANGE),
        ):
            value = _number_in(f"retry.{name}", getattr(self, name), bounds)
            object.__setattr__(self, name, value)
        if self.max_backoff_s < self.initial_backoff_s:
            raise InvalidArgumentError(
                "retry.max_backoff_s",
                f"{self.max_backoff_s} is below initial_backoff_s {self.initial_backoff_s}",
            )
        codes = self.retryable_codes
        if isinstance(codes, str) or not isinstance(codes, tuple | list):
            raise InvalidArgumentError(
                "retry.retryable_codes", f"must be a tuple of status names, got {codes!r}"
            )
        normalized = tuple(str(c).upper() for c in codes)
        unknown = sorted(set(normalized) - _STATUS_NAMES)
        if unknown:
            raise InvalidArgumentError(
                "retry.retryable_codes", f"unknown gRPC status code(s) {unknown}"
            )
        if not normalized:
            raise InvalidArgumentError("retry.retryable_codes", "must name at least one code")
        if "OK" in normalized:
            raise InvalidArgumentError("retry.retryable_codes", "OK is not a failure to retry")
        object.__setattr__(self, "retryable_codes", normalized)
        _int_in("retry.throttle_max_tokens", self.throttle_max_tokens, 1, 1000)
        object.__setattr__(
            self,
            "throttle_token_ratio",
            _number_in(
                "retry.throttle_token_ratio", self.throttle_token_ratio, THROTTLE_RATIO_RANGE
            ),
        )

    @property
    def enabled(self) -> bool:
        """Whether gRPC retries at all (more than one attempt)."""
        return self.max_attempts > 1

    def retry_policy_json(self) -> dict[str, Any] | None:
        """The ``retryPolicy`` object of a gRPC method config; None when disabled."""
        if not self.enabled:
            return None
        return {
            "maxAttempts": self.max_attempts,
            "initialBackoff": _duration(self.initial_backoff_s),
            "maxBackoff": _duration(self.max_backoff_s),
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": list(self.retryable_codes),
        }

    def service_config(self, service: str = SERVICE) -> dict[str, Any]:
        """gRPC service config (as a dict): this retry policy on every KVCache method.

        Every method is retried, Put included: storing a block under its content key is
        idempotent (a repeat answers ALREADY_PRESENT). Deadlines are NOT in it: gRPC
        Python ends calls early, often at once, with DEADLINE_EXCEEDED when a service
        config sets ``timeout`` (grpc/grpc#34547, #40633; seen with grpcio 1.85), so each
        call passes ``timeout=`` from :meth:`ClientConfig.method_timeouts` itself.
        """
        if not isinstance(service, str) or not service:
            raise InvalidArgumentError("service", f"must be a non-empty str, got {service!r}")
        policy = self.retry_policy_json()
        method_configs = []
        for method in METHODS:
            entry: dict[str, Any] = {"name": [{"service": service, "method": method}]}
            if policy is not None:
                entry["retryPolicy"] = policy
            method_configs.append(entry)
        config: dict[str, Any] = {"methodConfig": method_configs}
        if policy is not None:
            config["retryThrottling"] = {
                "maxTokens": self.throttle_max_tokens,
                "tokenRatio": self.throttle_token_ratio,
            }
        return config

    def service_config_json(self, service: str = SERVICE) -> str:
        """:meth:`service_config` as the JSON string ``grpc.service_config`` takes."""
        return json.dumps(self.service_config(service), sort_keys=True)


def _check_optional_path(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidArgumentError(name, f"must be None or a non-empty path, got {value!r}")


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Configuration of one nopecache client (see the module docstring for the URL form).

    Precedence, highest first: values set in code > URL query parameters > defaults.
    Durations are seconds. A server is ``host:port`` (normalized by
    :func:`normalize_server`); the list is the sharding ring, in no particular order.
    """

    servers: tuple[str, ...]
    # Per-call deadlines (each call's ``timeout=``; see method_timeouts).
    lookup_timeout_s: float = 0.5
    get_timeout_s: float = 5.0
    put_timeout_s: float = 10.0
    # Delete and Stats: small calls, but Stats is the first call to a new server.
    control_timeout_s: float = 2.0
    # How long the first connection to a server may take before its keys count as misses.
    connect_timeout_s: float = 1.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Same-host shared-memory payloads: "auto" when the server reports our host id.
    shm: ShmMode = "auto"
    # Get and Put payloads over the server's bulk byte stream when it offers one (plaintext
    # servers; "off": always the gRPC streams). See client/bulk.py.
    bulk: BulkMode = "auto"
    # Same-host zero copy (client/zero_copy.py): where shared memory is used and the server
    # offers its pool, blocks are placed straight from a read-only mapping of it.
    zero_copy: bool = True
    # Bulk connections one Get may use at once to one server (its keys dealt out in turn);
    # 1 to BULK_STREAMS_MAX. Where one TCP stream cannot fill the link (a long fat path).
    bulk_streams: int = 1
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Blocks waiting in the non-blocking store queue; a store beyond it is dropped (counted).
    store_queue_blocks: int = 256
    # After a failure, a server's keys are misses for this long before it is tried again.
    down_backoff_s: float = 1.0
    cost: CostConfig = field(default_factory=CostConfig)
    # Default tenant namespace salted into every key (a call may pass its own).
    namespace: str = ""
    # The compact stored form this client stores and loads (proto/kv_codec.py): "fp8",
    # "k16v8" (approximate KV: keyed apart from "none" blocks, never an exact prefix) or
    # "none" (the engine's dtype, bit-exact).
    kv_codec: KvCodec = "none"
    # With "dns", every server entry is a name standing for all its addresses (a Kubernetes
    # headless Service); see nopecache.client.discovery.
    discover: DiscoverMode = "off"
    # How often discovery resolves the names again; 0: only after a failure.
    dns_refresh_s: float = 30.0
    # A failed server triggers a new resolution, but never sooner than this after the last
    # one: a replica that stays listed while dead must not turn every call into a query.
    dns_min_interval_s: float = 1.0
    dns_family: DnsFamily = "any"
    # Where prompts are cut, hence the keys: storing and looking-up clients must agree.
    prefix_block_tokens: int = DEFAULT_PREFIX_BLOCK_TOKENS
    chunk_min_tokens: int = DEFAULT_CHUNK_MIN_TOKENS
    chunk_avg_tokens: int = DEFAULT_CHUNK_AVG_TOKENS
    chunk_max_tokens: int = DEFAULT_CHUNK_MAX_TOKENS
    # TLS: on with tls=True or any tls_* file; the CA defaults to the system roots.
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # Bearer token sent in call metadata; kept out of repr so it does not reach logs.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        servers = self.servers
        if isinstance(servers, str) or not isinstance(servers, tuple | list):
            raise InvalidArgumentError(
                "servers", f"must be a tuple of 'host:port' strings, got {servers!r}"
            )
        normalized = tuple(normalize_server(s) for s in servers)
        if not normalized:
            raise InvalidArgumentError("servers", "at least one server is required")
        seen: set[str] = set()
        for server in normalized:
            if server in seen:
                raise InvalidArgumentError("servers", f"{server} is listed twice")
            seen.add(server)
        object.__setattr__(self, "servers", normalized)
        for name in (
            "lookup_timeout_s",
            "get_timeout_s",
            "put_timeout_s",
            "control_timeout_s",
            "connect_timeout_s",
        ):
            object.__setattr__(self, name, _number_in(name, getattr(self, name), TIMEOUT_RANGE_S))
        for name, bounds in (
            ("down_backoff_s", DOWN_BACKOFF_RANGE_S),
            ("dns_refresh_s", DNS_INTERVAL_RANGE_S),
            ("dns_min_interval_s", DNS_INTERVAL_RANGE_S),
        ):
            object.__setattr__(self, name, _number_in(name, getattr(self, name), bounds))
        if self.discover not in _DISCOVER_MODES:
            raise InvalidArgumentError(
                "discover", f"must be one of {_DISCOVER_MODES}, got {self.discover!r}"
            )
        if self.dns_family not in _DNS_FAMILIES:
            raise InvalidArgumentError(
                "dns_family", f"must be one of {_DNS_FAMILIES}, got {self.dns_family!r}"
            )
        _int_in("prefix_block_tokens", self.prefix_block_tokens, 1, _MAX_BLOCK_TOKENS)
        self.content_chunker()  # the sizes must make a valid chunker
        if not isinstance(self.retry, RetryPolicy):
            raise InvalidArgumentError(
                "retry", f"must be a RetryPolicy, got {type(self.retry).__name__}"
            )
        if self.shm not in _SHM_MODES:
            raise InvalidArgumentError("shm", f"must be one of {_SHM_MODES}, got {self.shm!r}")
        if self.bulk not in ("auto", "off"):
            raise InvalidArgumentError("bulk", f"must be 'auto' or 'off', got {self.bulk!r}")
        if not isinstance(self.zero_copy, bool):
            raise InvalidArgumentError(
                "zero_copy", f"must be True or False, got {self.zero_copy!r}"
            )
        _int_in("bulk_streams", self.bulk_streams, 1, BULK_STREAMS_MAX)
        _int_in("max_message_bytes", self.max_message_bytes, _MIN_MESSAGE_BYTES, _GRPC_MAX_MESSAGE)
        _int_in("store_queue_blocks", self.store_queue_blocks, 1, 1 << 20)
        if not isinstance(self.cost, CostConfig):
            raise InvalidArgumentError(
                "cost", f"must be a CostConfig, got {type(self.cost).__name__}"
            )
        if not isinstance(self.namespace, str):
            raise InvalidArgumentError("namespace", f"must be a str, got {self.namespace!r}")
        if self.kv_codec not in CODECS:
            raise InvalidArgumentError(
                "kv_codec", f"must be one of {list(CODECS)}, got {self.kv_codec!r}"
            )
        if not isinstance(self.tls, bool):
            raise InvalidArgumentError("tls", f"must be a bool, got {self.tls!r}")
        for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            _check_optional_path(name, getattr(self, name))
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise InvalidArgumentError(missing, "a client certificate needs both cert and key")
        if self.token is not None and (
            not isinstance(self.token, str)
            or not self.token
            or any(c.isspace() or not c.isprintable() for c in self.token)
        ):
            # gRPC metadata values are printable ASCII; whitespace would split the header.
            raise InvalidArgumentError("token", "must be a non-empty str without whitespace")

    # -- derived values -------------------------------------------------------------

    @property
    def use_tls(self) -> bool:
        """Whether channels use TLS (``tls`` or any TLS file set)."""
        return self.tls or any(
            f is not None for f in (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        )

    def content_chunker(self) -> ContentChunker:
        """The content chunker of the ``chunk_*_tokens`` sizes (position-independent keys)."""
        sizes = {
            "min_size": "chunk_min_tokens",
            "avg_size": "chunk_avg_tokens",
            "max_size": "chunk_max_tokens",
        }
        for name in sizes.values():
            _int_in(name, getattr(self, name), 1, _MAX_BLOCK_TOKENS)
        try:
            return ContentChunker(
                min_size=self.chunk_min_tokens,
                avg_size=self.chunk_avg_tokens,
                max_size=self.chunk_max_tokens,
            )
        except InvalidArgumentError as err:
            # Name the config fields, not the chunker's.
            reason = err.reason
            for chunker_name, name in sizes.items():
                reason = reason.replace(chunker_name, name)
            raise InvalidArgumentError(sizes.get(err.argument, err.argument), reason) from None

    def method_timeouts(self) -> dict[str, float]:
        """Deadline in seconds of each KVCache method (pass it as each call's ``timeout``)."""
        return {
            "Lookup": self.lookup_timeout_s,
            "Get": self.get_timeout_s,
            "Put": self.put_timeout_s,
            "Delete": self.control_timeout_s,
            "AttachShm": self.control_timeout_s,
            "DetachShm": self.control_timeout_s,
            "OpenBulk": self.control_timeout_s,
            "Stats": self.control_timeout_s,
            "OpenArena": self.control_timeout_s,
            "LeaseGet": self.get_timeout_s,
            "ReleaseLeases": self.control_timeout_s,
        }

    def service_config(self, service: str = SERVICE) -> dict[str, Any]:
        """gRPC service config (as a dict); see :meth:`RetryPolicy.service_config`."""
        return self.retry.service_config(service)

    def service_config_json(self, service: str = SERVICE) -> str:
        """The JSON string the ``grpc.service_config`` channel argument takes."""
        return self.retry.service_config_json(service)

    def channel_options(self) -> list[tuple[str, int | str]]:
        """gRPC channel arguments: message limits, service config, retries on/off."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.service_config", self.service_config_json()),
            ("grpc.enable_retries", 1 if self.retry.enabled else 0),
        ]

    # -- URL form -------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str) -> ClientConfig:
        """Parse ``nopecache://h1:p1,h2:p2?param=value&...`` (see the module docstring)."""
        if not isinstance(url, str):
            raise InvalidArgumentError("url", f"must be a str, got {type(url).__name__}")
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in (SCHEME, TLS_SCHEME):
            raise InvalidArgumentError(
                "url", f"{url!r} must start with {SCHEME}:// or {TLS_SCHEME}://"
            )
        location, _, query = rest.partition("?")
        location, _, path = location.partition("/")
        if path:
            raise InvalidArgumentError("url", f"has a path {path!r}; a client URL has none")
        if "@" in location:
            raise InvalidArgumentError("url", "credentials go in the token= parameter, not user@")
        servers = tuple(s for s in location.split(",") if s)
        top: dict[str, Any] = {"servers": servers}
        nested: dict[str, dict[str, Any]] = {"retry": {}, "cost": {}}
        try:
            pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
        except ValueError:
            raise InvalidArgumentError("url", f"malformed query {query!r}") from None
        seen: set[str] = set()
        for name, raw in pairs:
            param = URL_PARAMS.get(name)
            if param is None:
                raise InvalidArgumentError(
                    name, f"unknown URL parameter; known: {', '.join(sorted(URL_PARAMS))}"
                )
            if name in seen:
                raise InvalidArgumentError(name, "given twice in the URL")
            seen.add(name)
            value = param.parse(name, raw)
            if param.group is None:
                top[param.attr] = value
            else:
                nested[param.group][param.attr] = value
        if scheme.lower() == TLS_SCHEME:
            if top.get("tls") is False:
                raise InvalidArgumentError("tls", f"tls=false contradicts {TLS_SCHEME}://")
            top["tls"] = True
        try:
            return cls(
                **top, retry=RetryPolicy(**nested["retry"]), cost=CostConfig(**nested["cost"])
            )
        except InvalidArgumentError as err:
            # Name the parameter the user wrote, not the field behind it.
            for name in seen:
                if URL_PARAMS[name].field_path == err.argument:
                    raise InvalidArgumentError(name, err.reason) from None
            raise

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, default_url: str | None = None
    ) -> ClientConfig:
        """The config of the URL in ``NOPECACHE_CLIENT_URL`` (else ``default_url``)."""
        env = os.environ if env is None else env
        url = env.get(ENV_URL) or default_url
        if url is None:
            raise InvalidArgumentError(ENV_URL, "is not set and no default_url was given")
        return cls.from_url(url)

    def to_url(self) -> str:
        """The URL that :meth:`from_url` turns back into this config (non-defaults only)."""
        base = ClientConfig(servers=self.servers)
        query: list[tuple[str, str]] = []
        for name, param in URL_PARAMS.items():
            value, default = param.get(self), param.get(base)
            if value != default and not (name == "tls" and self.tls):
                query.append((name, param.format(value)))
        scheme = TLS_SCHEME if self.tls else SCHEME
        text = f"{scheme}://{','.join(self.servers)}"
        if query:
            text += "?" + urlencode(query, quote_via=quote, safe="/,:")
        return text


# -- URL parameters -------------------------------------------------------------------

_DURATION_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse_duration(name: str, raw: str) -> float:
    match = _DURATION_RE.match(raw.strip().lower())
    if not match:
        raise InvalidArgumentError(name, f"expected a duration such as 0.2, 0.2s or 200ms: {raw!r}")
    value = float(match.group(1))
    return value / 1000 if match.group(2) == "ms" else value


def _parse_size(name: str, raw: str) -> int:
    # The one parser the server uses too (proto/sizes.py): 64Mi, 1.5GiB and 1TB alike.
    try:
        return parse_size(raw, field=name)
    except SizeError as e:
        raise InvalidArgumentError(name, str(e).removeprefix(f"{name}: ")) from e


def _parse_bool(name: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text not in _TRUE | _FALSE:
        raise InvalidArgumentError(name, f"expected true or false, got {raw!r}")
    return text in _TRUE


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise InvalidArgumentError(name, f"expected an integer, got {raw!r}") from None


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise InvalidArgumentError(name, f"expected a number, got {raw!r}") from None


def _parse_optional_float(name: str, raw: str) -> float | None:
    return None if raw.strip().lower() in ("", "none") else _parse_float(name, raw)


def _parse_text(name: str, raw: str) -> str:
    return raw


def _parse_codes(name: str, raw: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in raw.split(",") if c.strip())


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float):
        return repr(value)  # repr round-trips a float exactly
    return str(value)


@dataclass(frozen=True, slots=True)
class _Param:
    """One URL query parameter: the field it sets and how its text is read."""

    attr: str
    parse: Callable[[str, str], Any]
    group: str | None = None  # "retry" or "cost" for a nested field

    @property
    def field_path(self) -> str:
        """The field as an error names it: ``lookup_timeout_s``, ``retry.max_attempts``."""
        return self.attr if self.group is None else f"{self.group}.{self.attr}"

    def get(self, config: ClientConfig) -> Any:
        """The value this parameter sets in ``config``."""
        owner = config if self.group is None else getattr(config, self.group)
        return getattr(owner, self.attr)

    def format(self, value: Any) -> str:
        """The query text of ``value`` (parsed back to the same value)."""
        return _format(value)


URL_PARAMS: dict[str, _Param] = {
    "lookup_timeout": _Param("lookup_timeout_s", _parse_duration),
    "get_timeout": _Param("get_timeout_s", _parse_duration),
    "put_timeout": _Param("put_timeout_s", _parse_duration),
    "control_timeout": _Param("control_timeout_s", _parse_duration),
    "connect_timeout": _Param("connect_timeout_s", _parse_duration),
    "shm": _Param("shm", _parse_text),
    "bulk": _Param("bulk", _parse_text),
    "zero_copy": _Param("zero_copy", _parse_bool),
    "bulk_streams": _Param("bulk_streams", _parse_int),
    "max_message_bytes": _Param("max_message_bytes", _parse_size),
    "store_queue_blocks": _Param("store_queue_blocks", _parse_int),
    "down_backoff": _Param("down_backoff_s", _parse_duration),
    "namespace": _Param("namespace", _parse_text),
    "kv_codec": _Param("kv_codec", _parse_text),
    "discover": _Param("discover", _parse_text),
    "dns_refresh": _Param("dns_refresh_s", _parse_duration),
    "dns_min_interval": _Param("dns_min_interval_s", _parse_duration),
    "dns_family": _Param("dns_family", _parse_text),
    "prefix_block_tokens": _Param("prefix_block_tokens", _parse_int),
    "chunk_min_tokens": _Param("chunk_min_tokens", _parse_int),
    "chunk_avg_tokens": _Param("chunk_avg_tokens", _parse_int),
    "chunk_max_tokens": _Param("chunk_max_tokens", _parse_int),
    "tls": _Param("tls", _parse_bool),
    "tls_ca_file": _Param("tls_ca_file", _parse_text),
    "tls_cert_file": _Param("tls_cert_file", _parse_text),
    "tls_key_file": _Param("tls_key_file", _parse_text),
    "token": _Param("token", _parse_text),
    "retry_max_attempts": _Param("max_attempts", _parse_int, "retry"),
    "retry_initial_backoff": _Param("initial_backoff_s", _parse_duration, "retry"),
    "retry_max_backoff": _Param("max_backoff_s", _parse_duration, "retry"),
    "retry_backoff_multiplier": _Param("backoff_multiplier", _parse_float, "retry"),
    "retry_codes": _Param("retryable_codes", _parse_codes, "retry"),
    "retry_throttle_max_tokens": _Param("throttle_max_tokens", _parse_int, "retry"),
    "retry_throttle_token_ratio": _Param("throttle_token_ratio", _parse_float, "retry"),
    "cost_enabled": _Param("enabled", _parse_bool, "cost"),
    "cost_prefill_tokens_per_s": _Param("prefill_tokens_per_s", _parse_optional_float, "cost"),
    "cost_default_prefill_tokens_per_s": _Param(
        "default_prefill_tokens_per_s", _parse_float, "cost"
    ),
    "cost_safety_factor": _Param("safety_factor", _parse_float, "cost"),
    "cost_min_samples": _Param("min_samples", _parse_int, "cost"),
    "cost_ewma_alpha": _Param("ewma_alpha", _parse_float, "cost"),
    "cost_window": _Param("window", _parse_int, "cost"),
    "cost_max_age": _Param("max_age_s", _parse_duration, "cost"),
    "cost_probe_share": _Param("probe_share", _parse_float, "cost"),
}


def url_fields() -> set[tuple[str | None, str]]:
    """(group, field) of every config field a URL parameter sets (servers excluded)."""
    return {(p.group, p.attr) for p in URL_PARAMS.values()}


def config_fields() -> set[tuple[str | None, str]]:
    """(group, field) of every leaf field of ClientConfig (servers excluded)."""
    out: set[tuple[str | None, str]] = set()
    for f in fields(ClientConfig):
        if f.name == "retry":
            out |= {("retry", g.name) for g in fields(RetryPolicy)}
        elif f.name == "cost":
            out |= {("cost", g.name) for g in fields(CostConfig)}
        elif f.name != "servers":
            out.add((None, f.name))
    return out
