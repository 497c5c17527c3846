"""A real cache server whose Lookups are slow on purpose: the scheduler-never-waits tests.

:class:`SlowLookups` is a gRPC server interceptor: every ``Lookup`` is held ``delay_s``
seconds; the next ``gated`` ones then, while a ``release`` condition is set, until it is
true (a test's event: what must have happened while the lookup was in flight), with a
hang guard. Every other RPC passes untouched (a store's own lookup, which skips blocks
the server holds, comes after the gated one and is only delayed). :class:`SlowServer` runs the real server (``start_server``, CPU
tier) with it in this process, on its own event-loop thread, on a loopback port, so
synchronous tests and engine processes reach it like any server.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.main import RunningServer, start_server

__all__ = ["SlowLookups", "SlowServer"]

# Only a hang guard for a release that never comes (the test then fails on what it
# expected to happen while the lookup was held).
_RELEASE_GUARD_S = 120.0


class SlowLookups(grpc.aio.ServerInterceptor):
    """Holds Lookups (see the module docstring); counts them held and answered."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.release: Callable[[], Awaitable[bool]] | None = None
        self.gated = 1
        self.held = 0
        self.answered = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The Lookup handler wrapped in the hold; any other handler as it is."""
        handler = await continuation(handler_call_details)
        method = getattr(handler_call_details, "method", "")
        if handler is None or not method.endswith("/Lookup") or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary

        async def held(request: Any, context: grpc.aio.ServicerContext) -> Any:
            self.held += 1
            gated = self.release is not None and self.gated > 0
            self.gated -= gated
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            deadline = time.monotonic() + _RELEASE_GUARD_S
            while gated and self.release is not None and not await self.release():
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            reply = await inner(request, context)  # type: ignore[arg-type]  # an aio handler
            self.answered += 1
            return reply

        return grpc.unary_unary_rpc_method_handler(
            held,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class SlowServer:
    """A real cache server with :class:`SlowLookups`, in process on its own loop thread."""

    def __init__(self, delay_s: float = 0.0) -> None:
        """Start it on a free loopback port (CPU tier, 256 MiB, unpinned)."""
        self.lookups = SlowLookups(delay_s)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        config = ServerConfig(port=0, metrics=False, tiers=("cpu://?capacity=256MiB&pinned=no",))
        self.running: RunningServer = self.call(start_server(config, interceptors=[self.lookups]))

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return self.running.address

    def call(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    async def entries(self) -> int:
        """Entries the server holds (on its loop)."""
        return sum(t.entries for t in await self.running.store.stats())

    def stop(self) -> None:
        """Stop the server and its loop thread."""
        self.lookups.release = None
        self.call(self.running.stop(grace_s=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
