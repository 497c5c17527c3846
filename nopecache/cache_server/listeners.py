"""Binding a gRPC server's listening port: a busy or unresolvable address is one clear line.

Used for the gRPC port and the listeners beside it (admin_exposure.py, health_port.py).
"""

from __future__ import annotations

import socket

import grpc

from nopecache.cache_server.config import ConfigError, env_name, flag_name

__all__ = ["LOOPBACK_HOSTS", "bind_error", "check_bindable", "listen"]

# The hosts that mean "this machine only" for the exposure rules (admin_exposure.py, the
# TLS warning). Other 127.0.0.0/8 addresses count as reachable: a server bound to one was
# meant to be reached by that address, and tests use 127.0.0.2 for a routable address.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def bind_error(option: str, host_option: str, host: str, port: int, why: str) -> str:
    """The one-line start-up error for a port that cannot be bound, naming the options."""
    if option == host_option:  # a HOST:PORT option (admin_listen, health_listen)
        return (
            f"{option}: cannot listen on {host}:{port} ({why}); choose another address or "
            f"port with {flag_name(option)} (or {env_name(option)})"
        )
    return (
        f"{option}: cannot listen on {host}:{port} ({why}); choose another port with "
        f"{flag_name(option)} (or {env_name(option)}), or another address with "
        f"{flag_name(host_option)}"
    )


def check_bindable(host: str, port: int, option: str, host_option: str) -> None:
    """Raise ConfigError naming ``option`` unless ``host:port`` can be bound now.

    Probed with a plain socket before gRPC or the metrics exporter try it, so a busy port
    is one clear line (gRPC's own failure is a generic message plus a core log line).
    Port 0 (any free port) always binds.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"{host_option}: cannot resolve {host!r} ({e.strerror})") from e
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # As the real listeners do: a port left in TIME_WAIT by a previous server is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise ConfigError(
                bind_error(option, host_option, host, port, e.strerror or str(e))
            ) from e


def listen(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
    *,
    option: str,
    host_option: str,
) -> int:
    """Add ``host:port`` to ``server`` (TLS with ``credentials``); the port bound."""
    check_bindable(host, port, option, host_option)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if credentials is None:
            return int(server.add_insecure_port(target))
        return int(server.add_secure_port(target, credentials))
    except RuntimeError as e:  # gRPC says only "Failed to bind": the probe above did not
        raise ConfigError(bind_error(option, host_option, host, port, str(e))) from e
