"""Health that an attacker cannot take: Watch streams limited per address, and a health
listener of its own outside the gRPC port's caps.

``grpc.health.v1.Health`` needs no token (probes carry none), so only the caller's
address tells callers apart. Two walls:

1. :class:`WatchLimiter`, first in every listener's interceptor chain, caps the
   never-ending ``Health.Watch`` streams: ``max_health_watches_per_peer`` per address and
   a total per listener. On the gRPC port the total is half of what tokenless calls may
   hold there (principals.py, ``PROBE_SHARE``), so Watch streams from any number of
   addresses leave the other half to ``Health.Check``. Refusals are RESOURCE_EXHAUSTED
   naming the option.
2. ``health_listen`` (``HOST:PORT``): a second gRPC server that serves the same health
   statuses and nothing else, with its own small connection and call caps, so that
   clients filling the gRPC port's connections (``max_connections``) or call slots
   (``max_concurrent_rpcs``) cannot fail a liveness probe. The Kubernetes probes and the
   image's HEALTHCHECK point at it; the NetworkPolicy lets only the node (kubelet) reach
   it, which is what keeps its connection slots from being hoarded.

      gRPC port (max_connections, CallLimiter, ...)     health_listen (its own caps)
        KVCache, Admin, Health, reflection                Health only
        WatchLimiter: per address, total = probes / 2     WatchLimiter: per address,
                                                          HEALTH_PORT_WATCHES in all

Concurrency: event loop only (the interceptor's counters, like principals.py).
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # stubs lack aio

from nopecache.cache_server.config import ServerConfig, split_listen
from nopecache.cache_server.interception import Handler, WrappingInterceptor, guarded
from nopecache.cache_server.limits import FLOW_CONTROL
from nopecache.cache_server.listeners import listen
from nopecache.cache_server.metrics import ServerMetrics
from nopecache.cache_server.principals import PROBE_SHARE, peer_address

__all__ = [
    "HEALTH_PORT_CONNECTIONS",
    "HEALTH_PORT_WATCHES",
    "WATCH_METHOD",
    "WatchLimiter",
    "main_port_watches",
    "start_health_listener",
]

WATCH_METHOD = "/grpc.health.v1.Health/Watch"
# The health listener serves probes: a kubelet opens a connection per probe, three probes
# per pod. These caps leave room for many probers while bounding what the listener holds.
HEALTH_PORT_CONNECTIONS = 64
HEALTH_PORT_WATCHES = 32
# Checks are answered at once; past the Watch streams they get as many slots again.
_HEALTH_PORT_RPCS = 2 * HEALTH_PORT_WATCHES
# A probe's connection carries one Check and closes; one that sits idle is closed soon.
_HEALTH_PORT_IDLE_S = 10.0

log = logging.getLogger(__name__)


def main_port_watches(max_concurrent_rpcs: int) -> int:
    """The Watch streams the gRPC port holds in all: half the tokenless calls' slots."""
    return max(1, max_concurrent_rpcs // PROBE_SHARE // 2)


class WatchLimiter(WrappingInterceptor):
    """Refuses a ``Health.Watch`` past ``per_peer`` from its address or ``total`` in all."""

    covers = WATCH_METHOD

    def __init__(self, *, per_peer: int, total: int, metrics: ServerMetrics) -> None:
        if per_peer < 1 or total < 1:
            raise ValueError("per_peer and total must be >= 1")
        self.per_peer = per_peer
        self.total_cap = total
        self._metrics = metrics
        self._held: dict[str, int] = {}
        self.total = 0

    def held(self, address: str) -> int:
        """Watch streams open from ``address`` (``ipv4:127.0.0.1``)."""
        return self._held.get(address, 0)

    def refusal(self, address: str) -> str | None:
        """Why a new Watch from ``address`` is refused now, or None when it is admitted."""
        if self._held.get(address, 0) >= self.per_peer:
            return (
                f"max_health_watches_per_peer: {self.per_peer} Health.Watch streams already "
                "open from this address"
            )
        if self.total >= self.total_cap:
            return f"Health.Watch: {self.total_cap} streams open on this listener, all in use"
        return None

    def _give(self, address: str) -> None:
        n = self._held[address] - 1
        if n:
            self._held[address] = n
        else:
            del self._held[address]
        self.total -= 1

    def wrap(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        """The Watch handler, wrapped to take and give back its address's slot."""

        async def enter(context: grpc.aio.ServicerContext) -> str:
            address = peer_address(context.peer())
            why = self.refusal(address)
            if why is not None:
                self._metrics.rejected("Watch", "too_many_watches")
                log.debug("Health.Watch refused for %s: %s", address, why)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, why)
            self._held[address] = self._held.get(address, 0) + 1
            self.total += 1
            return address

        return guarded(handler, enter, self._give)


def start_health_listener(
    config: ServerConfig,
    health: health_aio.HealthServicer,
    metrics: ServerMetrics,
) -> tuple[grpc.aio.Server, int, WatchLimiter]:
    """The health listener at ``config.health_listen`` (not started yet), its port, its
    Watch limiter.

    Plaintext even when the gRPC port speaks TLS: kubelet's gRPC probes cannot do TLS,
    and serving statuses are no secret.
    """
    host, port = split_listen(config.health_listen, "health_listen")
    limiter = WatchLimiter(
        per_peer=config.max_health_watches_per_peer, total=HEALTH_PORT_WATCHES, metrics=metrics
    )
    server = grpc.aio.server(
        interceptors=[limiter],
        maximum_concurrent_rpcs=_HEALTH_PORT_RPCS,
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_allowed_incoming_connections", HEALTH_PORT_CONNECTIONS),
            ("grpc.server_handshake_timeout_ms", round(config.handshake_timeout_s * 1000)),
            ("grpc.max_connection_idle_ms", round(_HEALTH_PORT_IDLE_S * 1000)),
            *FLOW_CONTROL,
        ],
    )
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = listen(server, host, port, None, option="health_listen", host_option="health_listen")
    return server, bound, limiter
