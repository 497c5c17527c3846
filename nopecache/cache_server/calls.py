"""What every call of the service is: who makes it, and a request that did not parse.

``resolve_context`` (an extension point of :class:`~.service.KVCacheService`) turns each
call into a :class:`RequestContext`; the request deserializers return
:class:`MalformedRequest` instead of raising, so that the service can answer
INVALID_ARGUMENT with a message (gRPC would turn a raising deserializer into UNKNOWN).
Also the version the service reports about its process (the host id is the wire
contract's, ``proto/shm_layout.host_id``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

import grpc
from google.protobuf.message import DecodeError, Message

from nopecache.cache_server.tenants import Tenant, current_tenant
from nopecache.cache_server.wire_fields import bad_field

__all__ = [
    "ContextResolver",
    "MalformedRequest",
    "RequestContext",
    "default_context",
    "lenient_parser",
    "server_version",
]


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Who is calling: the peer address and the tenant whose namespace the call uses."""

    peer: str
    tenant: Tenant


ContextResolver = Callable[[grpc.aio.ServicerContext], RequestContext]


def default_context(context: grpc.aio.ServicerContext) -> RequestContext:
    """The peer, and the tenant the request gate set for this call (else ANONYMOUS)."""
    return RequestContext(peer=context.peer(), tenant=current_tenant())


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """A request that is not valid protobuf wire format for ``message_type``.

    ``field`` names the first record that could not be read (``PinRequest.keys: length
    9 runs past the end of the message``), or is empty when the walk found none.
    """

    message_type: str
    error: str
    field: str = ""

    @property
    def message(self) -> str:
        """The INVALID_ARGUMENT message: the field (when known), then the parser's error."""
        if self.field:
            return f"{self.field} ({self.error})"
        return f"{self.message_type}: not a valid protobuf message ({self.error})"


def lenient_parser(cls: type[Message]) -> Callable[[bytes], Message | MalformedRequest]:
    """A request deserializer that returns MalformedRequest instead of raising."""
    name = cls.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Message | MalformedRequest:
        try:
            return cls.FromString(raw)
        except DecodeError as e:
            return MalformedRequest(name, str(e), bad_field(cls, raw) or "")

    return parse


def server_version() -> str:
    """The installed nopecache package version."""
    try:
        return metadata.version("nopecache")
    except metadata.PackageNotFoundError:
        return "0+unknown"
