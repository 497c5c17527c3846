#!/usr/bin/env python3
"""Container health check: exit 0 when the local nopecache server's gRPC health says SERVING.

The image's ``HEALTHCHECK`` runs this as ``nopecache-healthcheck``. It finds the port the
way the server does (``NOPECACHE_*`` environment, then the TOML file named by
``NOPECACHE_CONFIG``, then the defaults), so the check follows a port set there; with
``health_listen`` set it asks that listener, which the gRPC port's caps do not reach. Options
passed as command-line flags to the entrypoint are not visible here: set the port through
the environment or the config file when the container's health matters.

Exit status: 0 SERVING, 1 anything else (not listening, NOT_SERVING, unknown service,
timeout), 2 unusable configuration. Kubernetes does not use this: its native gRPC
probes ask the same health service directly, on the health listener.

    nopecache-healthcheck [SERVICE]     default SERVICE: nopecache.v1.KVCache
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nopecache.cache_server.config import ConfigError, load_config, split_listen

# The name under which the server reports "at least one tier answers" (service.SERVICE_NAME);
# "" reports only that the process serves gRPC at all.
DEFAULT_SERVICE = "nopecache.v1.KVCache"
TIMEOUT_S = 3.0
# Addresses that mean "every interface": the check connects over loopback instead.
_WILDCARDS = frozenset({"0.0.0.0", "::", "[::]", ""})


def probe_target(host: str, port: int) -> str:
    """The address to reach a server bound to ``host:port`` from inside its container."""
    if host in _WILDCARDS:
        return f"127.0.0.1:{port}"
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def check(target: str, service: str, timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """Ask the health service at ``target`` about ``service``; (serving, what it said)."""
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            return False, f"{target}: health check failed: {code.name if code else e}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: check the local server; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1:
        print("usage: nopecache-healthcheck [SERVICE]", file=sys.stderr)
        return 2
    service = args[0] if args else DEFAULT_SERVICE
    try:
        config = load_config([])
    except ConfigError as e:
        print(f"nopecache-healthcheck: {e}", file=sys.stderr)
        return 2
    # The health listener when there is one: it answers whatever fills the gRPC port.
    host, port = (
        split_listen(config.health_listen, "health_listen")
        if config.health_listen
        else (config.host, config.port)
    )
    serving, said = check(probe_target(host, port), service)
    print(f"nopecache-healthcheck: {said!s} (service {service!r})", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
