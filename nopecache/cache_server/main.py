"""Process entry point: build the server from a ServerConfig, run it, shut it down cleanly.

``nopecache-server`` and ``python -m nopecache.cache_server`` both land in :func:`main`.
What one server process runs::

    grpc.aio server (host:port, TLS/mTLS when configured)
      RequestGate (auth.py): token -> tenant, per-client stream limit   metrics HTTP
      nopecache.v1.KVCache  ──> TieredStore ──> tiers (cuda / cpu / redis)   exporter
      grpc.health.v1.Health     ^  observer: ServerMetrics             (metrics_host:
      reflection                |                                       metrics_port)
    tier monitor task ──────────┘  every few seconds: stats -> gauges + per-tier health

Health and reflection pass the gate untouched (no token needed), so probes work;
Health.Watch streams are capped per address (health_port.py). Beside the gRPC port, two
optional listeners: ``health_listen`` (health only, caps of its own: the probes' port) and
``admin_listen`` (the Admin service when it may not share the port: admin_exposure.py).

Shutdown (SIGTERM or SIGINT): health turns NOT_SERVING, the gRPC server stops accepting
and gives in-flight RPCs ``shutdown_grace_s`` to finish, then the store is closed (Redis
connections) and the exporter stopped. The exit status is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import prometheus_client
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # stubs lack aio
from grpc_reflection.v1alpha import reflection

from nopecache.cache_server.admin_exposure import admin_placement, start_admin_listener
from nopecache.cache_server.admin_service import AdminService, add_admin_to_server
from nopecache.cache_server.auth import RequestGate, load_token_table
from nopecache.cache_server.config import (
    ConfigError,
    ServerConfig,
    load_config,
)
from nopecache.cache_server.health_port import (
    WatchLimiter,
    main_port_watches,
    start_health_listener,
)
from nopecache.cache_server.limits import connection_options
from nopecache.cache_server.listeners import LOOPBACK_HOSTS, check_bindable
from nopecache.cache_server.listeners import bind_error as _bind_error
from nopecache.cache_server.metrics import MetricsEndpoint, ServerMetrics
from nopecache.cache_server.pins import PinTable
from nopecache.cache_server.principals import CallLimiter, transport_rpc_cap
from nopecache.cache_server.roles import ADMIN_SERVICE_NAME, AdminGate, load_admin_tokens
from nopecache.cache_server.service import (
    SERVICE_NAME,
    ContextResolver,
    KVCacheService,
    add_to_server,
    default_context,
    server_version,
)
from nopecache.cache_server.store import TieredStore
from nopecache.cache_server.tenants import ANONYMOUS, Tenant
from nopecache.cache_server.tiers import TierError, redact_url
from nopecache.cache_server.tls import load_server_tls
from nopecache.cache_server.verify import BlockVerifier
from nopecache.proto.allocator import tune_malloc

__all__ = ["RunningServer", "main", "serve", "start_server", "tier_health_name", "tune_malloc"]

# How often tier statistics are refreshed into the gauges and the health service.
DEFAULT_MONITOR_INTERVAL_S = 2.0

log = logging.getLogger("nopecache.cache_server")


def tier_health_name(tier: str) -> str:
    """The health-service name that reports one tier (``nopecache.v1.KVCache/tier/redis``)."""
    return f"{SERVICE_NAME}/tier/{tier}"


@dataclass(slots=True)
class RunningServer:
    """A started server; ``stop()`` shuts it down gracefully."""

    config: ServerConfig
    port: int
    server: grpc.aio.Server
    store: TieredStore
    metrics: ServerMetrics
    service: KVCacheService
    health: health_aio.HealthServicer
    metrics_endpoint: MetricsEndpoint | None
    gate: RequestGate
    pins: PinTable
    calls: CallLimiter | None = None
    tls: bool = False
    # Port of the Admin service's own listener, of the health listener (None: none).
    admin_port: int | None = None
    health_port: int | None = None
    # The Health.Watch limits of the gRPC port and of the health listener.
    watches: WatchLimiter | None = None
    health_watches: WatchLimiter | None = None
    # The listeners beside the gRPC port (Admin, health): stopped with it.
    side_servers: list[grpc.aio.Server] = field(default_factory=list)
    _monitor: asyncio.Task[None] | None = field(default=None, repr=False)
    _stopped: bool = False

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight RPCs finish within the grace, close the store."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        # Drain first: readiness off, new Puts refused UNAVAILABLE (clients go elsewhere);
        # then gRPC stops accepting calls and gives those in flight the grace.
        await self.drain()
        await asyncio.gather(self.server.stop(grace), *(s.stop(grace) for s in self.side_servers))
        if self.service.bulk is not None:
            await self.service.bulk.close()
        await self.service.zero_copy.close()
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        try:
            await self.store.close()
        finally:
            if self.metrics_endpoint is not None:
                # The exporter's shutdown waits up to its 0.5 s poll; keep it off the loop.
                await asyncio.to_thread(self.metrics_endpoint.close)

    async def drain(self) -> None:
        """Leave rotation: readiness NOT_SERVING (for good), new Puts refused UNAVAILABLE."""
        self.service.puts.draining = True
        await self.health.enter_graceful_shutdown()

    async def sweep_pins(self) -> None:
        """End the soft pins whose TTL ran out (their Redis copies expire again)."""
        expired = self.pins.expired()
        if expired:
            await self.store.hold(expired, False)

    async def refresh_tiers(self) -> None:
        """Read tier statistics once: update the gauges and the health statuses."""
        stats = await self.store.stats()
        self.metrics.set_tier_stats(stats)
        for tier, corrupt in _corrupt_counts(self.store):
            self.metrics.corrupt_total(tier, corrupt)
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for s in stats:
            await self.health.set(tier_health_name(s.name), serving if s.healthy else not_serving)
        any_up = any(s.healthy for s in stats)
        await self.health.set(SERVICE_NAME, serving if any_up else not_serving)

    async def _monitor_loop(self, interval_s: float) -> None:
        """Refresh tier statistics every ``interval_s`` until cancelled."""
        task = asyncio.current_task()
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep_pins()
                await self.refresh_tiers()
            except Exception:  # a failed probe must not end monitoring; the tier says why
                log.exception("tier statistics refresh failed")
            # redis-py can swallow a cancel that lands inside a command (measured: the
            # command then returns normally), so the CancelledError never reaches this
            # loop although the request stays counted. Honour it here, or stop() would
            # wait for this loop forever.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError


async def start_server(
    config: ServerConfig,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    resolve_context: ContextResolver = default_context,
    credentials: grpc.ServerCredentials | None = None,
    monitor_interval_s: float = DEFAULT_MONITOR_INTERVAL_S,
) -> RunningServer:
    """Build the store, the servicers and the metrics exporter from ``config`` and start them.

    The security layer comes from ``config``: TLS credentials (``tls_*`` files), and a
    :class:`RequestGate` first in the interceptor chain (bearer tokens -> tenants, the
    per-client stream limit). ``interceptors`` run after the gate; ``credentials``
    replaces the configured TLS. By default the port is plaintext and unauthenticated,
    which is why the default host is loopback.
    """
    # Read the secrets and certificates first: a bad file fails before anything starts.
    tokens = load_token_table(config)
    admins = load_admin_tokens(config, tokens)
    tls = load_server_tls(config)
    if credentials is None and tls is not None:
        credentials = tls.credentials()
    if tokens is not None and credentials is None and config.host not in LOOPBACK_HOSTS:
        log.warning(
            "auth is on without TLS on %s: bearer tokens cross the network in clear", config.host
        )
    if config.fault_injection is not None:
        log.warning(
            "FAULT INJECTION IS ON (%s): this server damages, drops and delays blocks it "
            "sends on purpose; for testing and staging only, never in production",
            config.fault_injection,
        )
    metrics = ServerMetrics(version=server_version())
    gate = RequestGate(
        SERVICE_NAME,
        tokens=tokens,
        anonymous=Tenant(ANONYMOUS.name, config.tenant_quota),
        max_streams_per_client=config.max_streams_per_client,
        metrics=metrics,
    )
    admin_gate = AdminGate(admins=admins, tenants=tokens, current=gate.current)
    placement = admin_placement(config, authenticated=tokens is not None or admins is not None)
    for tenant in gate.tenants:
        if tenant.quota_bytes:
            metrics.tenant_usage(tenant.name, 0, tenant.quota_bytes)
    store = TieredStore.from_urls(
        config.tiers,
        write_through=config.write_through,
        observer=metrics,
        verify=BlockVerifier(config.max_block_bytes).check_stored,
        max_blob_bytes=config.max_block_bytes,
    )
    pins = PinTable(config.pin_max_ttl_s)
    store.keep(pins)
    endpoint: MetricsEndpoint | None = None
    side: list[grpc.aio.Server] = []
    admin_port: int | None = None
    health_port: int | None = None
    health_watches: WatchLimiter | None = None
    try:
        service = KVCacheService(store, config, metrics, resolve_context=resolve_context)
        service.pins = pins
        service.offer_zero_copy([t.name for t in gate.tenants])
        calls = CallLimiter(
            SERVICE_NAME,
            tokens=tokens,
            max_concurrent_rpcs=config.max_concurrent_rpcs,
            max_probe_calls_per_peer=config.max_probe_calls_per_peer,
            metrics=metrics,
        )
        watches = WatchLimiter(
            per_peer=config.max_health_watches_per_peer,
            total=main_port_watches(config.max_concurrent_rpcs),
            metrics=metrics,
        )
        server = grpc.aio.server(
            interceptors=[watches, calls, gate, admin_gate, *interceptors],
            # Past what CallLimiter admits: its refusals name the option and spare the
            # clients under their share, gRPC's would refuse everyone alike.
            maximum_concurrent_rpcs=transport_rpc_cap(config.max_concurrent_rpcs),
            options=[
                *config.grpc_options,
                # Fail loudly if another process holds the port instead of sharing it.
                ("grpc.so_reuseport", 0),
                *connection_options(config),
            ],
        )
        add_to_server(service, server)
        health_servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        admin = AdminService(
            store,
            service,
            gate,
            pins,
            metrics,
            on_drain=health_servicer.enter_graceful_shutdown,
        )
        if placement.on_port:
            add_admin_to_server(admin, server)
        if placement.listen is not None:
            listener, admin_port = start_admin_listener(
                config, placement, interceptors=[calls, admin_gate], credentials=credentials
            )
            add_admin_to_server(admin, listener)
            side.append(listener)
        if config.health_listen:
            listener, health_port, health_watches = start_health_listener(
                config, health_servicer, metrics
            )
            side.append(listener)
        reflection.enable_server_reflection(
            [
                SERVICE_NAME,
                *([ADMIN_SERVICE_NAME] if placement.on_port else []),
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
        target = f"{config.host}:{config.port}"
        check_bindable(config.host, config.port, "port", "host")
        try:
            if credentials is None:
                port = server.add_insecure_port(target)
                # Plaintext: Get payloads may also take the bulk byte stream (bulk.py).
                bulk = service.offer_bulk(config.host)
                if config.bulk_listen:
                    try:
                        bulk.listen()
                    except OSError as e:
                        raise ConfigError(
                            f"bulk_listen: cannot listen on {config.bulk_listen}: {e}"
                        ) from e
            else:
                port = server.add_secure_port(target, credentials)
        except RuntimeError as e:  # gRPC says only "Failed to bind": the probe above did not
            raise ConfigError(_bind_error("port", "host", config.host, config.port, str(e))) from e
        if config.metrics:
            check_bindable(config.metrics_host, config.metrics_port, "metrics_port", "metrics_host")
            try:
                endpoint = metrics.serve(
                    config.metrics_host,
                    config.metrics_port,
                    tenant_labels=config.metrics_tenant_labels,
                )
            except OSError as e:
                raise ConfigError(
                    _bind_error(
                        "metrics_port",
                        "metrics_host",
                        config.metrics_host,
                        config.metrics_port,
                        e.strerror or str(e),
                    )
                ) from e
        await server.start()
        for listener in side:
            await listener.start()
    except BaseException:
        await store.close()
        if endpoint is not None:
            endpoint.close()
        raise
    running = RunningServer(
        config=config,
        port=port,
        server=server,
        store=store,
        metrics=metrics,
        service=service,
        health=health_servicer,
        metrics_endpoint=endpoint,
        gate=gate,
        pins=pins,
        calls=calls,
        tls=credentials is not None,
        admin_port=admin_port,
        health_port=health_port,
        side_servers=side,
        watches=watches,
        health_watches=health_watches,
    )
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await running.refresh_tiers()
    running._monitor = asyncio.create_task(running._monitor_loop(monitor_interval_s))
    return running


async def serve(config: ServerConfig) -> int:
    """Run a server until SIGTERM/SIGINT, then shut it down gracefully; the exit status."""
    if config.tune_malloc and not tune_malloc():
        log.info("tune_malloc: not glibc, allocator left as it is")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running = await start_server(config)
    metrics_at = (
        f"{config.metrics_host}:{running.metrics_endpoint.port}"
        if running.metrics_endpoint is not None
        else "off"
    )
    log.info(
        "nopecache-server %s listening on %s (metrics %s; tiers %s; %s; %s)",
        server_version(),
        running.address,
        metrics_at,
        " ".join(redact_url(u) for u in config.tiers),
        "mTLS" if config.tls_client_ca_file else "TLS" if running.tls else "plaintext",
        f"auth: {len(running.gate.tenants)} tenant(s)" if config.auth_enabled else "auth off",
    )
    for what, port, host in (
        ("Admin service", running.admin_port, config.admin_listen.rpartition(":")[0]),
        ("health service", running.health_port, config.health_listen.rpartition(":")[0]),
    ):
        if port is not None:
            log.info("%s on its own listener %s:%d", what, host, port)
    await stop.wait()
    log.info("shutting down: finishing in-flight requests (grace %.1fs)", config.shutdown_grace_s)
    await running.stop()
    log.info("stopped")
    return 0


def _corrupt_counts(store: TieredStore) -> list[tuple[str, int]]:
    """(tier, damaged values found so far) for every tier (memory tiers always count 0)."""
    return [(tier.name, tier.corrupt_values) for tier in store.tiers]


def main(argv: Sequence[str] | None = None) -> int:
    """``nopecache-server`` command line: parse the config, serve, return the exit status."""
    try:
        config = load_config(argv)
    except ConfigError as e:
        print(f"nopecache-server: {e}", file=sys.stderr)
        return 2
    # One `_created` gauge per counter doubles the exposition for no dashboard use.
    prometheus_client.disable_created_metrics()
    logging.basicConfig(
        level=config.log_level_number,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(serve(config))
    except (TierError, ValueError) as e:
        # A tier URL that parses as a URL but not as a tier (bad capacity, unknown scheme),
        # or a port that cannot be bound (ConfigError naming --port / --metrics-port).
        print(f"nopecache-server: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
