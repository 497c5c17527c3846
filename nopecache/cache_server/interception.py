"""What the server's interceptors share: wrapping a handler around an enter and a release.

Each interceptor (:class:`~nopecache.cache_server.principals.CallLimiter`,
:class:`~nopecache.cache_server.auth.RequestGate`, :class:`~nopecache.cache_server.roles.AdminGate`)
either refuses a call or lets it run between an *enter* (admit it, take a slot, tag it;
it may abort the call) and a *release* (give back what enter took, however the call ends).
:func:`guarded` builds that handler for every streaming kind.

Concurrency: event loop only.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

__all__ = ["Behavior", "Handler", "WrappingInterceptor", "behavior", "guarded", "like"]

Handler = grpc.RpcMethodHandler
Behavior = Callable[..., Any]
T = TypeVar("T")


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that hands each call of the methods it covers to :meth:`wrap`."""

    # The methods covered: those whose full name (``/service/Method``) starts with this.
    covers = "/"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        details: grpc.HandlerCallDetails,
    ) -> Handler:
        """The handler of this call: :meth:`wrap`'s, or the real one when not covered."""
        handler = await continuation(details)
        # None: no such method (gRPC answers UNIMPLEMENTED); the stubs do not say so.
        if handler is None or not details.method.startswith(self.covers):
            return handler
        return self.wrap(handler, details)

    def wrap(self, handler: Handler, details: grpc.HandlerCallDetails) -> Handler:
        """The handler that serves a covered call (``handler`` wrapped, or one refusing)."""
        raise NotImplementedError


def behavior(handler: Handler) -> Behavior:
    """The servicer function of a handler, whatever its streaming kind."""
    fn = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    assert fn is not None, "an RPC method handler without a behavior"
    return fn


def like(handler: Handler, unary: Behavior, stream: Behavior, *, deserializer: Any) -> Handler:
    """A handler of the same streaming kind as ``handler`` running ``unary``/``stream``.

    ``unary`` serves calls with a single response, ``stream`` those with streamed ones.
    """
    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, deserializer, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, deserializer, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(unary, deserializer, serializer)


def guarded(
    handler: Handler,
    enter: Callable[[grpc.aio.ServicerContext], Awaitable[T]],
    release: Callable[[T], None],
) -> Handler:
    """``handler`` run after ``await enter(context)``, then ``release(what enter returned)``.

    Nothing is released when enter aborts the call; the release runs however the call
    ends once enter has returned (answer, error, cancellation, a stream left unread).
    """
    inner = behavior(handler)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        held = await enter(context)
        try:
            return await inner(request, context)
        finally:
            release(held)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        held = await enter(context)
        try:
            messages = inner(request, context)
            if inspect.isawaitable(messages):  # a handler that writes with context.write
                await messages
                return
            async for message in messages:
                yield message
        finally:
            release(held)

    return like(handler, unary, stream, deserializer=handler.request_deserializer)
