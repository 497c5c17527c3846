"""A real in-process server with tenants, for tests: two tenants' bearer tokens, a channel
that sends a token on every call, a harness with one channel per token, and the status a
call ends with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc

from nopecache.cache_server.config import ServerConfig
from nopecache.cache_server.main import RunningServer, start_server
from nopecache.proto import cache_pb2_grpc
from tests.support.server_harness import SMALL

ALICE = "alice-token-7f3a9c1e5b2d4068"
BOB = "bob-token-2c8e6a4f1d3b5079"
AUTH = replace(SMALL, auth_tokens=f"{ALICE} alice; {BOB} bob")


class _Bearer:
    """Adds ``authorization: <value>`` to every call's metadata (a test-side client)."""

    def __init__(self, value: str) -> None:
        self._entry = ("authorization", value)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._entry)
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]


# grpc.aio files an interceptor under the first call kind it implements: one class per kind.
class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self._details(details), requests)


def bearer_interceptors(value: str) -> list[Any]:
    """Client interceptors that send ``authorization: <value>`` on every call."""
    return [_BearerUnaryUnary(value), _BearerUnaryStream(value), _BearerStreamUnary(value)]


def open_channel(
    address: str,
    *,
    token: str | None = None,
    authorization: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A channel to ``address`` that sends ``Bearer <token>`` (or a raw ``authorization``)."""
    value = authorization if authorization is not None else token and f"Bearer {token}"
    interceptors = bearer_interceptors(value) if value else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options, interceptors=interceptors)


class TenantHarness:
    """A running server plus one channel per token asked for (None: no token)."""

    def __init__(
        self, running: RunningServer, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        self.running = running
        self.config = running.config
        self.credentials = credentials
        self._channels: dict[str | None, grpc.aio.Channel] = {}

    @property
    def frame_bytes(self) -> int:
        """The largest frame data the server accepts."""
        return self.config.max_frame_data_bytes

    def channel(self, token: str | None) -> grpc.aio.Channel:
        """The channel that sends ``token`` (opened on first use, closed with the harness)."""
        if token not in self._channels:
            self._channels[token] = open_channel(
                self.running.address,
                token=token,
                credentials=self.credentials,
                options=self.config.grpc_options,
            )
        return self._channels[token]

    def stub(self, token: str | None) -> cache_pb2_grpc.KVCacheAsyncStub:
        """A KVCache stub whose calls carry ``token``."""
        return cache_pb2_grpc.KVCacheStub(self.channel(token))

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One metric sample of the server (0 when absent)."""
        value = self.running.metrics.registry.get_sample_value(name, labels or {})
        return value or 0.0

    async def close(self) -> None:
        """Close every channel and stop the server."""
        for channel in self._channels.values():
            await channel.close(None)
        await self.running.stop(grace_s=1.0)


class tenant_serving:
    """``async with tenant_serving(config) as h``: a server and its TenantHarness."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        server_credentials: grpc.ServerCredentials | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.config = config
        self.server_credentials = server_credentials
        self.channel_credentials = channel_credentials

    async def __aenter__(self) -> TenantHarness:
        running = await start_server(
            self.config, credentials=self.server_credentials, monitor_interval_s=0.2
        )
        self.harness = TenantHarness(running, self.channel_credentials)
        return self.harness

    async def __aexit__(self, *exc: object) -> None:
        await self.harness.close()


async def rpc_code(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status code a call ends with (streams are drained)."""
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK
