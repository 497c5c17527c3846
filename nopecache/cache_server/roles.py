"""Roles for the Admin service: who is calling, and what they may do.

Two roles::

    admin    an admin token (admin_tokens / admin_tokens_file), or any caller when no
             token of any kind is configured (the embedded default: like the KVCache
             service, loopback and open). Acts on any tenant or on everything: flush all,
             set quotas, drain.
    tenant   a tenant token (the KVCache tokens, auth.py). Acts on its own namespace only:
             stats, lookup, flush, pin and unpin of its own blocks, show its own quota.

Admin tokens are listed one per line (``#`` comments) in the file, or inline separated by
';' or newlines; each is 16-4096 printable ASCII characters, distinct from every tenant
token. They are compared like tenant tokens (SHA-256 then ``hmac.compare_digest`` against
every entry, no early exit). An admin token is not a tenant token: on a server with tenant
tokens, KVCache calls made with it are refused (UNAUTHENTICATED).

When tenant tokens are configured and admin tokens are not, no caller is the admin (the
admin verbs answer PERMISSION_DENIED); configure an admin token to flush all, set quotas
or drain on such a server.

:class:`AdminGate` (a grpc.aio server interceptor) runs for ``nopecache.v1.Admin`` calls
only: it authenticates, then sets :data:`CURRENT_PRINCIPAL` for the servicer
(admin_service.py), which checks each verb's role.

Concurrency: event loop only.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from nopecache.cache_server.auth import (
    MAX_TOKEN_CHARS,
    MIN_TOKEN_CHARS,
    AuthFailure,
    TokenTable,
    bearer_token,
)
from nopecache.cache_server.config import ConfigError, ServerConfig
from nopecache.cache_server.interception import Handler, WrappingInterceptor, guarded
from nopecache.cache_server.tenants import Tenant

__all__ = [
    "ADMIN_SERVICE_NAME",
    "CURRENT_PRINCIPAL",
    "AdminGate",
    "AdminTokens",
    "Principal",
    "load_admin_tokens",
]

ADMIN_SERVICE_NAME = "nopecache.v1.Admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller of an Admin RPC: the admin, or one tenant."""

    admin: bool
    tenant: Tenant | None = None


CURRENT_PRINCIPAL: contextvars.ContextVar[Principal] = contextvars.ContextVar("nopecache_principal")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class AdminTokens:
    """The configured admin tokens (digests only)."""

    def __init__(self, tokens: list[str]) -> None:
        if not tokens:
            raise ConfigError("admin_tokens: configured but lists no token")
        digests = [_digest(t) for t in tokens]
        if len(set(digests)) != len(digests):
            raise ConfigError("admin_tokens: a token is listed twice")
        self._digests = tuple(digests)

    def __len__(self) -> int:
        return len(self._digests)

    def match(self, token: str) -> bool:
        """Whether ``token`` is an admin token (constant time in the token's content)."""
        digest = _digest(token)
        found = False
        for known in self._digests:
            # No break: every entry is compared whatever matched.
            found |= hmac.compare_digest(digest, known)
        return found

    def overlaps(self, table: TokenTable, tokens: list[str]) -> bool:
        """Whether any of ``tokens`` (the admin ones) is also a tenant token of ``table``."""
        return any(table.match(t) is not None for t in tokens)


def _parse(text: str, where: str) -> list[str]:
    tokens = []
    for number, line in enumerate(text.replace(";", "\n").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if " " in line or "\t" in line:
            raise ConfigError(f"{where}: entry {number}: expected one token per line")
        if not MIN_TOKEN_CHARS <= len(line) <= MAX_TOKEN_CHARS:
            raise ConfigError(
                f"{where}: entry {number}: a token must be {MIN_TOKEN_CHARS}-{MAX_TOKEN_CHARS} "
                f"characters, got {len(line)}"
            )
        if not all("!" <= c <= "~" for c in line):
            raise ConfigError(f"{where}: entry {number}: a token must be printable ASCII")
        tokens.append(line)
    return tokens


def load_admin_tokens(config: ServerConfig, tenants: TokenTable | None) -> AdminTokens | None:
    """The admin tokens of ``config`` (file and inline), or None when none is configured."""
    if not config.admin_auth_enabled:
        return None
    tokens: list[str] = []
    if config.admin_tokens_file:
        path = Path(config.admin_tokens_file)
        where = f"admin_tokens_file {path}"
        try:
            text = path.read_bytes().decode("ascii")
        except OSError as e:
            raise ConfigError(f"{where}: cannot read: {e.strerror}") from e
        except UnicodeDecodeError:
            raise ConfigError(f"{where}: must be ASCII text") from None
        tokens += _parse(text, where)
    if config.admin_tokens:
        tokens += _parse(config.admin_tokens, "admin_tokens")
    table = AdminTokens(tokens)
    if tenants is not None and table.overlaps(tenants, tokens):
        raise ConfigError("admin_tokens: a token is also a tenant token; use distinct tokens")
    return table


class AdminGate(WrappingInterceptor):
    """Authenticates Admin calls and tags them with a :class:`Principal`."""

    def __init__(
        self,
        *,
        admins: AdminTokens | None,
        tenants: TokenTable | None,
        current: Callable[[Tenant], Tenant],
    ) -> None:
        """``current`` maps a tenant to its state now (quota set at run time)."""
        self.covers = f"/{ADMIN_SERVICE_NAME}/"
        self._admins = admins
        self._tenants = tenants
        self._current = current
        # No token configured at all: every caller is the admin.
        self._open = admins is None and tenants is None

    def wrap(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        """The handler of this call: tagged with its principal, or one that refuses."""
        if self._open:
            return _tagged(handler, Principal(admin=True))
        token = bearer_token(details.invocation_metadata)
        if isinstance(token, AuthFailure):
            return _refusing(handler, token.message)
        if self._admins is not None and self._admins.match(token):
            return _tagged(handler, Principal(admin=True))
        tenant = self._tenants.match(token) if self._tenants is not None else None
        if tenant is None:
            return _refusing(handler, "authorization: invalid token")
        return _tagged(handler, Principal(admin=False, tenant=self._current(tenant)))


def _tagged(handler: Handler, principal: Principal) -> Handler:
    assert handler.unary_unary is not None, "every Admin RPC is unary"

    async def enter(context: grpc.aio.ServicerContext) -> None:
        CURRENT_PRINCIPAL.set(principal)

    return guarded(handler, enter, _hold_nothing)


def _hold_nothing(held: None) -> None:
    """Tagging takes no slot: nothing to give back."""


def _refusing(handler: Handler, message: str) -> Handler:
    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    # The request of a refused call is never parsed.
    return grpc.unary_unary_rpc_method_handler(refuse, None, handler.response_serializer)
