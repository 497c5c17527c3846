"""Bearer-token authentication and the per-call gate every KVCache RPC passes.

Tokens. A client sends ``authorization: Bearer <token>`` in its call metadata. The server
knows each token's tenant from one of two sources (both may be used; a token may appear
once)::

    auth_tokens_file   plain text: one "TOKEN TENANT" per line, '#' starts a comment
                       TOML (name ends in .toml):
                           [tenants.alice]
                           tokens = ["<token>", "<next token, for rotation>"]
                           quota = "4GiB"              # optional, overrides tenant_quota
    auth_tokens        the plain-text form inline (NOPECACHE_AUTH_TOKENS), entries
                       separated by newlines or ';'

A token is 16 to 4096 printable ASCII characters without spaces. Configuring any token
turns authentication on; with none (the embedded default) every call is the tenant
``anonymous``. The table is read at start-up: rotate by listing the new token next to
the old one, restarting, then removing the old one.

Comparison. The presented token and every configured token are hashed with SHA-256 and
compared with ``hmac.compare_digest`` against *every* entry, without stopping at the
first match: the time taken depends on the number of tokens only, not on how many
leading bytes a guess got right nor on which entry matched (and hashing first hides the
configured tokens' lengths). No dict is keyed by a token.

The gate (:class:`RequestGate`, a grpc.aio server interceptor) runs for every
``nopecache.v1.KVCache`` call; other services (health, reflection) pass untouched so
that probes and tooling work without a token: they reveal nothing stored. For a KVCache
call it

1. authenticates (when on): a missing, malformed or wrong token gets ``UNAUTHENTICATED``
   before the request is read, so the call changes nothing;
2. admits the call if its client has fewer than ``max_streams_per_client`` calls in
   flight, else ``RESOURCE_EXHAUSTED``; the client is the tenant when auth is on, the
   connection (peer address) when it is off;
3. sets :data:`~nopecache.cache_server.tenants.CURRENT_TENANT` for the servicer (which
   namespaces keys and charges quotas with it) and counts the request per tenant.

Concurrency: the gate and its counters are used from the event loop only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import tomllib
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from nopecache.cache_server.config import ConfigError, ServerConfig
from nopecache.cache_server.interception import (
    Handler,
    WrappingInterceptor,
    behavior,
    guarded,
    like,
)
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.sizes import SizeError, parse_size
from nopecache.cache_server.tenants import (
    ANONYMOUS,
    CURRENT_TENANT,
    Tenant,
    TenantError,
    check_distinct,
)

__all__ = [
    "MAX_TOKEN_CHARS",
    "MIN_TOKEN_CHARS",
    "AuthFailure",
    "ClientLimiter",
    "RequestGate",
    "TokenTable",
    "bearer_token",
    "load_token_table",
    "parse_token_lines",
    "tenant_of",
]

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AuthFailure:
    """Why a call was not authenticated: a metric label and the message the client sees."""

    reason: str  # "missing" | "malformed" | "invalid"
    message: str


@dataclass(frozen=True, slots=True)
class _Credential:
    digest: bytes = b""
    tenant: Tenant = ANONYMOUS


def _check_token(token: str, where: str) -> None:
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ConfigError(
            f"{where}: a token must be {MIN_TOKEN_CHARS}-{MAX_TOKEN_CHARS} characters, "
            f"got {len(token)}"
        )
    if not all("!" <= c <= "~" for c in token):
        raise ConfigError(f"{where}: a token must be printable ASCII without spaces")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """The configured tokens and the tenant each one authenticates as."""

    def __init__(self, entries: Iterable[tuple[str, Tenant]]) -> None:
        credentials: list[_Credential] = []
        seen: set[bytes] = set()
        tenants: dict[str, Tenant] = {}
        for token, tenant in entries:
            digest = _digest(token)
            if digest in seen:
                raise ConfigError(f"tokens: a token is listed twice (tenant {tenant.name})")
            seen.add(digest)
            known = tenants.setdefault(tenant.name, tenant)
            if known != tenant:
                raise ConfigError(f"tokens: tenant {tenant.name} is defined twice differently")
            credentials.append(_Credential(digest, tenant))
        if not credentials:
            raise ConfigError("tokens: authentication is configured but lists no token")
        try:
            check_distinct(tenants.values())
        except TenantError as e:
            raise ConfigError(f"tokens: {e}") from e
        self._credentials = tuple(credentials)
        self._tenants = tuple(tenants.values())

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """Every tenant some token maps to."""
        return self._tenants

    def __len__(self) -> int:
        return len(self._credentials)

    def match(self, token: str) -> Tenant | None:
        """The tenant ``token`` belongs to, or None (constant time in the token's content)."""
        digest = _digest(token)
        found: Tenant | None = None
        for credential in self._credentials:
            # No break: every entry is compared whatever matched (see the module docstring).
            if hmac.compare_digest(digest, credential.digest):
                found = credential.tenant
        return found


def parse_token_lines(text: str, where: str, quota_bytes: int) -> list[tuple[str, Tenant]]:
    """(token, tenant) pairs of the plain-text form: ``TOKEN TENANT`` per line or ';' entry."""
    pairs: list[tuple[str, Tenant]] = []
    tenants: dict[str, Tenant] = {}
    for number, line in enumerate(text.replace(";", "\n").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            # Never echo the line: it holds a token.
            raise ConfigError(
                f"{where}: entry {number}: expected 'TOKEN TENANT', got {len(parts)} fields"
            )
        token, name = parts
        _check_token(token, f"{where}: entry {number}")
        tenant = tenants.get(name)
        if tenant is None:
            try:
                tenant = tenants[name] = Tenant.named(name, quota_bytes)
            except TenantError as e:
                raise ConfigError(f"{where}: entry {number}: {e}") from e
        pairs.append((token, tenant))
    return pairs


def _parse_token_toml(
    data: dict[str, Any], where: str, quota_bytes: int
) -> list[tuple[str, Tenant]]:
    unknown = sorted(set(data) - {"tenants"})
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {unknown}; expected [tenants.NAME]")
    section = data.get("tenants", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: 'tenants' must be a table of [tenants.NAME] tables")
    pairs: list[tuple[str, Tenant]] = []
    for name, spec in section.items():
        here = f"{where}: tenants.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{here}: must be a table with 'tokens' (and 'quota')")
        extra = sorted(set(spec) - {"tokens", "quota"})
        if extra:
            raise ConfigError(f"{here}: unknown key(s) {extra}; known: tokens, quota")
        tokens = spec.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ConfigError(f"{here}.tokens: must be a non-empty list of strings")
        quota = quota_bytes
        if "quota" in spec:
            try:
                quota = parse_size(spec["quota"], field=f"{here}.quota")
            except SizeError as e:
                raise ConfigError(str(e)) from e
        try:
            tenant = Tenant.named(name, quota)
        except TenantError as e:
            raise ConfigError(f"{here}: {e}") from e
        for i, token in enumerate(tokens):
            if not isinstance(token, str):
                raise ConfigError(f"{here}.tokens[{i}]: must be a string")
            _check_token(token, f"{here}.tokens[{i}]")
            pairs.append((token, tenant))
    return pairs


def load_token_table(config: ServerConfig) -> TokenTable | None:
    """The tokens of ``config`` (file and inline), or None when authentication is off."""
    if not config.auth_enabled:
        return None
    pairs: list[tuple[str, Tenant]] = []
    if config.auth_tokens_file:
        path = Path(config.auth_tokens_file)
        where = f"auth_tokens_file {path}"
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read: {e.strerror}") from e
        if path.suffix == ".toml":
            try:
                data = tomllib.loads(raw.decode())
            except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
                # The decoder's message may quote a token: keep only its position.
                position = str(e).rpartition("(")[2].rstrip(")") if "(" in str(e) else ""
                raise ConfigError(f"{where}: not valid TOML ({position})") from None
            pairs += _parse_token_toml(data, where, config.tenant_quota)
        else:
            try:
                text = raw.decode("ascii")
            except UnicodeDecodeError:
                raise ConfigError(f"{where}: must be ASCII text") from None
            pairs += parse_token_lines(text, where, config.tenant_quota)
    if config.auth_tokens:
        pairs += parse_token_lines(config.auth_tokens, "auth_tokens", config.tenant_quota)
    return TokenTable(pairs)


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | AuthFailure:
    """The token of an ``authorization: Bearer <token>`` metadata entry, or why there is none."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return AuthFailure(
            "missing",
            "authorization: no bearer token (send metadata 'authorization: Bearer <token>')",
        )
    if len(values) > 1:
        return AuthFailure("malformed", "authorization: given more than once")
    value = values[0]
    if isinstance(value, bytes):
        return AuthFailure("malformed", "authorization: expected text 'Bearer <token>'")
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return AuthFailure("malformed", "authorization: expected 'Bearer <token>'")
    return token


def tenant_of(
    tokens: TokenTable, metadata: Sequence[tuple[str, str | bytes]] | None
) -> Tenant | AuthFailure:
    """The tenant named by the bearer token in a call's ``metadata``, or why none is."""
    token = bearer_token(metadata)
    if isinstance(token, AuthFailure):
        return token
    tenant = tokens.match(token)
    if tenant is None:
        return AuthFailure("invalid", "authorization: invalid token")
    return tenant


UNCOUNTED_METHODS = frozenset({"WatchRemovals"})
"""Streams open for a client's whole life (a watch): authenticated and tagged with the
tenant, but not counted in flight: counted, one would hold a stream slot for good and keep
every Drain waiting on a call that never ends."""


class ClientLimiter:
    """Counts in-flight calls per client and refuses those over the limit."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self.limit = limit
        self._in_flight: dict[str, int] = {}

    def acquire(self, client: str) -> bool:
        """Take a slot for ``client``; False (nothing taken) when it has ``limit`` already."""
        n = self._in_flight.get(client, 0)
        if n >= self.limit:
            return False
        self._in_flight[client] = n + 1
        return True

    def release(self, client: str) -> None:
        """Give back a slot taken by ``acquire``."""
        n = self._in_flight[client] - 1
        if n:
            self._in_flight[client] = n
        else:
            del self._in_flight[client]

    def in_flight(self, client: str | None = None) -> int:
        """Calls in flight for ``client``, or for all clients."""
        if client is None:
            return sum(self._in_flight.values())
        return self._in_flight.get(client, 0)


class RequestGate(WrappingInterceptor):
    """Authenticates, limits and tags each call of one service (see the module docstring)."""

    def __init__(
        self,
        service_name: str,
        *,
        tokens: TokenTable | None,
        anonymous: Tenant,
        max_streams_per_client: int,
        metrics: ServerMetrics,
    ) -> None:
        self.covers = f"/{service_name}/"
        self._tokens = tokens
        self._anonymous = anonymous
        self.limiter = ClientLimiter(max_streams_per_client)
        self._metrics = metrics
        # Tenant name -> quota set at run time (Admin.SetQuota); replaces the configured one.
        self.quota_overrides: dict[str, int] = {}

    def current(self, tenant: Tenant) -> Tenant:
        """``tenant`` as it is now: with the quota set at run time, if any."""
        quota = self.quota_overrides.get(tenant.name)
        return tenant if quota is None else replace(tenant, quota_bytes=quota)

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """The tenants calls can be tagged with."""
        return self._tokens.tenants if self._tokens is not None else (self._anonymous,)

    def wrap(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        """The handler that serves this call: the real one wrapped, or one that refuses."""
        method = details.method[len(self.covers) :]
        if self._tokens is None:
            return self._admitting(handler, method, self.current(self._anonymous))
        tenant = tenant_of(self._tokens, details.invocation_metadata)
        if isinstance(tenant, AuthFailure):
            return self._refusing(handler, method, tenant)
        return self._admitting(handler, method, self.current(tenant))

    def _refusing(self, handler: Handler, method: str, failure: AuthFailure) -> Handler:
        self._metrics.auth_failure(failure.reason)
        log.debug("%s refused UNAUTHENTICATED (%s)", method, failure.reason)
        code, message = grpc.StatusCode.UNAUTHENTICATED, failure.message

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        async def refuse_stream(
            request: object, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            await context.abort(code, message)
            yield b""  # never reached: abort raises; the yield makes this a stream handler

        # No deserializer: the request of a refused call is never parsed.
        return like(handler, refuse, refuse_stream, deserializer=None)

    def _admitting(self, handler: Handler, method: str, tenant: Tenant) -> Handler:
        limiter, metrics = self.limiter, self._metrics
        by_tenant = self._tokens is not None

        async def enter(context: grpc.aio.ServicerContext) -> str:
            client = tenant.name if by_tenant else context.peer()
            if not limiter.acquire(client):
                metrics.rejected(method, "too_many_streams")
                metrics.tenant_rejected(tenant.name, "too_many_streams")
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"max_streams_per_client: {limiter.limit} calls already in flight for "
                    f"this {'tenant' if by_tenant else 'connection'}",
                )
            CURRENT_TENANT.set(tenant)
            metrics.tenant_request(tenant.name, method)
            return client

        if method in UNCOUNTED_METHODS and handler.response_streaming:
            inner = behavior(handler)

            async def uncounted(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                CURRENT_TENANT.set(tenant)
                async for message in inner(request, context):
                    yield message

            return like(handler, uncounted, uncounted, deserializer=handler.request_deserializer)
        return guarded(handler, enter, limiter.release)
