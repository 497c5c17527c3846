"""Where the Admin service listens: never open to the network by default.

With no token of any kind configured, every Admin caller is the admin (roles.py): it may
flush everything, set quotas and drain the server. So an unauthenticated Admin service
stays on this machine unless the operator says otherwise (``admin_listen``)::

    admin_listen   tokens configured         no token at all
    ''  (auto)     on the gRPC port          on the gRPC port if host is 127.0.0.1, ::1 or
                                             localhost; else off (a warning says how to
                                             turn it on)
    port           on the gRPC port          on the gRPC port (warning unless loopback)
    HOST:PORT      a listener of its own     a listener of its own (warning unless HOST
                   (same TLS as the port)    is loopback); the gRPC port has no Admin
    off            off                       off

"Tokens configured" means admin tokens or tenant tokens: with tenant tokens only, Admin
calls need a tenant token and act on that tenant's namespace, no more than its KVCache
calls may (roles.py). "Loopback" is listeners.LOOPBACK_HOSTS: 127.0.0.2 and the other
127/8 addresses count as reachable, the address a server was told to be reached by.

A listener of its own takes the gRPC port's connection limits and TLS credentials and
serves ``nopecache.v1.Admin`` only, through the CallLimiter (its calls count with the
port's) and the AdminGate; ``kubectl exec POD --
nopecache-admin --server 127.0.0.1:PORT ...`` reaches a loopback one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from nopecache.cache_server.config import ServerConfig, split_listen
from nopecache.cache_server.limits import connection_options
from nopecache.cache_server.listeners import LOOPBACK_HOSTS, listen

__all__ = ["AdminPlacement", "admin_placement", "start_admin_listener"]

log = logging.getLogger("nopecache.cache_server")


@dataclass(frozen=True, slots=True)
class AdminPlacement:
    """Where the Admin service is served: on the gRPC port, on ``listen``, or nowhere."""

    on_port: bool
    listen: tuple[str, int] | None = None

    @property
    def served(self) -> bool:
        """Whether the Admin service is served at all."""
        return self.on_port or self.listen is not None


def admin_placement(config: ServerConfig, *, authenticated: bool) -> AdminPlacement:
    """Where ``config`` puts the Admin service, logging a warning where it is open or off.

    ``authenticated``: whether any token (admin or tenant) is configured.
    """
    where = config.admin_listen
    if where == "off":
        return AdminPlacement(on_port=False)
    if where == "":
        if authenticated or config.host in LOOPBACK_HOSTS:
            return AdminPlacement(on_port=True)
        log.warning(
            "Admin service off: no admin or tenant token is configured and the gRPC port "
            "listens on %s, where anyone who reaches it could flush, set quotas and drain. "
            "Set admin_tokens (--admin-tokens-file), or serve it on loopback with "
            "--admin-listen 127.0.0.1:PORT, or open on the gRPC port with --admin-listen port",
            config.host,
        )
        return AdminPlacement(on_port=False)
    if where == "port":
        _warn_if_open(config.host, authenticated)
        return AdminPlacement(on_port=True)
    host, port = split_listen(where, "admin_listen")
    _warn_if_open(host, authenticated)
    return AdminPlacement(on_port=False, listen=(host, port))


def _warn_if_open(host: str, authenticated: bool) -> None:
    if authenticated or host in LOOPBACK_HOSTS:
        return
    log.warning(
        "Admin service open without tokens on %s: anyone who reaches it can flush every "
        "tenant, set quotas and drain this server (admin_listen); set admin_tokens "
        "(--admin-tokens-file) to require a token",
        host,
    )


def start_admin_listener(
    config: ServerConfig,
    placement: AdminPlacement,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    credentials: grpc.ServerCredentials | None,
) -> tuple[grpc.aio.Server, int]:
    """A server (not started yet) for the Admin listener of ``placement``, and its port.

    The caller registers the Admin service on it.
    """
    assert placement.listen is not None, "the Admin service has no listener of its own"
    host, port = placement.listen
    server = grpc.aio.server(
        interceptors=list(interceptors),
        options=[*config.grpc_options, ("grpc.so_reuseport", 0), *connection_options(config)],
    )
    bound = listen(
        server, host, port, credentials, option="admin_listen", host_option="admin_listen"
    )
    return server, bound
